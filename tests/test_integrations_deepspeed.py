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
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import ckptstore  # noqa: E402
from ckptstore.errors import FormatError  # noqa: E402
from ckptstore.testing import free_port  # noqa: E402

from . import ds_workers as W
from .helpers import spawn

pytestmark = pytest.mark.slow  # DeepSpeed ZeRO on spawned gloo ranks


def _spawn(fn, world, *args):
    spawn(fn, args=(world, free_port(), *args), nprocs=world)


def _assert_only_bookkeeping(save_dir):
    """save_dir holds DeepSpeed's latest, recovery scripts (zero_to_fp32.py ckptstore's own) and stubs, no tensor bytes."""
    from ckptstore.integrations import deepspeed_tools as T

    for root, _, files in os.walk(save_dir):
        for f in files:
            path = os.path.join(root, f)
            if root == save_dir:
                assert f in ("latest", "zero_to_fp32.py", "zero_to_torch.py"), path
                if f == "zero_to_fp32.py":
                    with open(path) as fh:
                        assert fh.read() == T.SCRIPT, path
                continue
            assert os.path.getsize(path) < 2048, path
            doc = T.read_stub(path)
            assert doc["format"] == "ckptstore.deepspeed.stub" and doc["file"] == f and doc["version"] == 2, doc


# ------------------------------------------------------------------ import and format
def test_import_without_deepspeed_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "ckptstore.integrations.deepspeed", raising=False)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'ckptstore\[integrations\]'"):
        importlib.import_module("ckptstore.integrations.deepspeed")


def test_importing_ckptstore_imports_no_framework():
    code = (
        "import sys, ckptstore, ckptstore.integrations, ckptstore.dcp, ckptstore.repo.transfer, ckptstore.cli.main\n"
        "bad = [m for m in ('deepspeed', 'megatron', 'transformers', 'lightning') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_structure_round_trip_allow_list_and_refusals():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from ckptstore.repo import zero as F
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


# ------------------------------------------------------------------ every DeepSpeed load path reads the repository
def test_zero3_loads_without_optimizer_states_read_the_tag_being_loaded(tmp_path):
    """load_module_only / load_optimizer_states=False under ZeRO-3: DeepSpeed consolidates the weights itself
    (get_fp32_state_dict_from_zero_checkpoint on the folder); they come from the step of the tag being loaded,
    not from `latest`, also into a folder that never saw the checkpoint; a plain folder still goes to DeepSpeed."""
    _spawn(W.module_only_worker, 2, f"file://{tmp_path}/repo", str(tmp_path))


# ------------------------------------------------------------------ DeepSpeed's own tools on a save folder
@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def tools_run(request, tmp_path_factory):
    """One state saved twice by 2 ranks: by DeepSpeed itself (plain/) and through ckptstore (ds/), tag "t" (step 2)."""
    tmp = tmp_path_factory.mktemp(f"tools{request.param}")
    url = f"file://{tmp}/repo"
    _spawn(W.tools_worker, 2, request.param, url, str(tmp))
    with ckptstore.open(url) as repo:
        assert repo.steps() == [2]
        return tmp, repo.url


def _same_state(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def _same_folder(got_dir, want_dir) -> None:
    """Two output folders of zero_to_fp32: the same files, the same index, the same tensors."""
    names = sorted(os.listdir(got_dir))
    assert names == sorted(os.listdir(want_dir)) and names, (names, sorted(os.listdir(want_dir)))
    for f in names:
        if f.endswith(".json"):
            with open(os.path.join(got_dir, f)) as a, open(os.path.join(want_dir, f)) as b:
                assert json.load(a) == json.load(b), f
        else:
            _same_state(torch.load(os.path.join(got_dir, f), weights_only=True),
                        torch.load(os.path.join(want_dir, f), weights_only=True))


def test_zero_to_fp32_functions_read_a_folder_of_stubs(tools_run, tmp_path):
    """DeepSpeed's zero_to_fp32 functions on a folder of stubs give what they give on DeepSpeed's own files."""
    from deepspeed.utils import zero_to_fp32 as z

    import ckptstore.integrations.deepspeed  # noqa: F401  (the integration in use)

    tmp, _ = tools_run
    plain, ds = str(tmp / "plain"), str(tmp / "ds")
    want = z.get_fp32_state_dict_from_zero_checkpoint(plain, tag="t")
    got = z.get_fp32_state_dict_from_zero_checkpoint(ds, tag="t")
    _same_state(got, want)
    assert got["c.weight"] is got["b.weight"]  # tied: one tensor, as DeepSpeed returns it
    assert got["scale"].dtype == torch.float32 and got["seen"].dtype == torch.int64
    _same_state(z.get_fp32_state_dict_from_zero_checkpoint(ds, tag="t", exclude_frozen_parameters=True),
                z.get_fp32_state_dict_from_zero_checkpoint(plain, tag="t", exclude_frozen_parameters=True))
    lazy = z.get_fp32_state_dict_from_zero_checkpoint(ds, tag="t", lazy_mode=True)
    _same_state({k: v.contiguous() for k, v in lazy.items()}, want)

    z.convert_zero_checkpoint_to_fp32_state_dict(ds, str(tmp_path / "ours"), tag="t", max_shard_size="10KB")
    z.convert_zero_checkpoint_to_fp32_state_dict(plain, str(tmp_path / "theirs"), tag="t", max_shard_size="10KB")
    _same_folder(tmp_path / "ours", tmp_path / "theirs")
    model = z.load_state_dict_from_zero_checkpoint(W.TiedModel(), ds)  # tag from `latest`
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), want[name]), name


def test_zero_to_fp32_script_in_a_save_folder(tools_run, tmp_path):
    """`python zero_to_fp32.py CKPT_DIR OUT` where DeepSpeed leaves it: the same files as DeepSpeed's script on
    DeepSpeed's own files; a folder of DeepSpeed files through ckptstore's script is DeepSpeed's conversion;
    DeepSpeed's zero_to_torch.py, which imports its neighbour, reads the stubs too."""
    from deepspeed.utils import zero_to_fp32 as z

    tmp, _ = tools_run
    ours, theirs = tmp / "ds" / "zero_to_fp32.py", tmp / "plain" / "zero_to_fp32.py"
    with open(ours) as f:
        assert "ckptstore" in f.read()
    with open(theirs) as f:
        assert "ckptstore" not in f.read()  # DeepSpeed's own copy

    def run(script, *args):
        subprocess.run([sys.executable, str(script), *map(str, args)], check=True, timeout=600,
                       stdout=subprocess.DEVNULL, cwd=str(tmp_path))

    run(ours, tmp / "ds", tmp_path / "ours", "--max_shard_size", "10KB")
    run(theirs, tmp / "plain", tmp_path / "theirs", "--max_shard_size", "10KB")
    _same_folder(tmp_path / "ours", tmp_path / "theirs")
    assert len(os.listdir(tmp_path / "ours")) > 2  # sharded, with an index
    run(ours, tmp / "plain", tmp_path / "fallback", "--max_shard_size", "10KB")
    _same_folder(tmp_path / "fallback", tmp_path / "theirs")
    run(tmp / "ds" / "zero_to_torch.py", tmp / "ds", tmp_path / "bf16", "--dtype", "bf16", "-t", "t")
    z.convert_zero_checkpoint_to_state_dict(str(tmp / "plain"), str(tmp_path / "bf16_theirs"), dtype="bf16", tag="t")
    _same_folder(tmp_path / "bf16", tmp_path / "bf16_theirs")


def test_torch_load_of_a_stub_fails_with_one_line_naming_the_repository(tools_run):
    tmp, repo_url = tools_run
    folder = tmp / "ds" / "t"
    names = sorted(os.listdir(folder))
    assert any(n.endswith("_optim_states.pt") for n in names) and any(n.endswith("_model_states.pt") for n in names)
    for name in names:
        for weights_only in (True, False):
            with pytest.raises(RuntimeError) as e:
                torch.load(folder / name, weights_only=weights_only)
            msg = str(e.value)
            assert "\n" not in msg, msg
            assert f"step 2 of the ckptstore repository {repo_url}" in msg and name in msg, msg
            assert f"ckptstore export {repo_url} 2 model.safetensors" in msg, msg


def test_version_1_stubs_still_read(tools_run, tmp_path):
    """Stubs written before version 2 (the JSON record alone) are read by the engine and the tools."""
    import shutil

    from deepspeed.utils import zero_to_fp32 as z

    from ckptstore.integrations import deepspeed_tools as T

    tmp, repo_url = tools_run
    shutil.copytree(tmp / "ds", tmp_path / "v1")
    for name in os.listdir(tmp_path / "v1" / "t"):
        path = tmp_path / "v1" / "t" / name
        doc = dict(T.read_stub(str(path)), version=1)
        path.write_text(json.dumps(doc))
        assert T.read_stub(str(path)) == doc
    _same_state(z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "v1"), tag="t"),
                z.get_fp32_state_dict_from_zero_checkpoint(str(tmp / "plain"), tag="t"))
    (tmp_path / "bad.pt").write_text(json.dumps({"format": "ckptstore.deepspeed.stub", "version": 1, "step": "x"}))
    with pytest.raises(FormatError, match="malformed ckptstore stub"):
        T.read_stub(str(tmp_path / "bad.pt"))


def test_stub_bytes_are_two_pickles_then_the_record():
    """The stub's head is what pickle protocol 2 writes for torch's MAGIC_NUMBER, then a str (built by hand)."""
    import pickle

    from ckptstore.integrations import deepspeed_tools as T

    doc = T.stub_record("file:///r", 7, "global_step7", "mp_rank_00_model_states.pt")
    raw = T.standin_bytes(T.stub_message(doc), doc)
    head = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2)
    assert raw.startswith(head)
    assert raw[len(head):].startswith(b"\x80\x02X")
    assert json.loads(raw[raw.index(b".\n", len(head)) + 2:]) == doc


# ------------------------------------------------------------------ ZeRO-1/2 on another data-parallel size
@pytest.mark.parametrize(
    "stage, zero, other",
    [(2, {}, 3), (1, {"elastic_checkpoint": True}, 1)],
    ids=["zero2-rigid-2to3to2", "zero1-elastic-2to1to2"],
)
def test_zero12_repartition_bit_exact(tmp_path, stage, zero, other):
    """Saved on 2 ranks, loaded on `other` ranks: without reshard=True DeepSpeed's ZeRORuntimeException (with
    ckptstore's hint) for optimizer states, the weights alone load; with reshard=True every parameter's fp32 master
    and Adam moments are the saved ones. Saved there and loaded on 2 ranks again, each rank's partitions equal,
    bit for bit, those of the run that never changed size, and training on gives that run's next step exactly."""
    url = f"file://{tmp_path}/repo"
    _spawn(W.zero12_worker, 2, stage, url, str(tmp_path), "save", zero)
    _spawn(W.zero12_worker, other, stage, url, str(tmp_path), "other", zero)
    _spawn(W.zero12_worker, 2, stage, url, str(tmp_path), "back", zero)
    with ckptstore.open(url) as repo:
        assert repo.steps() == [2, 3]  # "r" preferred step 2 (global_steps), taken by "s"
        assert repo.names("deepspeed") == {"s": 2, "r": 3}


def test_zero12_repartition_layout_pure():
    """FlatGroup: padding per rank and parameter pieces as DeepSpeed's groups_padding and slice mappings."""
    from ckptstore.repo.zero import FlatGroup

    g = FlatGroup(names=("w", "b", "v"), offsets=(0, 6, 10), numels=(5, 3, 7), partition_size=6, world=3)
    assert g.data_end == 17
    assert [g.padding(r) for r in range(3)] == [0, 0, 1]
    assert g.fragments(0) == [("w", 0, 5, 0)]
    assert g.fragments(1) == [("b", 0, 3, 0), ("v", 4, 2, 0)]
    assert g.fragments(2) == [("v", 0, 5, 2)]
    tiny = FlatGroup(names=("w",), offsets=(0,), numels=(3,), partition_size=2, world=4)
    assert [tiny.padding(r) for r in range(4)] == [0, 1, 2, 2]
    with pytest.raises(ValueError, match="past 2 partitions"):
        FlatGroup(names=("w",), offsets=(0,), numels=(9,), partition_size=4, world=2)


# ------------------------------------------------------------------ a tag saved again
def test_tag_saved_again_loads_the_new_state(tmp_path):
    url = f"file://{tmp_path}/repo"
    _spawn(W.resave_worker, 2, url, str(tmp_path))
    with ckptstore.open(url) as repo:
        assert repo.steps() == [1, 2, 3]  # the older step stays, for retention and GC
        assert repo.names("deepspeed") == {}  # dropped by the worker


def test_tag_naming_a_deleted_step_fails_naming_both(tmp_path):
    from ckptstore.errors import StepNotFoundError
    from ckptstore.integrations.deepspeed import CkptStoreCheckpointEngine

    url = f"file://{tmp_path}/repo"
    with ckptstore.open(url) as repo:
        repo.save({"x": torch.ones(2)}, step=4, metadata={"deepspeed": {"tag": "best"}})
        repo.save({"x": torch.ones(2)}, step=5, metadata={"deepspeed": {"tag": "best"}})
        repo.set_name("deepspeed", "best", 4)
        ce = CkptStoreCheckpointEngine(url)
        assert ce.resolve_tag(str(tmp_path / "ckpt"), "best") == 4  # the name, not the newest step with the tag
        repo.delete(4)
        with pytest.raises(StepNotFoundError, match=r"tag 'best' names step 4, which is no longer in the repository"):
            ce.resolve_tag(str(tmp_path / "ckpt"), "best")
        ce.close()
