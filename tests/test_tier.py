"""The node-local tier: write-through, reads nearest copy first, damaged copies, budget, sharing, full disk."""

from __future__ import annotations

import errno
import glob
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ckptstore
from ckptstore.repo.repository import Repository
from ckptstore.storage import open_store
from ckptstore.storage.wrappers import CountingStore
from ckptstore.tier.cache import Tier, parse_size, repo_key, tier_files, usage

from .helpers import SMALL, assert_tree_equal

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _state(seed: int, n: int = 6, rows: int = 64):
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.w": torch.randn(rows, 256, generator=g) for i in range(n)} | {"epoch": seed}


def _counting(url, so=None, **kw) -> tuple[Repository, CountingStore]:
    cs = CountingStore(open_store(url, so))
    return Repository(cs, **{**SMALL, **kw}), cs


def _pack_copies(cache) -> list[str]:
    return sorted(glob.glob(os.path.join(str(cache), "repos", "*", "packs", "*", "*.pack")))


def _chunk_files(cache) -> list[str]:
    return sorted(glob.glob(os.path.join(str(cache), "repos", "*", "chunks", "*", "*")))


@pytest.mark.parametrize("repo_url", ["local", "s3"], indirect=True)
def test_a_restart_on_the_same_node_reads_no_pack_from_the_store(repo_url, tmp_path):
    url, so = repo_url
    cache = tmp_path / "tier"
    sd = _state(1)
    with ckptstore.open(url, storage_options=so, cache_dir=cache, **SMALL) as repo:
        repo.save(sd, step=1)
        stored = sum(repo.manifest(1).packs.values())
    assert _pack_copies(cache), "the save wrote its packs through to the tier"
    repo, counting = _counting(url, so, cache_dir=cache)
    assert_tree_equal(repo.load(1), sd)
    assert counting.read_by_prefix.get("packs", 0) == 0
    assert counting.read_by_prefix.get("segments", 0) == 0, "the chunk table is written through too"
    assert repo.read_stats() == {"tier": repo.read_stats()["tier"], "peer": 0, "store": 0}
    assert repo.read_stats()["tier"] > 0.9 * stored - 4096
    # without the tier the same load reads the packs from the store
    plain, counting = _counting(url, so)
    assert_tree_equal(plain.load(1), sd)
    assert counting.read_by_prefix.get("packs", 0) > 0 and plain.read_stats()["tier"] == 0
    assert counting.read_by_prefix.get("segments", 0) > 0
    repo.close()
    plain.close()


def test_reads_through_the_tier_keep_chunks_for_the_next_reader(tmp_path):
    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    sd = _state(2)
    with ckptstore.open(url, **SMALL) as repo:  # saved elsewhere: nothing in the tier
        repo.save(sd, step=1)
    first, counting = _counting(url, cache_dir=cache)
    assert_tree_equal(first.load(1), sd)
    assert counting.read_by_prefix["packs"] > 0 and _chunk_files(cache)
    second, counting = _counting(url, cache_dir=cache)
    assert_tree_equal(second.load(1), sd)
    assert counting.read_by_prefix.get("packs", 0) == 0 and second.read_stats()["store"] == 0
    # a slice reads only the chunks that cover it, from the tier as well
    ckpt = second.checkpoint(1)
    assert torch.equal(ckpt.read("layer3.w", index=(slice(5, 9),)), sd["layer3.w"][5:9])
    first.close()
    second.close()


def _damage(path: str, at: int, data: bytes = b"\xde\xad\xbe\xef" * 8) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


@pytest.mark.parametrize("how", ["corrupt-pack", "truncate-pack", "remove-pack", "corrupt-chunk", "truncate-chunk"])
def test_damaged_truncated_or_missing_tier_files_give_bit_exact_data(tmp_path, how):
    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    sd = _state(3)
    # the compact copies (packs, chunk files) are the ones under test: no decoded copies
    with ckptstore.open(url, cache_dir=cache, cache_decoded=False, **SMALL) as repo:
        repo.save(sd, step=1)
    if how.endswith("chunk"):
        for p in _pack_copies(cache):
            os.unlink(p)
        reader, _ = _counting(url, cache_dir=cache)
        reader.load(1)  # from the store, keeping a chunk file per chunk
        reader.close()
        victim = _chunk_files(cache)[len(_chunk_files(cache)) // 2]
        if how == "corrupt-chunk":
            _damage(victim, 20)
        else:
            os.truncate(victim, os.path.getsize(victim) // 2)
    else:
        (victim,) = _pack_copies(cache)
        if how == "corrupt-pack":
            _damage(victim, os.path.getsize(victim) // 3)
        elif how == "truncate-pack":
            os.truncate(victim, os.path.getsize(victim) // 2)
        else:
            os.unlink(victim)
    repo, counting = _counting(url, cache_dir=cache)
    assert_tree_equal(repo.load(1), sd)  # never wrong data, never a failed restore
    from_store = counting.read_by_prefix.get("packs", 0)
    assert from_store > 0, "the damaged or missing part came from the store"
    if how in ("corrupt-pack", "corrupt-chunk", "truncate-chunk"):
        assert repo.read_stats()["tier"] > 0, "the rest came from the tier"
    if how == "truncate-pack":
        assert _pack_copies(cache) == [], "a truncated pack copy is removed"
    if how.endswith("chunk"):
        assert repo.tier.stats["discarded"] == 1, "the bad chunk file was removed (and kept again, verified)"
    repo.close()
    again, counting = _counting(url, cache_dir=cache)
    assert_tree_equal(again.load(1), sd)
    assert counting.read_by_prefix.get("packs", 0) == 0, "the repaired copy is read next time"
    again.close()


def test_the_tier_stays_within_its_budget_over_many_saves(tmp_path):
    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    pack_size = 64 << 10
    budget = 6 * pack_size
    with ckptstore.open(url, cache_dir=cache, cache_size=budget, **{**SMALL, "pack_size": pack_size}) as repo:
        for step in range(20):
            sd = _state(100 + step, n=3)  # all new data each time
            repo.save(sd, step=step)
            held = sum(f[1] for f in tier_files(str(cache)))
            assert held <= budget + pack_size + 4096, f"step {step}: tier holds {held} bytes"
        assert repo.tier.stats["evicted"] > 0
        assert_tree_equal(repo.load(19), sd)  # the newest step's packs are the most recently used
    assert usage(str(cache))[repo_key(repo.url)]["bytes"] <= budget + pack_size + 4096


def test_a_full_disk_in_the_tier_still_saves(tmp_path, monkeypatch, caplog):
    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    # the pack copies under test: decoded copies written before the disk filled would serve the load
    repo = ckptstore.open(url, cache_dir=cache, cache_decoded=False, **SMALL)
    store = repo.tier.pack_store()  # the tier's own store only (the repository is a local directory too)
    real = store.create_multipart

    def full(key, part_size):
        mpu = real(key, part_size)

        def write_at(offset, buffers):
            raise OSError(errno.ENOSPC, "No space left on device")

        mpu.write_at = write_at
        return mpu

    monkeypatch.setattr(store, "create_multipart", full)
    sd = _state(4)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        info = repo.save(sd, step=1)
    monkeypatch.undo()
    assert info.step == 1 and not repo.tier.writable
    assert any("No space left" in r.getMessage() for r in caplog.records)
    assert _pack_copies(cache) == []
    assert_tree_equal(repo.load(1), sd)  # the step is whole in the store
    repo.close()
    fresh, counting = _counting(url, cache_dir=cache)
    assert_tree_equal(fresh.load(1), sd)
    assert counting.read_by_prefix["packs"] > 0
    fresh.close()


@pytest.mark.slow
def test_two_processes_share_one_tier(tmp_path):
    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    sd = _state(5, n=8)
    with ckptstore.open(url, **SMALL) as repo:
        repo.save(sd, step=1)
    child = textwrap.dedent(
        f"""
        import json, sys, torch, ckptstore
        from ckptstore.repo.repository import Repository
        from ckptstore.storage import open_store
        with ckptstore.open({url!r}, cache_dir={str(cache)!r}, chunk_size=16384) as r:
            got = r.load(1)
            print(json.dumps({{"stats": r.read_stats(), "sum": float(sum(t.double().sum() for k, t in got.items() if k != "epoch"))}}))
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    import json

    want = float(sum(t.double().sum() for k, t in sd.items() if k != "epoch"))
    for out in outs:
        doc = json.loads(out.strip().splitlines()[-1])
        assert doc["sum"] == want
    # each chunk is kept once, whichever process published it first
    names = [os.path.basename(p) for p in _chunk_files(cache)]
    assert len(names) == len(set(names)) > 0
    repo, counting = _counting(url, cache_dir=cache)
    assert_tree_equal(repo.load(1), sd)
    assert counting.read_by_prefix.get("packs", 0) == 0
    repo.close()


def test_tier_layout_is_keyed_by_repository_not_by_process(tmp_path):
    cache = tmp_path / "tier"
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for url in (a, b):
        with ckptstore.open(url, cache_dir=cache, **SMALL) as repo:
            repo.save(_state(6), step=1)
    tiers = usage(str(cache))
    assert set(tiers) == {repo_key(ckptstore.open(a).url), repo_key(ckptstore.open(b).url)}
    assert {t["url"] for t in tiers.values()} == {ckptstore.open(a).url, ckptstore.open(b).url}
    assert open(cache / "TIER").read().startswith("ckptstore.tier.cache 1")
    # the same data saved to two repositories is kept for each (a repository's packs are its own)
    assert all(t["packs"] == 1 for t in tiers.values())


def test_parse_size_and_bad_options(tmp_path):
    assert parse_size("200GB") == 200 * 10**9 and parse_size("1.5 TiB") == int(1.5 * 2**40)
    assert parse_size("512MiB") == 512 << 20 and parse_size(4096) == 4096
    for bad in ("lots", "-1GB", True, "10 parsecs"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError, match="cache_size needs a cache_dir"):
        ckptstore.open(str(tmp_path / "r"), cache_size="1GB")
    with pytest.raises(ValueError, match="free_floor"):
        Tier(tmp_path / "t", "file:///x", free_floor=1.5)
    assert not (tmp_path / "t").exists(), "opening a tier writes nothing"


def test_verify_with_read_data_checks_the_store_not_the_tier(tmp_path):
    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    with ckptstore.open(url, cache_dir=cache, **SMALL) as repo:
        repo.save(_state(7), step=1)
        (pack,) = repo.manifest(1).packs
    store_copy = os.path.join(url, "packs", pack[:2], f"{pack}.pack")
    _damage(store_copy, os.path.getsize(store_copy) // 2)
    with ckptstore.open(url, cache_dir=cache) as tiered:
        assert_tree_equal(tiered.load(1), _state(7))  # the tier's good copy serves loads
        report = tiered.verify(read_data=True)
    assert not report.ok and any(p.pack == pack for p in report.problems), "the store's damage is found"


def test_an_error_other_than_a_full_disk_loses_one_copy_only(tmp_path, caplog):
    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    repo = ckptstore.open(url, cache_dir=cache, **SMALL)
    store = repo.tier.pack_store()
    real = store.create_multipart
    calls = {"n": 0}

    def flaky(key, part_size):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.EIO, "Input/output error")
        return real(key, part_size)

    store.create_multipart = flaky
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        repo.save(_state(8), step=1)  # its copy is lost
    assert repo.tier.writable and _pack_copies(cache) == []
    repo.save(_state(9), step=2)  # the next one is kept
    assert len(_pack_copies(cache)) == 1
    repo.close()


def test_a_dead_process_temporary_files_are_removed(tmp_path):
    import time

    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    with ckptstore.open(url, cache_dir=cache, **SMALL) as repo:
        repo.save(_state(10), step=1)
        tmp = os.path.join(repo.tier.root, ".tmp")
    old = os.path.join(tmp, "left-by-a-kill.mpu")
    fresh = os.path.join(tmp, "being-written-now")
    for p in (old, fresh):
        with open(p, "wb") as f:
            f.write(b"x" * 1000)
    os.utime(old, (time.time() - 2 * 3600,) * 2)
    with ckptstore.open(url, cache_dir=cache, **SMALL) as repo:
        repo.save(_state(11), step=2)  # the first write of a handle sweeps the tier's .tmp
    assert not os.path.exists(old) and os.path.exists(fresh)


def test_eviction_takes_steps_older_than_the_newest_two_first_even_when_read_recently(tmp_path):
    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    opts = {**SMALL, "pack_size": 64 << 10}
    with ckptstore.open(url, **opts) as probe:  # the stored size of one step, measured
        probe.save(_state(1, n=3), step=1)
        one = sum(probe.manifest(1).packs.values())
    import shutil

    shutil.rmtree(url)
    budget = int(2.5 * one)  # two steps and a half
    with ckptstore.open(url, cache_dir=cache, cache_size=budget, **opts) as repo:
        repo.save(_state(1, n=3), step=1)
        repo.save(_state(2, n=3), step=2)
        assert_tree_equal(repo.load(1), _state(1, n=3))  # step 1's packs are now the most recently used
        repo.save(_state(3, n=3), step=3)  # over budget: something goes
        held = {os.path.basename(p).split(".")[0] for p, _, _, _, kind in tier_files(str(cache)) if kind == "pack"}
        packs = {s: set(repo.manifest(s).packs) for s in (1, 2, 3)}
        assert repo.tier.stats["evicted"] > 0
        assert packs[2] | packs[3] <= held, "the newest two steps' packs were evicted before an older step's"
        assert not packs[1] <= held


def test_no_pack_id_is_recorded_twice_and_old_records_go(tmp_path):
    tier = Tier(tmp_path / "t", "file:///x")
    tier.prepare()
    for step in range(10):
        tier.note_step(step)
        tier.note_step(step, [f"p{step}"])
    from ckptstore.tier.cache import recent_packs

    assert recent_packs(str(tmp_path / "t")) == {"p8", "p9"}
    assert len(os.listdir(os.path.join(tier.root, "recent"))) <= 8


def test_chunks_kept_decoded_are_read_straight_into_the_destinations_and_checked_there(tmp_path):
    import shutil

    url, cache = str(tmp_path / "repo"), tmp_path / "tier"
    sd = _state(21)
    with ckptstore.open(url, cache_dir=cache, cache_decoded=True, **SMALL) as repo:
        repo.save(sd, step=1)
    raws = glob.glob(str(cache / "repos" / "*" / "raw" / "*" / "*"))
    assert raws, "cache_decoded=True keeps each new chunk decoded"
    # the pack copies gone: a load still reads nothing from the store (every chunk from raw/)
    shutil.rmtree(glob.glob(str(cache / "repos" / "*" / "packs"))[0])
    repo, counting = _counting(url, None, cache_dir=cache)
    assert_tree_equal(repo.load(1), sd)
    assert counting.read_by_prefix.get("packs", 0) == 0 and repo.read_stats()["store"] == 0
    repo.close()
    # a damaged and a truncated decoded file: misses, read from the store, bit-exact
    with open(raws[0], "r+b") as f:
        f.seek(100)
        f.write(b"\x00\xff" * 50)
    with open(raws[1], "r+b") as f:
        f.truncate(10)
    assert len(raws) >= 3
    with open(raws[2], "ab") as f:  # one byte too long: its length says it is not that chunk
        f.write(b"\x00")
    repo, counting = _counting(url, None, cache_dir=cache)
    assert_tree_equal(repo.load(1), sd)
    assert 0 < counting.read_by_prefix.get("packs", 0)
    assert repo.tier.stats["discarded"] >= 3
    # a caller that wants stored bytes (export) never takes the decoded copies
    out = tmp_path / "x.safetensors"
    repo.export(1, out)
    repo.close()


def test_cache_decoded_needs_a_cache_dir(tmp_path):
    with pytest.raises(ValueError, match="cache_decoded needs a cache_dir"):
        ckptstore.open(str(tmp_path / "r"), cache_decoded=True)
