"""Issue 44: a restart from the tier with default options, and a checkpoint every step.

- the fast restart is the default: decoded copies kept where the budget has room, 0 store bytes,
  bit-exact, for 1 and 2 ranks; a tier written with decoded copies off or on serves either way;
- ``save(blocking=False)`` snapshots into reused buffers, finds unchanged chunks by comparing bytes
  (never a changed one), and a write-back handle saving every step commits every step exactly;
- a save while the previous one is still writing waits, with a bound, and says so.
"""

from __future__ import annotations

import glob
import json
import os
import threading

import pytest
import torch

import ckptstore
from ckptstore.errors import SaveBacklogError
from ckptstore.pipeline.snapshot import Snapshots
from ckptstore.repo.repository import Repository
from ckptstore.storage import open_store
from ckptstore.storage.wrappers import CountingStore
from ckptstore.testing import free_port

from .helpers import SMALL, assert_tree_equal, decoded_coverage

CHUNK = 4096  # the smallest chunk: tiny tensors of several chunks


def _decoded_files(cache) -> list[str]:
    """The tier's decoded copies: a chunk's under ``raw/``, a tiled tensor's bands under ``bands/``."""
    return [p for sub in ("raw", "bands") for p in glob.glob(os.path.join(str(cache), "repos", "*", sub, "*", "*"))]


def _optim_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(128, 256, generator=g).to(torch.bfloat16),
            "exp_avg": torch.randn(128, 256, generator=g), "exp_avg_sq": torch.rand(128, 256, generator=g)}


# ---------------------------------------------------------------- item 1: the fast restart by default
def test_a_restart_from_the_tier_with_default_options_reads_no_store_bytes(tmp_path):
    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    sd = _optim_state(1)
    with ckptstore.open(url, cache_dir=cache, **SMALL) as repo:
        repo.save(sd, step=1)
        covered, chunks = decoded_coverage(repo, 1, cache)
    assert covered == chunks, "by default a save keeps every new chunk decoded (room allows)"
    store = CountingStore(open_store(url))
    repo = Repository(store, cache_dir=cache, **SMALL)
    into = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    repo.load(1, into=into)
    assert_tree_equal(into, sd)
    assert repo.read_stats()["store"] == 0 and repo.read_stats()["tier"] > 0
    assert store.read_by_prefix.get("packs", 0) == 0
    repo.close()


@pytest.mark.parametrize("written,read", [(False, None), (False, True), (True, False), (None, False)])
def test_a_tier_written_with_decoded_copies_off_or_on_serves_either_way(tmp_path, written, read):
    """``written``: the save's ``cache_decoded`` (False: the tier as saves wrote it before issue 44)."""
    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    sd = _optim_state(2)
    with ckptstore.open(url, cache_dir=cache, cache_decoded=written, **SMALL) as repo:
        repo.save(sd, step=1)
    assert bool(_decoded_files(cache)) == (written is not False)
    store = CountingStore(open_store(url))
    repo = Repository(store, cache_dir=cache, cache_decoded=read, **SMALL)
    into = {k: torch.zeros_like(v) for k, v in sd.items()}
    repo.load(1, into=into)
    assert_tree_equal(into, sd)
    assert_tree_equal(repo.load(1), sd)  # into fresh tensors too (the pack copies, hash-checked)
    assert repo.read_stats()["store"] == 0 and store.read_by_prefix.get("packs", 0) == 0
    repo.close()


def test_decoded_copies_take_only_the_room_the_budget_leaves(tmp_path):
    """With a ``cache_size`` that holds the packs but not both copies, a save keeps decoded copies
    only while they and their compact copies fit: the tier stays within it and nothing is evicted."""
    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    sd = _optim_state(3)  # 320 KiB raw
    cap = 480 << 10
    with ckptstore.open(url, cache_dir=cache, cache_size=cap, **SMALL) as repo:
        repo.save(sd, step=1)
        held = sum(os.path.getsize(p) for p in glob.glob(os.path.join(str(cache), "repos", "*", "*", "*", "*")))
        assert held <= cap
        assert repo.tier.stats["evicted"] == 0, "decoded copies never make a save evict"
        covered, chunks = decoded_coverage(repo, 1, cache)
        assert 0 < covered < chunks
    repo = ckptstore.open(url, cache_dir=cache, **SMALL)
    assert_tree_equal(repo.load(1), sd)
    assert repo.read_stats()["store"] == 0
    repo.close()


@pytest.mark.slow
def test_a_two_rank_restart_from_the_tier_with_default_options_reads_no_store_bytes(tmp_path):
    import torch.multiprocessing as mp

    from . import tier_restart_workers as W

    url = str(tmp_path / "repo")
    mp.spawn(W.run, args=(2, free_port(), url, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        out = json.load(open(tmp_path / f"rank{rank}.json"))
        assert out["equal"], f"rank {rank}: not bit-exact"
        assert out["read"]["store"] == 0 and out["read"]["tier"] > 0, out["read"]
        assert out["decoded_files"] > 0


# ---------------------------------------------------------------- item 2: the cheap check
def test_the_snapshot_comparison_never_takes_a_changed_block_as_unchanged():
    snaps = Snapshots(CHUNK, _inline_pool())
    a = torch.zeros(3 * CHUNK // 4)  # 3 blocks of floats
    first = snaps.take({"a": a})
    assert first.unchanged["a"] is None  # nothing to compare against yet
    same = snaps.take({"a": a})
    assert same.unchanged["a"] == [True, True, True]
    a[CHUNK // 4 + 5] = -0.0  # an in-place edit that keeps shape and dtype, and compares equal as a float
    edited = snaps.take({"a": a})
    assert edited.unchanged["a"] == [True, False, True]
    assert torch.equal(snaps.buffers["a"].view(torch.uint8), a.view(torch.uint8))
    b = a.clone()
    b[-1] = float("nan")
    nan1 = snaps.take({"a": b})
    b.view(torch.int32)[-1] ^= 1  # another NaN: equal to no float, different bytes
    nan2 = snaps.take({"a": b})
    assert nan1.unchanged["a"] == [True, True, False] and nan2.unchanged["a"] == [True, True, False]
    other = torch.ones(3 * CHUNK // 4)  # a new tensor of the same shape and dtype
    assert snaps.take({"a": other}).unchanged["a"] == [False, False, False]
    assert snaps.take({"a": other.reshape(3, -1)}).unchanged["a"] is None  # reshaped: a fresh buffer


def _inline_pool():
    import concurrent.futures as cf

    return cf.ThreadPoolExecutor(2)


def test_an_async_save_reuses_only_chunks_whose_bytes_are_unchanged(tmp_path):
    repo = ckptstore.open(str(tmp_path / "repo"), chunk_size=CHUNK)
    w = torch.randn(4 * CHUNK // 4)  # 4 chunks
    v = torch.randn(2 * CHUNK // 4)  # 2 chunks
    expect = {}
    edits = [
        lambda: None,                                   # nothing changed: every chunk unchanged
        lambda: w.__setitem__(CHUNK // 4 * 2 + 1, 7.0),  # an in-place edit of chunk 2
        lambda: w.add_(0.0),                            # rewritten in place with the same bytes
        lambda: v.copy_(torch.randn(v.shape)),          # the same tensor's memory, new values
        lambda: w.__setitem__(0, -w[0]),                # flipped in place ...
        lambda: w.__setitem__(0, -w[0]),                # ... and back: bytes as two steps ago
    ]
    changed = [None, 1, 0, 2, 1, 1]
    infos = []
    for step, edit in enumerate(edits, start=1):
        edit()
        expect[step] = {"w": w.clone(), "v": v.clone()}
        infos.append(repo.save({"w": w, "v": v}, step=step, blocking=False).result(timeout=60))
    for step, info in enumerate(infos, start=1):
        assert_tree_equal(repo.load(step), expect[step])
        if changed[step - 1] is None:
            assert info.unchanged_chunks == 0 and info.new_chunks == 6
        else:
            assert info.unchanged_chunks == 6 - changed[step - 1], f"step {step}"
            assert info.new_chunks <= changed[step - 1]
        assert info.blocked_seconds is not None
    # a save with another dedup base than the previous async step hashes everything
    w[0] += 1
    info = repo.save({"w": w, "v": v}, step=20, blocking=False, base=None).result(timeout=60)
    assert info.unchanged_chunks == 0 and info.new_chunks == 6
    repo.close()


# ---------------------------------------------------------------- item 2: a checkpoint every step
def test_write_back_every_step_with_a_changing_subset_commits_every_step_exactly(tmp_path):
    repo = ckptstore.open(str(tmp_path / "repo"), cache_dir=tmp_path / "shm", write_back=True, chunk_size=CHUNK,
                          pack_size=64 << 10)
    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(CHUNK // 2, generator=g) for i in range(8)}  # 2 chunks each
    expect, unchanged = {}, {}
    for step in range(1, 51):
        if step > 1:
            for i in range(step % 3, 8, 3):  # a changing subset, in place
                sd[f"t{i}"][(step * 7) % (CHUNK // 2)] += 1.0
        expect[step] = {k: t.clone() for k, t in sd.items()}
        info = repo.save(sd, step=step, blocking=False).result(timeout=60)
        unchanged[step] = (info.unchanged_chunks, info.new_chunks)
    repo.flush()
    assert repo.steps() == list(range(1, 51)) and repo.pending_steps() == []
    fresh = ckptstore.open(str(tmp_path / "repo"))  # from the store alone
    for step in range(1, 51):
        assert_tree_equal(fresh.load(step), expect[step])
        if step > 1:
            n = len(range(step % 3, 8, 3))
            assert unchanged[step] == (16 - n, n), f"step {step}"
    fresh.close()
    repo.close()


def test_a_save_while_the_previous_one_writes_waits_with_a_bound_and_says_so(tmp_path, caplog):
    import logging

    repo = ckptstore.open(str(tmp_path / "repo"), chunk_size=CHUNK, async_wait=0.0)
    gate, entered = threading.Event(), threading.Event()
    real = repo.store.put_if_absent

    from ckptstore.format.layout import manifest_key

    def slow_commit(key, data):
        if key == manifest_key(1):
            entered.set()
            gate.wait(30)
        return real(key, data)

    repo.store.put_if_absent = slow_commit
    sd = {"w": torch.randn(1024)}
    first = repo.save(sd, step=1, blocking=False)
    assert entered.wait(30)
    with pytest.raises(SaveBacklogError, match=r"step 2: the previous async save \(step 1\) is still being written"):
        repo.save(sd, step=2, blocking=False)
    repo.options.async_wait = 60.0
    threading.Timer(0.2, gate.set).start()
    with caplog.at_level(logging.INFO, logger="ckptstore.repo.async_save"):
        info = repo.save(sd, step=2, blocking=False).result(timeout=60)
    assert first.result(timeout=60).step == 1
    assert info.waited_seconds > 0 and info.blocked_seconds >= info.waited_seconds
    assert "step 2 waited" in caplog.text
    assert repo.steps() == [1, 2]
    repo.close()


def test_a_step_committed_while_the_steps_are_listed_is_never_missed():
    # The write-back drain commits a step in the store, then drops its pending record. steps(pending=True)
    # reads the pending records before it lists the store, so a step the drain moves between the two
    # reads is in one of them (listed first, step 42 of the test above once took step 40 as its base).
    from types import SimpleNamespace

    from ckptstore.format.layout import manifest_key
    from ckptstore.repo.catalog import Catalog

    committed, pending = {1, 2, 3}, {4}

    def listing(prefix):
        out = [SimpleNamespace(key=manifest_key(s)) for s in sorted(committed)]
        committed.update(pending)  # the drain commits step 4 and drops its record right after this listing
        pending.clear()
        return iter(out)

    cat = SimpleNamespace(store=SimpleNamespace(list=listing), pending_steps=lambda: sorted(pending),
                          _drop_deleted=lambda listed: None)
    assert Catalog.steps(cat, pending=True) == [1, 2, 3, 4]
