"""DeepSpeed integration: ZeRO-2/3 on 2 CPU gloo ranks through a ckptstore repository.

Ranks are processes spawned with torch.multiprocessing (bodies in
tests/ds_workers.py), DeepSpeed's CPU accelerator, gloo on 127.0.0.1. The
shared-memory comm op DeepSpeed would compile with g++ is switched off in
the workers (``deepspeed.ops.__compatible_ops__``), so no test builds an op.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch.multiprocessing as mp  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore.errors import FormatError  # noqa: E402

from . import ds_workers as W  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world, *args):
    mp.spawn(fn, args=(world, _port(), *args), nprocs=world, join=True)


def _assert_only_bookkeeping(save_dir):
    """save_dir holds DeepSpeed's latest/recovery scripts and ckptstore's small JSON stubs, no tensor bytes."""
    for root, _, files in os.walk(save_dir):
        for f in files:
            path = os.path.join(root, f)
            if root == save_dir:
                assert f in ("latest", "zero_to_fp32.py", "zero_to_torch.py"), path
                continue
            with open(path, "rb") as fh:
                raw = fh.read()
            assert len(raw) < 1024, path
            doc = json.loads(raw)
            assert doc["format"] == "ckptstore.deepspeed.stub" and doc["file"] == f, doc


# ------------------------------------------------------------------ import and format
def test_import_without_deepspeed_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "ckptstore.integrations.deepspeed", raising=False)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'ckptstore\[integrations\]'"):
        importlib.import_module("ckptstore.integrations.deepspeed")


def test_importing_ckptstore_imports_no_framework():
    code = (
        "import sys, ckptstore, ckptstore.integrations, ckptstore.dcp, ckptstore.transfer, ckptstore.cli.main\n"
        "bad = [m for m in ('deepspeed', 'megatron', 'transformers', 'lightning') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_structure_round_trip_allow_list_and_refusals():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from ckptstore import zero as F
    from ckptstore.integrations import deepspeed as cds

    scaler = DynamicLossScaler(init_scale=2.0**16, scale_window=100, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False, dtype=torch.bfloat16)
    state = {
        "loss_scaler": scaler,
        "zero_stage": ZeroStageEnum.gradients,
        "param_slice_mappings": [OrderedDict([("w", fragment_address(numel=6, start=0))])],
        "shapes": [OrderedDict([("w", torch.Size([2, 3]))])],
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.arange(6.0)}},
        "betas": (0.9, 0.999),
        "nan": float("nan"),
        "view": torch.arange(10.0)[2:5],
    }
    tensors, structure = F.encode_file("f.pt", state, cds.CODECS)
    assert set(tensors) == {"f.pt/state/0/step", "f.pt/state/0/exp_avg", "f.pt/view"}
    root = F.parse_structure(structure.numpy().tobytes(), "f.pt")
    back = F.decode(root, tensors.__getitem__, cds._BY_NAME, "f.pt")
    assert type(back["loss_scaler"]) is DynamicLossScaler and vars(back["loss_scaler"]) == vars(scaler)
    assert back["zero_stage"] is ZeroStageEnum.gradients
    assert back["param_slice_mappings"][0]["w"] == fragment_address(numel=6, start=0)
    assert type(back["shapes"][0]) is OrderedDict and back["shapes"][0]["w"] == torch.Size([2, 3])
    assert back["betas"] == (0.9, 0.999) and back["nan"] != back["nan"]
    assert torch.equal(back["view"], torch.tensor([2.0, 3.0, 4.0]))

    with pytest.raises(TypeError, match=r"f\.pt: extra/0 is a builtins\.object"):
        F.encode_file("f.pt", {"extra": [object()]}, cds.CODECS)
    evil = {"format": F.STRUCTURE_FORMAT, "version": 1, "file": "f.pt",
            "root": {"d": [["x", {"obj": "builtins.eval", "state": {"v": "1"}}]]}}
    with pytest.raises(FormatError, match="not on ckptstore's allow-list"):
        F.decode(F.parse_structure(json.dumps(evil).encode(), "f.pt"), tensors.__getitem__, cds._BY_NAME, "f.pt")
    with pytest.raises(FormatError, match="names file"):
        F.parse_structure(json.dumps(dict(evil, file="g.pt")).encode(), "f.pt")


def test_plain_deepspeed_files_need_the_allow_list(tmp_path):
    """DeepSpeed's own optimizer files hold classes torch's weights_only loader refuses unless allow-listed."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from ckptstore.integrations import deepspeed as cds

    path = tmp_path / "optim_states.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": LossScaler(4.0), "zero_stage": ZeroStageEnum.weights}}, path)
    with pytest.raises(Exception, match="weights_only"):
        torch.load(path, weights_only=True)
    sd = cds._legacy_load(str(path), "cpu")
    assert sd["optimizer_state_dict"]["loss_scaler"].cur_scale == 4.0
    assert sd["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.weights


# ------------------------------------------------------------------ multi-rank
def test_zero2_resume_bit_exact_frozen_layers_upload_nothing(tmp_path):
    url = f"file://{tmp_path}/repo"
    _spawn(W.save_load_worker, 2, 2, url, None, str(tmp_path))
    _assert_only_bookkeeping(str(tmp_path / "ds"))
    repo = ckptstore.open(url)
    assert repo.steps() == [2, 3]
    m2, m3 = repo.resolved_manifest(2), repo.resolved_manifest(3)
    assert m3.metadata["deepspeed"]["tag"] == "global_step3" and m3.metadata["deepspeed"]["zero_stage"] == 2
    # Frozen layer 0 appears twice per step (module weights, frozen fragments); at step 3 its chunks
    # are the same chunks step 2 stored: nothing of it was uploaded again.
    frozen = [k for k in m3.tensors if "/module/0." in k or "/frozen_param_fragments/0." in k]
    assert len(frozen) == 4
    step2_chunks = {c.hash for e in m2.tensors.values() for s in e.shards for c in s.chunks}
    frozen_bytes = 0
    for k in frozen:
        for s in m3.tensors[k].shards:
            assert all(c.hash in step2_chunks for c in s.chunks), k
        frozen_bytes += m3.tensors[k].nbytes
    st = m3.stats
    assert st["reused_bytes"] >= frozen_bytes
    assert st["new_bytes"] == st["logical_bytes"] - st["reused_bytes"]
    assert st["new_bytes"] <= st["logical_bytes"] - frozen_bytes
    repo.close()

    # the consolidated weights of the ZeRO-2 step: full fp32 masters of the trainable parameters
    from ckptstore.integrations.deepspeed import consolidated_state_dict

    want = torch.load(tmp_path / "expect_2.pt", weights_only=True)["want"]
    sd = consolidated_state_dict(url, 2)
    assert list(sd) == [n for n, _ in W.model().named_parameters() if n.startswith("0.")] + [
        n for n, _ in W.model().named_parameters() if not n.startswith("0.")]
    for name, p in W.model().named_parameters():
        assert torch.equal(sd[name], want[f"{name}.fp32"] if p.requires_grad else want[f"{name}.param"]), name


def test_zero3_bf16_resume_reshard_to_one_rank_and_export(tmp_path):
    from safetensors.torch import load_file

    from ckptstore.cli.main import main as cli

    url = f"file://{tmp_path}/repo"
    _spawn(W.save_load_worker, 2, 3, url, None, str(tmp_path), True)
    _assert_only_bookkeeping(str(tmp_path / "ds"))
    _spawn(W.reshard_worker, 1, url, None, str(tmp_path), True)

    out = tmp_path / "model.safetensors"
    assert cli(["export", url, "2", str(out)]) == 0
    sd = load_file(str(out))
    want = torch.load(tmp_path / "expect_3.pt", weights_only=True)["want"]
    model = W.model(seed=11)
    model.load_state_dict(sd, strict=True)  # every name and shape of the model
    for name, p in W.model().named_parameters():
        if p.requires_grad:  # trainable: the full fp32 master weights, not the bf16 copies
            assert sd[name].dtype == torch.float32 and torch.equal(sd[name], want[f"{name}.fp32"]), name
        else:
            assert torch.equal(sd[name], want[f"{name}.param"]), name


def test_zero2_on_s3(s3, tmp_path):
    _spawn(W.save_load_worker, 2, 2, s3.url, s3.storage_options, str(tmp_path))
    repo = ckptstore.open(s3.url, storage_options=s3.storage_options)
    assert repo.steps() == [2, 3]
    assert not repo.verify(read_data=True).problems
    repo.close()


def test_plain_directory_loads_failures_commit_nothing(tmp_path):
    url = f"file://{tmp_path}/repo"
    _spawn(W.failure_worker, 2, url, None, str(tmp_path))
    repo = ckptstore.open(url)
    assert repo.steps() == [1]
    repo.close()


def test_export_of_zero3_step_loads_as_hugging_face_model(tmp_path):
    """`ckptstore export` of a ZeRO-3 step is a model.safetensors that from_pretrained takes (tied weights too).

    transformers comes with the integrations extra's Hugging Face part.
    """
    pytest.importorskip("transformers")
    from transformers import GPT2LMHeadModel

    from ckptstore.cli.main import main as cli

    url = f"file://{tmp_path}/repo"
    _spawn(W.hf_worker, 2, url, str(tmp_path))
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    W.hf_config().save_pretrained(hf_dir)
    assert cli(["export", url, "2", str(hf_dir / "model.safetensors")]) == 0
    model = GPT2LMHeadModel.from_pretrained(hf_dir)
    want = torch.load(tmp_path / "hf_full.pt", weights_only=True)
    got = model.state_dict()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    assert got["lm_head.weight"].data_ptr() == got["transformer.wte.weight"].data_ptr()
