"""Write-back saves: durable in the node-local tier first, committed in the store in the background."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

import ckptstore
from ckptstore.clock import ManualClock
from ckptstore.format.layout import manifest_key
from ckptstore.repo.repository import Repository
from ckptstore.storage import open_store
from ckptstore.storage.faults import FaultStore
from ckptstore.testing import free_port
from ckptstore.repo.writeback import WriteBackError

from .crash_child import CHILD_OPTS, build_state
from .helpers import SMALL, assert_tree_equal, spawn

HERE = os.path.dirname(os.path.abspath(__file__))


def _state(seed: int, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, 256, generator=g) for i in range(n)} | {"seed": seed}


class _Gate:
    """Holds the uploader at its first write to the store (a pack or segment) until opened."""

    def __init__(self, store: FaultStore):
        self.open = threading.Event()
        self.reached = threading.Event()
        for op in ("put", "create_multipart"):
            for glob in ("packs/*", "segments/*"):
                store.add_rule(op, glob, self._hook)

    def _hook(self, op, key):
        self.reached.set()
        assert self.open.wait(60), "the test never opened the gate"
        return None


def _gated(tmp_path, **kw):
    store = FaultStore(open_store(str(tmp_path / "repo")))
    gate = _Gate(store)
    repo = Repository(store, cache_dir=tmp_path / "tier", write_back=True, **{**SMALL, **kw})
    return repo, gate


def test_a_write_back_save_returns_before_the_store_has_the_step(tmp_path):
    repo, gate = _gated(tmp_path)
    sd = _state(1)
    info = repo.save(sd, step=1)
    assert info.step == 1
    gate.reached.wait(30)
    assert repo.steps() == [] and repo.steps(pending=True) == [1] and repo.pending_steps() == [1]
    assert repo.latest() is None and repo.latest(pending=True) == 1
    assert not repo.store.exists(manifest_key(1)), "the step appears in the store only when committed"
    assert_tree_equal(repo.load(1), sd)  # read from the tier while pending
    other = ckptstore.open(str(tmp_path / "repo"), cache_dir=tmp_path / "tier")  # another handle on this node
    assert other.steps(pending=True) == [1] and other.manifest(1).step == 1
    assert_tree_equal(other.load(1), sd)
    other.close()
    gate.open.set()
    repo.flush()
    assert repo.steps() == [1] and repo.pending_steps() == []
    repo.close()
    with ckptstore.open(str(tmp_path / "repo")) as plain:  # no tier: everything is in the store
        assert_tree_equal(plain.load(1), sd)


def test_at_most_write_back_steps_pending_then_a_save_waits(tmp_path):
    repo, gate = _gated(tmp_path, write_back_steps=2)
    repo.save(_state(1), step=1)
    repo.save(_state(2), step=2)
    third = threading.Thread(target=repo.save, args=(_state(3),), kwargs={"step": 3})
    third.start()
    third.join(1.0)
    assert third.is_alive(), "a third pending step must wait for the oldest to commit"
    assert repo.pending_steps() == [1, 2]
    gate.open.set()
    third.join(60)
    assert not third.is_alive()
    repo.flush()
    assert repo.steps() == [1, 2, 3]
    for s in (1, 2, 3):
        assert_tree_equal(repo.load(s), _state(s))
    repo.close()


def test_a_later_save_dedups_against_a_pending_step(tmp_path):
    repo, gate = _gated(tmp_path)
    sd = _state(4)
    repo.save(sd, step=1)
    info = repo.save({**sd, "seed": 5}, step=2)  # same tensors: nothing new to write
    assert info.new_bytes == 0 and info.reused_bytes > 0
    gate.open.set()
    repo.flush()
    repo.close()
    with ckptstore.open(str(tmp_path / "repo")) as plain:
        assert_tree_equal(plain.load(2), {**sd, "seed": 5})


def test_a_pending_step_older_than_the_grace_period_is_refused_at_commit(tmp_path, caplog):
    clock = ManualClock()
    store = FaultStore(open_store(str(tmp_path / "repo")))
    gate = _Gate(store)
    repo = Repository(store, clock=clock, grace=100.0, cache_dir=tmp_path / "tier", write_back=True, **SMALL)
    repo.save(_state(6), step=1)
    gate.reached.wait(30)
    clock.advance(1000.0)  # the store was unreachable for longer than the grace period
    gate.open.set()
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        with pytest.raises(WriteBackError, match="could not be committed") as e:
            repo.flush()
    assert "Save again" in str(e.value.__cause__) and "ckptstore flush" in str(e.value)
    assert repo.steps() == [] and repo.pending_steps() == [1], "kept in the tier, never committed stale"
    with pytest.raises(WriteBackError, match="discard_pending"):
        repo.save(_state(7), step=2)  # the next save says so too, and how to save it again
    with pytest.raises(WriteBackError):
        repo.flush()  # tried again: still stale
    again = repo.load(1)  # from the tier
    repo.discard_pending(1)
    assert repo.pending_steps() == [] and repo.steps(pending=True) == []
    repo.save(again, step=1)
    repo.flush()
    assert repo.steps() == [1]
    repo.close()
    with ckptstore.open(str(tmp_path / "repo")) as plain:
        assert_tree_equal(plain.load(1), _state(6))


def test_gc_keeps_what_a_pending_step_will_commit(tmp_path):
    store = FaultStore(open_store(str(tmp_path / "repo")))
    direct = Repository(store, **SMALL)
    base = _state(8)
    direct.save(base, step=1)
    gate = _Gate(store)
    repo = Repository(store, cache_dir=tmp_path / "tier", write_back=True, **SMALL)
    repo.save({**base, "w9": torch.ones(3)}, step=2)  # reuses step 1's chunks
    gate.reached.wait(30)
    direct.delete(1)
    plan = direct.plan_gc(keep_last=1)
    plan.execute()  # step 1's packs are held by the pending save's lease and the tombstone
    gate.open.set()
    repo.flush()
    repo.close()
    with ckptstore.open(str(tmp_path / "repo")) as plain:
        assert plain.steps() == [2]
        assert_tree_equal(plain.load(2), {**base, "w9": torch.ones(3)})
        assert plain.verify(read_data=True).ok


def test_a_full_tier_falls_back_to_a_direct_save(tmp_path, caplog):
    repo = ckptstore.open(str(tmp_path / "repo"), cache_dir=tmp_path / "tier", write_back=True, **SMALL)
    real = repo.write_back.store.create_multipart

    def full(key, part_size):
        mpu = real(key, part_size)

        def write_at(offset, buffers):
            raise OSError(errno.ENOSPC, "No space left on device")

        mpu.write_at = write_at
        return mpu

    repo.write_back.store.create_multipart = full
    sd = _state(9)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        info = repo.save(sd, step=1)
    assert info.step == 1 and repo.steps() == [1] and repo.pending_steps() == []
    assert any("is full" in r.getMessage() for r in caplog.records)
    repo.close()
    with ckptstore.open(str(tmp_path / "repo")) as plain:
        assert_tree_equal(plain.load(1), sd)


def test_write_back_needs_a_tier(tmp_path):
    with pytest.raises(ValueError, match="needs a cache_dir"):
        ckptstore.open(str(tmp_path / "repo"), write_back=True)


def _child(url, cache, step, seed, phase):
    return subprocess.run(
        [sys.executable, os.path.join(HERE, "writeback_child.py"), url, cache, str(step), str(seed), phase],
        capture_output=True, text=True, timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["tier", "pending", "upload", "commit"])
def test_a_killed_write_back_saver_leaves_no_partial_step_and_the_next_handle_commits_it(tmp_path, phase):
    url, cache = str(tmp_path / "repo"), str(tmp_path / "tier")
    seed = {"tier": 21, "pending": 22, "upload": 23, "commit": 24}[phase]
    res = _child(url, cache, 5, seed, phase)
    assert res.returncode == -9 and f"PHASE {phase}" in res.stdout, (res.stdout, res.stderr[-2000:])
    with ckptstore.open(url) as plain:
        assert plain.steps() == [], "no partial step in the store"
    repo = ckptstore.open(url, cache_dir=cache, write_back=True, **CHILD_OPTS)
    if phase == "tier":
        assert repo.pending_steps() == [], "the save never reached its local commit: nothing to commit"
        repo.close()
        return
    repo.flush()  # the dead process's pending step, claimed and committed
    assert repo.steps() == [5] and repo.pending_steps() == []
    repo.close()
    with ckptstore.open(url) as plain:
        assert_tree_equal(plain.load(5), build_state(seed))
        assert plain.verify(read_data=True).ok


@pytest.mark.slow
def test_ckptstore_flush_commits_what_a_dead_process_left(tmp_path, capsys):
    import json

    from ckptstore.cli.main import main

    url, cache = str(tmp_path / "repo"), str(tmp_path / "tier")
    res = _child(url, cache, 7, 31, "pending")
    assert res.returncode == -9, res.stderr[-2000:]
    assert main(["ls", url, "--cache-dir", cache, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["steps"]
    assert [(r["step"], r["pending"]) for r in rows] == [(7, True)]
    assert main(["ls", url]) == 0  # without the tier: the repository exists (its config), no step is committed
    assert "no committed steps" in capsys.readouterr().out
    assert main(["flush", url, "--cache-dir", cache]) == 0
    assert "committed step 7" in capsys.readouterr().out
    assert main(["ls", url, "--json"]) == 0
    assert [r["step"] for r in json.loads(capsys.readouterr().out)["steps"]] == [7]
    assert main(["flush", url, "--cache-dir", cache]) == 0
    assert "no pending step" in capsys.readouterr().out
    with ckptstore.open(url) as plain:
        assert_tree_equal(plain.load(7), build_state(31))


def test_eviction_and_prune_never_take_a_write_back_save_s_files(tmp_path):
    from ckptstore.tier import admin as tier_admin
    from ckptstore.tier.cache import evict

    cache = tmp_path / "tier"
    repo, gate = _gated(tmp_path, cache_size=1 << 20)  # the save fits; the evictions below take everything they may
    real_write = repo.write_back.records.write

    def write(step, record):
        # the save has written its packs and segment, its pending record is next: the window
        evict(str(cache), 0)
        tier_admin.plan_prune(tier_admin.scan(str(cache)), everything=True).execute()
        real_write(step, record)

    repo.write_back.records.write = write
    sd = _state(12)
    repo.save(sd, step=1)
    gate.open.set()
    repo.flush()
    repo.close()
    with ckptstore.open(str(tmp_path / "repo")) as plain:
        assert_tree_equal(plain.load(1), sd)


def _dcp_loaded(url):
    """Step 1 read back with DCP from the store alone, as one process (no tier)."""
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import CkptStoreReader

    from .wb_workers import state

    want = {**state(0, 1), **state(1, 1)}
    got = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load(got, storage_reader=CkptStoreReader(url, step=1))
    return want, got


@pytest.mark.slow
@pytest.mark.parametrize("leave", [False, True], ids=["flushed", "ranks-died"])
def test_dcp_write_back_commits_once_every_rank_uploaded(tmp_path, leave):
    import json

    from . import wb_workers as W

    url, tmp = str(tmp_path / "repo"), str(tmp_path)
    spawn(W.dcp_write_back, args=(2, free_port(), url, tmp, leave), nprocs=2)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert r["committed_after_save"] == [], "dcp.save returned before the store had the step"
    assert res[0]["pending_here"] == [1], "the coordinator's node holds the step's pending commit"
    if not leave:
        for r in res:
            assert r["committed_after_flush"] == [1] and r["uploads_left"] == []
    else:
        with ckptstore.open(url) as plain:
            assert plain.steps() == []
        # the nodes come back: each one's next write-back handle finishes what its process left
        for node in (1, 0):
            repo = ckptstore.open(url, cache_dir=tmp_path / f"node{node}", write_back=True)
            repo.flush()
            repo.close()
        with ckptstore.open(url) as plain:
            assert plain.steps() == [1] and list(plain.store.list("uploads/")) == []
    want, got = _dcp_loaded(url)
    assert_tree_equal(got, want)


def test_the_dcp_reader_does_not_restore_a_step_pending_on_one_node(tmp_path):
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint.api import CheckpointException

    from ckptstore.dcp import CkptStoreReader

    repo, gate = _gated(tmp_path)
    sd = _state(13)
    repo.save(sd, step=1)
    gate.reached.wait(30)
    got = {k: torch.empty_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(CheckpointException, match="not committed in the store yet"):  # DCP wraps the refusal
        dcp.load(got, storage_reader=CkptStoreReader(str(tmp_path / "repo"), step=1, cache_dir=tmp_path / "tier"))
    gate.open.set()
    repo.flush()
    dcp.load(got, storage_reader=CkptStoreReader(str(tmp_path / "repo"), step=1, cache_dir=tmp_path / "tier"))
    assert_tree_equal(got, {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)})
    repo.close()


def test_gc_reclaims_upload_markers_past_the_grace_period(tmp_path):
    from ckptstore.format.layout import upload_key

    clock = ManualClock()
    repo = ckptstore.open(str(tmp_path / "repo"), clock=clock, grace=100.0, **SMALL)
    repo.save(_state(14), step=1)
    repo.store.put(upload_key(7, 1), b'{"format": "ckptstore.upload"}')  # a DCP step that never committed
    assert repo.plan_gc().stale_markers == ()  # young: its commit may still be waiting for it
    clock.advance(100.0 + repo.store.mtime_resolution + 1.0)
    plan = repo.plan_gc()
    assert plan.stale_markers == (upload_key(7, 1),)
    plan.execute()
    assert list(repo.store.list("uploads/")) == [] and repo.steps() == [1]
    repo.close()


def test_a_save_that_does_not_fit_waits_for_uploads_and_one_that_never_can_fails_naming_sizes(tmp_path):
    raw = 4 * 64 * 256 * 4  # _state's tensors
    repo, gate = _gated(tmp_path, write_back_steps=4, cache_size=int(1.5 * raw))
    repo.save(_state(1), step=1)
    gate.reached.wait(30)
    entered, seen = threading.Event(), {}
    real = repo.write_back.reserve

    def spy(need=0, what=""):
        entered.set()
        real(need, what)
        seen["committed when it went on"] = repo.steps()

    repo.write_back.reserve = spy
    second = threading.Thread(target=repo.save, args=(_state(2),), kwargs={"step": 2})
    second.start()
    assert entered.wait(30)
    gate.open.set()
    second.join(60)
    assert not second.is_alive()
    assert seen["committed when it went on"] == [1], "step 2 did not fit beside pending step 1: it must wait"
    repo.write_back.reserve = real
    repo.flush()
    with pytest.raises(WriteBackError, match=r"step 3 needs up to 4\.0 MiB .* more than its cache_size of 384\.0 KiB"):
        repo.save({"w": torch.randn(1024, 1024)}, step=3)
    assert repo.steps(pending=True) == [1, 2] and repo.pending_steps() == []
    for s in (1, 2):
        assert_tree_equal(repo.load(s), _state(s))
    repo.close()


def test_write_back_saves_keep_the_tier_within_its_budget(tmp_path):
    """Found by benchmarks/distributed/tier_soak.py: a write-back save's files are counted only once its step is
    committed, so room is made before it writes (they used to come on top of a full cache)."""
    from ckptstore.tier.cache import tier_files

    cap, pack = 6 << 20, 1 << 20
    repo = ckptstore.open(str(tmp_path / "repo"), cache_dir=tmp_path / "tier", cache_size=cap, write_back=True,
                          chunk_size=64 << 10, pack_size=pack)
    for s in range(1, 7):
        g = torch.Generator().manual_seed(s)
        repo.save({f"t{i}": torch.randn(512, 256, generator=g) for i in range(8)}, step=s)  # 4 MiB, all new
        held = sum(f[1] for f in tier_files(str(tmp_path / "tier")))
        assert held <= cap + pack, f"step {s}: the tier holds {held} bytes when save() returns"
        repo.flush()
    assert repo.tier.stats["evicted"] > 0
    repo.close()


def test_write_back_uploads_reuse_one_pooled_read_buffer(tmp_path):
    """The drain reads each pack and segment from the tier into a part buffer of the handle's pool,
    the same one upload after upload: with a fresh part_size buffer an upload, a DCP soak's rank 0
    held about 300 MB free in glibc's arenas (issue 44 item 3)."""
    repo = ckptstore.open(str(tmp_path / "repo"), cache_dir=tmp_path / "tier", write_back=True, **SMALL)
    try:
        for s in range(6):
            repo.save(_state(s), step=s)
            repo.flush()  # one upload at a time: one buffer is enough
        parts = repo.runtime.buffers("parts", repo.options.part_size, 1)
        uploads = len(repo.packs()) + len(repo.segments())
        assert uploads >= 6
        # every upload took a buffer from the pool (none of its own), and the pool made one
        assert parts.allocated == 1, (parts.allocated, uploads)
    finally:
        repo.close()


def test_the_uploader_gives_the_heaps_free_memory_back_once_it_has_drained(tmp_path, monkeypatch):
    from ckptstore.pipeline import runtime
    from ckptstore.repo import writeback

    calls = []
    monkeypatch.setattr(writeback, "release_free_memory", lambda: calls.append(1) or True)
    repo, gate = _gated(tmp_path)
    repo.save(_state(1), step=1)
    assert gate.reached.wait(30)
    uploader = repo.write_back._thread
    repo.save(_state(2), step=2)  # queued behind step 1
    assert calls == []  # nothing while steps wait
    gate.open.set()
    repo.flush()
    uploader.join(30)  # it trims after its last commit, as it exits
    assert not uploader.is_alive()
    assert calls == [1]  # once for the two steps: at the end of the queue, not per step
    repo.close()
    if sys.platform.startswith("linux") and os.path.exists("/lib/x86_64-linux-gnu/libc.so.6"):
        assert runtime.release_free_memory() is True
