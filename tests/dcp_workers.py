"""Process bodies for the multi-rank DCP tests (spawned with gloo on 127.0.0.1).

Kept in an importable module so torch.multiprocessing's spawn can find them.
Expected values travel between processes as torch.save files in the test's
tmp dir (test scaffolding only; the store never holds a pickle).
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckptstore.dcp import CkptStoreReader, CkptStoreWriter
from ckptstore.errors import StorageError
from ckptstore.storage.faults import FaultStore

from .helpers import SMALL, assert_tree_equal




def _init(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def _shutdown():
    # Every rank finishes its last collective before any rank tears gloo
    # down; tearing down while a peer still reads aborts that peer.
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # gloo's threads sometimes abort the interpreter's own exit ("terminate
    # called without an active exception", SIGABRT): a rank that succeeded
    # leaves at once. A rank unwinding an error (called from a finally
    # clause) exits normally, so the error still reaches the test.
    if sys.exc_info()[0] is None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def _train_state(mesh):
    """FSDP2 model + AdamW after one step; state dict as DCP users build it."""
    m = _model()
    if mesh is not None:
        for layer in (m[0], m[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    torch.manual_seed(1)
    m(torch.randn(8, 16)).pow(2).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    return m, opt, msd, osd


def _extras(mesh, fill=None):
    g = torch.Generator().manual_seed(2)
    big = torch.randn(512, 256, generator=g)
    rep = torch.randn(8, 8, generator=g)
    plain = torch.randn(1000, generator=g)
    if fill is not None:
        big, rep, plain = torch.full_like(big, fill), torch.full_like(rep, fill), torch.full_like(plain, fill)
    if mesh is None:
        return {"big": big, "rep_dt": rep, "rep_plain": plain}
    return {
        "big": distribute_tensor(big, mesh, [Shard(0)]),
        "rep_dt": distribute_tensor(rep, mesh, [Replicate()]),
        "rep_plain": plain,
    }


def _full(tree):
    if isinstance(tree, DTensor):
        return tree.full_tensor()
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _full(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_full(v) for v in tree)
    return tree


def compare(expected, got) -> None:
    """The loaded state equals the saved one (DCP may rebuild dicts in another key order)."""
    assert_tree_equal(expected, got, key_order=False)


def save_worker(rank, world, port, url, so, expect_path):
    mesh = _init(rank, world, port)
    try:
        _, _, msd, osd = _train_state(mesh)
        sd = {"model": msd, "optim": osd, **_extras(mesh), "epoch": 7}
        dcp.save(sd, storage_writer=CkptStoreWriter(url, step=1, storage_options=so, **SMALL))
        expected = _full(sd)
        if rank == 0:
            torch.save(expected, expect_path)
    finally:
        _shutdown()


def load_worker(rank, world, port, url, so, expect_path):
    mesh = _init(rank, world, port)
    try:
        expected = torch.load(expect_path, weights_only=True)
        _, _, msd, osd = _train_state(mesh)
        sd = {"model": msd, "optim": osd, **_extras(mesh, fill=0.0), "epoch": 0}
        dcp.load(sd, storage_reader=CkptStoreReader(url, step=1, storage_options=so))
        compare(expected, sd)
    finally:
        _shutdown()


def load_single_process(url, so, expect_path):
    expected = torch.load(expect_path, weights_only=True)
    _, _, msd, osd = _train_state(None)
    sd = {"model": msd, "optim": osd, **_extras(None, fill=0.0), "epoch": 0}
    dcp.load(sd, storage_reader=CkptStoreReader(url, step=1, storage_options=so))
    compare(expected, sd)


class _FailingWriter(CkptStoreWriter):
    """Rank 1's pack uploads fail, as a broken network or bucket would."""

    def _get_repo(self):
        repo = super()._get_repo()
        if self.rank == 1 and not isinstance(repo.store, FaultStore):
            repo.store = FaultStore(
                repo.store, [("*", "packs/*", lambda op, k: StorageError(f"injected failure: {op} {k}"), None)]
            )
        return repo


def dedup_and_failure_worker(rank, world, port, url, so, out_path):
    mesh = _init(rank, world, port)
    try:
        g = torch.Generator().manual_seed(3)
        w = torch.randn(256, 512, generator=g)  # 512 KiB: 256 KiB per rank
        dt = distribute_tensor(w, mesh, [Shard(0)])
        dcp.save({"w": dt}, storage_writer=CkptStoreWriter(url, step=1, storage_options=so, **SMALL))
        # step 2: only rank 1's shard changes
        if rank == 1:
            dt.to_local().add_(1.0)
        writer = CkptStoreWriter(url, step=2, storage_options=so, **SMALL)
        dcp.save({"w": dt}, storage_writer=writer)
        stats = writer.last_rank_stats
        # step 3: rank 1 fails while writing
        err = None
        try:
            dt.to_local().add_(1.0)
            dcp.save({"w": dt}, storage_writer=_FailingWriter(url, step=3, storage_options=so, **SMALL))
        except (Exception, CheckpointException) as e:  # a BaseException, raised on every rank
            err = f"{type(e).__name__}: {e}"
        all_stats = [None] * world
        dist.all_gather_object(all_stats, {"stats": stats, "err": err})
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(all_stats, f)
    finally:
        _shutdown()


# ------------------------------------------------------------ DCP compatibility (test_dcp_compat)
def _init_with_timeout(rank, world, port, seconds=60):
    """Like ``_init`` without a mesh, and a collective that waits on a peer
    who never comes fails after ``seconds`` instead of hanging the suite."""
    import datetime

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=seconds))


def sharded_dtypes_save_worker(rank, world, port, url):
    """Step 1: fp32 and bf16 tensors row-sharded over the ranks (one shard each)."""
    mesh = _init(rank, world, port)
    try:
        g = torch.Generator().manual_seed(11)
        f32 = torch.randn(64, 24, generator=g)
        bf16 = torch.randn(64, 24, generator=g).bfloat16()
        sd = {"f32": distribute_tensor(f32, mesh, [Shard(0)]), "bf16": distribute_tensor(bf16, mesh, [Shard(0)])}
        dcp.save(sd, storage_writer=CkptStoreWriter(url, step=1, **SMALL))
    finally:
        _shutdown()


def no_dist_and_subgroup_worker(rank, world, port, url, out_dir):
    """``CkptStoreReader(url)`` (latest step) under ``no_dist=True`` on rank 0
    alone, then on the sub-group of ranks 1..world-1 while rank 0 stays out."""
    _init_with_timeout(rank, world, port)
    try:
        expect = torch.arange(40, dtype=torch.float32).reshape(8, 5)
        if rank == 0:
            sd = {"w": torch.zeros(8, 5)}
            dcp.load(sd, storage_reader=CkptStoreReader(url), no_dist=True)
            assert torch.equal(sd["w"], expect), "no_dist load read wrong values"
        dist.barrier()
        sub = dist.new_group(list(range(1, world)))
        if rank != 0:
            sd = {"w": torch.zeros(8, 5)}
            dcp.load(sd, storage_reader=CkptStoreReader(url), process_group=sub)
            assert torch.equal(sd["w"], expect), "sub-group load read wrong values"
        dist.barrier()
        with open(os.path.join(out_dir, f"ok-{rank}"), "w") as f:
            f.write("ok")
    finally:
        _shutdown()


# ------------------------------------------------------------ many small shards (test_scale_dcp)
MANY = 1250  # tensors; x 16 ranks = 20k shards


def _many_tensor(t: int) -> torch.Tensor:
    return torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4) * (t + 1) + t


def many_shards_save_worker(rank, world, port, url):
    mesh = _init(rank, world, port)
    try:
        sd = {f"p{t}": distribute_tensor(_many_tensor(t), mesh, [Shard(0)]) for t in range(MANY)}
        dcp.save(sd, storage_writer=CkptStoreWriter(url, step=1))
    finally:
        _shutdown()


class _CountingReader(CkptStoreReader):
    """Counts every byte this rank reads, by key prefix."""

    def _get_repo(self):
        from ckptstore.storage.wrappers import CountingStore

        repo = super()._get_repo()
        if not isinstance(repo.store, CountingStore):
            repo.store = CountingStore(repo.store)
            # the handle's readers were built on the old store object
            repo.tables.store = repo.fetcher.store = repo.relocations.store = repo.store
        return repo


def many_shards_load_worker(rank, world, port, url, out_dir):
    mesh = _init(rank, world, port)
    try:
        sd = {f"p{t}": distribute_tensor(torch.zeros(64, 4), mesh, [Shard(0)]) for t in range(MANY)}
        reader = _CountingReader(url, step=1)
        dcp.load(sd, storage_reader=reader)
        bad = [k for t, (k, v) in enumerate(sd.items()) if not torch.equal(v.to_local(), _many_tensor(t).chunk(world)[rank])]
        store = reader._repo.store
        segments = sorted({k for k, _, _ in store.reads if k.startswith("segments/")})
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"bad": bad[:5], "manifests": store.read_by_prefix["manifests"],
                       "segments": store.read_by_prefix["segments"], "segment_keys": segments}, f)
    finally:
        _shutdown()


# ------------------------------------------------------------ replicated reads (test_dcp_replicated)
def _counting(reader):
    """The CountingStore behind a _CountingReader after its load."""
    return reader._repo.store


def _digest(tensors: dict) -> dict:
    """BLAKE3 of every tensor's bytes (DTensors by their local shard), by key."""
    import blake3

    out = {}
    for k, v in tensors.items():
        t = v.to_local() if isinstance(v, DTensor) else v
        t = t.detach().contiguous()
        out[k] = blake3.blake3(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest() if t.numel() else ""
    return out


def _zero(tensors: dict) -> None:
    for v in tensors.values():
        (v.to_local() if isinstance(v, DTensor) else v).zero_()


def replicated_state(seed: int = 5) -> dict:
    """~256 MiB, the same on every rank: a 96 MiB embedding, 16 and 4 MiB matrices,
    a bf16 matrix, an odd-shaped one, 100 small vectors, a 0-d tensor.

    Random bits (cheap to make, incompressible), as float32 or bf16 tensors."""
    g = torch.Generator().manual_seed(seed)

    def rnd(shape, dtype=torch.float32):
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size() // 4
        return torch.empty(n, dtype=torch.int32).random_(generator=g).view(dtype).reshape(shape)

    sd = {"emb": rnd((24576, 1024))}
    sd.update({f"layer{i}.w": rnd((2048, 2048)) for i in range(8)})
    sd.update({f"proj{i}.w": rnd((1024, 1024)) for i in range(4)})
    sd["head.bf16"] = rnd((2048, 2048), torch.bfloat16)
    sd["odd"] = rnd((1000, 1573))
    sd.update({f"norm{i}": rnd((4096,)) for i in range(100)})
    sd["scale"] = rnd(())
    return sd


REPLICATED_OPTS = dict(chunk_size=1 << 20, pack_size=64 << 20)


def replicated_worker(rank, world, port, url, out_dir):
    """Save a fully replicated ~256 MiB state once (DCP's dedup), then load it
    with the exchange off and on, counting this rank's pack bytes."""
    _init_with_timeout(rank, world, port, seconds=120)
    try:
        sd = replicated_state()
        want = _digest(sd)
        writer = CkptStoreWriter(url, step=1, **REPLICATED_OPTS)
        dcp.save(sd, storage_writer=writer)
        out = {"save": writer.last_rank_stats}
        for exchange in (False, True):
            _zero(sd)
            reader = _CountingReader(url, step=1, exchange_replicated=exchange, exchange_timeout=60)
            dcp.load(sd, storage_reader=reader)
            got = _digest(sd)
            out[f"exchange={exchange}"] = {
                "packs": _counting(reader).read_by_prefix["packs"],
                "bad": [k for k in want if got[k] != want[k]],
                "stats": reader.last_read_stats,
            }
            reader.close()
        # the same state again: every part of the cut embedding dedups against step 1
        writer = CkptStoreWriter(url, step=2, **REPLICATED_OPTS)
        dcp.save(sd, storage_writer=writer)
        out["save2"] = writer.last_rank_stats
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        _shutdown()


def _mixed_model(mesh, seed):
    """A DDP part (plain, replicated parameters) and an FSDP2 part (sharded), AdamW after one step."""
    torch.manual_seed(seed)
    ddp = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    fsdp = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    for layer in fsdp:
        fully_shard(layer, mesh=mesh)
    m = torch.nn.ModuleDict({"ddp": ddp, "fsdp": fsdp})
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    torch.manual_seed(seed + 1)
    (ddp(torch.randn(4, 256)).sum() + fsdp(torch.randn(4, 512)).pow(2).sum()).backward()
    opt.step()
    return get_state_dict(m, opt)


def _mixed_extras(mesh, fill=None):
    """Replicated tensors loaded into unusual destinations, and a sharded one."""
    g = torch.Generator().manual_seed(9)
    ex = {
        "rep_cast": torch.randn(512, 512, generator=g),  # loaded into bf16
        "rep_t": torch.randn(300, 700, generator=g),  # loaded into a transposed view
        "rep_dt": torch.randn(96, 80, generator=g),  # a replicated DTensor
        "rep_0d": torch.randn((), generator=g),
        "big": torch.randn(512, 300, generator=g),  # sharded
    }
    if fill is not None:
        ex = {k: torch.full_like(v, fill) for k, v in ex.items()}
        ex["rep_cast"] = ex["rep_cast"].bfloat16()
        ex["rep_t"] = torch.full((700, 300), fill).t()
    ex["rep_dt"] = distribute_tensor(ex["rep_dt"], mesh, [Replicate()])
    ex["big"] = distribute_tensor(ex["big"], mesh, [Shard(0)])
    # HSDP-style: sharded over one mesh dim, replicated over the other: pairs of ranks share a shard
    g = torch.Generator().manual_seed(10)
    mesh2 = init_device_mesh("cpu", (2, 2))
    for name, shape in (("hsdp", (400, 300)), ("hsdp_small", (64, 10))):
        t = torch.randn(shape, generator=g) if fill is None else torch.full(shape, fill)
        ex[name] = distribute_tensor(t, mesh2, [Replicate(), Shard(0)])
    return ex


def mixed_worker(rank, world, port, url, out_dir):
    """DDP + FSDP state saved by DCP (writes balanced), then loaded bit-exact with the
    exchange on (several rounds, split pieces, packed small pieces) and off."""
    _init_with_timeout(rank, world, port, seconds=120)
    mesh = init_device_mesh("cpu", (world,))
    try:
        msd, osd = _mixed_model(mesh, 0)
        sd = {"model": msd, "optim": osd, **_mixed_extras(mesh)}
        expected = _full(sd)
        expected["rep_cast"] = expected["rep_cast"].bfloat16()
        writer = CkptStoreWriter(url, step=1, **SMALL)
        dcp.save(sd, storage_writer=writer)
        out = {"save": writer.last_rank_stats}
        for exchange in (True, False):
            msd, osd = _mixed_model(mesh, 100)  # other values
            dest = {"model": msd, "optim": osd, **_mixed_extras(mesh, fill=0.0)}
            reader = _CountingReader(url, step=1, exchange_replicated=exchange, exchange_timeout=60,
                                     exchange_round_bytes=1 << 20, exchange_piece_bytes=1 << 20)
            dcp.load(dest, storage_reader=reader)
            compare(expected, _full(dest))
            out[f"exchange={exchange}"] = {"packs": _counting(reader).read_by_prefix["packs"],
                                           "stats": reader.last_read_stats}
            reader.close()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        _shutdown()


class _FaultyReader(CkptStoreReader):
    """On rank ``fail_rank``, the first ranged read of a pack succeeds and every later one fails."""

    fail_rank = 1

    def _get_repo(self):
        repo = super()._get_repo()  # first called from read_metadata, before DCP names the rank
        if dist.get_rank() == self.fail_rank and not isinstance(repo.store, FaultStore):
            calls = []

            def after_first(op, key):
                calls.append(key)
                return None if len(calls) == 1 else StorageError(f"injected failure: {op} {key}")

            repo.store = FaultStore(repo.store, [("get_ranges", "packs/*", after_first, None)])
            repo.tables.store = repo.fetcher.store = repo.relocations.store = repo.store
        return repo


def _replicated_small():
    g = torch.Generator().manual_seed(4)
    return {f"t{i}": torch.randn(256, 256, generator=g) for i in range(12)}  # 12 x 256 KiB


def exchange_failure_worker(rank, world, port, url, out_dir):
    """A rank whose pack reads fail mid-exchange, and a rank whose destination cannot take
    the stored dtype, fail the load on every rank naming them; then a clean load, a load
    on a sub-group with and without its group passed to the reader."""
    import warnings

    _init_with_timeout(rank, world, port, seconds=60)
    out = {}
    try:
        sd = _replicated_small()
        expected = {k: v.clone() for k, v in sd.items()}
        # one chunk per tensor: reading one tensor is one ranged GET
        dcp.save(sd, storage_writer=CkptStoreWriter(url, step=1, **dict(SMALL, chunk_size=256 << 10)))
        # every rank owns 4 of the 12 tensors; all-gather rounds of 3 x 256 KiB carry one
        # tensor per rank: 4 rounds. Rank 1 reads its first tensor, then fails in round 2,
        # after round 1's data has been exchanged.
        opts = dict(exchange_timeout=30, exchange_round_bytes=3 * (256 << 10), exchange_all_gather_ranks=2)

        def attempt(name, reader, dest, group=None):
            try:
                dcp.load(dest, storage_reader=reader, process_group=group)
                out[name] = None
            except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
                out[name] = f"{type(e).__name__}: {e}"

        attempt("pack_reads_fail", _FaultyReader(url, step=1, **opts), {k: torch.zeros_like(v) for k, v in sd.items()})
        bad = {k: torch.zeros_like(v) for k, v in sd.items()}
        if rank == 2:
            bad["t5"] = torch.zeros(256, 256, dtype=torch.int32)
        attempt("bad_destination", CkptStoreReader(url, step=1, **opts), bad)
        dest = {k: torch.zeros_like(v) for k, v in sd.items()}
        reader = CkptStoreReader(url, step=1, **opts)
        attempt("clean", reader, dest)
        out["clean_equal"] = all(torch.equal(dest[k], expected[k]) for k in expected)
        out["clean_stats"] = reader.last_read_stats
        dist.barrier()
        sub = dist.new_group(list(range(1, world)))
        if rank != 0:
            for name, group in (("subgroup_passed", sub), ("subgroup_default", None)):
                dest = {k: torch.zeros_like(v) for k, v in sd.items()}
                reader = CkptStoreReader(url, step=1, process_group=group, **opts)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    attempt(name, reader, dest, sub)
                out[name + "_equal"] = all(torch.equal(dest[k], expected[k]) for k in expected)
                out[name + "_stats"] = reader.last_read_stats
                out[name + "_warnings"] = [str(w.message) for w in caught if "no exchange" in str(w.message)]
        dist.barrier()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        _shutdown()


def cuda_exchange_worker(rank, world, port, url, out_dir):
    """Replicated tensors loaded into CUDA destinations with the exchange on: over NCCL
    (CUDA buffers) with a GPU per rank, else over gloo (CPU buffers) on one GPU."""
    import datetime

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    nccl = torch.cuda.device_count() >= world
    device = torch.device("cuda", rank if nccl else 0)
    torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if nccl else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        g = torch.Generator().manual_seed(12)
        src = {"big": torch.randn(1024, 1024, generator=g), "mid": torch.randn(300, 200, generator=g),
               "cast": torch.randn(512, 512, generator=g), **{f"b{i}": torch.randn(64, generator=g) for i in range(10)}}
        dcp.save(src, storage_writer=CkptStoreWriter(url, step=1, **SMALL))
        dest = {k: torch.zeros_like(v, device=device) for k, v in src.items()}
        dest["cast"] = torch.zeros(512, 512, dtype=torch.bfloat16, device=device)
        reader = CkptStoreReader(url, step=1, exchange_timeout=60, exchange_piece_bytes=1 << 20)
        dcp.load(dest, storage_reader=reader)
        torch.cuda.synchronize()
        bad = [k for k, v in src.items() if not torch.equal(dest[k].cpu(), v.to(dest[k].dtype))]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"bad": bad, "stats": reader.last_read_stats, "nccl": nccl}, f)
    finally:
        _shutdown()
