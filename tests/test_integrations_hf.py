"""Hugging Face integration: lazy state dicts for from_pretrained, the Trainer
callback and its resume, and accelerate's sharded FSDP saves routed to ckptstore.

Models are built from tiny configs (no hub). Distributed parts run 2 gloo
ranks spawned on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ckptstore
from ckptstore.integrations import hf
from ckptstore.storage import open_store
from ckptstore.storage.wrappers import CountingStore
from ckptstore.testing import free_port

from . import hf_lightning_workers as W
from .helpers import spawn

from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM, Trainer, TrainingArguments

pytestmark = pytest.mark.slow  # Hugging Face Trainer fits, spawned ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _results(out, world=2):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _llama(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(W.tiny_llama_config())


def _pack_bytes(store: CountingStore) -> int:
    return sum(e - s for key, s, e in store.reads if key.startswith("packs/"))


def test_lazy_values_read_only_what_is_indexed(tmp_path):
    model = _llama()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 256, (2, 8))).logits.sum().backward()
    opt.step()
    store = CountingStore(open_store(str(tmp_path / "repo")))
    repo = ckptstore.Repository(store, chunk_size=4096)
    repo.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, step=5)
    ckpt = repo.checkpoint(5)
    model_stored = sum(ckpt.tensor_meta(k).stored_bytes for k in ckpt.keys() if k.startswith("model."))
    optim_stored = sum(ckpt.tensor_meta(k).stored_bytes for k in ckpt.keys() if k.startswith("optimizer."))
    assert optim_stored > model_stored  # two Adam moments per parameter

    store.reset()
    lazy = hf.lazy_state_dict(repo, 5, prefix="model.")
    assert sorted(lazy) == sorted(model.state_dict())
    assert _pack_bytes(store) == 0, "building the lazy dict must read no tensor bytes"
    q = lazy["model.layers.0.self_attn.q_proj.weight"]
    assert q.get_shape() == [64, 64] and q.shape == torch.Size([64, 64])
    assert q.get_dtype() == "F32" and q.dtype == torch.float32 and q.is_floating_point()

    # A tensor-parallel style slice reads only the chunks covering it: 16 of 64 rows.
    store.reset()
    rows = q[16:32]
    assert torch.equal(rows, model.state_dict()["model.layers.0.self_attn.q_proj.weight"][16:32])
    whole = ckpt.tensor_meta("model.model.layers.0.self_attn.q_proj.weight").stored_bytes
    assert 0 < _pack_bytes(store) < whole / 2

    # from_pretrained fills every parameter and never touches the optimizer's bytes.
    store.reset()
    loaded = LlamaForCausalLM.from_pretrained(None, config=W.tiny_llama_config(), state_dict=lazy)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert _pack_bytes(store) <= model_stored
    assert _pack_bytes(store) < optim_stored

    # With a device map placing layers on the CPU and on disk (accelerate's offload).
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"}
    placed = LlamaForCausalLM.from_pretrained(
        None, config=W.tiny_llama_config(), state_dict=lazy, device_map=device_map,
        offload_folder=str(tmp_path / "offload"),
    )
    assert placed.hf_device_map == device_map
    x = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        assert torch.equal(placed(x).logits, model(x).logits)
    # Cast on load to the dtype asked for.
    bf16 = LlamaForCausalLM.from_pretrained(None, config=W.tiny_llama_config(), state_dict=lazy, dtype=torch.bfloat16)
    w = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(bf16.state_dict()[w], model.state_dict()[w].to(torch.bfloat16))


def test_lazy_state_dict_errors_name_what_failed(tmp_path):
    url = str(tmp_path / "repo")
    with pytest.raises(LookupError, match="no committed step"):
        hf.lazy_state_dict(url)
    with ckptstore.open(url) as repo:
        repo.save({"w": torch.ones(2)}, step=1)
    with pytest.raises(KeyError, match="'model.'"):
        hf.lazy_state_dict(url, 1, prefix="model.")
    with hf.lazy_state_dict(url) as lazy:
        assert lazy.step == 1 and torch.equal(lazy["w"][...], torch.ones(2))
        with pytest.raises(IndexError):
            lazy["w"][5]


def test_lazy_tensors_of_a_url_materialize_as_another_dtype(tmp_path):
    # lazy_state_dict(url) opens a fresh handle, which has read no chunk table
    # yet; a cast (or a device) goes through staging, which used to size its
    # buffers from those tables and failed with a TypeError.
    url = str(tmp_path / "repo")
    w = torch.randn(300, 40, generator=torch.Generator().manual_seed(4))
    with ckptstore.open(url) as repo:
        repo.save({"w": w}, step=1)
    with hf.lazy_state_dict(url) as lazy:
        got = lazy["w"].materialize(dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, w.bfloat16())


def test_tensor_parallel_from_pretrained_reads_local_slices(tmp_path):
    url = str(tmp_path / "repo")
    with ckptstore.open(url, chunk_size=4096) as repo:
        repo.save(_llama().state_dict(), step=1)
    out = tmp_path / "out"
    out.mkdir()
    spawn(W.hf_tensor_parallel, args=(2, free_port(), url, 1, str(out)), nprocs=2)
    for rank, r in enumerate(_results(out)):
        assert r["mismatched"] == [], f"rank {rank}"
        assert "model.layers.0.self_attn.q_proj.weight" in r["sharded"]
        # Sharded projections are read in halves; embeddings, norms and lm_head whole.
        assert r["read"] < 0.9 * r["stored"], f"rank {rank} read {r['read']} of {r['stored']} stored bytes"


# ---------------------------------------------------------------- Trainer
class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=24, seq=16, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 128, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2)  # dropout 0.1: RNG matters
    model = GPT2LMHeadModel(cfg)
    frozen = 0
    for name, p in model.named_parameters():
        if name.startswith(("transformer.wpe", "transformer.h.0.")):
            p.requires_grad_(False)
            frozen += p.numel() * p.element_size()
    return model, frozen


def _args(out, **kw):
    base = dict(
        output_dir=str(out), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3,
        save_strategy="steps", save_steps=3, report_to=[], use_cpu=True, seed=7,
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


def test_trainer_callback_resume_equals_uninterrupted_run(tmp_path):
    url = str(tmp_path / "repo")
    model, frozen = _gpt2()
    cb = hf.CkptStoreCallback(url, chunk_size=4096)
    Trainer(model=model, args=_args(tmp_path / "a"), train_dataset=_Tokens(), callbacks=[cb]).train()
    cb.close()
    final = {k: v.clone() for k, v in model.state_dict().items()}
    with ckptstore.open(url) as repo:
        assert repo.steps() == [3, 6]
        ckpt = repo.checkpoint(6)
        assert ckpt.metadata["hf_trainer"]["global_step"] == 6
        assert {k.split(".")[0] for k in ckpt.keys()} == {"model", "optimizer", "rng"}
        assert ckpt.values()["trainer_state"]["global_step"] == 6
    # Frozen layers (and the unchanged RNG-free parts) upload nothing at the second save.
    assert cb.last_info.step == 6 and cb.last_info.reused_bytes >= frozen

    # Resume from step 3 with Trainer's own local files gone: only the repository has the state.
    import shutil

    shutil.rmtree(tmp_path / "a")
    resume = hf.restore_checkpoint_dir(url, tmp_path / "restore", step=3)
    assert sorted(os.listdir(resume)) == sorted(
        ["model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"]
    )
    fresh, _ = _gpt2()
    trainer = Trainer(model=fresh, args=_args(tmp_path / "b", save_strategy="no"), train_dataset=_Tokens())
    trainer.train(resume_from_checkpoint=resume)
    assert trainer.state.global_step == 6
    for k, v in final.items():
        assert torch.equal(fresh.state_dict()[k], v), f"{k} differs from the uninterrupted run"

    with pytest.raises(FileExistsError):
        hf.restore_checkpoint_dir(url, tmp_path / "restore", step=3)


def test_trainer_callback_background_saves_to_s3_and_prunes_local_folders(tmp_path, s3):
    model, _ = _gpt2()
    cb = hf.CkptStoreCallback(s3.url, storage_options=s3.storage_options, blocking=False, prune_local=True)
    Trainer(model=model, args=_args(tmp_path / "a", max_steps=4, save_steps=2), train_dataset=_Tokens(), callbacks=[cb]).train()
    assert cb.last_info.step == 4
    cb.close()
    assert not [d for d in os.listdir(tmp_path / "a") if d.startswith("checkpoint-")]
    with ckptstore.open(s3.url, storage_options=s3.storage_options) as repo:
        assert repo.steps() == [2, 4]
    lazy = hf.lazy_state_dict(s3.url, storage_options=s3.storage_options)  # step 4, prefix "model."
    with lazy:
        loaded = GPT2LMHeadModel.from_pretrained(None, config=model.config, state_dict=lazy)
        for k, v in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v), k


def test_callback_refuses_sharded_runs_and_best_model_pruning(tmp_path):
    cb = hf.CkptStoreCallback(str(tmp_path / "repo"), prune_local=True)
    args = _args(tmp_path / "a", eval_strategy="steps", load_best_model_at_end=True)
    with pytest.raises(ValueError, match="load_best_model_at_end"):
        cb.on_train_begin(args, None, None)

    class Args:
        fsdp = "full_shard"
        deepspeed = None

    with pytest.raises(RuntimeError, match="route_fsdp_checkpoints"):
        hf.CkptStoreCallback(str(tmp_path / "repo")).on_train_begin(Args(), None, None)


# ---------------------------------------------------------------- FSDP
def test_fsdp_target_mapping(tmp_path):
    out = tmp_path / "out"
    assert hf.fsdp_target(out / "checkpoint-12" / "pytorch_model_fsdp_0", out, "s3://b/run") == (
        "s3://b/run/pytorch_model_fsdp_0", 12)
    assert hf.fsdp_target(out / "run-3" / "checkpoint-5" / "optimizer_0", out, "s3://b/run/") == (
        "s3://b/run/optimizer_0", 5)
    assert hf.fsdp_target(out / "checkpoint-5" / "something_else", out, "u") is None
    assert hf.fsdp_target(tmp_path / "elsewhere" / "checkpoint-5" / "optimizer_0", out, "u") is None

    import torch.distributed.checkpoint as dcp

    real = dcp.FileSystemWriter
    with hf.route_fsdp_checkpoints(str(tmp_path / "repo"), out):
        assert isinstance(dcp.FileSystemWriter(str(tmp_path / "plain")), real)
    assert dcp.FileSystemWriter is real


def test_accelerate_sharded_fsdp_saves_go_to_the_repository(tmp_path):
    url = str(tmp_path / "repo")
    out = tmp_path / "res"
    out.mkdir()
    spawn(W.hf_fsdp_route, args=(2, free_port(), url, str(tmp_path), str(out)), nprocs=2)
    for r in _results(out):
        assert r["bad"] == []
        assert r["steps"] == {"pytorch_model_fsdp_0": [7], "optimizer_0": [7]}
        # accelerate's folders exist (Trainer's resume looks for them) but hold no shard files.
        assert r["dirs"] == ["optimizer_0", "pytorch_model_fsdp_0"] and r["local_files"] == []


def test_import_without_transformers_names_the_extra():
    code = "import sys; sys.modules['transformers'] = None; import ckptstore.integrations.hf"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode != 0
    assert "ImportError" in res.stderr and "pip install 'ckptstore[integrations]'" in res.stderr
    ok = subprocess.run([sys.executable, "-c", "import ckptstore.integrations, sys; "
                         "assert 'transformers' not in sys.modules and 'lightning' not in sys.modules"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
