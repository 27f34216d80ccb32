"""DeepSpeed and Megatron-Core through ckptstore, next to each stack's own default path.

Run from the repository root::

    python -m benchmarks.integrations.ds_megatron [--hidden 1024] [--layers 8] [--steps 5]
                                                  [--stages 2,3] [--only ds|megatron] [--json OUT.json]

Two CPU processes (gloo on 127.0.0.1) fine-tune a model whose first half of
layers is frozen, saving after each of ``--steps`` steps, then a fresh
model restores the last save. Per stack, on the same ranks and data:

* DeepSpeed ZeRO-2 and ZeRO-3 (CPU accelerator, AdamW, fp32): DeepSpeed's
  own ``TorchCheckpointEngine`` (``torch.save`` files) into a local
  directory, against ``ckptstore.integrations.deepspeed.attach`` to a
  ``file://`` repository on the same disk. Restore: a fresh engine's
  ``load_checkpoint`` of the last tag.
* Megatron-Core (TP=2 ColumnParallelLinear/RowParallelLinear pairs, the
  weights perturbed each step, no optimizer): Megatron's stock ``torch_dist``
  save fails on CPU (``torch.cuda.synchronize()`` in
  ``dist_checkpointing/strategies/filesystem_async.py:preload_tensors``), so
  the baseline is the closest stock path that works: Megatron's own
  translation and ``MCoreSavePlanner`` writing through torch's
  ``FileSystemWriter`` (the torch_dist format without Megatron's CUDA-only
  async writer), restored with Megatron's stock ``torch_dist`` load
  strategy. Against ``ckptstore.integrations.megatron`` strategies.

Times are the slowest rank's (barrier before and after each operation),
median over the saves; bytes are what each directory holds after all saves
(ckptstore: the repository plus the small files left in the checkpoint
directory). Every restore is checked bit for bit against the saved state.
Nothing here is part of the test suite's pass/fail.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.common.measure import dir_bytes, loadavg  # noqa: E402
from benchmarks.common.report import mib, write_results  # noqa: E402
from benchmarks.common.servers import free_port  # noqa: E402
from benchmarks.common.verify import bits_equal  # noqa: E402


def _timed(fn):
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t), out


# ================================================================ DeepSpeed
def _ds_model(hidden: int, layers: int, seed: int):
    torch.manual_seed(seed)
    mods = []
    for i in range(layers):
        lin = torch.nn.Linear(hidden, hidden)
        if i < layers // 2:
            lin.requires_grad_(False)  # fine-tuning: the lower half frozen
        mods += [lin, torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def _ds_engine(deepspeed, stage, hidden, layers, seed):
    m = _ds_model(hidden, layers, seed)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    eng, *_ = deepspeed.initialize(model=m, optimizer=opt, config=cfg)
    return eng


def _ds_fingerprint(eng) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    getattr(eng.optimizer, "_lazy_init_hp_params_optimizer_state", lambda: None)()
    out = {}
    for name, p in eng.module.named_parameters():
        if p.requires_grad:
            out[name] = safe_get_full_fp32_param(p).clone()
            out[name + ".exp_avg_sq"] = safe_get_full_optimizer_state(p, "exp_avg_sq").clone()
    return out


def ds_worker(rank, world, port, args, tmp, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    import torch.distributed as dist

    from ckptstore.integrations import deepspeed as cds

    results = []
    for stage in args.stages:
        for backend in ("deepspeed-torch", "ckptstore"):
            save_dir = os.path.join(tmp, f"ds{stage}-{backend}")
            url = f"file://{tmp}/repo-ds{stage}"
            eng = _ds_engine(deepspeed, stage, args.hidden, args.layers, seed=0)
            ce = cds.attach(eng, url) if backend == "ckptstore" else None
            g = torch.Generator().manual_seed(100 + rank)
            saves, new_bytes = [], []
            for step in range(1, args.steps + 1):
                loss = eng(torch.randn(4, args.hidden, generator=g)).pow(2).mean()
                eng.backward(loss)
                eng.step()
                t, _ = _timed(lambda: eng.save_checkpoint(save_dir, tag=f"global_step{step}"))
                saves.append(t)
                if ce is not None:
                    n = torch.tensor([ce.last_save["new_bytes"] if ce.last_save else 0])
                    dist.all_reduce(n)
                    new_bytes.append(int(n))
            want = _ds_fingerprint(eng)
            fresh = _ds_engine(deepspeed, stage, args.hidden, args.layers, seed=1)
            if backend == "ckptstore":
                cds.attach(fresh, url)
            t_load, _ = _timed(lambda: fresh.load_checkpoint(save_dir, tag=f"global_step{args.steps}"))
            got = _ds_fingerprint(fresh)
            ok = all(bits_equal(got[k], want[k]) for k in want)
            flag = torch.tensor([int(ok)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if not int(flag):
                raise AssertionError(f"ZeRO-{stage} {backend}: restored state differs")
            if rank == 0:
                stored = dir_bytes(save_dir)
                row = {"stack": f"deepspeed-zero{stage}", "backend": backend, "save_s": saves,
                       "save_median_s": statistics.median(saves), "restore_s": t_load, "dir_bytes": stored}
                if backend == "ckptstore":
                    row["repo_bytes"] = dir_bytes(os.path.join(tmp, f"repo-ds{stage}"))
                    row["stored_bytes"] = row["repo_bytes"] + stored
                    row["new_bytes_per_step"] = new_bytes
                else:
                    row["stored_bytes"] = stored
                results.append(row)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


# ================================================================ Megatron
def _mg_layers(hidden: int, pairs: int, seed: int):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=8, use_cpu_initialization=True,
                            params_dtype=torch.float32)
    mods = []
    for _ in range(pairs):
        mods.append(ColumnParallelLinear(hidden, 4 * hidden, config=cfg, init_method=torch.nn.init.normal_,
                                         bias=True, gather_output=False))
        mods.append(RowParallelLinear(4 * hidden, hidden, config=cfg, init_method=torch.nn.init.normal_,
                                      bias=True, input_is_parallel=True, skip_bias_add=False))
    return mods


def _mg_sharded(ps, mods):
    md = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    sd = {}
    for i, m in enumerate(mods):
        sd[f"l{i}"] = m.sharded_state_dict(prefix=f"l{i}.", metadata=md)
    return sd


def _fs_save_strategy():
    """Megatron's torch_dist translation and planner over torch's FileSystemWriter (no CUDA call)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class FsSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            pyt = mcore_to_pyt_state_dict(sd, False)
            dcp.save(pyt, storage_writer=dcp.FileSystemWriter(str(checkpoint_dir)),
                     planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                              flatten_state_dict=False))

    return FsSave("torch_dist", 1)


def mg_worker(rank, world, port, args, tmp, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing, parallel_state

    from ckptstore.integrations import megatron as cmg

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    results = []
    for backend in ("torch_dist-FileSystemWriter", "ckptstore"):
        url = f"file://{tmp}/repo-mg"
        base = os.path.join(tmp, f"mg-{backend}")
        mods = _mg_layers(args.hidden, args.pairs, seed=0)
        g = torch.Generator().manual_seed(7)
        saves, new_bytes = [], []
        for step in range(1, args.steps + 1):
            with torch.no_grad():
                for m in mods[len(mods) // 2:]:  # the upper half is fine-tuned, the lower half frozen
                    m.weight.add_(torch.randn(m.weight.shape, generator=g), alpha=1e-3)
            d = os.path.join(base, f"iter_{step:07d}")
            os.makedirs(d, exist_ok=True)
            strat = cmg.save_strategy(url, step) if backend == "ckptstore" else _fs_save_strategy()
            t, _ = _timed(lambda: dist_checkpointing.save(_mg_sharded(parallel_state, mods), d,
                                                          sharded_strategy=strat))
            saves.append(t)
            if backend == "ckptstore":
                n = torch.tensor([strat.last_rank_stats["new_bytes"]])
                dist.all_reduce(n)
                new_bytes.append(int(n))
        want = [m.weight.detach().clone() for m in mods]
        fresh = _mg_layers(args.hidden, args.pairs, seed=1)
        d = os.path.join(base, f"iter_{args.steps:07d}")
        strat = cmg.load_strategy(url) if backend == "ckptstore" else None
        t_load, loaded = _timed(lambda: dist_checkpointing.load(_mg_sharded(parallel_state, fresh), d,
                                                                sharded_strategy=strat))
        for i, w in enumerate(want):
            if not bits_equal(loaded[f"l{i}"][f"l{i}.weight"], w):
                raise AssertionError(f"Megatron {backend}: layer {i} differs after restore")
        if rank == 0:
            row = {"stack": "megatron-tp2", "backend": backend, "save_s": saves,
                   "save_median_s": statistics.median(saves), "restore_s": t_load, "dir_bytes": dir_bytes(base)}
            if backend == "ckptstore":
                row["repo_bytes"] = dir_bytes(os.path.join(tmp, "repo-mg"))
                row["stored_bytes"] = row["repo_bytes"] + row["dir_bytes"]
                row["new_bytes_per_step"] = new_bytes
            else:
                row["stored_bytes"] = row["dir_bytes"]
            results.append(row)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


# ================================================================ main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8, help="DeepSpeed: Linear layers (the lower half frozen)")
    p.add_argument("--pairs", type=int, default=2, help="Megatron: column/row parallel pairs (4x hidden)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--stages", default="2,3")
    p.add_argument("--only", choices=["ds", "megatron"])
    p.add_argument("--json")
    args = p.parse_args(argv)
    args.stages = [int(s) for s in args.stages.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ckpt-int-bench-") as tmp:
        if args.only in (None, "ds"):
            out = os.path.join(tmp, "ds.json")
            mp.spawn(ds_worker, args=(2, free_port(), args, tmp, out), nprocs=2, join=True)
            rows += json.load(open(out))
        if args.only in (None, "megatron"):
            out = os.path.join(tmp, "mg.json")
            mp.spawn(mg_worker, args=(2, free_port(), args, tmp, out), nprocs=2, join=True)
            rows += json.load(open(out))
    print(f"{'stack':<16} {'backend':<28} {'save (median)':>13} {'restore':>8} {'stored after all saves':>23}")
    for r in rows:
        print(f"{r['stack']:<16} {r['backend']:<28} {r['save_median_s']:>12.3f}s {r['restore_s']:>7.3f}s "
              f"{mib(r['stored_bytes']):>23}")
        if "new_bytes_per_step" in r:
            print(f"{'':<16} {'  new bytes per step':<28} " + ", ".join(mib(b) for b in r["new_bytes_per_step"]))
    command = "python -m benchmarks.integrations.ds_megatron " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"\ncommand: {command.strip()}; load average at the end: {loadavg()}")
    if args.json:
        write_results(args.json, command.strip(), {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
