"""A save interrupted in its own process (an exception, KeyboardInterrupt, a SIGTERM handler that
raises) deletes the packs and chunk tables it uploaded for the step it did not commit, and aborts
its multipart uploads; a failure of the manifest create itself (outcome unknown) leaves them to GC.

Covers ``Repository.save`` (blocking, async, write-back before its local commit), ``import``,
``CkptStoreWriter`` (a rank's failure, the coordinator's commit) and ``cp``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.clock import ManualClock
from ckptstore.errors import ManifestTooLargeError, StorageError
from ckptstore.format.layout import pack_key, segment_key
from ckptstore.repo.repository import Repository
from ckptstore.storage import MemoryStore, open_store
from ckptstore.storage.faults import FaultStore

from .helpers import SMALL, assert_tree_equal

MiB = 1 << 20
#: Packs of two parts (5 MiB and 1 MiB): each goes up as a multipart upload.
MULTI = dict(chunk_size=1 * MiB, pack_size=6 * MiB, part_size=5 * MiB)


def _state(seed: int, mib: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(mib * MiB // 8, generator=g), "b": torch.randn(mib * MiB // 8, generator=g),
            "seed": seed}


def _orphans(repo) -> tuple[set, set, list]:
    """Packs and chunk tables no committed step names, and unfinished multipart uploads."""
    packs, segments = set(), set()
    for s in repo.steps():
        m = repo.manifest(s)
        packs |= {pack_key(p) for p in m.packs}
        segments |= {segment_key(x.id) for x in m.segments}
    stored_packs = {o.key for o in repo.store.list("packs/")}
    stored_segments = {o.key for o in repo.store.list("segments/")}
    return stored_packs - packs, stored_segments - segments, repo.store.list_multipart()


def _clean(repo) -> None:
    packs, segments, uploads = _orphans(repo)
    assert (packs, segments, uploads) == (set(), set(), []), "an interrupted save left objects behind"


def _interrupt(store: FaultStore, op: str, glob: str, exc_or_fn, count: int | None = 1, after: int = 0) -> None:
    """Raise ``exc_or_fn()`` at the ``after``-th call (0-based) of ``op`` on keys matching ``glob``."""
    seen = {"n": 0}

    def hook(op_, key):
        seen["n"] += 1
        if seen["n"] - 1 == after:
            return exc_or_fn()
        return None

    store.add_rule(op, glob, hook)


@pytest.mark.parametrize("where", ["segment put (main thread)", "second pack (main thread)",
                                   "a part upload (I/O thread)"])
def test_a_ctrl_c_during_a_save_deletes_what_it_uploaded(where, tmp_path):
    store = FaultStore(MemoryStore())
    repo = Repository(store, cache_dir=tmp_path / "tier", **MULTI)
    repo.save(_state(1), step=1)
    op, glob, after = {"segment": ("put", "segments/*", 0), "second": ("create_multipart", "packs/*", 1),
                       "a part": ("upload_part", "packs/*", 1)}[where.split(" ")[0] if where[0] != "a" else "a part"]
    _interrupt(store, op, glob, KeyboardInterrupt, after=after)
    with pytest.raises(KeyboardInterrupt):
        repo.save(_state(2, mib=16), step=2)  # 16 MiB (14 stored): packs of 6, 6 and 2 MiB
    assert op in {o for o, _ in store.triggered}
    assert repo.steps() == [1]
    _clean(repo)
    # the tier keeps no copy of a deleted pack either
    tier_packs = {p.name.removesuffix(".pack") for p in (Path(repo.tier.root) / "packs").rglob("*.pack")}
    assert tier_packs <= set(repo.manifest(1).packs)
    store.clear()
    repo.save(_state(2, mib=16), step=2)  # and the step saves as if nothing had happened
    assert_tree_equal(repo.load(2), _state(2, mib=16))
    repo.close()


def test_a_handled_sigterm_during_a_save_deletes_what_it_uploaded(tmp_path):
    store = FaultStore(MemoryStore())
    repo = Repository(store, **MULTI)
    repo.save(_state(1), step=1)

    def terminate(op, key):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises in this (the main) thread
        return None

    store.add_rule("put", "segments/*", terminate, count=1)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        with pytest.raises(SystemExit):
            repo.save(_state(2), step=2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert repo.steps() == [1]
    _clean(repo)


def test_an_exception_in_an_async_save_deletes_what_it_uploaded():
    store = FaultStore(MemoryStore())
    repo = Repository(store, **MULTI)
    _interrupt(store, "put", "segments/*", lambda: StorageError("segments/x: refused by the test"))
    fut = repo.save(_state(3), step=1, blocking=False)
    with pytest.raises(StorageError, match="refused by the test"):
        fut.result()
    assert repo.steps() == []
    _clean(repo)
    assert list(repo.store.list("packs/")) == []


def test_an_interrupted_import_deletes_what_it_uploaded(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({k: v for k, v in _state(4).items() if isinstance(v, torch.Tensor)}, str(path))
    store = FaultStore(MemoryStore())
    repo = Repository(store, **MULTI)
    _interrupt(store, "put", "segments/*", KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        repo.import_(path, step=1)
    assert repo.steps() == []
    _clean(repo)


def test_a_failed_manifest_create_leaves_the_packs_for_gc():
    # The create may have landed (a lost answer): the packs may be referenced, so they stay.
    store = FaultStore(MemoryStore())
    repo = Repository(store, **MULTI)
    _interrupt(store, "put_if_absent", "manifests/*", lambda: StorageError("manifests/x: no answer"))
    with pytest.raises(StorageError, match="no answer"):
        repo.save(_state(5), step=1)
    packs, segments, _ = _orphans(repo)
    assert packs and segments, "a save whose manifest create failed must not delete what it may name"


def test_a_step_refused_before_its_create_deletes_what_it_uploaded():
    from ckptstore.format import manifest as M

    repo = Repository(MemoryStore(), **SMALL)
    repo.save({"w": torch.ones(10)}, step=1)
    real = M.MAX_MANIFEST_BYTES
    M.MAX_MANIFEST_BYTES = 600
    try:
        with pytest.raises(ManifestTooLargeError):
            repo.save({f"t{i}": torch.ones(10) * i for i in range(20)}, step=2)
    finally:
        M.MAX_MANIFEST_BYTES = real
    _clean(repo)


def test_a_write_back_save_interrupted_before_its_local_commit_leaves_nothing_in_the_tier(tmp_path):
    repo = ckptstore.open(str(tmp_path / "repo"), cache_dir=tmp_path / "tier", write_back=True, **MULTI)
    wb = repo.write_back
    real = wb.store.create_multipart

    def create(key, part_size):  # the chunk table's write into the tier: its packs are there already
        if key.startswith("segments/"):
            raise KeyboardInterrupt
        return real(key, part_size)

    wb.store.create_multipart = create
    with pytest.raises(KeyboardInterrupt):
        repo.save(_state(6), step=1)
    assert any(p.is_file() for p in (tmp_path / "tier").rglob("*")), "the save wrote its packs into the tier"
    assert repo.pending_steps() == []
    leftovers = [p for p in (tmp_path / "tier").rglob("*") if p.is_file() and "/wb/" in str(p)]
    assert leftovers == [], "the pending area keeps files nothing will ever commit"
    wb.store.create_multipart = real
    repo.save(_state(6), step=1)
    repo.flush()
    assert repo.steps() == [1]
    repo.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("where", ["rank", "coordinator"])
def test_an_interrupted_dcp_save_deletes_what_its_ranks_uploaded(where, tmp_path):
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import CkptStoreWriter

    url = str(tmp_path / "repo")
    base = _state(7)
    sd = {"a": base["a"], "b": base["b"]}
    dcp.save(sd, storage_writer=CkptStoreWriter(url, step=1, **MULTI), no_dist=True)
    sd2 = {"a": base["a"], "b": torch.randn(base["b"].shape), "c": torch.randn(MiB)}  # "a" is reused from step 1
    if where == "rank":
        store = FaultStore(open_store(url))
        _interrupt(store, "put", "segments/*", KeyboardInterrupt)
        w = CkptStoreWriter(url, step=2, **MULTI)
        w._repo = Repository(store, **MULTI)
        with pytest.raises(BaseException):  # DCP wraps what a rank raised
            dcp.save(sd2, storage_writer=w, no_dist=True)
    else:
        # The save outlives the grace period while its rank uploads: the coordinator refuses to commit.
        clock = ManualClock()
        w = CkptStoreWriter(url, step=2, clock=clock, **MULTI)
        repo = w._get_repo()
        real_create = repo.store.create_multipart

        def create(key, part_size):  # the rank's chunk table, after its packs
            if key.startswith("segments/"):
                clock.advance(30 * 86400)
            return real_create(key, part_size)

        repo.store.create_multipart = create
        with pytest.raises(BaseException, match="grace period"):
            dcp.save(sd2, storage_writer=w, no_dist=True)
    with ckptstore.open(url) as repo:
        assert repo.steps() == [1]
        _clean(repo)
        assert repo.verify(read_data=True).ok  # step 1's packs, reused by the failed save, are all there
    dcp.save(sd2, storage_writer=CkptStoreWriter(url, step=2, **MULTI), no_dist=True)
    got = {k: torch.empty_like(v) for k, v in sd2.items()}
    from ckptstore.dcp import CkptStoreReader

    dcp.load(got, storage_reader=CkptStoreReader(url, step=2), no_dist=True)
    assert_tree_equal(got, sd2)


def test_an_interrupted_cp_deletes_the_uncommitted_step_s_packs_and_keeps_the_copied_steps(tmp_path):
    src = Repository(MemoryStore(), **MULTI)
    src.save(_state(8), step=1)
    src.save(_state(9), step=2)
    store = FaultStore(MemoryStore())
    dst = Repository(store, **MULTI)
    _interrupt(store, "put", "segments/*", KeyboardInterrupt, after=1)  # step 2's chunk table
    with pytest.raises(KeyboardInterrupt):
        src.cp(dst)
    assert dst.steps() == [1]
    _clean(dst)
    assert dst.verify(read_data=True).ok
    store.clear()
    assert src.cp(dst).copied == [2]
    assert_tree_equal(dst.load(2), _state(9))


def test_a_ctrl_c_during_an_s3_save_aborts_its_multipart_uploads_and_deletes_its_packs(s3):
    store = FaultStore(s3.store())
    repo = Repository(store, **MULTI)
    _interrupt(store, "upload_part", "packs/*", KeyboardInterrupt, after=2)  # the second pack's first part
    with pytest.raises(KeyboardInterrupt):
        repo.save(_state(10, mib=16), step=1)
    assert repo.steps() == []
    _clean(repo)
    assert list(repo.store.list("packs/")) == []
