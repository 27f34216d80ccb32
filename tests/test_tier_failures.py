"""Node-local tier failures beyond damaged files: files removed under a reader, a full disk while a read keeps chunks."""

from __future__ import annotations

import errno
import glob
import logging
import os
import threading

import pytest
import torch

import ckptstore
from ckptstore.repo.repository import Repository
from ckptstore.storage import open_store
from ckptstore.storage.wrappers import CountingStore
from ckptstore.tier.admin import plan_prune, scan

from .helpers import SMALL, assert_tree_equal


def _state(seed: int, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.w": torch.randn(64, 256, generator=g) for i in range(n)}


def _counting(url, **kw) -> tuple[Repository, CountingStore]:
    cs = CountingStore(open_store(url))
    return Repository(cs, **{**SMALL, **kw}), cs


def _chunk_files(cache) -> list[str]:
    return glob.glob(os.path.join(str(cache), "repos", "*", "chunks", "*", "*"))


def test_a_pack_copy_removed_between_the_check_and_the_read_is_read_from_the_store(tmp_path):
    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    sd = _state(1)
    with ckptstore.open(url, cache_dir=cache, cache_decoded=False, **SMALL) as repo:  # the pack copy under test
        repo.save(sd, step=1)
    repo, counting = _counting(url, cache_dir=cache)
    real = repo.tier.store.read_range_into

    def evicted_first(key, start, out, progress=None):
        # another process evicts the copy after the fetcher saw it and before it reads
        os.unlink(os.path.join(repo.tier.root, *key.split("/")))
        return real(key, start, out, progress)

    repo.tier.store.read_range_into = evicted_first
    assert_tree_equal(repo.load(1), sd)
    assert counting.read_by_prefix["packs"] > 0 and repo.tier.stats["tier_misses"] > 0
    assert repo.read_stats()["tier"] == 0
    repo.close()


def test_a_chunk_file_removed_between_the_check_and_the_read_is_read_from_the_store(tmp_path):
    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    sd = _state(2)
    with ckptstore.open(url, **SMALL) as repo:
        repo.save(sd, step=1)
    with ckptstore.open(url, cache_dir=cache, **SMALL) as repo:
        repo.load(1)  # keeps a chunk file per chunk
    kept = len(_chunk_files(cache))
    assert kept > 0
    repo, counting = _counting(url, cache_dir=cache)
    real = repo.tier.read_chunk

    def evicted_first(h, stored_len):
        os.unlink(repo.tier.chunk_path(h))
        return real(h, stored_len)

    repo.tier.read_chunk = evicted_first
    assert_tree_equal(repo.load(1), sd)
    assert counting.read_by_prefix["packs"] > 0 and repo.tier.stats["tier_misses"] == kept
    assert len(_chunk_files(cache)) == kept, "each chunk read from the store was kept again"
    repo.close()


def test_prune_racing_reads_never_gives_wrong_data(tmp_path):
    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    sd = _state(3, n=12)
    with ckptstore.open(url, cache_dir=cache, **SMALL) as repo:
        repo.save(sd, step=1)
    stop = threading.Event()
    pruned = []

    def prune_until_stopped():
        while not stop.is_set():
            pruned.append(plan_prune(scan(cache), everything=True).execute().removed)

    t = threading.Thread(target=prune_until_stopped)
    t.start()
    try:
        for _ in range(3):
            with ckptstore.open(url, cache_dir=cache, **SMALL) as repo:
                assert_tree_equal(repo.load(1), sd)
    finally:
        stop.set()
        t.join()
    assert sum(pruned) > 0


def test_a_full_disk_while_a_read_keeps_chunks_still_loads(tmp_path, monkeypatch, caplog):
    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    sd = _state(4)
    with ckptstore.open(url, **SMALL) as repo:
        repo.save(sd, step=1)

    def full(src, dst, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    repo = ckptstore.open(url, cache_dir=cache, **SMALL)
    monkeypatch.setattr(os, "link", full)  # how a chunk file is published
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        assert_tree_equal(repo.load(1), sd)
    monkeypatch.undo()
    assert not repo.tier.writable
    assert any("No space left" in r.getMessage() for r in caplog.records)
    assert _chunk_files(cache) == [] and not any(os.scandir(os.path.join(repo.tier.root, ".tmp")))
    assert_tree_equal(repo.load(1), sd)  # the handle reads on, from the store
    repo.close()
    with ckptstore.open(url, cache_dir=cache, **SMALL) as fresh:  # space again: a new handle keeps chunks
        assert_tree_equal(fresh.load(1), sd)
    assert _chunk_files(cache)


@pytest.mark.parametrize("how", ["evicted", "moved-on-commit", "damaged"])
def test_a_tier_segment_gone_or_damaged_between_the_look_and_the_read_is_read_from_the_store(tmp_path, monkeypatch, how):
    """Found by the 2-process soak: a chunk-table segment the tier held was evicted (or renamed out of
    wb/ as its step committed) after the reader looked and before it read: the store has it."""
    from ckptstore.pipeline import table_reader as tables
    from ckptstore.format.layout import segment_key

    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    sd = {"w": torch.randn(256, 256), "v": torch.randn(64)}
    with ckptstore.open(url, cache_dir=cache, write_back=True) as repo:
        repo.save(sd, step=1)
        repo.flush()  # committed: its segment is in the tier's segments/
    real = tables.ChunkTables._sources

    def sources_then_race(self, segment_id):
        out = real(self, segment_id)
        path = os.path.join(self.tier.root, segment_key(segment_id))
        if how == "evicted":
            if os.path.exists(path):
                os.unlink(path)
        elif how == "moved-on-commit":  # as if it were still pending when looked at, then committed
            out = [self.tier.pending.durable] + out
        else:
            with open(path, "r+b") as f:
                f.seek(40)
                f.write(b"\xff" * 64)
        return out

    monkeypatch.setattr(tables.ChunkTables, "_sources", sources_then_race)
    with ckptstore.open(url, cache_dir=cache) as again:
        assert_tree_equal(again.load(1), sd)
