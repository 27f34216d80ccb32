"""ckptstore.load_module: modules built on meta filled tensor by tensor, each onto its device.

Memory is checked by instrumentation, not RSS: every host tensor the load
allocates (``torch.empty`` is wrapped), the staging buffers' sizes, and the
read budget's high-water mark.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import random
import threading

import pytest
import torch
from torch import nn

import ckptstore
from ckptstore import loading
from ckptstore.repo import reader as reader_mod
from ckptstore.loading import IncompatibleKeys, ModuleLoader, StagingBuffers, TensorReader, plan_blocks
from ckptstore.pipeline.planner import box_shape, byte_runs
from ckptstore.storage import open_store
from ckptstore.storage.wrappers import CountingStore


class Net(nn.Module):
    """Embedding tied to the output head, a frozen layer, a persistent and a non-persistent buffer."""

    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.body[2].weight.requires_grad_(False)
        self.register_buffer("steps", torch.tensor(0))
        self.register_buffer("scratch", torch.ones(3), persistent=False)

    def forward(self, x):
        return self.head(self.norm(self.body(self.emb(x))))


def _ref(seed=0, **kw) -> Net:
    torch.manual_seed(seed)
    net = Net(**kw)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_()  # LayerNorm's ones/zeros would compare equal by accident
        net.steps.fill_(12)
    return net


def _meta(**kw) -> Net:
    with torch.device("meta"):
        return Net(**kw)


def _repo(tmp_path, **options):
    store = CountingStore(open_store(str(tmp_path / "repo")))
    return store, ckptstore.Repository(store, chunk_size=4096, **options)


def _pack_bytes(store: CountingStore) -> int:
    return sum(e - s for key, s, e in store.reads if key.startswith("packs/"))


class CpuAllocations:
    """Wraps ``torch.empty``: bytes of every CPU tensor allocated (any thread)."""

    def __init__(self, monkeypatch):
        self.sizes: list[int] = []
        real = torch.empty

        def empty(*args, **kwargs):
            t = real(*args, **kwargs)
            if t.device.type == "cpu":
                self.sizes.append(t.numel() * t.element_size())
            return t

        monkeypatch.setattr(torch, "empty", empty)


def _nbytes(module: nn.Module) -> int:
    seen = {}
    for t in list(module.parameters()) + [b for n, b in module.named_buffers() if n != "scratch"]:
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


# ---------------------------------------------------------------- materialize
def test_meta_module_materialized_bit_exact_tied_once_no_extra_copy(tmp_path, monkeypatch):
    ref = _ref(vocab=512, dim=64)  # the tied embedding is most of the bytes
    store, repo = _repo(tmp_path)
    repo.save({"model": ref.state_dict(), "optimizer": {"m": torch.zeros(8)}}, step=3)
    packs = sum(o.size for o in store.list("packs/"))
    m = _meta(vocab=512, dim=64)
    store.reset()
    allocs = CpuAllocations(monkeypatch)
    out = ckptstore.load_module(m, repo, prefix="model.")
    monkeypatch.undo()
    assert out == IncompatibleKeys([], []) and out.missing_keys == []
    assert m.head.weight is m.emb.weight, "tied weights must stay one Parameter"
    assert isinstance(m.emb.weight, nn.Parameter) and m.emb.weight.requires_grad
    assert not m.body[2].weight.requires_grad, "requires_grad is kept"
    for k, v in ref.state_dict().items():
        got = m.state_dict()[k]
        assert got.device.type == "cpu" and got.dtype == v.dtype and torch.equal(got, v), k
    assert m.scratch.is_meta, "non-persistent buffers are left alone"
    # Decoded straight into the new parameters: the only host tensors allocated
    # are the parameters themselves (the tied one once).
    assert sum(allocs.sizes) == _nbytes(m)
    # ...and the tied tensor's chunks were fetched once: nothing read twice.
    assert 0 < _pack_bytes(store) <= packs
    x = torch.randint(0, 512, (2, 5))
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))


def test_tensors_already_on_their_device_are_filled_in_place(tmp_path):
    ref = _ref()
    _, repo = _repo(tmp_path)
    repo.save(ref.state_dict(), step=1)
    m = Net()  # real CPU tensors
    ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
    head = m.head.weight
    ckptstore.load_module(m, repo)
    assert {n: p.data_ptr() for n, p in m.named_parameters()} == ptrs
    assert m.head.weight is head is m.emb.weight
    for k, v in ref.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k


def test_prefix_selects_a_subtree_and_url_is_opened_and_closed(tmp_path):
    ema = _ref(seed=1)
    url = str(tmp_path / "repo")
    with ckptstore.open(url, chunk_size=4096) as repo:
        repo.save({"model": _ref(seed=0).state_dict(), "ema": ema.state_dict()}, step=7)
        repo.save({"model": _ref(seed=2).state_dict()}, step=8)
    m = _meta()
    assert ckptstore.load_module(m, url, 7, prefix="ema.") == ([], [])
    for k, v in ema.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k
    m = _meta()
    ckptstore.load_module(m, url, prefix="model.")  # newest step
    assert torch.equal(m.body[0].weight, _ref(seed=2).body[0].weight)


# ---------------------------------------------------------------- strict, shapes, dtypes
def test_strict_errors_name_keys_like_load_state_dict_and_change_nothing(tmp_path):
    ref = _ref()
    sd = ref.state_dict()
    sd.pop("norm.bias")
    sd["extra.w"] = torch.ones(2)
    store, repo = _repo(tmp_path)
    repo.save(sd, step=1)
    m = _meta()
    store.reset()
    with pytest.raises(RuntimeError) as ei:
        ckptstore.load_module(m, repo)
    msg = str(ei.value)
    assert "step 1" in msg and repo.url in msg
    # the lines load_state_dict itself writes for the same state dict
    with pytest.raises(RuntimeError) as torch_ei:
        _ref().load_state_dict(sd)
    for line in str(torch_ei.value).splitlines()[1:]:
        assert line in msg.splitlines(), line
    assert all(t.is_meta for t in m.state_dict().values()), "checks come before any load"
    assert _pack_bytes(store) == 0

    # strict=False: reported, the rest loaded, the missing tensor left on meta
    out = ckptstore.load_module(m, repo, strict=False)
    assert out == IncompatibleKeys(["norm.bias"], ["extra.w"])
    assert m.norm.bias.is_meta and torch.equal(m.norm.weight, ref.norm.weight)


def test_shape_and_dtype_mismatches_raise_before_loading_even_when_not_strict(tmp_path):
    store, repo = _repo(tmp_path)
    sd = _ref().state_dict()
    sd["norm.weight"] = torch.ones(5)
    sd["steps"] = torch.tensor(1.5)  # float stored, the module's buffer is int64
    repo.save(sd, step=1)
    m = _meta()
    store.reset()
    with pytest.raises(RuntimeError) as ei:
        ckptstore.load_module(m, repo, strict=False)
    msg = str(ei.value)
    assert "size mismatch for norm.weight: copying a param with shape torch.Size([5])" in msg
    assert "dtype mismatch for steps" in msg and "float32" in msg
    assert all(t.is_meta for t in m.state_dict().values()) and _pack_bytes(store) == 0


def test_tied_names_stored_with_different_values_are_refused(tmp_path):
    _, repo = _repo(tmp_path)
    sd = _ref().state_dict()
    sd["head.weight"] = sd["head.weight"].clone() + 1
    repo.save(sd, step=1)
    with pytest.raises(RuntimeError, match='tied tensors "emb.weight" and "head.weight"'):
        ckptstore.load_module(_meta(), repo)


class DeferredStaging(StagingBuffers):
    """Copies out of a buffer happen only when their event is synchronized, as an
    accelerator's asynchronous copies complete later: reusing a buffer before its
    event, or finishing without waiting, gives wrong values."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.transfers = 0

    def transfer(self, src, dst):
        self.transfers += 1
        staging = self

        class Later:
            def synchronize(self):
                dst.copy_(src)

        assert staging.pin is False
        return Later()


def test_bf16_checkpoint_into_fp32_module_through_reused_staging_buffers(tmp_path, monkeypatch):
    ref = _ref(vocab=256, dim=64)
    bf = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in ref.state_dict().items()}
    _, repo = _repo(tmp_path)
    repo.save(bf, step=1)
    m = _meta(vocab=256, dim=64)
    allocs = CpuAllocations(monkeypatch)
    loader = ModuleLoader(m, repo.checkpoint(1), staging_bytes=6 * 4096, staging_cls=DeferredStaging)
    loader.run()
    monkeypatch.undo()
    st = loader.staging
    assert st.slot_bytes == 4096 and st.transfers > 3 * st.slots, "buffers must be reused many times"
    for k, v in bf.items():
        got = m.state_dict()[k]
        assert got.dtype == ref.state_dict()[k].dtype, k
        assert torch.equal(got, v.to(got.dtype)), k
    assert m.head.weight is m.emb.weight
    # host memory: the fp32 parameters plus at most the staging buffers
    assert st.allocated_bytes <= st.capacity
    assert sum(allocs.sizes) <= _nbytes(m) + st.capacity
    # one allocation per tensor and per staging buffer: blocks decode into the
    # buffers themselves, no temporary per block
    tensors = len({id(t) for t in m.state_dict(keep_vars=True).values()})
    assert len(allocs.sizes) == tensors + st.allocated_bytes // st.slot_bytes


def test_host_memory_stays_within_the_read_budget(tmp_path, monkeypatch):
    # A module of 4 x 256 KiB matrices read from bf16 (staged) on a repository
    # whose read budget is 512 KiB: staging comes out of the budget, fetches stay
    # in it, and no host tensor beyond the parameters and the staging exists.
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(256, 256, bias=False) for _ in range(4))

    torch.manual_seed(0)
    ref = Stack()
    store, repo = _repo(tmp_path, max_inflight_bytes=1 << 20, max_request=64 << 10)
    repo.save({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}, step=1)
    budget = repo.runtime.read_budget()
    assert budget.limit == 512 << 10
    with torch.device("meta"):
        m = Stack()
    allocs = CpuAllocations(monkeypatch)
    loader = ModuleLoader(m, repo.checkpoint(1))
    loader.run()
    monkeypatch.undo()
    st = loader.staging
    module_bytes = 4 * 256 * 256 * 4
    extra = sum(allocs.sizes) - module_bytes
    assert 0 < extra <= st.capacity <= budget.limit // 4
    assert len(allocs.sizes) == 4 + st.allocated_bytes // st.slot_bytes
    assert budget.peak <= budget.limit, "fetched bytes and staging together stay within the budget"
    assert budget.used == 0, "staging gives its share of the budget back"
    assert budget.peak > st.capacity, "staging was charged while fetches were in flight"
    for i in range(4):
        assert torch.equal(m.layers[i].weight, ref.layers[i].weight.to(torch.bfloat16).float())


def test_budget_reservations_always_leave_every_holders_room():
    from ckptstore.pipeline.runtime import ByteBudget

    b = ByteBudget(512)
    assert b.reserve(1000, room=100) == 412, "clamped to what leaves the room free"
    b.unreserve(412, 100)
    assert b.reserve(600, room=600) == 0 and b.reserved == 0
    assert b.reserve(300, room=100) == 300
    got = []
    t = threading.Thread(target=lambda: got.append(b.reserve(200, room=50)))
    t.start()
    # 300 + 200 would leave less than the first holder's 100 bytes: the second waits,
    # while requests up to the first holder's room still pass
    b.acquire(100)
    b.release(100)
    assert not got
    b.unreserve(300, 100)
    t.join()
    assert got == [200] and b.reserved == b.used == 200


def test_concurrent_staged_reads_on_one_handle_finish(tmp_path):
    # Each read reserves staging in the one read budget; together they must still
    # leave room for each other's requests (no deadlock).
    _, repo = _repo(tmp_path, max_inflight_bytes=1 << 20, max_request=64 << 10)
    w = {f"w{i}": torch.randn(256, 256, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    repo.save(w, step=1)
    reader = TensorReader(repo.checkpoint(1))
    with cf.ThreadPoolExecutor(6) as pool:
        futs = {k: pool.submit(reader.read, k, dtype=torch.float64) for k in w}
        for k, f in futs.items():
            assert torch.equal(f.result(timeout=300), w[k].double()), k  # the timeout only guards a hang
    budget = repo.runtime.read_budget()
    assert budget.used == budget.reserved == 0 and budget.peak <= budget.limit


# ---------------------------------------------------------------- device maps
def test_device_map_longest_prefix_at_name_boundaries():
    dm = loading._DeviceMap({"": "cpu"})
    keys = ["", "body", "body.1", "body.10"]
    dm.entries = {k: k or "default" for k in keys}  # distinguishable values without devices
    assert dm.lookup("body.10.weight") == "body.10"
    assert dm.lookup("body.1.weight") == "body.1"
    assert dm.lookup("body.1") == "body.1"
    assert dm.lookup("body.2.bias") == "body"
    assert dm.lookup("bodyguard.w") == "default"
    dm.entries = {"body": "body"}
    with pytest.raises(KeyError):
        dm.lookup("emb.weight")
    assert loading._DeviceMap(None).lookup("x") is None
    assert loading._DeviceMap("cpu").lookup("any.name") == torch.device("cpu")


def test_device_map_errors_come_before_any_read(tmp_path):
    store, repo = _repo(tmp_path)
    repo.save(_ref().state_dict(), step=1)
    store.reset()
    m = _meta()
    with pytest.raises(RuntimeError, match=r"device_map has no entry for emb.weight"):
        ckptstore.load_module(m, repo, device_map={"body": "cpu", "norm": "cpu"})
    with pytest.raises(ValueError, match="disk"):
        ckptstore.load_module(m, repo, device_map={"": "cpu", "head": "disk"})
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            ckptstore.load_module(m, repo, device_map={"": "cuda:0"})
    assert all(t.is_meta for t in m.state_dict().values()) and _pack_bytes(store) == 0
    out = ckptstore.load_module(m, repo, device_map={"": torch.device("cpu"), "body.0": "cpu"})
    assert out == ([], []) and m.body[0].weight.device.type == "cpu"


# ---------------------------------------------------------------- the reading path
def test_plan_blocks_partition_boxes_into_contiguous_runs():
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(200):
        nd = rng.randint(1, 4)
        shape = tuple(rng.randint(1, 6) for _ in range(nd))
        isz = rng.choice([1, 2, 4])
        limit = rng.choice([1, 2, 4, 8, 16, 64, 1024]) * isz
        whole = rng.random() < 0.5
        box = tuple((0, n, 1) for n in shape) if whole else tuple(
            (lambda a, b, s: (a, max(a, b), s))(rng.randrange(n), rng.randint(1, n), rng.randint(1, 2)) for n in shape
        )
        seen = torch.zeros(box_shape(box), dtype=torch.int64)
        for blk in plan_blocks(shape, isz, box, limit):
            n = torch.Size(blk.shape).numel()
            assert n * isz <= max(limit, isz), (seed, shape, box, blk)
            seen[blk.out] += 1
            assert tuple(seen[blk.out].shape) == blk.shape, (seed, blk)
            if whole and n:
                runs = byte_runs(shape, isz, blk.box)
                assert len(runs) == 1 and runs[0, 1] - runs[0, 0] == n * isz, (seed, shape, blk)
        assert bool((seen == 1).all()), f"seed {seed}: {shape} {box} not covered exactly once"


def test_tensor_reader_reads_slices_onto_other_dtypes_and_strided_destinations(tmp_path):
    _, repo = _repo(tmp_path)
    w = torch.randn(300, 40, generator=torch.Generator().manual_seed(3))
    repo.save({"w": w}, step=1)
    r = TensorReader(repo.checkpoint(1))
    assert torch.equal(r.read("w", (slice(10, 200, 3), 5)), w[10:200:3, 5])
    got = r.read("w", (slice(7, 290), slice(1, 39)), dtype=torch.float64)
    assert got.dtype == torch.float64 and torch.equal(got, w[7:290, 1:39].double())
    dest = torch.empty(40, 300).t()  # non-contiguous: staged, then copied
    r.read_into("w", dest)
    assert torch.equal(dest, w)
    repo.save({"s": torch.tensor(2.5)}, step=2)
    s0 = TensorReader(repo.checkpoint(2)).read("s", dtype=torch.float16)  # 0-d, staged
    assert s0.shape == () and s0.dtype == torch.float16 and s0.item() == 2.5
    with pytest.raises(ValueError, match=r"tensor 'w' is float32\[300, 40\]"):
        r.read_into("w", torch.empty(3, dtype=torch.int32), index=(0, slice(0, 3)))
    assert repo.runtime.read_budget().used == 0


def test_tensor_reader_on_a_fresh_handle_sizes_staging_from_the_shards_it_reads(tmp_path):
    # A fresh handle has read only the 2.0 root: chunk tables come when a shard
    # is read. Staged reads (a cast, a strided destination) used to size their
    # buffers from chunk lists not loaded yet and failed with a TypeError.
    g = torch.Generator().manual_seed(5)
    w = torch.randn(300, 40, generator=g)
    _, repo = _repo(tmp_path)
    repo.save({"w": w}, step=1)
    store, fresh = _repo(tmp_path)
    r = TensorReader(fresh.checkpoint(1))
    assert torch.equal(r.read("w", (slice(10, 20),), dtype=torch.bfloat16), w[10:20].bfloat16())
    dest = torch.empty(40, 300).t()
    r.read_into("w", dest)
    assert torch.equal(dest, w)
    assert fresh.runtime.read_budget().used == 0


def _staging_made(monkeypatch) -> list:
    """The staging buffers ``load(into=...)`` makes, in the order it makes them."""
    made = []
    real = reader_mod.make_staging

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(reader_mod, "make_staging", spy)
    return made


def test_load_into_casts_and_strided_destinations_through_bounded_staging(tmp_path, monkeypatch):
    # load(into=) decodes in place where it can; the other destinations (another
    # dtype, not contiguous, CUDA) go through one set of staging buffers of at
    # most half the read budget, not a host copy of each tensor.
    g = torch.Generator().manual_seed(6)
    sd = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(6)}  # 1 MiB each
    sd["b"] = torch.randn(64, generator=g)
    _, repo = _repo(tmp_path, max_inflight_bytes=2 << 20, max_request=64 << 10)
    repo.save(sd, step=1)
    _, fresh = _repo(tmp_path, max_inflight_bytes=2 << 20, max_request=64 << 10)
    into = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in sd.items() if k != "w5"}
    into["w5"] = torch.zeros(1024, 256).t()  # strided, same dtype
    made = _staging_made(monkeypatch)
    allocs = CpuAllocations(monkeypatch)
    fresh.load(1, into=into)
    monkeypatch.undo()
    (st,) = made
    budget = fresh.runtime.read_budget()
    assert st.capacity <= budget.limit // 2 and st.allocated_bytes <= st.capacity
    assert max(allocs.sizes) <= st.slot_bytes < 1 << 20, "no host tensor of a whole 1 MiB tensor"
    assert budget.peak <= budget.limit and budget.used == 0
    for k, v in sd.items():
        want = v if k == "w5" else v.bfloat16()
        assert torch.equal(into[k], want), k


def test_staged_loads_fetch_each_chunk_once_when_rows_divide_the_chunk_size(tmp_path, monkeypatch):
    # Staging buffers are a multiple of the chunk size (20 KiB here, 5 rows),
    # so blocks end on chunk boundaries: a cast load reads the same pack bytes
    # as a load in place (with 4 KiB-aligned buffers, each block boundary
    # inside a chunk made two blocks fetch that chunk).
    # Row-major runs (tiles=False) are what the alignment is for; tiled tensors are cut in blocks
    # of whole tiles instead (plan_tile_blocks), and must read the same bytes cast or not too.
    g = torch.Generator().manual_seed(7)
    sd = {f"w{i}": torch.randn(600, 1024, generator=g) for i in range(3)}
    opts = dict(max_inflight_bytes=2 << 20, max_request=64 << 10)
    for tiles in (False, True):
        root = tmp_path / f"repo-{tiles}"
        store = CountingStore(open_store(str(root)))
        ckptstore.Repository(store, chunk_size=20480, tiles=tiles, **opts).save(sd, step=1)
        made = _staging_made(monkeypatch)
        read = {}
        for name, dtype in (("in place", torch.float32), ("cast", torch.bfloat16)):
            store = CountingStore(open_store(str(root)))
            repo = ckptstore.Repository(store, **opts)
            into = {k: torch.zeros(v.shape, dtype=dtype) for k, v in sd.items()}
            repo.load(1, into=into)
            assert all(torch.equal(into[k], v.to(dtype)) for k, v in sd.items())
            read[name] = _pack_bytes(store)
            repo.close()
        assert read["cast"] == read["in place"], (tiles, read)
        if not tiles:
            (st,) = made
            assert st.slot_bytes % 20480 == 0 and st.slot_bytes < 600 * 4096, "blocks: several per tensor, whole chunks"
        monkeypatch.undo()


def test_tensor_reader_own_staging_fetches_each_chunk_once(tmp_path):
    # TensorReader without staging given makes its own for a cast read; its
    # buffers are chunk multiples too (12 KiB chunks, 3 rows), so a cast read
    # reads the same pack bytes as a read in the stored dtype (20% more
    # before, with buffers only 4 KiB-aligned).
    g = torch.Generator().manual_seed(8)
    w = torch.randn(600, 1024, generator=g)
    opts = dict(max_inflight_bytes=2 << 20, max_request=64 << 10)
    ckptstore.Repository(open_store(str(tmp_path / "repo")), chunk_size=12288, **opts).save({"w": w}, step=1)
    read = {}
    for dtype in (torch.float32, torch.bfloat16):
        store = CountingStore(open_store(str(tmp_path / "repo")))
        repo = ckptstore.Repository(store, **opts)
        got = TensorReader(repo.checkpoint(1)).read("w", dtype=dtype)
        assert torch.equal(got, w.to(dtype))
        read[dtype] = _pack_bytes(store)
        repo.close()
    assert read[torch.bfloat16] == read[torch.float32], read


def test_progress_bar_advances_to_the_bytes_loaded(tmp_path, monkeypatch):
    """progress=True: one bar over the bytes filled, advanced as tensors land, not once at the end."""
    bars = []

    class Bar:
        def __init__(self, total, desc):
            self.total, self.desc, self.steps, self.closed = total, desc, [], False
            bars.append(self)

        def update(self, n):
            assert not self.closed
            self.steps.append(n)

        def close(self):
            self.closed = True

    monkeypatch.setattr(loading, "byte_bar", Bar)
    _, repo = _repo(tmp_path, max_request=8192)  # tensors read in several batches (41 KiB in all)
    ref = _ref()
    repo.save(ref.state_dict(), step=4)
    ckptstore.load_module(_meta(), repo, progress=True)
    (bar,) = bars
    # every persistent tensor once (the tied head shares the embedding's storage)
    total = sum(t.nbytes for t in {t.data_ptr(): t for t in ref.state_dict().values()}.values())
    assert bar.desc == "load step 4" and bar.total == total and bar.closed
    done = list(itertools.accumulate(bar.steps))
    assert len(done) > 1 and all(n > 0 for n in bar.steps), bar.steps  # advances step by step
    assert done[-1] == total, (done, total)  # ...and reaches the total


def test_hf_model_on_meta_with_tied_embeddings(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg).eval()
    _, repo = _repo(tmp_path)
    repo.save({"model": ref.state_dict()}, step=1)
    with torch.device("meta"):
        m = transformers.GPT2LMHeadModel(cfg).eval()
    assert m.lm_head.weight is m.transformer.wte.weight
    ckptstore.load_module(m, repo, prefix="model.")
    assert m.lm_head.weight is m.transformer.wte.weight and not m.lm_head.weight.is_meta
    x = torch.randint(0, 96, (1, 8))
    with torch.no_grad():
        assert torch.equal(m(x).logits, ref(x).logits)


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_destinations_through_pinned_staging(tmp_path):
    ref = _ref(vocab=512, dim=64)
    bf = {k: (v.to(torch.bfloat16) if k.startswith("body.") else v) for k, v in ref.state_dict().items()}
    _, repo = _repo(tmp_path)
    repo.save(bf, step=1)
    m = _meta(vocab=512, dim=64)
    loader = ModuleLoader(m, repo.checkpoint(1), device_map={"": "cuda:0", "norm": "cpu"}, staging_bytes=8 * 4096)
    loader.run()
    st = loader.staging
    assert st.pin and st.allocated_bytes <= st.capacity
    assert m.head.weight is m.emb.weight and m.emb.weight.device == torch.device("cuda", 0)
    assert m.norm.weight.device.type == "cpu"
    for k, v in bf.items():
        got = m.state_dict()[k]
        assert torch.equal(got.cpu(), v.to(got.dtype)), k
