"""Save/load round trips, dedup, commit semantics and error reporting."""

from __future__ import annotations

import concurrent.futures as cf
import json

import pytest
import torch

import ckptstore
from ckptstore.errors import (
    FormatError,
    IntegrityError,
    MissingDataError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
    UnsupportedVersionError,
)
from ckptstore.format.layout import manifest_key, pack_key
from ckptstore.pipeline import planner as _plan
from ckptstore.repo.repository import Repository
from ckptstore.storage.memory import MemoryStore
from ckptstore.storage.faults import FaultStore
from ckptstore.storage.wrappers import CountingStore

from .helpers import SMALL, all_dtypes, assert_tree_equal, random_tensor


def _open(repo_url, **kw):
    url, so = repo_url
    return ckptstore.open(url, storage_options=so, **{**SMALL, **kw})


def _mem_repo(**kw) -> Repository:
    return Repository(MemoryStore(), **{**SMALL, **kw})


# ------------------------------------------------------------------ round trips
def test_every_dtype_round_trips_bit_exact(repo_url):
    sd = {}
    for i, d in enumerate(all_dtypes()):
        name = str(d).removeprefix("torch.")
        sd[name] = random_tensor(d, (33, 7), seed=i)
    base = torch.randn(40, 30)
    sd["special"] = {
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "scalar_bf16": torch.tensor(-1.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 5),
        "empty3": torch.zeros(4, 0, 2, dtype=torch.int16),
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "view_a": base[5:10],
        "view_b": base,
        "conj": torch.randn(6, dtype=torch.complex64).conj(),
        "expanded": torch.arange(4.0).expand(3, 4),
        "big": torch.randn(300, 257),  # several chunks
    }
    sd["values"] = {"lr": 0.001, "name": "adam", "flag": True, "none": None, "ints": [1, 2, 3],
                    "nested": {"a": [1.5, {"b": "c"}]}, "nan": float("nan"), "tuple": (1, torch.ones(2))}
    sd[7] = {3: torch.ones(3, dtype=torch.int64)}  # int keys, as optimizer state has
    with _open(repo_url) as repo:
        info = repo.save(sd, step=10, metadata={"loss": 1.25})
        assert info.step == 10 and info.tensors == len(repo.checkpoint(10).keys())
        expected_logical = sum(t.numel() * t.element_size() for t in _tensors(sd))
        assert info.logical_bytes == expected_logical
        out = repo.load(10)
    assert_tree_equal(_resolved(sd), out)
    # a second handle reads the same (nothing cached in the first)
    with _open(repo_url) as repo2:
        assert repo2.steps() == [10]
        assert repo2.checkpoint(10).metadata == {"loss": 1.25}
        assert_tree_equal(_resolved(sd), repo2.load(10))


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def _resolved(tree):
    """What a load returns: conj/neg resolved, everything contiguous."""
    if isinstance(tree, torch.Tensor):
        return tree.resolve_conj().resolve_neg().contiguous()
    if isinstance(tree, dict):
        return {k: _resolved(v) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_resolved(v) for v in tree)
    if isinstance(tree, list):
        return [_resolved(v) for v in tree]
    return tree


def test_steps_latest_checkpoint_views():
    repo = _mem_repo()
    assert repo.steps() == [] and repo.latest() is None
    for s in (5, 1, 30):
        repo.save({"w": torch.full((10,), float(s))}, step=s)
    assert repo.steps() == [1, 5, 30] and repo.latest() == 30
    ck = repo.checkpoint(5)
    assert ck.keys() == ["w"]
    meta = ck.tensor_meta("w")
    assert meta.dtype == torch.float32 and meta.shape == (10,) and meta.shards == (((0,), (10,)),)
    assert torch.equal(ck.read("w"), torch.full((10,), 5.0))
    with pytest.raises(KeyError, match="nope"):
        ck.read("nope")
    with pytest.raises(StepNotFoundError):
        repo.checkpoint(2)
    repo.delete(5)
    assert repo.steps() == [1, 30]
    with pytest.raises(StepNotFoundError):
        repo.delete(5)


def _listed(url, so) -> list[str]:
    from ckptstore.storage import open_store

    store = open_store(url, so)
    try:
        return [o.key for o in store.list()]
    finally:
        store.close()


def test_reads_refuse_a_location_without_a_repository_and_write_nothing(repo_url, tmp_path):
    from ckptstore.errors import RepositoryNotFoundError

    url, so = repo_url
    repo = _open(repo_url)
    # The resume idiom on a job's first run keeps working.
    assert repo.steps() == [] and repo.latest() is None and repo.tags() == {} and repo.all_names() == {}
    no_repo = f"no ckptstore repository at {repo.url} (no config.json); save a step to create one"
    latest = " (so there is no committed step to read)"
    for name, call, note in [
        ("verify", lambda: repo.verify(), ""),
        ("verify step", lambda: repo.verify(step=1), ""),
        ("checkpoint", lambda: repo.checkpoint(1), ""),
        ("load latest", lambda: repo.load(), latest),
        ("load step", lambda: repo.load(1), ""),
        ("plan_gc", lambda: repo.plan_gc(keep_last=1), ""),
        ("stats", lambda: repo.stats(), ""),
        ("diff", lambda: repo.diff(1, 2), ""),
        ("export", lambda: repo.export(1, str(tmp_path / "out.safetensors")), ""),
        ("copy from", lambda: repo.copy_to(_mem_repo()), ""),
        ("delete", lambda: repo.delete(1), ""),
        ("tag", lambda: repo.tag(1, "best"), ""),
        ("load_module", lambda: ckptstore.load_module(torch.nn.Linear(2, 2), repo), latest),
    ]:
        with pytest.raises(RepositoryNotFoundError) as ei:
            call()
        assert str(ei.value) == no_repo + note, name
        # what code written before the class existed catches, and the built-in
        assert isinstance(ei.value, StepNotFoundError) and isinstance(ei.value, FileNotFoundError), name
    assert not (tmp_path / "out.safetensors").exists()
    if url.startswith(("memory://", "s3://", "gs://")):
        assert _listed(url, so) == []
    else:
        assert not (tmp_path / "repo").exists()
    # A save creates the repository; the reads then answer as for any repository.
    repo.save({"w": torch.ones(3)}, step=1)
    assert repo.verify().ok and torch.equal(repo.load()["w"], torch.ones(3))
    with pytest.raises(StepNotFoundError) as ei:
        repo.checkpoint(2)
    assert not isinstance(ei.value, RepositoryNotFoundError)
    repo.close()


def test_an_empty_repository_is_not_a_missing_one():
    from ckptstore.errors import RepositoryNotFoundError

    repo = _mem_repo()
    repo.ensure_config()  # as left by a save that failed after creating it
    assert repo.verify().ok and repo.plan_gc(keep_last=1).delete_steps == ()
    with pytest.raises(StepNotFoundError, match="no committed step") as ei:
        repo.load()
    assert not isinstance(ei.value, RepositoryNotFoundError)


def test_save_and_load_report_progress_as_bytes_advance(capfd):
    repo = _mem_repo()
    sd = {"a": torch.randn(300, 1000), "b": {"c": torch.randn(70_000)}, "n": 3}
    total = (300 * 1000 + 70_000) * 4
    calls = []
    repo.save(sd, step=1, progress=lambda *a: calls.append(a))
    assert {w for w, _, _ in calls} == {"save bytes"} and {t for _, _, t in calls} == {total}
    done = [d for _, d, _ in calls]
    assert done[0] == 0 and done[-1] == total and done == sorted(done)
    assert len(done) >= total // SMALL["chunk_size"]  # per chunk, not once at the end
    # the next save reuses every chunk: still reported
    calls.clear()
    repo.save(sd, step=2, progress=lambda *a: calls.append(a))
    assert calls[-1] == ("save bytes", total, total)
    calls.clear()
    repo.save(sd, step=3, blocking=False, progress=lambda *a: calls.append(a)).result()
    assert calls[-1] == ("save bytes", total, total)

    for into in (None, {"a": torch.empty(300, 1000), "b": {"c": torch.empty(70_000)}},
                 {"a": torch.empty(300, 1000, dtype=torch.float64), "b": {"c": torch.empty(70_000)}}):
        calls.clear()
        out = repo.load(1, into=into, progress=lambda *a: calls.append(a))
        want = total + (300 * 1000 * 4 if into is not None and into["a"].dtype == torch.float64 else 0)
        done = [d for _, d, _ in calls]
        assert {w for w, _, _ in calls} == {"load bytes"} and {t for _, _, t in calls} == {want}
        assert done[0] == 0 and done[-1] == want and done == sorted(done) and len(done) > 3
        assert torch.equal(out["a"].float(), sd["a"])
    # off by default; True draws a bar on stderr, in the summaries' units
    capfd.readouterr()
    repo.load(1)
    repo.save(sd, step=4)
    assert capfd.readouterr().err == ""
    repo.load(1, progress=True)
    err = capfd.readouterr().err
    assert "load: 100%" in err and "1.4 MiB/1.4 MiB" in err
    with pytest.raises(TypeError, match="progress must be"):
        repo.load(1, progress="yes")


def test_load_into_is_in_place():
    repo = _mem_repo()
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7))
    repo.save({"model": model.state_dict(), "epoch": 3}, step=1)
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7))
    dest = {"model": fresh.state_dict(), "epoch": 0}
    ptrs = {k: v.data_ptr() for k, v in dest["model"].items()}
    out = repo.load(1, into=dest)
    assert out is dest and dest["epoch"] == 3
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)
        assert dest["model"][k].data_ptr() == ptrs[k]
    # wrong shape: clear error, naming the key
    bad = {"model": {**fresh.state_dict(), "0.weight": torch.zeros(3, 3)}}
    with pytest.raises(ValueError, match="0.weight"):
        repo.load(1, into=bad)
    # non-contiguous destination still loads correctly
    nc = torch.zeros(300, 64).t()
    dest2 = {"model": {**fresh.state_dict(), "0.weight": nc}}
    # shape of nc is (64, 300) but the tensor is (300, 64): expect error
    with pytest.raises(ValueError):
        repo.load(1, into=dest2)
    nc2 = torch.zeros(64, 300).t()
    repo.load(1, into={"model": {"0.weight": nc2}})
    assert torch.equal(nc2, model.state_dict()["0.weight"])


def test_bad_values_are_refused_naming_the_key():
    repo = _mem_repo()
    for bad, name in [(lambda x: x, "fn"), (object(), "obj"), ({1, 2}, "s"), (b"bytes", "b")]:
        with pytest.raises(TypeError, match=name):
            repo.save({"ok": torch.ones(2), "inner": {name: bad}}, step=1)
    with pytest.raises(TypeError, match="sparse|layout"):
        repo.save({"sp": torch.eye(3).to_sparse()}, step=1)
    with pytest.raises(TypeError):
        repo.save({"m": torch.ones(2)}, step=1, metadata={"x": object()})
    with pytest.raises(ValueError):
        repo.save({"m": torch.ones(2)}, step=-1)
    with pytest.raises(ValueError, match="flatten"):
        repo.save({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, step=1)
    assert list(repo.store.list()) == []  # nothing was written


def test_tensor_names_never_become_object_keys(tmp_path):
    repo = Repository(ckptstore.storage.LocalStore(str(tmp_path)), **SMALL)
    evil = {"../../etc/passwd": torch.ones(3), "a/b\x00c": torch.zeros(2), "ü" * 500: torch.ones(1)}
    repo.save(evil, step=1)
    keys = [o.key for o in repo.store.list()]
    assert all(k.startswith(("packs/", "segments/", "manifests/", "config.json")) for k in keys), keys
    out = repo.load(1)
    assert_tree_equal(evil, out)
    assert not (tmp_path.parent / "etc").exists()


# ------------------------------------------------------------------ dedup
def test_unchanged_tensors_upload_nothing(repo_url):
    cs = SMALL["chunk_size"]
    frozen = {f"frozen{i}": torch.randn(cs // 4 * 3) for i in range(4)}  # 3 chunks each
    trained = torch.randn(cs // 4 * 2)  # 2 chunks
    with _open(repo_url) as repo:
        i1 = repo.save({**frozen, "trained": trained}, step=1)
        assert i1.reused_bytes == 0 and i1.new_bytes == i1.logical_bytes
        trained2 = trained + 1
        i2 = repo.save({**frozen, "trained": trained2}, step=2)
        changed = trained2.numel() * 4
        assert i2.new_bytes == changed
        assert i2.reused_bytes == i2.logical_bytes - changed
        # uploaded: the changed tensor's compressed chunks + pack table/header + manifest
        assert i2.uploaded_bytes < changed * 1.02 + 16_384
        assert i2.new_chunks == 2 and i2.reused_chunks == 12
        i3 = repo.save({**frozen, "trained": trained2}, step=3)
        assert i3.new_bytes == 0 and i3.packs == 0
        assert_tree_equal({**frozen, "trained": trained}, repo.load(1))
        assert_tree_equal({**frozen, "trained": trained2}, repo.load(3))


def test_duplicate_chunks_within_one_save_are_stored_once():
    repo = _mem_repo()
    z = torch.zeros(SMALL["chunk_size"] // 4 * 8)
    info = repo.save({"a": z, "b": z.clone(), "c": torch.ones(10)}, step=1)
    assert info.new_chunks == 2 and info.reused_chunks == 15
    assert_tree_equal({"a": z, "b": z, "c": torch.ones(10)}, repo.load(1))


def test_compression_pays_and_falls_back_to_raw():
    repo = _mem_repo()
    info = repo.save({"zeros": torch.zeros(200_000), "noise": random_tensor(torch.uint8, (200_000,))}, step=1)
    m = repo.manifest(1)
    codecs_z = {c.codec for c in m.tensors["zeros"].shards[0].chunks}
    codecs_n = {c.codec for c in m.tensors["noise"].shards[0].chunks}
    assert codecs_z == {"bgz"} and codecs_n == {"raw"}  # float32: byte-grouped; random uint8: raw
    ck = repo.checkpoint(1)
    assert ck.tensor_meta("zeros").stored_bytes < 800_000 / 100
    assert ck.tensor_meta("noise").stored_bytes == 200_000
    assert info.new_bytes / info.stored_bytes == pytest.approx(info.compression_ratio)


# ------------------------------------------------------------------ slices
def test_slice_reads_fetch_only_covering_chunks(repo_url):
    url, so = repo_url
    from ckptstore.storage import open_store

    store = CountingStore(open_store(url, so))
    repo = Repository(store, tiles=False, **SMALL)  # row-major runs; tiles below
    w = torch.randn(1024, 1024)  # 4 MiB = 64 chunks of 64 KiB
    repo.save({"w": w, "other": torch.randn(100_000)}, step=1)
    ck = repo.checkpoint(1)
    store.reset()
    got = ck.read("w", (slice(128, 160), slice(None)))  # 128 KiB of rows = 2 chunks
    assert torch.equal(got, w[128:160])
    stored_total = ck.tensor_meta("w").stored_bytes
    assert store.bytes_read <= 3 * SMALL["chunk_size"] * 1.05
    assert store.bytes_read < stored_total / 10
    assert all(k.startswith("packs/") for k, _, _ in store.reads)
    # a column slice needs every row: reads everything, still correct
    assert torch.equal(ck.read("w", (slice(None), 5)), w[:, 5])
    # assorted indices
    for index in [5, -1, (3, 4), (slice(10, 900, 7), slice(3, 1000, 11)), (..., slice(0, 2)),
                  (slice(1000, 2000),), (slice(5, 5),)]:
        assert torch.equal(ck.read("w", index), w[index]), index
    with pytest.raises(IndexError):
        ck.read("w", 5000)
    with pytest.raises(IndexError):
        ck.read("w", (1, 2, 3))
    # Tiled (format 4.0, the default): a row or a column slice fetches exactly the tiles it meets.
    tiled = Repository(store, **SMALL, coalesce_gap=0)
    tiled.save({"w": w.clone()}, step=2, base=None)
    ck = tiled.checkpoint(2)
    e = ck.entry("w")
    assert e.tile is not None
    (shard,) = ck.shards("w", [0])
    for index in [(slice(128, 160), slice(None)), (slice(None), slice(128, 160)), (slice(None), 5),
                  (slice(10, 900, 7), slice(3, 1000, 11))]:
        store.reset()
        assert torch.equal(ck.read("w", index), w[index]), index
        box, _ = _plan.normalize_index(index, e.shape)
        covering = ck.box_refs(e, shard, box)
        assert store.bytes_read == sum(c.stored_len for c in covering), index
    store.reset()
    ck.read("w", (slice(None), slice(128, 160)))  # 1/32 of the columns
    assert store.bytes_read < ck.tensor_meta("w").stored_bytes / 10
    for index in [5, -1, (3, 4), (..., slice(0, 2)), (slice(1000, 2000),), (slice(5, 5),)]:
        assert torch.equal(ck.read("w", index), w[index]), index
    tiled.close()
    repo.close()


# ------------------------------------------------------------------ commit
def test_existing_step_is_refused_and_store_unchanged():
    repo = _mem_repo()
    repo.save({"w": torch.ones(100)}, step=1)
    before = [(o.key, o.size) for o in repo.store.list()]
    with pytest.raises(StepExistsError, match="step 1"):
        repo.save({"w": torch.zeros(100)}, step=1)
    assert [(o.key, o.size) for o in repo.store.list()] == before
    assert torch.equal(repo.load(1)["w"], torch.ones(100))


def test_failed_manifest_write_leaves_no_step(repo_url):
    url, so = repo_url
    from ckptstore.storage import open_store

    fault = FaultStore(open_store(url, so))
    repo = Repository(fault, **SMALL)
    sd1 = {"w": torch.randn(50_000)}
    repo.save(sd1, step=1)
    fault.add_rule("put_if_absent", "manifests/*", lambda op, k: StorageError(f"injected failure on {k}"), count=1)
    with pytest.raises(StorageError, match="injected"):
        repo.save({"w": torch.randn(50_000)}, step=2)
    reopened = _open(repo_url)
    assert reopened.steps() == [1]
    assert_tree_equal(sd1, reopened.load(1))
    # the same step can be saved afterwards
    sd2 = {"w": torch.randn(50_000)}
    repo.save(sd2, step=2)
    assert reopened.steps() == [1, 2]
    assert_tree_equal(sd2, reopened.load(2))
    repo.close()
    reopened.close()


def test_failed_pack_upload_aborts_and_leaves_no_step():
    fault = FaultStore(MemoryStore())
    repo = Repository(fault, chunk_size=64 << 10, pack_size=16 << 20, part_size=5 << 20)
    fault.add_rule("upload_part", "packs/*", lambda op, k: StorageError("injected part failure"), count=1)
    with pytest.raises(StorageError, match="injected"):
        repo.save({"w": torch.randn(3 << 20)}, step=1)  # 12 MiB -> multipart
    assert repo.steps() == []
    assert fault.inner.list_multipart() == []  # the upload was aborted
    assert not [o for o in fault.inner.list("packs/")]


def test_two_writers_race_for_one_step(repo_url):
    url, so = repo_url
    repos = [ckptstore.open(url, storage_options=so, **SMALL) for _ in range(4)]
    sds = [{"w": torch.full((20_000,), float(i))} for i in range(4)]

    def go(i):
        try:
            repos[i].save(sds[i], step=7)
            return i
        except StepExistsError:
            return None

    with cf.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(go, range(4)))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    fresh = ckptstore.open(url, storage_options=so)
    assert fresh.steps() == [7]
    assert torch.equal(fresh.load(7)["w"], sds[winners[0]]["w"])
    for r in repos + [fresh]:
        r.close()


def test_async_save_stages_a_copy():
    repo = _mem_repo()
    w = torch.randn(300_000)
    expected = w.clone()
    fut = repo.save({"w": w}, step=1, blocking=False)
    w.add_(1.0)  # caller mutates right away
    info = fut.result(timeout=60)
    assert info.step == 1
    assert torch.equal(repo.load(1)["w"], expected)


# ------------------------------------------------------------------ damage
def _corrupt_setup():
    store = MemoryStore()
    repo = Repository(store, **SMALL)
    repo.save({"a": torch.randn(100_000), "b": torch.randn(1000)}, step=1)
    return store, repo


def test_truncated_manifest_is_a_clear_error():
    store, repo = _corrupt_setup()
    raw = store.get(manifest_key(1))
    store.put(manifest_key(1), raw[: len(raw) // 2])
    with pytest.raises(FormatError, match="step 1.*not valid JSON"):
        Repository(store).checkpoint(1)


def test_corrupted_manifest_is_a_clear_error():
    store, repo = _corrupt_setup()
    doc = json.loads(store.get(manifest_key(1)))
    doc["segments"][0]["digest"] = "zz" * 32
    store.put(manifest_key(1), json.dumps(doc).encode())
    with pytest.raises(FormatError, match="step 1.*digest.*hex"):
        Repository(store).checkpoint(1)
    store.put(manifest_key(1), b"\x00\xff garbage")
    with pytest.raises(FormatError):
        Repository(store).load(1)


def test_future_major_version_is_refused():
    store, repo = _corrupt_setup()
    doc = json.loads(store.get(manifest_key(1)))
    doc["version"] = [5, 0]
    store.put(manifest_key(1), json.dumps(doc).encode())
    with pytest.raises(UnsupportedVersionError, match="5.0.*upgrade"):
        Repository(store).checkpoint(1)
    # a newer minor version is read
    doc["version"] = [4, 9]
    store.put(manifest_key(1), json.dumps(doc).encode())
    Repository(store).load(1)


def test_flipped_byte_in_pack_names_step_tensor_pack_offset():
    store, repo = _corrupt_setup()
    m = repo.manifest(1)
    c = m.tensors["a"].shards[0].chunks[3]
    key = pack_key(c.pack)
    data = bytearray(store.get(key))
    data[c.offset + c.stored_len // 2] ^= 0x01
    store.put(key, bytes(data))
    fresh = Repository(store)
    with pytest.raises(IntegrityError) as ei:
        fresh.load(1)
    msg = str(ei.value)
    assert "step 1" in msg and "'a'" in msg and c.pack in msg and f"offset {c.offset}" in msg
    # the untouched tensor still reads
    assert fresh.checkpoint(1).read("b").shape == (1000,)


def test_missing_pack_is_an_error_not_zeros():
    store, repo = _corrupt_setup()
    m = repo.manifest(1)
    pid = m.tensors["a"].shards[0].chunks[0].pack
    store.delete(pack_key(pid))
    with pytest.raises(MissingDataError, match=pid):
        Repository(store).load(1)


def test_manifest_naming_a_bigger_pack_than_stored():
    store, repo = _corrupt_setup()
    m = repo.manifest(1)
    c = m.tensors["a"].shards[0].chunks[-1]
    key = pack_key(c.pack)
    store.put(key, store.get(key)[: c.offset + 10])  # truncate the pack
    with pytest.raises(IntegrityError, match="shorter|short|hash"):
        Repository(store).load(1)


def test_moved_chunks_are_found_through_relocation_records():
    """A repack (GC) may move chunks; committed manifests keep resolving."""
    from ckptstore.format import pack as P
    from ckptstore.format.layout import relocation_key

    store, repo = _corrupt_setup()
    expected = repo.load(1)
    m = repo.manifest(1)
    old = m.tensors["a"].shards[0].chunks[0].pack
    entries = P.read_table(store, pack_key(old))
    data = store.get(pack_key(old))
    b = P.PackBuilder()
    body = [P.header()]
    moved = {}
    new_id = "f" * 32
    for e in reversed(entries):  # new order, new offsets
        ne = b.add(e.hash, e.codec, e.stored_len, e.raw_len)
        body.append(data[e.offset : e.offset + e.stored_len])
        moved[e.hash] = [new_id, ne.offset, e.stored_len, e.raw_len, e.codec]
    body.append(b.tail())
    store.put(pack_key(new_id), b"".join(body))
    rec = {"format": "ckptstore.relocation", "version": [1, 0], "pack": old, "chunks": moved}
    store.put(relocation_key(old), json.dumps(rec).encode())
    store.delete(pack_key(old))
    assert_tree_equal(expected, Repository(store).load(1))
    # a record that lacks a chunk is no rescue
    rec["chunks"].pop(next(iter(rec["chunks"])))
    store.put(relocation_key(old), json.dumps(rec).encode())
    with pytest.raises(MissingDataError, match=old):
        Repository(store).load(1)
    store.put(relocation_key(old), b"{not json")
    with pytest.raises(FormatError, match="relocation"):
        Repository(store).load(1)


def test_loading_many_small_tensors_coalesces_requests_across_tensors():
    store = CountingStore(MemoryStore())
    repo = Repository(store, chunk_size=64 << 10, pack_size=8 << 20, part_size=5 << 20)
    sd = {f"layer{i}.weight": torch.randn(100, 50) for i in range(200)}  # 200 tensors of 20 KB, one pack
    repo.save(sd, step=1)
    def requests(prefix):
        return sum(1 for key, _, _ in store.reads if key.startswith(prefix))

    store.reset()
    out = Repository(store).load(1)
    assert_tree_equal(sd, out)
    # not one request per tensor: the pack in two, the chunk table in two (header, records)
    assert requests("packs/") <= 2 and requests("segments/") <= 2, store.reads
    store.reset()
    into = {k: torch.zeros_like(v) for k, v in sd.items()}
    Repository(store).load(1, into=into)
    assert_tree_equal(sd, into)
    assert requests("packs/") <= 2 and requests("segments/") <= 2, store.reads


def test_async_saves_reuse_staging_buffers_safely():
    repo = _mem_repo()
    w = torch.randn(200_000)
    snapshots = []
    futures = []
    for step in range(1, 5):
        snapshots.append(w.clone())
        futures.append(repo.save({"w": w, "b": torch.full((10,), float(step))}, step=step, blocking=False))
        w.add_(1.0)  # the caller changes its tensor at once
    for f in futures:
        f.result(timeout=60)
    for step, snap in enumerate(snapshots, start=1):
        out = repo.load(step)
        assert torch.equal(out["w"], snap) and torch.equal(out["b"], torch.full((10,), float(step)))
    # once the last async save is done, the next one copies into the same buffers
    first = repo._async.staging["w"].data_ptr()
    repo.save({"w": w, "b": torch.zeros(10)}, step=9, blocking=False).result(timeout=60)
    assert repo._async.staging["w"].data_ptr() == first
    assert torch.equal(repo.load(9)["w"], w)


def test_async_staging_copies_views_and_refits_buffers_when_shapes_change():
    repo = _mem_repo()
    z = torch.randn(50, 40, dtype=torch.complex64)
    m = torch.randn(80, 60)
    sd = {"conj": z.conj(), "neg": torch._neg_view(m), "cols": m[:, ::3]}
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in sd.items()}
    repo.save(sd, step=1, blocking=False).result(timeout=60)
    assert_tree_equal(repo.load(1), expected)
    ptr = repo._async.staging["cols"].data_ptr()
    sd2 = {"conj": z, "neg": m, "cols": m[:, ::2]}  # same keys; "cols" changes shape
    repo.save(sd2, step=2, blocking=False).result(timeout=60)
    assert_tree_equal(repo.load(2), {k: v.clone() for k, v in sd2.items()})
    assert repo._async.staging["cols"].shape == (80, 30) and repo._async.staging["cols"].data_ptr() != ptr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_async_save_from_cuda_stages_into_reused_pinned_buffers(tmp_path):
    repo = ckptstore.open(str(tmp_path / "r"))
    w = torch.randn(1 << 20, device="cuda")
    b = torch.randn(100, 30, device="cuda").t()  # not contiguous
    snaps = []
    for step in (1, 2):
        snaps.append({"w": w.cpu(), "b": b.cpu()})
        fut = repo.save({"w": w, "b": b}, step=step, blocking=False)
        w.add_(1.0)  # the caller's next step writes the tensors at once
        b.mul_(2.0)
        fut.result(timeout=120)
        if step == 1:
            first = {k: v.data_ptr() for k, v in repo._async.staging.items()}
    assert all(v.is_pinned() and v.device.type == "cpu" for v in repo._async.staging.values())
    assert {k: v.data_ptr() for k, v in repo._async.staging.items()} == first  # reused after the 1st finished
    for step, snap in enumerate(snaps, start=1):
        assert_tree_equal(repo.load(step), snap)
    into = {"w": torch.zeros_like(w), "b": torch.zeros(30, 100, device="cuda")}
    repo.load(2, into=into)
    assert into["w"].device.type == "cuda" and torch.equal(into["w"].cpu(), snaps[1]["w"])
    assert torch.equal(into["b"].cpu(), snaps[1]["b"])
    repo.close()


def test_local_stores_get_few_io_threads_and_small_requests_unless_asked(tmp_path):
    from ckptstore.pipeline.options import LOCAL_IO_WORKERS, LOCAL_MAX_REQUEST, RepoOptions
    from ckptstore.storage.local import LocalStore
    from ckptstore.storage.memory import MemoryStore

    class Remote(MemoryStore):
        remote = True

    defaults = RepoOptions()
    local = Repository(LocalStore(str(tmp_path / "a")))
    assert local.options.io_workers == min(defaults.io_workers, LOCAL_IO_WORKERS)
    assert local.options.max_request == min(defaults.max_request, LOCAL_MAX_REQUEST)
    asked = Repository(LocalStore(str(tmp_path / "b")), io_workers=12, max_request=16 << 20)
    assert (asked.options.io_workers, asked.options.max_request) == (12, 16 << 20)
    remote = Repository(Remote("remote-defaults-test"))
    assert (remote.options.io_workers, remote.options.max_request) == (defaults.io_workers, defaults.max_request)
    for r in (local, asked, remote):
        r.close()


def test_a_manifest_readers_would_refuse_is_never_committed(monkeypatch):
    from ckptstore.format import manifest as M
    from ckptstore.errors import ManifestTooLargeError

    repo = _mem_repo()
    repo.save({"w": torch.ones(10)}, step=1)
    monkeypatch.setattr(M, "MAX_MANIFEST_BYTES", 600)
    with pytest.raises(ManifestTooLargeError, match=r"step 2: the manifest would be \d+ bytes.*nothing was committed.*chunk_size"):
        repo.save({f"t{i}": torch.ones(10) * i for i in range(20)}, step=2)
    assert repo.steps() == [1]
    # what the refused save uploaded was deleted with it (nothing could reference it): no orphan for GC
    assert not repo.plan_gc().young_packs
    from ckptstore.format.layout import pack_key, segment_key

    man = repo.manifest(1)
    assert {o.key for o in repo.store.list("packs/")} == {pack_key(p) for p in man.packs}
    assert {o.key for o in repo.store.list("segments/")} == {segment_key(s.id) for s in man.segments}


def test_pack_ranges_are_capped_by_closing_the_smallest_gaps():
    from ckptstore.format.manifest import merge_ranges

    spans = [(i * 10, i * 10 + 5) for i in range(100)] + [(2000, 2010)]
    merged = merge_ranges(spans, limit=4)
    assert len(merged) == 4 and merged[-1] == (2000, 2010)  # the one big gap stays open
    covered = sum(e - s for s, e in merged)
    assert covered >= sum(e - s for s, e in spans)  # never less than what is used
    assert merge_ranges([(5, 9), (0, 3), (3, 5), (20, 20)]) == ((0, 9),)


def test_damaged_or_missing_chunk_table_segment_is_a_clear_error():
    from ckptstore.errors import MissingDataError
    from ckptstore.format.layout import segment_key

    store, repo = _corrupt_setup()
    seg = repo.manifest(1).segments[0]
    key = segment_key(seg.id)
    raw = bytearray(store.get(key))
    raw[seg.header + 10] ^= 0x01  # a record byte: its block's digest no longer matches
    store.put(key, bytes(raw))
    with pytest.raises(FormatError, match=rf"step 1: chunk-table segment {seg.id}: block 0 does not match its digest"):
        Repository(store).load(1)
    raw[seg.header + 10] ^= 0x01
    raw[5] ^= 0x01  # the header: the root's digest no longer matches
    store.put(key, bytes(raw))
    with pytest.raises(FormatError, match="header does not match the manifest's digest"):
        Repository(store).load(1)
    store.delete(key)
    with pytest.raises(MissingDataError, match=rf"segment {seg.id} is missing"):
        Repository(store).load(1)
    rep = Repository(store).verify()
    assert [p.kind for p in rep.problems] == ["segment"] and rep.problems[0].step == 1


# ------------------------------------------------------------------ checkpoint names
def test_names_point_at_steps_and_move_with_one_write(repo_url):
    repo = _open(repo_url)
    repo.save({"w": torch.ones(4)}, step=2)
    name = "epoch=0-step=2 (é).ckpt"
    repo.set_name("lightning", name, 2)
    assert repo.name_step("lightning", name) == 2
    assert repo.name_step("deepspeed", name) is None  # name spaces are apart
    # saving the name again: the committed step is kept, the new state gets a free step
    new = repo.free_step(2)
    assert new == 3
    repo.save({"w": torch.zeros(4)}, step=new)
    repo.set_name("lightning", name, new)
    assert repo.names("lightning") == {name: 3}
    assert repo.steps() == [2, 3]
    assert torch.equal(repo.load(repo.name_step("lightning", name))["w"], torch.zeros(4))
    # a name is never an unchecked path, and only committed steps are named
    for bad in ("a/b", "..", "", "x\n", "a\\b", "x" * 256):
        with pytest.raises(ValueError, match="invalid checkpoint name"):
            repo.set_name("lightning", bad, 2)
    with pytest.raises(ValueError, match="invalid name space"):
        repo.set_name("Lightning/x", name, 2)
    with pytest.raises(StepNotFoundError, match="not committed"):
        repo.set_name("lightning", "other.ckpt", 9)
    assert repo.names("lightning") == {name: 3}
    assert repo.drop_name("lightning", name) and not repo.drop_name("lightning", name)
    assert repo.names("lightning") == {} and repo.steps() == [2, 3]
    assert repo.free_step(7) == 7


def test_name_records_are_checked_and_not_kept_by_gc(tmp_path):
    from ckptstore.format.layout import name_key, name_of_key

    repo = ckptstore.open(str(tmp_path), **SMALL)
    for s in (1, 2, 3):
        repo.save({"w": torch.full((4,), float(s))}, step=s)
    repo.set_name("deepspeed", "global_step1", 1)
    key = name_key("deepspeed", "global_step1")
    assert name_of_key(key) == ("deepspeed", "global_step1")
    assert name_of_key("refs/names/deepspeed/a%2Fb") is None  # decodes to a path: not a name
    assert name_of_key("refs/names/deepspeed/a%41") is None  # not the canonical spelling of "aA"
    # a record that names another checkpoint is refused, not followed
    repo.store.put(name_key("deepspeed", "global_step2"), repo.store.get(key))
    with pytest.raises(FormatError, match="names 'global_step1'"):
        repo.name_step("deepspeed", "global_step2")
    assert repo.names("deepspeed") == {"global_step1": 1}
    # names do not keep a step from retention (tags do)
    plan = repo.plan_gc(keep_last=1)
    assert 1 in plan.delete_steps and 3 not in plan.delete_steps


def test_a_finalizer_stops_a_handles_threads_without_joining_them(tmp_path):
    # A garbage collection can run a finalizer inside threading's own locks (a thread starting,
    # threading._maintain_shutdown_locks): a join there deadlocks (a DCP async save hung in
    # Thread.start once, a collected CkptStoreWriter joining its pools). Finalizers abandon.
    import threading

    from ckptstore.dcp.reader import CkptStoreReader
    from ckptstore.dcp.writer import CkptStoreWriter
    from ckptstore.storage import open_store

    repo = Repository(open_store(str(tmp_path / "r")))
    repo.save({"w": torch.arange(10.0)}, step=1)  # its pools have threads now
    done = threading.Event()

    def collect():
        with threading._shutdown_locks_lock:  # held, as where the collection ran
            repo.abandon()
        done.set()

    t = threading.Thread(target=collect, daemon=True)
    t.start()
    t.join(120)  # a deadlock guard, not a timing
    assert done.is_set()
    calls = []

    class Handle:
        write_back = None

        def close(self):
            calls.append("close")

        def abandon(self):
            calls.append("abandon")

    for cls in (CkptStoreWriter, CkptStoreReader):
        obj = cls.__new__(cls)
        obj.__dict__.update(_repo=Handle(), _commit=None, _replicator=None)
        obj.__del__()
    assert calls == ["abandon", "abandon"]
