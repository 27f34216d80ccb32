"""N-dimensional chunk tiles (format 4.0): a slice along any dimension reads about its share.

Bytes read are counted through a :class:`CountingStore` with ``coalesce_gap=0`` (no gap filling
between the ranges of one read: the bytes read are the tiles asked for). The bound each slice is
held to is the one :func:`ckptstore.format.tiles.choose_tile` sizes tiles for: a slice of a
fraction ``f`` of one dimension reads at most ``1.25 * f`` of the tensor's stored bytes plus two
chunks (for ``f`` of 1/8 and larger).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptstore
from ckptstore.errors import FormatError, IntegrityError, UnsupportedVersionError
from ckptstore.format import manifest as M
from ckptstore.format import strict_json
from ckptstore.format import tiles as T
from ckptstore.storage import MemoryStore, open_store
from ckptstore.storage.wrappers import CountingStore
from ckptstore.testing import free_port

from . import tile_workers as W
from .helpers import spawn

CHUNK = 16 << 10


def _pack_bytes(store: CountingStore) -> int:
    return sum(e - s for key, s, e in store.reads if key.startswith("packs/"))


def _tensor(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _saved(tmp_path, sd, **options):
    path = str(tmp_path / "repo")
    with ckptstore.Repository(open_store(path), chunk_size=CHUNK, **options) as repo:
        repo.save(sd, step=1)
    store = CountingStore(open_store(path))
    return store, ckptstore.Repository(store, coalesce_gap=0)


def _bound(repo, key: str, fraction: float, chunk: int = CHUNK) -> float:
    """1.25 times the slice's share of the tensor's stored bytes, plus two chunks (``chunk`` raw
    bytes each, at the tensor's compression ratio)."""
    meta = repo.checkpoint(1).tensor_meta(key)
    return 1.25 * fraction * meta.stored_bytes + 2 * chunk * meta.stored_bytes / meta.nbytes


# ------------------------------------------------------------------ the grid (pure)
@pytest.mark.parametrize("shape,itemsize", [
    ((4096, 4096), 2), ((2048, 5632), 2), ((14336, 4096), 2), ((128256, 4096), 2), ((4096, 11008), 2),
    ((8, 4096, 4096), 2), ((3, 1 << 22), 4), ((1 << 20, 3), 4), ((64, 64, 64, 64), 4), ((1500, 1000), 8),
])
def test_choose_tile_meets_the_slice_bound_in_every_dimension(shape, itemsize):
    chunk = 4 << 20
    tile = T.choose_tile(shape, itemsize, chunk)
    nbytes = math.prod(shape) * itemsize
    assert tile is not None and len(tile) == len(shape)
    assert math.prod(tile) * itemsize <= chunk
    # a few rows read at most two slabs of tiles of two chunks each (or single rows, if larger)
    assert tile[0] == 1 or tile[0] * nbytes // shape[0] <= 2 * chunk
    # a tensor-parallel slice at the eighths of a dimension meets whole tiles
    assert all(n % 8 or (n // 8) % t == 0 or t % (n // 8) == 0 for n, t in zip(shape, tile)), tile
    for n, t in zip(shape, tile):
        share = max(1, n // 8) / n
        assert T.worst_fraction(n, t) * nbytes <= 1.25 * share * nbytes + 2 * chunk, (shape, tile, n, t)


def test_small_and_one_dimensional_tensors_keep_row_major_runs():
    assert T.choose_tile((1 << 24,), 4, 4 << 20) is None  # 64 MiB, 1-D
    assert T.choose_tile((1024, 2047), 4, 4 << 20) is None  # under 8 MiB (two chunks)
    assert T.choose_tile((1024, 2048), 4, 4 << 20) == (128, 256)  # 8 MiB: eighths of each dimension
    assert T.choose_tile((1024, 2048), 4, 16 << 20) == (128, 256)  # from 8 MiB, whatever the chunk size
    assert T.choose_tile((32, 32), 4, 4096) is None and T.choose_tile((32, 64), 4, 4096) is not None  # 2 chunks
    assert T.choose_tile((1024, 2048), 4, 1 << 20) == (128, 256)
    assert T.choose_tile((), 4, 4 << 20) is None


def test_tile_lengths_and_meeting_follow_the_grid():
    sizes, tile = (10, 7), (4, 3)
    assert T.grid(sizes, tile) == (3, 3) and T.count(sizes, tile) == 9
    assert T.tile_lengths(sizes, tile, 2).tolist() == [24, 24, 8, 24, 24, 8, 12, 12, 4]
    assert [i for i, _ in T.meeting(sizes, tile, ((0, 10, 1), (3, 6, 1)))] == [1, 4, 7]
    assert [i for i, _ in T.meeting(sizes, tile, ((5, 6, 1), (0, 7, 1)))] == [3, 4, 5]
    assert [i for i, _ in T.meeting(sizes, tile, ((0, 10, 9), (0, 7, 6)))] == [0, 2, 6, 8]


# ------------------------------------------------------------------ bytes read by slices
SHAPES = [((512, 768), torch.bfloat16), ((384, 640), torch.float32), ((16, 96, 160), torch.float32),
          ((48, 40, 72), torch.bfloat16)]


@pytest.mark.parametrize("shape,dtype", SHAPES)
@pytest.mark.parametrize("parts", [2, 4, 8])
def test_a_slice_along_any_dimension_reads_about_its_share(tmp_path, shape, dtype, parts):
    full = _tensor(shape, dtype)
    store, repo = _saved(tmp_path, {"w": full})
    with repo:
        ck = repo.checkpoint(1)
        assert ck.entry("w").tile is not None
        for dim, n in enumerate(shape):
            length = n // parts
            for start in (0, length, n - length, max(0, n // 2 - length // 2 - 1)):  # aligned and not
                index = tuple(slice(start, start + length) if d == dim else slice(None) for d in range(len(shape)))
                store.reset()
                got = ck.read("w", index)
                assert torch.equal(got.view(torch.uint8), full[index].contiguous().view(torch.uint8))
                read = _pack_bytes(store)
                assert read <= _bound(repo, "w", length / n), (dim, start, read, ck.tensor_meta("w").stored_bytes)


def test_a_column_slice_reads_all_of_a_row_major_tensor_and_its_share_of_a_tiled_one(tmp_path):
    full = _tensor((512, 1024), torch.bfloat16)
    reads = {}
    for tiles in (False, True):
        store, repo = _saved(tmp_path / str(tiles), {"w": full}, tiles=tiles)
        with repo:
            ck = repo.checkpoint(1)
            stored = ck.tensor_meta("w").stored_bytes
            store.reset()
            assert torch.equal(ck.read("w", (slice(None), slice(128, 256))), full[:, 128:256])
            reads[tiles] = _pack_bytes(store) / stored
    assert reads[False] == 1.0  # every chunk: a row-major run holds some of every column
    assert reads[True] <= 1.25 / 8 + 0.02, reads


# ------------------------------------------------------------------ dedup, checks, versions
def test_an_unchanged_tiled_tensor_stores_no_new_bytes(tmp_path):
    full = _tensor((256, 384))
    with ckptstore.Repository(open_store(str(tmp_path / "r")), chunk_size=CHUNK) as repo:
        first = repo.save({"w": full, "b": torch.ones(8)}, step=1)
        assert repo.manifest(1).tensors["w"].tile is not None and repo.manifest(1).version == (4, 0)
        again = repo.save({"w": full.clone(), "b": torch.zeros(8)}, step=2)
        assert again.new_bytes == 32 and again.reused_bytes == full.numel() * 4  # only "b" changed
        changed = full.clone()
        changed[7, 300] += 1  # one element: one tile
        third = repo.save({"w": changed, "b": torch.zeros(8)}, step=3)
        tile = repo.manifest(3).tensors["w"].tile
        assert third.new_bytes == math.prod(tile) * 4
        assert torch.equal(repo.load(3)["w"], changed)
        assert first.compression_ratio > 0


def test_a_tile_whose_bytes_are_wrong_is_refused_naming_the_tensor(tmp_path):
    full = _tensor((256, 384))
    mem = MemoryStore()
    with ckptstore.Repository(mem, chunk_size=CHUNK) as repo:
        repo.save({"w": full}, step=1)
        ref = repo.checkpoint(1).shards("w", [0])[0].chunks[5]
        t0, t1 = repo.manifest(1).tensors["w"].tile  # chunk 5 is tile (0, 5): rows 0:t0, columns 5*t1:6*t1
    key = f"packs/{ref.pack[:2]}/{ref.pack}.pack"
    data = bytearray(mem.get(key))
    data[ref.offset + ref.stored_len // 2] ^= 0xFF
    mem.delete(key)
    mem.put(key, bytes(data))
    with ckptstore.Repository(mem) as repo:
        ck = repo.checkpoint(1)
        with pytest.raises(IntegrityError, match="tensor 'w'"):
            ck.read("w", (slice(None), slice(5 * t1, 5 * t1 + 1)))
        with pytest.raises(IntegrityError, match="tensor 'w'"):
            repo.load(1, into={"w": torch.zeros(256, 384)})
        # the other tiles are fine: a slice that does not meet tile (0, 5) reads
        assert torch.equal(ck.read("w", (slice(t0, None), slice(5 * t1, 6 * t1))), full[t0:, 5 * t1 : 6 * t1])


def test_a_4_0_root_is_validated_and_a_3_x_reader_refuses_it(tmp_path, monkeypatch):
    with ckptstore.Repository(open_store(str(tmp_path / "r")), chunk_size=CHUNK) as repo:
        repo.save({"w": _tensor((256, 384)), "v": torch.ones(3)}, step=1)
        body = repo.store.get("manifests/00000000000000000001.json")
    doc = json.loads(body)
    assert doc["version"] == [4, 0]
    (w,) = [t for t in doc["tensors"] if t["key"] == "w"]
    assert w["tile"] and M.from_json(body).tensors["w"].tile == tuple(w["tile"])
    bad = json.loads(body)
    bad["version"] = [3, 0]  # a tile in a 3.0 root is an unknown field
    with pytest.raises(FormatError):
        M.from_json(json.dumps(bad).encode())
    for tile in ([0, 4], [4], [4, 4, 4], [1000, 4]):
        bad = json.loads(body)
        next(t for t in bad["tensors"] if t["key"] == "w")["tile"] = tile
        with pytest.raises(FormatError, match="tile"):
            M.from_json(json.dumps(bad).encode())
    bad = json.loads(body)
    next(t for t in bad["tensors"] if t["key"] == "w")["tile"] = [w["tile"][0] * 2, w["tile"][1]]
    with pytest.raises(FormatError, match="number of tiles"):
        M.from_json(json.dumps(bad).encode())
    monkeypatch.setattr(strict_json, "VERSION", (3, 0))  # what a 3.x ckptstore does with it
    with pytest.raises(UnsupportedVersionError, match=r"4\.0, newer than this ckptstore reads \(3\.x\); upgrade"):
        M.from_json(body)


def test_steps_without_tiled_tensors_stay_3_0_and_tiles_false_writes_runs(tmp_path):
    with ckptstore.Repository(open_store(str(tmp_path / "a")), chunk_size=CHUNK) as repo:
        repo.save({"v": torch.ones(1 << 16), "s": torch.ones(8, 8)}, step=1)
        assert repo.manifest(1).version == (3, 0)
    with ckptstore.Repository(open_store(str(tmp_path / "b")), chunk_size=CHUNK, tiles=False) as repo:
        repo.save({"w": _tensor((256, 384))}, step=1)
        assert repo.manifest(1).version == (3, 0) and repo.manifest(1).tensors["w"].tile is None


def test_export_cp_and_diff_of_a_tiled_step(tmp_path):
    sd = {"w": _tensor((256, 384)), "h": _tensor((8, 40, 72), torch.bfloat16, 1), "v": torch.arange(10.0)}
    files = {}
    for tiles in (False, True):
        with ckptstore.Repository(open_store(str(tmp_path / f"r{tiles}")), chunk_size=CHUNK, tiles=tiles) as repo:
            repo.save(sd, step=1)
            repo.save(sd, step=2)
            out = tmp_path / f"{tiles}.safetensors"
            repo.export(1, str(out))
            files[tiles] = out.read_bytes()
            assert repo.diff(1, 2)["changed"] == []
            dst = ckptstore.open(str(tmp_path / f"copy{tiles}"))
            repo.cp(dst)
            assert dst.manifest(1).tensors["w"].tile == repo.manifest(1).tensors["w"].tile
            assert all(torch.equal(dst.load(1)[k], v) for k, v in sd.items())
            assert dst.verify(read_data=True).ok
    assert files[True] == files[False]  # the same file, byte for byte


def test_load_into_strided_cuda_like_and_cast_destinations(tmp_path):
    full = _tensor((256, 384))
    _, repo = _saved(tmp_path, {"w": full, "h": _tensor((8, 40, 72), seed=3)})
    with repo:
        into = {"w": torch.zeros(384, 256).t(), "h": torch.zeros(8, 40, 72, dtype=torch.float64)}
        repo.load(1, into=into)
        assert torch.equal(into["w"], full) and torch.equal(into["h"], _tensor((8, 40, 72), seed=3).double())


def test_lazy_state_dict_reads_a_column_slice_by_tiles(tmp_path):
    hf = pytest.importorskip("ckptstore.integrations.hf")
    full = _tensor((512, 768), torch.bfloat16)
    store, repo = _saved(tmp_path, {"w": full})
    with repo:
        sd = hf.lazy_state_dict(repo)
        store.reset()
        got = sd["w"][:, 96:192]
        assert torch.equal(got, full[:, 96:192])
        assert _pack_bytes(store) <= _bound(repo, "w", 1 / 8)


# ------------------------------------------------------------------ property: any slice, bit-exact
@st.composite
def _case(draw):
    nd = draw(st.integers(2, 4))
    shape = tuple(draw(st.integers(1, 24)) for _ in range(nd))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int16, torch.uint8]))
    index = []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a, n))
        index.append(slice(a, b, draw(st.integers(1, 3))))
    if draw(st.booleans()):
        index[draw(st.integers(0, nd - 1))] = draw(st.integers(0, min(shape) - 1))
    return shape, dtype, tuple(index), draw(st.integers(0, 1 << 16))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case())
def test_any_slice_of_a_tiled_tensor_is_bit_exact(case):
    shape, dtype, index, seed = case
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(0, 250, shape, generator=g, dtype=torch.int16).to(dtype)
    with ckptstore.Repository(MemoryStore(), chunk_size=4096) as repo:
        repo.save({"t": full}, step=1)
        ck = repo.checkpoint(1)
        want = full[index]
        got = ck.read("t", index)
        assert got.shape == want.shape and torch.equal(got, want)
        tile = ck.entry("t").tile
        if tile is not None:  # the tiles read: exactly those holding an element of the slice
            box, _ = ckptstore.pipeline.planner.normalize_index(index, shape)
            refs = ck.box_refs(ck.entry("t"), ck.shards("t", [0])[0], box)
            assert len(refs) <= T.count(shape, tile)


# ------------------------------------------------------------------ DCP reshards, 2 ranks
@pytest.mark.slow  # 2 gloo ranks
@pytest.mark.parametrize("saved_dim,load_dim", [(0, 1), (1, 0)])
def test_dcp_reshard_between_dims_on_2_ranks_reads_each_ranks_share(tmp_path, saved_dim, load_dim):
    tensors = {"w": _tensor((256, 384)), "h": _tensor((64, 96, 40), torch.bfloat16, 2)}
    paths = {}
    for k, v in tensors.items():
        paths[k] = str(tmp_path / f"{k}.pt")
        torch.save(v, paths[k])
    url = str(tmp_path / "repo")
    spawn(W.save_worker, args=(2, free_port(), url, paths, saved_dim, {"chunk_size": CHUNK}), nprocs=2)
    with ckptstore.open(url) as repo:
        man = repo.manifest(1)
        assert man.version == (4, 0) and all(man.tensors[k].tile is not None for k in tensors)
        stored = sum(man.tensors[k].stored_bytes for k in tensors)
        ratio = stored / sum(man.tensors[k].nbytes for k in tensors)
    out = tmp_path / "out"
    out.mkdir()
    spawn(W.reshard_load_worker, args=(2, free_port(), url, None, 1, paths, load_dim, str(out), {"coalesce_gap": 0}),
          nprocs=2)
    for r in range(2):
        doc = json.loads((out / f"rank{r}.json").read_text())
        assert doc["bad"] == []
        # its half of each tensor, read from the halves the other split stored: ~ half the step
        assert doc["packs"] <= 1.25 * 0.5 * stored + 2 * 2 * CHUNK * ratio, (r, doc["packs"], stored)


def test_an_async_save_reuses_the_tiles_its_snapshot_found_unchanged(tmp_path):
    w = _tensor((256, 384))
    with ckptstore.Repository(open_store(str(tmp_path / "r")), chunk_size=CHUNK) as repo:
        first = repo.save({"w": w}, step=1, blocking=False).result(timeout=120)
        tile = repo.manifest(1).tensors["w"].tile
        assert tile is not None and first.unchanged_chunks == 0
        ntiles = T.count(w.shape, tile)
        again = repo.save({"w": w}, step=2, blocking=False).result(timeout=120)
        assert again.unchanged_chunks == ntiles and again.new_bytes == 0  # none hashed, none stored
        w[200, 10] += 1.0  # one element: its tile, and the tiles whose byte span shares its block
        third = repo.save({"w": w}, step=3, blocking=False).result(timeout=120)
        assert 0 < third.unchanged_chunks < ntiles
        assert third.new_bytes == math.prod(tile) * 4  # only the edited tile is new
        for step, want in ((2, _tensor((256, 384))), (3, w)):
            assert torch.equal(repo.load(step)["w"], want)


# ------------------------------------------------------------------ landing by bands
def _plan(repo, key, index, target=None):
    from ckptstore.repo.tile_read import TileRead
    ck = repo.checkpoint(1)
    e = ck.entry(key)
    shard = ck.shards(key, [0])[0]
    box, shape = ckptstore.pipeline.planner.normalize_index(index, e.shape)
    if target is None:
        target = torch.empty(tuple(len(range(*b)) for b in box), dtype=M.DTYPES[e.dtype])
    return TileRead(e, shard, box, target)


@pytest.mark.parametrize("shape,dtype", [((256, 384), torch.float32), ((8, 40, 72), torch.bfloat16),
                                         ((96, 640), torch.bfloat16)])
def test_a_whole_tensor_lands_by_bands_and_a_cut_box_tile_by_tile(tmp_path, shape, dtype):
    full = _tensor(shape, dtype)
    _, repo = _saved(tmp_path, {"w": full})
    with repo:
        tile = repo.checkpoint(1).entry("w").tile
        assert tile is not None and T.grid(shape, tile)[1:] != (1,) * (len(shape) - 1)
        whole = _plan(repo, "w", None)
        assert len(whole.bands) == len(whole.refs)  # every tile decodes into its band's buffer
        # rows cut inside the first band's tiles: those tiles land one by one, the others by bands
        cut = _plan(repo, "w", (slice(1, shape[0]),))
        first_band = [k for k, (tsz, tile_sl, out_sl) in enumerate(cut.parts) if tile_sl[0].start != 0]
        assert first_band and not any(k in cut.bands for k in first_band)
        assert len(cut.bands) == len(cut.refs) - len(first_band)
        # a slice of a trailing dimension lands tile by tile
        col = _plan(repo, "w", (slice(None), slice(0, shape[1] // 2)))
        assert not col.bands
        for index in (None, (slice(1, shape[0]),), (slice(3, shape[0] - 2),), (slice(None), slice(0, shape[1] // 2))):
            want = full if index is None else full[index]
            assert torch.equal(repo.checkpoint(1).read("w", index), want)
        out = _counted_band_pool(repo)
        into = {"w": torch.full_like(full, 7)}
        repo.load(1, into=into)
        assert torch.equal(into["w"], full)
        assert out["get"] > 0 and out["get"] == out["put"]  # every band buffer came back
        assert not repo.runtime._buffer_pools["tile bands"]._free  # and went back to the system once idle


def _counted_band_pool(repo) -> dict:
    """Count the gets and puts of the pool of band buffers the repository's reads use."""
    pool = repo.runtime.tile_buffers()[1]
    out = {"get": 0, "put": 0}
    get, put = pool.get, pool.put

    def counted_get():
        out["get"] += 1
        return get()

    def counted_put(buf):
        out["put"] += 1
        put(buf)

    pool.get, pool.put = counted_get, counted_put
    return out


def test_trailing_sizes_off_the_grid_land_tile_by_tile(tmp_path):
    full = _tensor((200, 390), torch.bfloat16)  # 390 is not a whole number of tiles
    _, repo = _saved(tmp_path, {"w": full})
    with repo:
        tile = repo.checkpoint(1).entry("w").tile
        assert tile is not None and 390 % tile[1]
        assert not _plan(repo, "w", None).bands
        assert torch.equal(repo.load(1)["w"], full)


def test_a_corrupt_tile_in_a_band_is_refused_and_its_buffer_given_back(tmp_path):
    full = _tensor((256, 384))
    path = tmp_path / "repo"
    with ckptstore.Repository(open_store(str(path)), chunk_size=CHUNK) as repo:
        repo.save({"w": full}, step=1)
        ref = repo.checkpoint(1).shards("w", [0])[0].chunks[5]
    pack = next((path / "packs").rglob(f"{ref.pack}*"))
    data = bytearray(pack.read_bytes())
    data[ref.offset + ref.stored_len // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    with ckptstore.Repository(open_store(str(path))) as repo:
        out = _counted_band_pool(repo)
        with pytest.raises(IntegrityError, match="'w'"):
            repo.load(1, into={"w": torch.zeros_like(full)})
        assert out["get"] > 0 and out["get"] == out["put"]


def test_small_tiles_are_prepared_by_groups_of_about_a_chunk(tmp_path, monkeypatch):
    from ckptstore.repo import save as S
    calls: list[int] = []
    real = S.ChunkWriter._prepare_many
    monkeypatch.setattr(S.ChunkWriter, "_prepare_many", lambda self, pieces, *a: calls.append(len(pieces)) or real(self, pieces, *a))
    w = _tensor((256, 384))
    store, repo = _saved(tmp_path, {"w": w, "b": _tensor((96, 640), torch.bfloat16, 1)})
    with repo:
        tile = repo.checkpoint(1).entry("w").tile
        tile_bytes = math.prod(tile) * 4
        assert 2 * tile_bytes <= CHUNK  # small: grouped
        ntiles = T.count(w.shape, tile) + T.count((96, 640), repo.checkpoint(1).entry("b").tile)
        assert sum(calls) == ntiles and len(calls) < ntiles / 2  # every tile, by groups
        assert max(calls) <= CHUNK // min(tile_bytes, CHUNK // 8) + 1
        got = repo.load(1)
        assert torch.equal(got["w"], w) and torch.equal(got["b"], _tensor((96, 640), torch.bfloat16, 1))
        assert repo.verify(read_data=True).ok
