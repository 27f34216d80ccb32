"""Megatron-LM's own ``save_checkpoint``/``load_checkpoint`` through ``ckptstore.integrations.megatron.install``.

Run from the repository root, with Megatron-LM's sources at the tag of the
installed megatron-core exported outside this repository (never committed)::

    mkdir -p /work/ext/mlm016 && git --git-dir=/work/.mirror/NVIDIA+Megatron-LM/repo archive core_v0.16.1 \\
        megatron | tar -x -C /work/ext/mlm016
    python -m benchmarks.integrations.suites.megatron_lm --src /work/ext/mlm016 [--triton DIR]

``megatron.training`` is not in the megatron-core wheel: the sources'
``megatron/`` (core and training, the same release) go first on the path.
``--triton``: a folder holding triton (the sources' training package imports
it; e.g. the ``.mcore019`` overlay). Two gloo ranks on the CPU (TP=2) build a
small GPT, set Megatron-LM's arguments as its own checkpoint tests do
(``tests/unit_tests/dist_checkpointing/utils.py:init_checkpointing_mock_args``:
``torch_dist`` format; no optimizer and no RNG state here, both CUDA-only on
this stack), call ``install(url)``, then, for synchronous saves and for
``--async-save`` (Megatron-LM's own queue, ``maybe_finalize_async_save``):
``save_checkpoint`` at iterations 10 and 20, ``load_checkpoint`` into a
model of another seed, and checks the iteration, the tracker file, the
repository's steps and every weight bit for bit. Megatron's async queue
calls CUDA even for CPU state; those calls are pointed at the CPU here, as
in the tests. Nothing here runs under ``pytest tests/``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def _cpu_cuda_calls():
    import torch

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.set_device = lambda *a, **k: None
    # save_checkpoint collects the RNG states even with --no-save-rng (get_rng_state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()


def _cpu_read_metadata(tracker_filename):
    """Megatron-LM's ``checkpointing.read_metadata`` (the tracker file) without its CUDA all-reduce:
    the iteration, or 0 and release for ``release``."""
    with open(tracker_filename) as f:
        text = f.read().strip()
    if text == "release":
        return 0, True
    return int(text), False


def _gpt(seed: int):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True,
                            tensor_model_parallel_size=2)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                    max_sequence_length=8)


def _args(save_dir: str, async_save: bool):
    from megatron.training.arguments import parse_args

    argv, sys.argv = sys.argv, [sys.argv[0]]
    try:
        args = parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = argv
    for k, v in dict(non_persistent_global_ckpt_dir=None, non_persistent_ckpt_type=None, save=save_dir,
                     load=save_dir, pretrained_checkpoint=None, ckpt_fully_parallel_save=False,
                     ckpt_fully_parallel_load=False, async_save=async_save, use_dist_ckpt=True,
                     ckpt_format="torch_dist", no_save_optim=True, no_save_rng=True, no_load_optim=True,
                     no_load_rng=True, ckpt_assume_constant_structure=False, log_progress=False,
                     auto_detect_ckpt_format=False, exit_on_missing_checkpoint=False, finetune=False,
                     consumed_train_samples=0, skipped_train_samples=0, consumed_valid_samples=0,
                     dist_ckpt_strictness="assume_ok_unexpected", tensor_model_parallel_size=2,
                     pipeline_model_parallel_size=1, num_layers=2, hidden_size=16, num_attention_heads=4,
                     async_strategy="mcore").items():
        setattr(args, k, v)
    return args


def _py311():
    """Megatron-LM 0.19's training package imports ``typing.override`` (Python 3.12); on 3.11, typing_extensions'."""
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def worker(rank, world, port, url, tmp, results):
    _py311()
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.training import global_vars
    from megatron.training.async_utils import maybe_finalize_async_save
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint

    import ckptstore
    from ckptstore.integrations import megatron as cmg

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    _cpu_cuda_calls()
    import megatron.training.checkpointing as C

    C.read_metadata = _cpu_read_metadata  # its consistency check all-reduces a CUDA tensor
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    init_num_microbatches_calculator(rank, None, 1, 1, 1)  # load_checkpoint updates it (pretrain sets it up)
    cmg.install(url)
    out = []
    for mode in ("sync", "async"):
        save_dir = os.path.join(tmp, mode)
        os.makedirs(save_dir, exist_ok=True)
        args = _args(save_dir, async_save=(mode == "async"))
        global_vars.set_args(args)
        model = _gpt(seed=1)
        for it in (10, 20):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            save_checkpoint(it, [model], None, None, num_floating_point_operations_so_far=0)
            if mode == "async":
                maybe_finalize_async_save(blocking=True)
        want = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        fresh = _gpt(seed=7)
        iteration, _ = load_checkpoint([fresh], None, None, strict=False)
        got = {k: v for k, v in fresh.state_dict().items() if torch.is_tensor(v)}
        same = [k for k in want if k in got and torch.equal(want[k], got[k])]
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
            tracker = f.read().strip()
        with ckptstore.open(url) as repo:
            steps = repo.steps()
        out.append({"mode": mode, "iteration": iteration, "tracker": tracker, "steps": steps,
                    "weights": len(want), "equal": len(same),
                    "folder": sorted(os.listdir(os.path.join(save_dir, "iter_0000020")))})
        # the next mode saves the same iterations: a repository of its own
        url = url + "-" + mode
        cmg.install(url)
    if rank == 0:
        import json

        with open(results, "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    maybe_finalize_async_save(blocking=True, terminate=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main(argv=None) -> int:
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, help="Megatron-LM sources (a folder holding megatron/training)")
    ap.add_argument("--triton", default=None, help="a folder holding triton, appended to the path")
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.abspath(a.src))
    if a.triton:
        sys.path.append(os.path.abspath(a.triton))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    import torch.multiprocessing as mp

    from benchmarks.common.servers import free_port

    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.json")
        mp.spawn(worker, args=(2, free_port(), f"file://{tmp}/repo", tmp, results), nprocs=2, join=True)
        with open(results) as f:
            out = json.load(f)
    import megatron.core

    print(f"megatron-core {megatron.core.__version__} from {os.path.dirname(megatron.core.__file__)}")
    for r in out:
        print(f"{r['mode']}: load_checkpoint -> iteration {r['iteration']}; tracker file {r['tracker']!r}; "
              f"repository steps {r['steps']}; weights equal {r['equal']}/{r['weights']}; "
              f"iter_0000020 holds {r['folder']}")
    ok = all(r["iteration"] == 20 and r["tracker"] == "20" and r["steps"] == [10, 20] and r["equal"] == r["weights"]
             for r in out)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
