"""Tensor-parallel serving loads: ``load_module(..., tp_plan=, tp_rank=, tp_size=)`` reads one rank's slices.

A tiny Llama-shaped model built from a transformers config (no hub), saved
in 4 KiB chunks; each rank's load is compared with slicing the full tensors,
and its pack bytes are counted through a :class:`CountingStore`.
"""

from __future__ import annotations

import pytest
import torch

import ckptstore
from ckptstore import TPPlanError
from ckptstore.storage import open_store
from ckptstore.storage.wrappers import CountingStore

transformers = pytest.importorskip("transformers")


CFG = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
           num_key_value_heads=8, tie_word_embeddings=False)
#: The split dimension of each tensor under Hugging Face's Llama plan (colwise: dim 0, rowwise: dim 1).
HF_DIMS = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "lm_head": 0, "embed_tokens": 0,
           "o_proj": 1, "down_proj": 1}
#: Every matrix split along dim 0, the norms replicated.
DIM0_PLAN = {"model.layers.*.self_attn.*": 0, "model.layers.*.mlp.*": 0, "model.embed_tokens": 0, "lm_head": 0}


def _config():
    return transformers.LlamaConfig(**CFG)


def _meta(dtype=torch.bfloat16):
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(_config()).to(dtype)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(path, reference state dict, tp_plan)`` of the model saved as step 1."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config()).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # norms' ones would compare equal by accident
    path = str(tmp_path_factory.mktemp("tp") / "repo")
    with ckptstore.Repository(open_store(path), chunk_size=4096) as repo:
        repo.save(model.state_dict(), step=1)
    return path, {k: v.clone() for k, v in model.state_dict().items()}, dict(model.tp_plan)


def _open(path):
    store = CountingStore(open_store(path))
    # no gap filling between the ranges of one tensor: bytes read are the bytes asked for
    return store, ckptstore.Repository(store, coalesce_gap=0)


def _expected_dim(name: str, plan_dims: dict) -> int | None:
    parts = name.split(".")
    for part, dim in plan_dims.items():
        if part in parts and not (dim == 1 and parts[-1] == "bias"):
            return dim
    return None


def _pack_bytes(store: CountingStore) -> int:
    return sum(e - s for key, s, e in store.reads if key.startswith("packs/"))


@pytest.mark.parametrize("tp_size", [2, 8])
def test_each_rank_gets_exactly_its_slice_of_every_tensor_under_the_hf_plan(saved, tp_size):
    path, ref, plan = saved
    store, repo = _open(path)
    with repo:
        for rank in sorted({0, 1, tp_size - 1}):
            model = _meta()
            ckptstore.load_module(model, repo, tp_plan=plan, tp_rank=rank, tp_size=tp_size)
            got = model.state_dict()
            assert got.keys() == ref.keys()
            for name, full in ref.items():
                dim = _expected_dim(name, HF_DIMS)
                want = full if dim is None else torch.chunk(full, tp_size, dim)[rank]
                assert got[name].shape == want.shape, name
                assert torch.equal(got[name].view(torch.int16), want.view(torch.int16)), name
                assert not got[name].is_meta


@pytest.mark.parametrize("tp_size", [2, 8])
def test_dim0_splits_read_at_most_1_1_over_tp_of_their_stored_bytes(saved, tp_size):
    path, ref, _ = saved
    store, repo = _open(path)
    with repo:
        ckpt = repo.checkpoint(1)
        split = [k for k in ref if _expected_dim(k, {"self_attn": 0, "mlp": 0, "embed_tokens": 0, "lm_head": 0}) == 0]
        replicated = [k for k in ref if k not in split]
        assert replicated and all(ref[k].dim() == 1 for k in replicated)  # the norms
        split_bytes = sum(ckpt.tensor_meta(k).stored_bytes for k in split)
        repl_bytes = sum(ckpt.tensor_meta(k).stored_bytes for k in replicated)
        for rank in (0, tp_size - 1):
            store.reset()
            model = _meta()
            ckptstore.load_module(model, repo, tp_plan=DIM0_PLAN, tp_rank=rank, tp_size=tp_size)
            read = _pack_bytes(store)
            assert read - repl_bytes <= 1.1 / tp_size * split_bytes, (rank, read, split_bytes)
            for name in split:
                assert torch.equal(model.state_dict()[name], torch.chunk(ref[name], tp_size, 0)[rank])


@pytest.mark.parametrize("tp_size", [2, 8])
def test_whole_model_under_the_hf_plan_reads_at_most_1_1_over_tp_of_the_stored_bytes(saved, tp_size):
    path, ref, plan = saved
    store, repo = _open(path)
    with repo:
        ckpt = repo.checkpoint(1)
        replicated = [k for k in ref if _expected_dim(k, HF_DIMS) is None]
        repl_bytes = sum(ckpt.tensor_meta(k).stored_bytes for k in replicated)
        split_bytes = sum(ckpt.tensor_meta(k).stored_bytes for k in ref) - repl_bytes
        for rank in (0, tp_size - 1):
            store.reset()
            ckptstore.load_module(_meta(), repo, tp_plan=plan, tp_rank=rank, tp_size=tp_size)
            assert _pack_bytes(store) - repl_bytes <= 1.1 / tp_size * split_bytes


def test_slices_cast_to_another_dtype_go_through_staging(saved):
    path, ref, plan = saved
    _, repo = _open(path)
    with repo:
        model = _meta(torch.float32)
        ckptstore.load_module(model, repo, tp_plan=plan, tp_rank=1, tp_size=2, staging_bytes=64 << 10)
        got = model.state_dict()
        for name, full in ref.items():
            dim = _expected_dim(name, HF_DIMS)
            want = (full if dim is None else torch.chunk(full, 2, dim)[1]).float()
            assert got[name].dtype == torch.float32 and torch.equal(got[name], want), name


def test_a_module_built_with_local_shapes_is_filled_in_place(saved):
    path, ref, _ = saved
    _, repo = _open(path)
    lin = torch.nn.Linear(256, 128, bias=False, dtype=torch.bfloat16)  # rank 1 of 2 of a [256, 256] weight
    holder = torch.nn.Module()
    holder.q_proj = lin
    before = lin.weight
    with repo:
        ckptstore.load_module(holder, repo, prefix="model.layers.0.self_attn.", strict=False,
                              tp_plan={"q_proj": "colwise"}, tp_rank=1, tp_size=2)
    assert holder.q_proj.weight is before
    assert torch.equal(before.detach(), ref["model.layers.0.self_attn.q_proj.weight"][128:])


@pytest.mark.parametrize("plan, kw, match", [
    ({"lm_head": 2}, {}, r"tp_plan\['lm_head'\] = 2: lm_head.weight has 2 dims, so there is no dim 2"),
    ({"lm_head": "diagonal"}, {}, r"'diagonal' is not a split.*colwise"),
    ({"model.layers.*.mlp.down_proj": "rowwise"}, {"tp_size": 3},
     r"down_proj.weight has size 512 along dim 1, which tp_size 3 does not divide"),
    ({"model.layers.*.attn.q": 0, "lm_head": 0}, {}, r"entries \['model.layers.\*.attn.q'\] match no parameter"),
    ({"lm_head": 0}, {"tp_rank": 2}, r"tp_rank must be an int in \[0, 2\), got 2"),
    (None, {"tp_rank": 1}, r"without a tp_plan"),
])
def test_bad_plans_are_refused_before_anything_is_read(saved, plan, kw, match):
    path, _, _ = saved
    store, repo = _open(path)
    model = _meta()
    args = {"tp_rank": 0, "tp_size": 2, **kw}
    with repo, pytest.raises(TPPlanError, match=match):
        ckptstore.load_module(model, repo, tp_plan=plan, **args)
    assert _pack_bytes(store) == 0
    assert all(p.is_meta for p in model.parameters())


def test_tied_names_split_differently_are_refused(saved):
    path, _, _ = saved
    _, repo = _open(path)
    model = _meta()
    model.lm_head.weight = model.model.embed_tokens.weight  # one tensor, two names
    with repo, pytest.raises(RuntimeError, match=r"split differently by tp_plan"):
        ckptstore.load_module(model, repo, tp_plan={"lm_head": 1, "model.embed_tokens": 0}, tp_rank=0, tp_size=2,
                              strict=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tp_slices_onto_cuda_through_pinned_staging(saved, monkeypatch):
    from ckptstore.pipeline import staging as staging_mod

    pins = []
    real = staging_mod.StagingBuffers.__init__

    def init(self, *a, **k):
        pins.append(k.get("pin"))
        real(self, *a, **k)

    monkeypatch.setattr(staging_mod.StagingBuffers, "__init__", init)
    path, ref, plan = saved
    _, repo = _open(path)
    with repo:
        model = _meta()
        ckptstore.load_module(model, repo, device_map="cuda:0", tp_plan=plan, tp_rank=1, tp_size=8)
    assert pins and all(pins)
    for name, full in ref.items():
        dim = _expected_dim(name, HF_DIMS)
        want = full if dim is None else torch.chunk(full, 8, dim)[1]
        t = model.state_dict()[name]
        assert t.device.type == "cuda" and torch.equal(t.cpu(), want), name


@pytest.mark.parametrize("tp_size", [2, 8])
def test_a_tile_plan_at_the_default_chunk_size_gives_small_matrices_the_tp_bound(tmp_path, tp_size):
    """Matrices far under a 4 MiB chunk keep one run by default, so every TP rank reads them whole;
    saved with ``tile_plan=`` the model's own plan, each is 8 blocks along its split dimension."""
    cfg = dict(CFG, hidden_size=512, intermediate_size=1024, vocab_size=2048)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    plan = dict(model.tp_plan)
    read = {}
    for tiled in (False, True):
        path = str(tmp_path / f"repo{tiled}")
        with ckptstore.Repository(open_store(path), tile_plan=plan if tiled else None) as repo:
            assert repo.options.chunk_size == 4 << 20
            repo.save(model.state_dict(), step=1)
        store, repo = _open(path)
        with repo:
            ckpt = repo.checkpoint(1)
            if tiled:
                assert ckpt.entry("model.layers.0.mlp.down_proj.weight").tile == (512, 128)
                assert ckpt.entry("model.layers.0.self_attn.q_proj.weight").tile == (64, 512)
            replicated = [k for k in ref if _expected_dim(k, HF_DIMS) is None]
            repl_bytes = sum(ckpt.tensor_meta(k).stored_bytes for k in replicated)
            split_bytes = sum(ckpt.tensor_meta(k).stored_bytes for k in ref) - repl_bytes
            rank = tp_size - 1
            store.reset()
            with torch.device("meta"):
                meta = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(torch.bfloat16)
            ckptstore.load_module(meta, repo, tp_plan=plan, tp_rank=rank, tp_size=tp_size)
            read[tiled] = (_pack_bytes(store) - repl_bytes) / split_bytes
            got = meta.state_dict()
            for name, full in ref.items():
                dim = _expected_dim(name, HF_DIMS)
                want = full if dim is None else torch.chunk(full, tp_size, dim)[rank]
                assert torch.equal(got[name].view(torch.int16), want.view(torch.int16)), name
            full_load = repo.load(1)
            assert all(torch.equal(full_load[k].view(torch.int16), ref[k].view(torch.int16)) for k in ref)
    assert read[True] <= 1.1 / tp_size, read
    assert read[False] > 0.5, read  # without the plan: the rowwise matrices read whole


def test_a_tile_plan_is_checked_when_the_handle_opens(tmp_path):
    with pytest.raises(TPPlanError, match="'bogus'"):
        ckptstore.Repository(open_store(str(tmp_path / "r")), tile_plan={"model.*": "bogus"})
    with pytest.raises(ValueError, match="tile_plan needs tiles=True"):
        ckptstore.Repository(open_store(str(tmp_path / "r")), tile_plan={"model.*": 0}, tiles=False)
