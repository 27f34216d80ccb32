"""Process bodies for the DeepSpeed pipeline tests (``PipelineModule`` + ``PipelineEngine``, gloo, CPU).

Every save goes to a ckptstore repository through ``attach`` and, in the
same run, to a plain folder through DeepSpeed's own ``TorchCheckpointEngine``
(the engine's ``checkpoint_engine`` swapped for that one save), so each
check compares ckptstore with DeepSpeed's own files: same file names,
same weights, same losses afterwards. Expected values travel between
processes as ``torch.save`` files in the test's tmp dir (test scaffolding
only; the store never holds a pickle).
"""

from __future__ import annotations

import os
import shutil

import torch

from .ds_workers import init, shutdown

D = 16
MICRO, GAS = 2, 2  # micro-batch size, micro-batches per step
TAG = "global_step3"


def pipe_module(stages: int, seed: int):
    """Ten layers: a tied first/last linear (as tied embeddings), four hidden linears with ReLUs between."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    torch.manual_seed(seed)
    layers = [TiedLayerSpec("io", torch.nn.Linear, D, D)]
    for _ in range(4):
        layers += [LayerSpec(torch.nn.Linear, D, D), torch.nn.functional.relu]
    layers.append(TiedLayerSpec("io", torch.nn.Linear, D, D))
    return PipelineModule(layers=layers, num_stages=stages, loss_fn=torch.nn.MSELoss(), partition_method="uniform")


def pipe_engine(deepspeed, stages: int, zero_stage: int, seed: int = 0, parallel_write: bool = False,
                bf16: bool = False):
    m = pipe_module(stages, seed)
    cfg = {
        "bf16": {"enabled": bf16},
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "zero_optimization": {"stage": zero_stage},
        "checkpoint": {"parallel_write": {"pipeline_stage": parallel_write}},
    }
    eng, *_ = deepspeed.initialize(model=m, model_parameters=[p for p in m.parameters()], config=cfg)
    return eng


def batches(eng, skip_steps: int = 0):
    """This data-parallel replica's micro-batches, from the first one of step ``skip_steps + 1``."""
    g = torch.Generator().manual_seed(100 + eng.grid.data_parallel_id)
    dt = torch.bfloat16 if eng.bfloat16_enabled() else torch.float32
    n = 0
    while True:
        x, y = torch.randn(MICRO, D, generator=g), torch.randn(MICRO, D, generator=g)
        if n >= skip_steps * GAS:
            yield x.to(dt), y.to(dt)
        n += 1


def train(eng, it, steps: int) -> list[float]:
    return [float(eng.train_batch(it)) for _ in range(steps)]


def weights(eng) -> dict:
    """This stage's layers by PipelineModule name (``<global layer index>.<name>``, ``tied_modules.io.*``)."""
    return {k: v.detach().clone() for k, v in eng.module.state_dict().items()}


def save_both(eng, stock_engine, tmp: str, tag: str) -> None:
    """Save ``tag`` through ckptstore (``tmp/ck``), then through DeepSpeed's own engine (``tmp/stock``)."""
    eng.save_checkpoint(os.path.join(tmp, "ck"), tag=tag)
    ours, eng.checkpoint_engine = eng.checkpoint_engine, stock_engine
    try:
        eng.save_checkpoint(os.path.join(tmp, "stock"), tag=tag)
    finally:
        eng.checkpoint_engine = ours


def same(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), f"{what}: {k} differs"


def _drop_local_folder(tmp: str) -> None:
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(os.path.join(tmp, "ck"))
    dist.barrier()


# ------------------------------------------------------------------ workers
def resume_worker(rank, world, port, zero_stage, bf16, url, tmp):
    """2 stages x 2 data-parallel replicas: save at step 3 (ckptstore and DeepSpeed's files), resume both."""
    import torch.distributed as dist

    from ckptstore.integrations import deepspeed as cds

    deepspeed = init(rank, world, port)
    eng = pipe_engine(deepspeed, 2, zero_stage, parallel_write=zero_stage == 1, bf16=bf16)
    stock = eng.checkpoint_engine
    cds.attach(eng, url, chunk_size=4096)
    it = batches(eng)
    train(eng, it, 3)
    saved = weights(eng)
    save_both(eng, stock, tmp, TAG)
    ck_names = sorted(os.listdir(os.path.join(tmp, "ck", TAG)))
    assert ck_names == sorted(os.listdir(os.path.join(tmp, "stock", TAG))), ck_names
    ref = train(eng, it, 2)
    final = weights(eng)
    parts = list(eng.module.parts)
    if eng.grid.data_parallel_id == 0:
        torch.save({"saved": saved, "final": final, "ref": ref, "parts": parts, "names": ck_names},
                   os.path.join(tmp, f"pipe_expect_{eng.grid.get_stage_id()}.pt"))

    _drop_local_folder(tmp)  # ckptstore's side resumes from the URL alone
    for side in ("ck", "stock"):
        fresh = pipe_engine(deepspeed, 2, zero_stage, seed=9, parallel_write=zero_stage == 1, bf16=bf16)
        if side == "ck":
            cds.attach(fresh, url)
        path, _ = fresh.load_checkpoint(os.path.join(tmp, side), tag=TAG)
        assert path is not None, side
        same(weights(fresh), saved, f"rank {rank} {side}: after load")
        assert fresh.global_steps == 3, (side, fresh.global_steps)
        got = train(fresh, batches(fresh, skip_steps=3), 2)
        assert got == ref, (side, got, ref)
        same(weights(fresh), final, f"rank {rank} {side}: two steps after load")
    dist.barrier()
    shutdown()


def merge_worker(rank, world, port, tmp):
    """One stage on one rank: the 2-stage step loads where DeepSpeed allows it; then a 1-stage step is saved."""
    from ckptstore.integrations import deepspeed as cds

    deepspeed = init(rank, world, port)
    url = f"file://{tmp}/repo"
    saved = {}
    for s in (0, 1):
        saved.update(torch.load(os.path.join(tmp, f"pipe_expect_{s}.pt"), weights_only=True)["saved"])

    # With optimizer states: DeepSpeed's own files fail in torch's Optimizer.load_state_dict (stage 0's
    # states, another parameter count); ckptstore refuses before loading anything, saying what loads.
    errors = {}
    for side in ("ck", "stock"):
        eng = pipe_engine(deepspeed, 1, 0, seed=9)
        if side == "ck":
            cds.attach(eng, url)
        before = weights(eng)
        try:
            eng.load_checkpoint(os.path.join(tmp, side), tag=TAG)
        except ValueError as e:
            errors[side] = str(e)
        if side == "ck":
            same(weights(eng), before, "refused load")  # nothing was loaded
    assert "doesn't match the size of optimizer's group" in errors["stock"], errors
    assert "was saved by a pipeline of 2 stage(s)" in errors["ck"] and "load_optimizer_states=False" in errors["ck"], errors

    # Without optimizer states: the layers (numbered in the whole model), the scheduler and counters.
    runs = {}
    for side in ("ck", "stock"):
        eng = pipe_engine(deepspeed, 1, 0, seed=9)
        stock = eng.checkpoint_engine
        if side == "ck":
            cds.attach(eng, url)
        eng.load_checkpoint(os.path.join(tmp, side), tag=TAG, load_optimizer_states=False)
        same(weights(eng), saved, f"{side}: 1 stage after load")
        assert eng.global_steps == 3, (side, eng.global_steps)
        sched = eng.lr_scheduler.state_dict()
        runs[side] = (train(eng, batches(eng, skip_steps=3), 1), weights(eng), sched)
        if side == "ck":
            save_both(eng, stock, tmp, "one_stage")
    assert runs["ck"][0] == runs["stock"][0] and runs["ck"][2] == runs["stock"][2], runs
    same(runs["ck"][1], runs["stock"][1], "1 stage, one step on")
    torch.save({"after": runs["ck"][1]}, os.path.join(tmp, "one_stage_expect.pt"))
    shutdown()


def split_worker(rank, world, port, tmp):
    """Two stages on two ranks load the 1-stage step (weights only; with optimizer states refused)."""
    import torch.distributed as dist

    from ckptstore.integrations import deepspeed as cds

    deepspeed = init(rank, world, port)
    url = f"file://{tmp}/repo"
    after = torch.load(os.path.join(tmp, "one_stage_expect.pt"), weights_only=True)["after"]
    eng = pipe_engine(deepspeed, 2, 0, seed=9)
    cds.attach(eng, url)
    try:
        eng.load_checkpoint(os.path.join(tmp, "ck"), tag="one_stage")
        raise AssertionError("optimizer states of 1 stage loaded into 2")
    except ValueError as e:
        assert "pipeline of 1 stage(s) with layer boundaries [0, 10]" in str(e), e
    got = {}
    for side in ("ck", "stock"):
        eng = pipe_engine(deepspeed, 2, 0, seed=9)
        if side == "ck":
            cds.attach(eng, url)
        eng.load_checkpoint(os.path.join(tmp, side), tag="one_stage", load_optimizer_states=False)
        got[side] = weights(eng)
        assert eng.global_steps == 4, (side, eng.global_steps)
    same(got["ck"], got["stock"], f"rank {rank}: 2 stages from the 1-stage step")
    same(got["ck"], {k: v for k, v in after.items() if k in got["ck"]}, f"rank {rank}: 2 stages")
    dist.barrier()
    shutdown()


def dp_change_worker(rank, world, port, tmp):
    """The ZeRO-1 step of 2 stages x 2 replicas on 2 stages x 1 replica: as DeepSpeed, with either reshard."""
    import torch.distributed as dist
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    from ckptstore.integrations import deepspeed as cds

    deepspeed = init(rank, world, port)
    url = f"file://{tmp}/repo"
    for side, reshard in (("stock", None), ("ck", None), ("ck", True)):
        eng = pipe_engine(deepspeed, 2, 1, seed=9)
        if side == "ck":
            cds.attach(eng, url, reshard=reshard)
        try:
            eng.load_checkpoint(os.path.join(tmp, side), tag=TAG)
            raise AssertionError(f"{side}: ZeRO-1 optimizer states of 2 replicas loaded into 1")
        except ZeRORuntimeException as e:
            assert "used a DP world size of 2 but the current world size is 1" in str(e), e
            if side == "ck":
                assert "pipeline or model-parallel files, which ckptstore does not re-partition" in str(e), e
    got = {}
    for side, reshard in (("stock", None), ("ck", True)):
        eng = pipe_engine(deepspeed, 2, 1, seed=9)
        if side == "ck":
            cds.attach(eng, url, reshard=reshard)
        eng.load_checkpoint(os.path.join(tmp, side), tag=TAG, load_optimizer_states=False)
        got[side] = (train(eng, batches(eng, skip_steps=3), 1), weights(eng))
    assert got["ck"][0] == got["stock"][0], got
    same(got["ck"][1], got["stock"][1], f"rank {rank}: one step after a weights-only load")
    dist.barrier()
    shutdown()
