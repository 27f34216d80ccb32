"""Process bodies of the torchtitan test: llama3 ``debugmodel`` on the CPU, 2 gloo ranks.

torchtitan 0.3.0 assumes an accelerator in a few places; the patches of
:func:`cpu_patches` (this test harness only; ``ckptstore`` never patches
torchtitan) make its stock trainer run on CPU processes:

- the device type falls back to ``cuda`` when no accelerator is found:
  ``torch._utils._get_available_device_type`` answers ``cpu`` before
  torchtitan reads it (its device module is then ``torch.cpu``);
- its device memory monitor calls CUDA-only functions (device name,
  properties, memory stats): a stand-in reporting zeros;
- ``set_pg_timeouts`` (after the first step) issues a barrier with device
  ids and calls ``torch.distributed.set_timeout``, absent in torch 2.13: a
  no-op;
- FSDP2 reduce-scatters gradients with ``PREMUL_SUM(1.0)`` (torchtitan
  sets the divide factor to 1.0), which gloo lacks: every FSDP module is
  told to use plain sums (:func:`sum_reductions`), the same arithmetic;
- flex attention's backward refuses CPU tensors unless its device check is
  skipped (its eager backward matches SDPA's), and the compiled flex path
  fails in inductor on CPU: the check is skipped and torchtitan's flex
  module calls the eager function (also after ``--debug.deterministic``,
  which compiles it again), and block masks are made eagerly;
- ``minimal_async_ep`` imports triton unconditionally: its kernels module
  is a stub (not triton: torch would take an importable triton for a
  usable one).

Each rank writes what the test compares (every step's loss as
``float.hex``, where each run resumed from) into the result folder as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import types


def _env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="disabled",
    )


def cpu_patches() -> None:
    """Make torchtitan 0.3.0's trainer run on CPU processes (see the module docstring)."""
    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    # A stub of the kernels module, not of triton: torch takes an importable
    # triton for a usable one.
    sys.modules.setdefault("torchtitan.distributed.minimal_async_ep.kernels", _kernels_stub())

    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils

    class _NoDeviceMemory:
        device_name = "cpu"
        device_capacity_gib = 0.0

        def reset_peak_stats(self):
            pass

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0, 0, 0, 0, 0, 0)

    metrics.build_device_memory_monitor = lambda: _NoDeviceMemory()
    dist_utils.set_pg_timeouts = lambda *a, **k: None

    import torch.nn.attention.flex_attention as flex
    import torchtitan.models.common.attention as attention

    flex._validate_device = lambda *a, **k: None
    attention._compiled_create_block_mask = flex.create_block_mask
    attention.FlexAttention._compiled_flex_attn = flex.flex_attention
    set_determinism = dist_utils.set_determinism

    def deterministic_eager_flex(*a, **k):
        # --debug.deterministic compiles flex attention again (eager on ROCm only)
        set_determinism(*a, **k)
        attention.FlexAttention._compiled_flex_attn = flex.flex_attention

    dist_utils.set_determinism = deterministic_eager_flex


def sum_reductions(trainer) -> None:
    """FSDP2 with gloo: plain sums instead of ``PREMUL_SUM`` (gloo has none).

    torchtitan sets every FSDP module's gradient divide factor to 1.0 (it
    scales by the global token count itself), so FSDP reduce-scatters with
    ``PREMUL_SUM(1.0)``; forcing sum reductions gives the same sums.
    """
    from torch.distributed.fsdp import FSDPModule

    for part in trainer.model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def _kernels_stub() -> types.ModuleType:
    mod = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")

    def missing(name):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*a, **k):
            raise RuntimeError(f"{name}: a triton kernel (not available in this CPU test)")

        return kernel

    mod.__getattr__ = missing
    return mod


def make_assets(root: str) -> tuple[str, str]:
    """A small JSON dataset and a word-level tokenizer built from it (offline): (dataset folder, tokenizer folder)."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = ("the model reads a checkpoint from the store and writes it back while training goes on every step "
             "saves shards of weights and optimizer state so that a restart resumes exactly where it stopped").split()
    rng = random.Random(0)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 120))) for _ in range(64)]
    data = os.path.join(root, "data")
    os.makedirs(data, exist_ok=True)
    with open(os.path.join(data, "data.json"), "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=specials))
    assets = os.path.join(root, "tokenizer")
    os.makedirs(assets, exist_ok=True)
    tok.save(os.path.join(assets, "tokenizer.json"))
    with open(os.path.join(assets, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": specials[1], "eos_token": specials[2]}, f)
    return data, assets


def base_args(data: str, assets: str, dump: str, steps: int) -> list[str]:
    """torchtitan's command line for llama3 debugmodel on 2 CPU ranks (seq_len 64, batch 2, fp32, deterministic)."""
    return [
        "--module", "llama3", "--config", "llama3_debugmodel",
        "--hf-assets-path", assets, "--dataloader.dataset-path", data, "--dump-folder", dump,
        "--training.seq-len", "64", "--training.local-batch-size", "2", "--training.steps", str(steps),
        "--training.mixed-precision-param", "float32",
        "--debug.deterministic", "--debug.seed", "42", "--parallelism.spmd-backend", "partial_dtensor",
        "--validator.no-enable",
    ]


#: tyro's subcommand, last on the command line: no activation checkpointing (the runs are small)
AC_NONE = ["activation-checkpoint:none"]


def run_phases(rank: int, world: int, ports: list[int], phases: list[dict], env: dict, out: str) -> None:
    """Every phase's torchtitan run, one after the other in this rank's process.

    A phase is ``{"name", "args", "stop"}``: ``stop`` ends training after
    that step (a preemption: no last-step save). One process runs them all
    (a fresh process group each, on its own port): torchtitan's import and
    set-up are paid once.
    """
    os.environ.update(env)
    _env(rank, world, ports[0])
    cpu_patches()
    import torch

    torch.set_num_threads(1)
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from torchtitan.trainer import Trainer

    init_logger()
    record: dict = {}
    original_log = MetricsProcessor.log

    def log(self, step, global_avg_loss, *a, **k):
        record["losses"][int(step)] = float(global_avg_loss).hex()
        return original_log(self, step, global_avg_loss, *a, **k)

    MetricsProcessor.log = log
    results = {}
    for phase, port in zip(phases, ports):
        os.environ["MASTER_PORT"] = str(port)
        record = {"losses": {}}
        stop = phase.get("stop")
        Trainer.should_continue_training = (
            (lambda self, stop=stop: self.step < min(stop, self.config.training.steps)) if stop
            else (lambda self: self.step < self.config.training.steps))
        config = ConfigManager().parse_args(list(phase["args"]) + AC_NONE)
        trainer = config.build()
        sum_reductions(trainer)
        try:
            original_load = trainer.checkpointer.load

            def load(step=-1, _orig=original_load, _t=trainer):
                found = _orig(step=step)
                record["resumed_from"] = _t.step if found else None
                return found

            trainer.checkpointer.load = load
            trainer.train()
            record["step"] = trainer.step
            record["manager"] = type(trainer.checkpointer).__name__
        finally:
            trainer.close()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        results[phase["name"]] = record
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
