"""Band copies in the node-local tier: a tiled tensor's decoded copy kept by bands of its rows.

A restart reads each band straight into its destination rows (one read, one digest check); a
damaged band is a miss; reads that cut a band use the tier's compact copies; a tier kept by
tiles (before band copies) still serves.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

import ckptstore
from ckptstore.format import tiles as T
from ckptstore.repo import chunks as C
from ckptstore.tier import bands as B
from ckptstore.tier.cache import Tier

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

CHUNK = 16 << 10


def _tensor(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _state(seed=0):
    # 2-D and 3-D, trailing sizes on and off the tile grid, two dtypes; a small tensor stays runs
    return {"a": _tensor((256, 384), seed=seed), "b": _tensor((200, 390), torch.bfloat16, seed=seed + 1),
            "c": _tensor((8, 40, 72), torch.bfloat16, seed=seed + 2), "bias": _tensor((384,), seed=seed + 3)}


def _open(tmp_path, **kw):
    return ckptstore.open(str(tmp_path / "repo"), cache_dir=tmp_path / "tier", chunk_size=CHUNK, **kw)


def _files(tmp_path, sub):
    return sorted(glob.glob(str(tmp_path / "tier" / "repos" / "*" / sub / "*" / "*")))


def _bands_of(repo, sd) -> int:
    cp = repo.checkpoint(1)
    n = 0
    for key, t in sd.items():
        tile = cp.entry(key).tile
        if tile is not None and t.dim() >= 2 and T.grid(tuple(t.shape), tile)[1:] != (1,) * (t.dim() - 1):
            n += T.grid(tuple(t.shape), tile)[0]
    return n


def _count(monkeypatch, obj, name) -> dict:
    calls = {"n": 0, "ok": 0}
    real = getattr(obj, name)

    def counted(*a, **k):
        calls["n"] += 1
        got = real(*a, **k)
        calls["ok"] += bool(got)
        return got

    monkeypatch.setattr(obj, name, counted)
    return calls


def test_a_restart_reads_every_band_straight_into_its_rows(tmp_path, monkeypatch):
    sd = _state()
    with _open(tmp_path) as repo:
        repo.save(sd, step=1)
        want = _bands_of(repo, sd)
    assert want >= 3 and len(_files(tmp_path, "bands")) == want
    assert len(_files(tmp_path, "raw")) == 1  # the bias's one run: no per-tile copies of banded tensors
    bands = _count(monkeypatch, B, "read_band_into")
    tiles = _count(monkeypatch, Tier, "read_raw_into")
    into = {k: torch.full_like(t, 7) for k, t in sd.items()}
    with _open(tmp_path) as repo:
        repo.load(1, into=into)
        stats = repo.read_stats()
    for k, t in sd.items():
        assert torch.equal(into[k], t), k
    assert stats["store"] == 0 and stats["tier"] > 0
    assert bands == {"n": want, "ok": want}
    assert tiles["n"] == 1  # the bias: the banded tensors' tiles were never read one by one


def test_a_cast_destination_and_a_dim0_slice_use_bands_and_a_column_slice_does_not(tmp_path, monkeypatch):
    sd = _state(3)
    with _open(tmp_path) as repo:
        repo.save(sd, step=1)
    bands = _count(monkeypatch, B, "read_band_into")
    with _open(tmp_path) as repo:
        cp = repo.checkpoint(1)
        into = {k: torch.zeros_like(t) for k, t in sd.items()}
        into["b"] = torch.zeros(200, 390, dtype=torch.float32)  # bf16 stored: staged, then cast
        repo.load(1, into=into)
        assert torch.equal(into["b"], sd["b"].float()) and torch.equal(into["c"], sd["c"])
        n = bands["n"]
        assert n > 0
        tile = cp.entry("a").tile
        rows = slice(tile[0], 3 * tile[0] + 5)  # two whole bands and a cut one
        assert torch.equal(cp.read("a", (rows,)), sd["a"][rows])
        assert bands["n"] == n + 2
        assert torch.equal(cp.read("a", (slice(None), slice(10, 100))), sd["a"][:, 10:100])
        assert bands["n"] == n + 2  # a column slice reads tiles (the tier's compact copies)
        assert repo.read_stats()["store"] == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "header"])
def test_a_damaged_band_is_a_miss_removed_and_read_from_the_other_copies(tmp_path, damage):
    sd = _state(5)
    with _open(tmp_path) as repo:
        repo.save(sd, step=1)
    path = _files(tmp_path, "bands")[1]
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if damage == "flip":
            f.seek(size - 7)
            b = f.read(1)
            f.seek(size - 7)
            f.write(bytes([b[0] ^ 0x01]))
        elif damage == "truncate":
            f.truncate(size - 1)
        elif damage == "extend":
            f.seek(0, os.SEEK_END)
            f.write(b"\x00")
        else:
            f.write(b"XXBAND1\0")
    into = {k: torch.full_like(t, 7) for k, t in sd.items()}
    with _open(tmp_path) as repo:
        repo.load(1, into=into)
        assert repo.tier.stats["discarded"] == 1
        assert repo.read_stats()["store"] == 0  # the band's tiles came from the tier's pack copies
    for k, t in sd.items():
        assert torch.equal(into[k], t), k
    assert not os.path.exists(path)


def test_an_unchanged_tensor_keeps_its_band_files_and_a_changed_band_gets_a_new_one(tmp_path, monkeypatch):
    sd = _state(7)
    with _open(tmp_path) as repo:
        repo.save(sd, step=1)
        before = set(_files(tmp_path, "bands"))
        puts = _count(monkeypatch, B, "put_band")
        sd2 = dict(sd, a=sd["a"].clone())
        sd2["a"][0, 0] += 1  # one element of the first band
        repo.save(sd2, step=2)
        after = set(_files(tmp_path, "bands"))
    assert puts["n"] == 1 and len(after - before) == 1
    into = {k: torch.zeros_like(t) for k, t in sd2.items()}
    with _open(tmp_path) as repo:
        repo.load(2, into=into)
        assert repo.read_stats()["store"] == 0
    for k, t in sd2.items():
        assert torch.equal(into[k], t), k


def test_a_tier_kept_by_tiles_still_serves_and_cache_decoded_false_keeps_no_bands(tmp_path, monkeypatch):
    sd = _state(9)
    with monkeypatch.context() as m:  # a save before band copies: each tile's decoded copy, a file each
        m.setattr(C._BandCopies, "wanted", staticmethod(lambda host, tile: False))
        with _open(tmp_path) as repo:
            repo.save(sd, step=1)
    assert len(_files(tmp_path, "raw")) > 10 and not _files(tmp_path, "bands")
    tiles = _count(monkeypatch, Tier, "read_raw_into")
    into = {k: torch.zeros_like(t) for k, t in sd.items()}
    with _open(tmp_path) as repo:
        repo.load(1, into=into)
        assert repo.read_stats()["store"] == 0
    assert tiles["ok"] > 10
    for k, t in sd.items():
        assert torch.equal(into[k], t), k
    with ckptstore.open(str(tmp_path / "r2"), cache_dir=tmp_path / "t2", chunk_size=CHUNK,
                        cache_decoded=False) as repo:
        repo.save(sd, step=1)
    assert not glob.glob(str(tmp_path / "t2" / "repos" / "*" / "bands" / "*" / "*"))


def test_band_copies_count_in_the_budget_and_are_evicted_like_any_file(tmp_path):
    from ckptstore.tier.cache import tier_files

    sd = _state(11)
    with _open(tmp_path) as repo:
        repo.save(sd, step=1)
    files = [f for f in tier_files(str(tmp_path / "tier")) if "/bands/" in f[0]]
    assert files and all(f[4] == "chunk" for f in files)
    assert all(f[1] == os.path.getsize(f[0]) for f in files)
    # no room in the budget beside the compact copies: no band copies at all
    with ckptstore.open(str(tmp_path / "r2"), cache_dir=tmp_path / "t2", chunk_size=CHUNK,
                        cache_size=200 << 10) as repo:
        repo.save(sd, step=1)
    assert not glob.glob(str(tmp_path / "t2" / "repos" / "*" / "bands" / "*" / "*"))


def test_band_names_follow_the_geometry_and_every_tile():
    h = ["0" * 64, "1" * 64]
    base = B.band_name(2, 8, (16,), (8, 8), h)
    assert base == B.band_name(2, 8, (16,), (8, 8), list(h))
    for other in (B.band_name(4, 8, (16,), (8, 8), h), B.band_name(2, 7, (16,), (8, 8), h),
                  B.band_name(2, 8, (17,), (8, 8), h), B.band_name(2, 8, (16,), (8, 4), h),
                  B.band_name(2, 8, (16,), (8, 8), h[::-1])):
        assert other != base
