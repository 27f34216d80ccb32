"""DeepSpeed pipeline parallelism (``PipelineModule`` + ``PipelineEngine``) through ``attach``, beside DeepSpeed's files.

Ranks are processes spawned with torch.multiprocessing (bodies in
tests/ds_pipe_workers.py), DeepSpeed's CPU accelerator, gloo on 127.0.0.1.
Every save also goes, in the same run, to a folder of DeepSpeed's own files,
and every load is done from both: ckptstore must give what DeepSpeed gives.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")


import ckptstore  # noqa: E402
from ckptstore.testing import free_port  # noqa: E402

from . import ds_pipe_workers as P
from .helpers import spawn

slow = pytest.mark.slow  # DeepSpeed pipelines on spawned gloo ranks


def _spawn(fn, world, *args):
    spawn(fn, args=(world, free_port(), *args), nprocs=world)


RUNS = {"zero0": (0, False), "zero1": (1, False), "zero1-bf16": (1, True)}


@pytest.fixture(scope="module", params=list(RUNS))
def pipe_run(request, tmp_path_factory):
    """2 stages x 2 data-parallel replicas (4 ranks) saved at step 3 and resumed from both storages."""
    zero_stage, bf16 = RUNS[request.param]
    tmp = tmp_path_factory.mktemp(f"pipe-{request.param}")
    url = f"file://{tmp}/repo"
    _spawn(P.resume_worker, 4, zero_stage, bf16, url, str(tmp))
    return zero_stage, url, tmp


@slow
def test_pipeline_resume_bit_exact_beside_deepspeed_files(pipe_run):
    zero_stage, url, tmp = pipe_run
    by_stage = [torch.load(tmp / f"pipe_expect_{s}.pt", weights_only=True)["saved"] for s in (0, 1)]
    e0 = torch.load(tmp / "pipe_expect_0.pt", weights_only=True)
    with ckptstore.open(url) as repo:
        (step,) = repo.steps()
        meta = repo.manifest(step).metadata["deepspeed"]
        assert step == 3 and meta["zero_stage"] == zero_stage and meta["dp_world_size"] == 2
        assert meta["pipeline"] == {"stages": 2, "parts": e0["parts"]}
        # One tensor per layer file (PipelineModule.save_state_dict), as DeepSpeed's folder holds them.
        files = {k for k in repo.manifest(step).tensors if "/" not in k}
        assert files == set(e0["names"])
        assert {"layer_00-model_states.pt", "layer_09-model_states.pt", "mp_rank_01_model_states.pt"} <= files
        # The export names each layer's tensors as a one-stage PipelineModule does, the tied layer under
        # both of its indices as each stage saved it (DeepSpeed ties its weight, not its bias).
        out = repo.export(step, tmp / "pipe.safetensors")
    from safetensors.torch import load_file

    got = load_file(out["path"])
    want = {k: v for sd in by_stage for k, v in sd.items() if not k.startswith("tied_modules.")}
    for i, sd in ((0, by_stage[0]), (9, by_stage[1])):
        want.update({f"{i}.{n}": sd[f"tied_modules.io.{n}"] for n in ("weight", "bias")})
    assert set(got) == set(want) and len(want) == 12
    for k, v in got.items():
        assert torch.equal(v, want[k]), k
    # The local folder holds only stubs where DeepSpeed wrote its files (resume dropped and rewrote it).
    from ckptstore.integrations import deepspeed_tools as T

    for f in e0["names"]:
        assert T.read_stub(str(tmp / "ck" / P.TAG / f))["step"] == 3, f


@slow
@pytest.mark.parametrize("pipe_run", ["zero0"], indirect=True)
def test_pipeline_stage_count_change_where_deepspeed_allows_it(pipe_run):
    # 2 stages -> 1 stage (one rank) -> 2 stages again, ckptstore beside DeepSpeed's own folder each time.
    _, url, tmp = pipe_run
    _spawn(P.merge_worker, 1, str(tmp))
    _spawn(P.split_worker, 2, str(tmp))
    with ckptstore.open(url) as repo:
        assert repo.steps() == [3, 4]
        assert repo.manifest(4).metadata["deepspeed"]["pipeline"] == {"stages": 1, "parts": [0, 10]}


@slow
@pytest.mark.parametrize("pipe_run", ["zero1"], indirect=True)
def test_zero_to_fp32_of_a_pipeline_folder_fails_as_deepspeeds_does(pipe_run):
    # DeepSpeed's zero_to_fp32 does not read pipeline checkpoints (it fails on the model-states file's
    # module, None); on a folder of stubs it fails too, naming the export that does.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from ckptstore.errors import UnsupportedLayoutError
    from ckptstore.integrations import deepspeed_tools as T

    T.install()
    _, url, tmp = pipe_run
    with pytest.raises(AttributeError):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp / "stock"), tag=P.TAG)
    with pytest.raises(UnsupportedLayoutError, match="ckptstore export"):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp / "ck"), tag=P.TAG)


@slow
@pytest.mark.parametrize("pipe_run", ["zero1"], indirect=True)
def test_pipeline_zero1_on_another_data_parallel_size_as_deepspeed(pipe_run):
    # DeepSpeed refuses ZeRO-1 optimizer states of 2 replicas on 1 (and so does ckptstore, saying that
    # reshard=True does not re-partition pipeline steps); weights-only loads give DeepSpeed's next step.
    _, _, tmp = pipe_run
    _spawn(P.dp_change_worker, 2, str(tmp))


# ------------------------------------------------------------------ pure: a pipeline step's layout (no DeepSpeed)
def _save_files(repo, step: int, files: dict) -> None:
    """Store ``files`` (name -> state dict) as ckptstore.integrations.deepspeed lays a step out."""
    from ckptstore.repo import zero

    flat = {}
    for name, sd in files.items():
        tensors, structure = zero.encode_file(name, sd, {})
        flat.update(tensors)
        flat[zero.structure_key(name)] = structure
    meta = {"format": 1, "tag": f"global_step{step}", "zero_stage": 0, "dp_world_size": 1, "world_size": 2}
    repo.save(flat, step=step, metadata={"deepspeed": meta})


def test_pipeline_step_layout_export_and_refusals(tmp_path, capsys):
    from ckptstore.repo import zero
    from ckptstore.cli.main import main
    from ckptstore.errors import FormatError, UnsupportedLayoutError

    g = torch.Generator().manual_seed(0)
    lin = {f"layer_{i:02d}-model_states.pt": {"weight": torch.randn(3, 3, generator=g), "bias": torch.randn(3, generator=g)}
           for i in (0, 2, 11)}
    counters = {"module": None, "global_steps": 3, "mp_world_size": 2}
    url = f"file://{tmp_path}/repo"
    with ckptstore.open(url) as repo:
        _save_files(repo, 1, {**lin, "mp_rank_00_model_states.pt": counters, "mp_rank_01_model_states.pt": counters})
        _save_files(repo, 2, {"layer_00-model_01-model_states.pt": lin["layer_00-model_states.pt"],
                              "mp_rank_00_model_states.pt": counters})
        _save_files(repo, 3, {"mp_rank_00_model_states.pt": counters})  # a module of None without layer files
        stored = zero.StoredStep(repo.checkpoint(1))
        assert stored.is_pipeline() and stored.model_parallel()
        assert stored.layer_files() == {0: "layer_00-model_states.pt", 2: "layer_02-model_states.pt",
                                        11: "layer_11-model_states.pt"}
        with pytest.raises(UnsupportedLayoutError, match="zero_to_fp32 does not read"):
            zero.consolidated(repo.checkpoint(1), pipeline=False)
        with pytest.raises(FormatError, match="holds no module state dict"):
            zero.consolidated(repo.checkpoint(3))  # never an empty export
    assert main(["export", url, "1", str(tmp_path / "w.safetensors")]) == 0
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "w.safetensors"))
    assert set(got) == {f"{i}.{n}" for i in (0, 2, 11) for n in ("weight", "bias")}
    for k, v in got.items():
        i, n = k.split(".")
        assert torch.equal(v, lin[f"layer_{int(i):02d}-model_states.pt"][n]), k
    # tensor-parallel slices of a layer: refused in one line, nothing written
    capsys.readouterr()
    assert main(["export", url, "2", str(tmp_path / "tp.safetensors")]) == 1
    err = capsys.readouterr().err
    assert "ckptstore: error: step 2: layer_00-model_01-model_states.pt is one tensor-parallel slice" in err
    assert "Traceback" not in err and not (tmp_path / "tp.safetensors").exists()
