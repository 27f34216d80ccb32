"""Megatron-Core async saves through ckptstore: the trainer's blocking part against a synchronous save.

Run from the repository root::

    python -m benchmarks.integrations.megatron_async [--hidden 1024] [--pairs 2] [--saves 5]
                                                      [--backends file,seaweedfs] [--json OUT.json]

Two CPU processes (gloo on 127.0.0.1) hold ``--pairs`` Megatron
ColumnParallelLinear/RowParallelLinear pairs (hidden -> 4 x hidden ->
hidden) at TP=2. Each round saves twice, to two steps, each time after
perturbing every weight (so that every save uploads everything: no
dedup against the step before):

* **sync**: ``dist_checkpointing.save`` with ckptstore's strategy;
* **async**: ``dist_checkpointing.save(..., async_sharded_save=True)`` and
  ``AsyncCallsQueue.schedule_async_request`` (Megatron's temporal worker,
  forked per save): the **blocking** part, what the training loop waits
  for (timed as two parts: the ``dist_checkpointing.save`` call, which
  plans, claims the step and snapshots, and ``schedule_async_request``,
  which forks the worker); then the worker's upload runs in the background (waited for here),
  then ``maybe_finalize_async_calls(blocking=True)``: the time **finalize**
  adds (the commit, on every rank).

Times are the slowest rank's (a barrier before and after each timed part),
median over ``--saves`` rounds. Backends: a ``file://`` repository in a
temporary folder, and a SeaweedFS S3 server on 127.0.0.1 (its own
process). Megatron's async queue calls CUDA even for CPU state
(``torch.cuda.current_device()``, ``synchronize``); on the CPU those are
pointed at the CPU and made no-ops here, as in the tests. Nothing here is
part of the test suite's pass/fail.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager

import torch
import torch.multiprocessing as mp

from benchmarks.common.measure import loadavg
from benchmarks.common.report import write_results
from benchmarks.common.servers import free_port

BUCKET = "mcore-async"


def _cpu_cuda_calls():
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.set_device = lambda *a, **k: None


def _timed(fn):
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def worker(rank, world, port, url, so, tmp, hidden, pairs, saves, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    from ckptstore.integrations import megatron as cmg

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    _cpu_cuda_calls()
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=8, use_cpu_initialization=True,
                            params_dtype=torch.float32)
    mods = []
    for _ in range(pairs):
        mods.append(ColumnParallelLinear(hidden, 4 * hidden, config=cfg, init_method=torch.nn.init.normal_,
                                         bias=True, gather_output=False))
        mods.append(RowParallelLinear(4 * hidden, hidden, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                                      input_is_parallel=True, skip_bias_add=False))

    def sharded():
        md = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
        return {f"m{i}": m.sharded_state_dict(prefix=f"m{i}.", metadata=md) for i, m in enumerate(mods)}

    def perturb():
        with torch.no_grad():
            for m in mods:
                m.weight.add_(torch.randn_like(m.weight))

    def folder(step):
        d = os.path.join(tmp, f"iter_{step:07d}")
        os.makedirs(d, exist_ok=True)
        return d

    kw = {"async_sharded_save": True}
    import inspect

    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        kw["async_strategy"] = "mcore"
    strat = cmg.save_strategy(url, storage_options=so)
    q = AsyncCallsQueue()
    rows = []
    for i in range(saves):
        perturb()
        t_sync, _ = _timed(lambda: dist_checkpointing.save(sharded(), folder(2 * i + 1), sharded_strategy=strat))

        perturb()  # new values: the async save uploads everything too (no dedup against the sync step)

        t_plan, req = _timed(lambda: dist_checkpointing.save(sharded(), folder(2 * i + 2), sharded_strategy=strat,
                                                              **kw))
        t_sched, _ = _timed(lambda: q.schedule_async_request(req))
        t_block = t_plan + t_sched
        t_bg, _ = _timed(lambda: q.async_calls[0].async_caller.process.join())
        t_fin, done = _timed(lambda: q.maybe_finalize_async_calls(blocking=True))
        assert done == [i], done
        rows.append({"sync": t_sync, "async_blocking": t_block, "async_save_call": t_plan,
                     "schedule_async_request": t_sched, "background_wait": t_bg, "finalize": t_fin})
    nbytes = sum(p.numel() * p.element_size() for m in mods for p in m.parameters())
    got = [None] * world
    dist.all_gather_object(got, {"rows": rows, "bytes": nbytes})
    if rank == 0:
        import json

        with open(out, "w") as f:
            json.dump(got, f)
    q.close()
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@contextmanager
def _backend(name: str, tmp: str):
    if name == "file":
        yield f"file://{tmp}/repo", None
    elif name == "seaweedfs":
        from ckptstore.testing.seaweedfs import SeaweedFS

        with SeaweedFS() as weed:
            weed.create_bucket(BUCKET)
            yield f"s3://{BUCKET}/run", weed.storage_options()
    else:
        raise SystemExit(f"unknown backend {name!r} (file, seaweedfs)")


def main(argv=None) -> int:
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--backends", default="file,seaweedfs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    command = f"{sys.executable} -m benchmarks.integrations.megatron_async" + "".join(
        " " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    import megatron.core

    results = {}
    for name in args.backends.split(","):
        with tempfile.TemporaryDirectory() as tmp, _backend(name, tmp) as (url, so):
            out = os.path.join(tmp, "times.json")
            mp.spawn(worker, args=(2, free_port(), url, so, tmp, args.hidden, args.pairs, args.saves, out),
                     nprocs=2, join=True)
            with open(out) as f:
                ranks = json.load(f)
        per = {k: [max(r["rows"][i][k] for r in ranks) for i in range(args.saves)] for k in ranks[0]["rows"][0]}
        med = {k: statistics.median(v) for k, v in per.items()}
        results[name] = {"median_s": med, "per_save_s": per, "bytes_per_save": sum(r["bytes"] for r in ranks),
                         "blocking_over_sync": med["async_blocking"] / med["sync"],
                         "finalize_over_sync": med["finalize"] / med["sync"]}
        r = results[name]
        print(f"{name}: {r['bytes_per_save'] / 2**20:.1f} MiB per save; sync {med['sync']:.3f} s, async blocking "
              f"{med['async_blocking']:.3f} s ({r['blocking_over_sync']:.3f}x: save call {med['async_save_call']:.3f} s, "
              f"schedule {med['schedule_async_request']:.3f} s), background "
              f"{med['background_wait']:.3f} s, finalize {med['finalize']:.3f} s ({r['finalize_over_sync']:.3f}x)")
    if args.json:
        write_results(args.json, command, {"megatron_core": megatron.core.__version__, "loadavg": loadavg(),
                                           "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
