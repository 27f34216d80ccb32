"""DCP backend behaves like PyTorch's own FileSystemWriter/FileSystemReader
where users rely on it: dtype casts on load, readers and writers reused with
new checkpoint ids, ``no_dist`` and sub-group loads, one checkpoint id per
step, Hugging Face-loadable exports, and optimizer state through
``get_state_dict``/``set_state_dict``.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import ckptstore
from ckptstore.dcp import CkptStoreReader, CkptStoreWriter, split_checkpoint_id
from ckptstore.testing import free_port

from . import dcp_workers as W
from .doc_blocks import recipe
from .helpers import SMALL, bits_equal, spawn

pytestmark = pytest.mark.slow  # spawned gloo ranks, PyTorch's own DCP writer/reader beside ours

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]


def _source(dtype, shape=(48, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 4).to(dtype)


# ------------------------------------------------------------ 1. dtype casts
@pytest.fixture
def dtype_repo(tmp_path):
    url = str(tmp_path / "repo")
    with ckptstore.open(url, **SMALL) as repo:
        repo.save({str(d): _source(d) for d in FLOATS}, step=1)
    return url


@pytest.mark.parametrize("stored", FLOATS, ids=str)
def test_repo_load_into_other_float_dtype_casts(dtype_repo, stored):
    with ckptstore.open(dtype_repo) as repo:
        for dest_dtype in FLOATS:
            into = {str(stored): torch.zeros(48, 5, dtype=dest_dtype)}
            repo.load(1, into=into)
            assert bits_equal(into[str(stored)], _source(stored).to(dest_dtype)), (stored, dest_dtype)
            # a slice-shaped, non-contiguous destination view too
            dest = torch.zeros(5, 48, dtype=dest_dtype).t()
            repo.checkpoint(1).read_into(str(stored), dest)
            assert bits_equal(dest.contiguous(), _source(stored).to(dest_dtype))


@pytest.mark.parametrize("stored", FLOATS, ids=str)
def test_dcp_reader_casts_like_filesystem_reader(dtype_repo, tmp_path, stored):
    fs_dir = str(tmp_path / f"fs-{stored}")
    dcp.save({"x": _source(stored)}, storage_writer=FileSystemWriter(fs_dir))
    for dest_dtype in FLOATS:
        ours = {str(stored): torch.zeros(48, 5, dtype=dest_dtype)}
        dcp.load(ours, storage_reader=CkptStoreReader(dtype_repo, step=1))
        theirs = {"x": torch.zeros(48, 5, dtype=dest_dtype)}
        dcp.load(theirs, storage_reader=FileSystemReader(fs_dir))
        assert bits_equal(ours[str(stored)], _source(stored).to(dest_dtype)), (stored, dest_dtype)
        assert bits_equal(ours[str(stored)], theirs["x"])


def test_sharded_step_loads_into_other_dtypes_across_shards(tmp_path):
    url = str(tmp_path / "repo")
    spawn(W.sharded_dtypes_save_worker, args=(2, free_port(), url), nprocs=2)
    g = torch.Generator().manual_seed(11)
    f32 = torch.randn(64, 24, generator=g)
    bf16 = torch.randn(64, 24, generator=g).bfloat16()
    with ckptstore.open(url) as repo:
        assert len(repo.manifest(1).tensors["f32"].shards) == 2
        into = {"f32": torch.zeros(64, 24, dtype=torch.bfloat16), "bf16": torch.zeros(64, 24, dtype=torch.float32)}
        repo.load(1, into=into)
        assert bits_equal(into["f32"], f32.bfloat16()) and bits_equal(into["bf16"], bf16.float())
        # a slice crossing the shard boundary, cast
        sub = torch.zeros(8, 24, dtype=torch.float64)
        sd = {"bf16": torch.zeros(64, 24, dtype=torch.float16), "f32": torch.zeros(64, 24, dtype=torch.float64)}
        dcp.load(sd, storage_reader=CkptStoreReader(url, step=1))
        assert bits_equal(sd["bf16"], bf16.half()) and bits_equal(sd["f32"], f32.double())
        repo.checkpoint(1).read_box(repo.manifest(1).tensors["f32"], ((28, 36, 1), (0, 24, 1)), sub)
        assert bits_equal(sub, f32[28:36].double())


def test_cast_across_kinds_is_refused_and_names_step(dtype_repo):
    with ckptstore.open(dtype_repo) as repo:
        into = {"torch.float32": torch.zeros(48, 5, dtype=torch.int32)}
        with pytest.raises(ValueError, match=r"step 1: tensor 'torch.float32' is float32.*int32"):
            repo.load(1, into=into)
        assert torch.count_nonzero(into["torch.float32"]) == 0


def test_same_dtype_load_makes_no_full_size_copy(tmp_path, monkeypatch):
    url = str(tmp_path / "repo")
    w = torch.randn(1024, 1024)  # 4 MiB
    with ckptstore.open(url, **SMALL) as repo:
        repo.save({"w": w}, step=1)
        big = []
        real_empty = torch.empty

        def spy(*args, **kwargs):
            t = real_empty(*args, **kwargs)
            if t.numel() * t.element_size() >= 1 << 20:
                big.append(tuple(t.shape))
            return t

        monkeypatch.setattr(torch, "empty", spy)
        into = {"w": torch.zeros(1024, 1024)}
        repo.load(1, into=into)
        sd = {"w": torch.zeros(1024, 1024)}
        dcp.load(sd, storage_reader=CkptStoreReader(url, step=1))
        monkeypatch.undo()
        assert torch.equal(into["w"], w) and torch.equal(sd["w"], w)
        assert big == []  # decoded straight into the destinations
        into = {"w": torch.zeros(1024, 1024, dtype=torch.bfloat16)}
        repo.load(1, into=into)
        assert torch.equal(into["w"], w.bfloat16())


# ------------------------------------------------------------ 2. reset with a new checkpoint id
def test_reused_reader_and_writer_follow_new_checkpoint_id(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    wa, wb = torch.full((4, 4), 1.0), torch.full((4, 4), 2.0)
    writer = CkptStoreWriter(a, step=1)
    dcp.save({"w": wa}, storage_writer=writer)
    dcp.save({"w": wb}, storage_writer=writer, checkpoint_id=b)
    with ckptstore.open(a) as ra, ckptstore.open(b) as rb:
        assert torch.equal(ra.load(1)["w"], wa) and torch.equal(rb.load(1)["w"], wb)
    reader = CkptStoreReader(a, step=1)
    sd = {"w": torch.zeros(4, 4)}
    dcp.load(sd, storage_reader=reader)
    assert torch.equal(sd["w"], wa)
    dcp.load(sd, storage_reader=reader, checkpoint_id=b)
    assert torch.equal(sd["w"], wb)
    dcp.load(sd, storage_reader=reader, checkpoint_id=a)
    assert torch.equal(sd["w"], wa)


# ------------------------------------------------------------ 3. no_dist and sub-groups
def test_latest_step_without_collectives_and_on_sub_group(tmp_path):
    url = str(tmp_path / "repo")
    with ckptstore.open(url) as repo:
        repo.save({"w": torch.zeros(8, 5)}, step=1)
        repo.save({"w": torch.arange(40, dtype=torch.float32).reshape(8, 5)}, step=2)
    spawn(W.no_dist_and_subgroup_worker, args=(3, free_port(), url, str(tmp_path)), nprocs=3)
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == ["ok-0", "ok-1", "ok-2"]


def test_ranks_that_resolve_different_latest_steps_fail_the_load(tmp_path):
    url = str(tmp_path / "repo")
    with ckptstore.open(url) as repo:
        repo.save({"w": torch.zeros(3)}, step=1)
    reader = CkptStoreReader(url)
    reader.read_metadata()
    reader.set_up_storage_reader(None, True, rank=0)
    from torch.distributed.checkpoint.planner import LoadPlan

    p0 = reader.prepare_local_plan(LoadPlan([]))
    with ckptstore.open(url) as repo:
        repo.save({"w": torch.ones(3)}, step=2)
    other = CkptStoreReader(url)
    other.read_metadata()
    other.set_up_storage_reader(None, False, rank=1)
    p1 = other.prepare_local_plan(LoadPlan([]))
    with pytest.raises(ckptstore.errors.CkptStoreError, match=r"step 1 on rank\(s\) \[0\]; step 2 on rank\(s\) \[1\]"):
        reader.prepare_global_plan([p0, p1])
    # the same step everywhere: the plans go through (with the reader's own data for read_data)
    assert [p.items for p in reader.prepare_global_plan([p0, p0])] == [p0.items, p0.items]


# ------------------------------------------------------------ 4. one checkpoint id per step
def test_split_checkpoint_id():
    assert split_checkpoint_id("s3://b/run/step-1000") == ("s3://b/run", 1000)
    assert split_checkpoint_id("s3://b/run/step-7/") == ("s3://b/run", 7)
    assert split_checkpoint_id("/ckpt/run/step-0") == ("/ckpt/run", 0)
    assert split_checkpoint_id("file:///ckpt/step-3") == ("file:///ckpt", 3)
    for plain in ("s3://b/run", "s3://step-5", "step-5", "/ckpt/step-x", "/ckpt/step-1e3", "memory://x"):
        assert split_checkpoint_id(plain) == (plain, None)


def test_one_writer_saves_one_step_per_checkpoint_id_with_dedup(tmp_path):
    url = str(tmp_path / "run")
    torch.manual_seed(0)
    frozen, head = torch.randn(256, 256), torch.randn(16, 256)
    writer = CkptStoreWriter(url, **SMALL)
    heads = {}
    for n in (100, 200, 300):
        head.add_(1.0)
        heads[n] = head.clone()
        dcp.save({"frozen": frozen, "head": head}, storage_writer=writer, checkpoint_id=f"{url}/step-{n}")
    with ckptstore.open(url) as repo:
        assert repo.steps() == [100, 200, 300]
        for n in (200, 300):
            m = repo.manifest(n)
            assert m.base_step == n - 100
            assert m.stats["reused_bytes"] >= frozen.numel() * 4
            assert m.stats["new_bytes"] == head.numel() * 4
    # a reader names the step the same way
    sd = {"frozen": torch.zeros(256, 256), "head": torch.zeros(16, 256)}
    dcp.load(sd, storage_reader=CkptStoreReader(url), checkpoint_id=f"{url}/step-200")
    assert torch.equal(sd["head"], heads[200]) and torch.equal(sd["frozen"], frozen)
    # saving a committed step again is refused, saying what to do, and changes nothing
    with pytest.raises(CheckpointException, match=r"step 200 already exists.*save a new step"):
        dcp.save({"frozen": frozen, "head": head * 0}, storage_writer=writer, checkpoint_id=f"{url}/step-200")
    with ckptstore.open(url) as repo:
        assert repo.steps() == [100, 200, 300]
        assert torch.equal(repo.load(200)["head"], heads[200])


def test_writer_without_a_step_says_how_to_name_one(tmp_path):
    url = str(tmp_path / "run")
    with pytest.raises(CheckpointException, match=r"no step to save.*step-N"):
        dcp.save({"w": torch.zeros(2)}, storage_writer=CkptStoreWriter(url))
    with pytest.raises(ValueError, match="names step 5 but step=6"):
        CkptStoreWriter(f"{url}/step-5", step=6)
    with ckptstore.open(url) as repo:
        assert repo.steps() == []


# ------------------------------------------------------------ 5. Hugging Face-loadable export
def test_exported_safetensors_has_pt_format_and_loads_in_hf_loaders(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    url = str(tmp_path / "repo")
    with ckptstore.open(url) as repo:
        repo.save(model.state_dict(), step=1)
        repo.export(1, tmp_path / "model.safetensors")
    path = str(tmp_path / "model.safetensors")
    with safe_open(path, framework="pt") as f:
        assert f.metadata()["format"] == "pt"
    loaded = load_file(path)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded[k], v)
    try:
        from accelerate.utils import load_checkpoint_in_model
    except ImportError:
        load_checkpoint_in_model = None
    if load_checkpoint_in_model is not None:
        fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        load_checkpoint_in_model(fresh, path)
        for k, v in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[k], v)
    try:
        from transformers.modeling_utils import load_state_dict as hf_load_state_dict
    except ImportError:
        hf_load_state_dict = None
    if hf_load_state_dict is not None:
        got = hf_load_state_dict(path)
        for k, v in model.state_dict().items():
            assert torch.equal(got[k], v)


# ------------------------------------------------------------ 6. optimizer state
def _trained(seed=0, steps=3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 12)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _doc_block(name: str) -> str:
    return recipe("docs/dcp.md", name)


def test_documented_optimizer_recipe_restores_every_adam_moment(tmp_path):
    model, opt = _trained()
    fresh, fresh_opt = _trained(seed=1, steps=1)  # other values, same structure
    ns = {"url": str(tmp_path / "run"), "step": 7, "model": model, "optimizer": opt,
          "new_model": fresh, "new_optimizer": fresh_opt}
    exec(compile(_doc_block("optimizer"), "docs/dcp.md", "exec"), ns)

    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert want["state"].keys() == got["state"].keys() and len(want["state"]) == 4
    for pid, moments in want["state"].items():
        assert set(moments) == {"step", "exp_avg", "exp_avg_sq"}
        for name, t in moments.items():
            assert bits_equal(got["state"][pid][name], t), (pid, name)
    assert got["param_groups"][0]["lr"] == want["param_groups"][0]["lr"]
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert bits_equal(a.detach(), b.detach())
    with ckptstore.open(ns["url"]) as repo:
        assert repo.steps() == [7]


def test_raw_optimizer_state_dict_behaves_like_filesystem_writer(tmp_path):
    # The pitfall docs/dcp.md warns about: DCP keys are strings, so the
    # integer parameter ids of a raw optimizer.state_dict() come back as
    # "0", "1", ... with both writers alike; the recipe above avoids it.
    _, opt = _trained()
    raw = opt.state_dict()
    url, fs_dir = str(tmp_path / "repo"), str(tmp_path / "fs")
    dcp.save({"optim": raw}, storage_writer=CkptStoreWriter(url, step=1))
    dcp.save({"optim": raw}, storage_writer=FileSystemWriter(fs_dir))
    ours = {"optim": _trained(seed=1, steps=1)[1].state_dict()}
    theirs = {"optim": _trained(seed=1, steps=1)[1].state_dict()}
    dcp.load(ours, storage_reader=CkptStoreReader(url, step=1))
    dcp.load(theirs, storage_reader=FileSystemReader(fs_dir))
    for pid in raw["state"]:
        for name in raw["state"][pid]:
            assert bits_equal(ours["optim"]["state"][pid][name], theirs["optim"]["state"][pid][name])


# ------------------------------------------------------------ bytes items are never unpickled unrestricted
class _Opaque:  # a class torch's weights_only unpickler does not allow
    def __init__(self):
        self.x = 1


def test_bytes_item_with_an_arbitrary_object_is_refused(tmp_path):
    url = str(tmp_path / "repo")
    dcp.save({"w": torch.ones(2), "obj": _Opaque()}, storage_writer=CkptStoreWriter(url, step=1))
    sd = {"w": torch.zeros(2), "obj": None}
    with pytest.raises(CheckpointException, match=r"bytes item 'obj' holds tests.test_dcp_compat._Opaque, which is not on ckptstore's allowlist"):
        dcp.load(sd, storage_reader=CkptStoreReader(url, step=1))
    # plain values (and tensors) still load
    dcp.save({"w": torch.ones(2), "cfg": {"lr": 0.1, "names": ["a", "b"]}}, storage_writer=CkptStoreWriter(url, step=2))
    sd = {"w": torch.zeros(2), "cfg": {"lr": 0.0, "names": []}}
    dcp.load(sd, storage_reader=CkptStoreReader(url, step=2))
    assert sd["cfg"] == {"lr": 0.1, "names": ["a", "b"]} and torch.equal(sd["w"], torch.ones(2))


def test_the_exchange_options_come_as_one_object_or_as_keywords_not_both(tmp_path):
    from ckptstore.dcp import ExchangeOptions

    url = str(tmp_path / "r")
    r = CkptStoreReader(url, exchange=ExchangeOptions(timeout=5.0, round_bytes=1 << 20))
    assert (r.exchange_timeout, r.exchange_round_bytes, r.exchange_replicated) == (5.0, 1 << 20, True)
    r = CkptStoreReader(url, exchange_replicated=False, exchange_piece_bytes=4096)  # the keywords still work
    assert r.exchange == ExchangeOptions(replicated=False, piece_bytes=4096)
    with pytest.raises(ValueError, match="not both"):
        CkptStoreReader(url, exchange=ExchangeOptions(), exchange_timeout=3.0)
    with pytest.raises(ValueError, match="timeout must be a positive"):
        CkptStoreReader(url, exchange=ExchangeOptions(timeout=0))
    with pytest.raises(ValueError, match="round_bytes must be a positive integer"):
        CkptStoreReader(url, exchange_round_bytes=0)
