"""Shared test helpers (not fixtures)."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import torch

from ckptstore.format.manifest import DTYPES
from ckptstore.testing import bits_equal

SMALL = dict(chunk_size=64 << 10, pack_size=1 << 20, part_size=5 << 20)


def random_tensor(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    """Random bits of any dtype (exotic ones made by viewing uint8 bytes)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    nbytes = n * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def all_dtypes() -> list[torch.dtype]:
    return [DTYPES[n] for n in sorted(DTYPES)]


def _full(t):
    """A DTensor's full tensor (a collective: every rank must call it); other tensors as they are."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return t
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_tree_equal(a, b, path="", key_order: bool = True) -> None:
    """``b`` equals ``a`` leaf for leaf, tensors bit for bit (DTensors by their full tensor).

    ``key_order=False`` accepts dicts with the same keys in another order
    (a state dict rebuilt from a checkpoint's planner paths).
    """
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert bits_equal(_full(a), _full(b)), f"tensor {path} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict), path
        if key_order:
            assert list(a.keys()) == list(b.keys()), path
        else:
            assert set(a.keys()) == set(b.keys()), f"{path}: keys {sorted(map(str, set(a) ^ set(b)))} differ"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}.{k}", key_order)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{path}[{i}]", key_order)
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b and type(a) is type(b), f"{path}: {a!r} != {b!r}"


def flat_tensors(sd: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested dict, keyed by dotted path (``{"a": {"b": t}}`` -> ``{"a.b": t}``)."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(flat_tensors(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
    return out


def copy_repository(src: Path, where: str, request, tmp_path) -> tuple[str, dict | None]:
    """A copy of the repository folder ``src`` (test data, written by an older ckptstore) in a
    local directory (``where="local"``) or in the session's moto bucket (``"s3"``):
    ``(url, storage_options)``."""
    if where == "local":
        dst = tmp_path / "repo"
        shutil.copytree(src, dst)
        return str(dst), None
    env = request.getfixturevalue("s3")
    store = env.store()
    for p in sorted(src.rglob("*")):
        if p.is_file() and p.name != ".gitkeep":
            store.put(p.relative_to(src).as_posix(), p.read_bytes())
    return env.url, env.storage_options


def _child_uses(store, client_of, parents, q) -> None:
    try:
        store.put("child", b"from the child")
        head = bytearray(5)
        store.read_range_into("k", 0, head)
        own = b"own" if client_of(store) is not parents else b"shared"
        q.put(b" ".join([store.get("k"), store.get("child"), bytes(head), own]))
    except Exception as e:  # noqa: BLE001 - the test wants its type and text
        q.put(f"{type(e).__name__}: {e}".encode())


def use_in_forked_child(store, client_of) -> bytes:
    """Use ``store`` in a forked child: what the child saw, or its error.

    The parent must have used the store (its client then holds pooled
    connections) and written ``"k"``. The child writes ``"child"``, reads
    ``"k"`` whole and its first 5 bytes streamed, then ``"child"``, and says
    whether ``client_of(store)`` gave it a client of its own: the answer is
    ``b"<k> from the child <k[:5]> own"`` when all went well. A hang fails
    after 60 s.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    parents = client_of(store)  # the very object, in the child's copy of memory
    p = ctx.Process(target=_child_uses, args=(store, client_of, parents, q))
    p.start()
    try:
        got = q.get(timeout=60)  # a hang fails here
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0, p.exitcode
    return got


#: What the rank processes of :func:`spawn` find imported: the forkserver imports these once per
#: test run and every rank is forked from it, instead of each rank importing torch anew (about
#: 3 CPU-seconds a rank on the reference machine).
RANK_PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor",
                "torch.multiprocessing", "numpy", "ckptstore", "ckptstore.dcp")


def _as_spawned(rank: int, env: dict, cwd: str, fn, args: tuple) -> None:
    # A rank forked from the forkserver has the environment and folder the forkserver started in;
    # a spawned one has the caller's at the call: give it those.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fn(rank, *args)


def spawn(fn, args: tuple = (), nprocs: int = 1) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join=True)``, started from a forkserver.

    Same contract as ``mp.spawn``: ``fn(rank, *args)`` runs in ``nprocs`` new processes with the
    caller's environment and working folder, and an exception in any of them is raised here
    (``ProcessRaisedException``, naming the rank). The processes are forked from one forkserver
    per test run that has imported :data:`RANK_PRELOAD` and touched nothing else (no threads, no
    process group), so a rank starts in milliseconds, not seconds. ``fn`` and ``args`` must be
    picklable, as with spawn.
    """
    import multiprocessing

    import torch.multiprocessing as tmp

    multiprocessing.set_forkserver_preload(list(RANK_PRELOAD))  # read when the forkserver starts
    tmp.start_processes(_as_spawned, args=(dict(os.environ), os.getcwd(), fn, tuple(args)), nprocs=nprocs,
                        join=True, start_method="forkserver")


def decoded_coverage(repo, step: int, cache) -> tuple[int, int]:
    """(chunks of ``step`` a decoded copy in tier ``cache`` covers, chunks in all), distinct by hash:
    a chunk is covered by its file under ``raw/``, or a tile by its band's copy under ``bands/``."""
    import glob

    from ckptstore.format import tiles as T
    from ckptstore.tier import bands as B

    def names(sub):
        return {os.path.basename(p) for p in glob.glob(os.path.join(str(cache), "repos", "*", sub, "*", "*"))}

    raw, bands = names("raw"), names("bands")
    cp = repo.checkpoint(step)
    covered, every = set(), set()
    for key in cp.manifest.tensors:
        e = cp.entry(key)
        for shard in cp.shards(key, range(len(e.shards))):
            hashes = [c.hash for c in shard.chunks]
            every.update(hashes)
            covered.update(h for h in hashes if h in raw)
            sizes = tuple(shard.sizes)
            if e.tile is None or len(sizes) < 2:
                continue
            grid = T.grid(sizes, e.tile)
            across = math.prod(grid[1:])
            for b in range(grid[0]):
                rows = min(e.tile[0], sizes[0] - b * e.tile[0])
                hs = hashes[b * across:(b + 1) * across]
                if B.band_name(DTYPES[e.dtype].itemsize, rows, sizes[1:], e.tile, hs) in bands:
                    covered.update(hs)
    return len(covered), len(every)

