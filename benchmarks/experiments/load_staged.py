"""Loads into destinations that cannot take chunks in place: staging buffers against a host copy per tensor.

Run from the repository root::

    python -m benchmarks.experiments.load_staged [--where s3|local] [--gib 1] [--rounds 3]

Saves workload a (``--gib`` of random fp32, as in ``benchmarks.run``) once,
to SeaweedFS (pinned to CPU 1, this process on CPU 0, as in
``benchmarks.run``) or to a local directory, then loads it with
``repo.load(1, into=...)`` into bf16 tensors (a cast: the path CUDA
destinations take too), rounds interleaved, two ways:

``copy``
    each tensor read whole into a fresh host tensor of the stored dtype,
    then copied into its destination (what ``load(into=)`` did before
    a8d157b; reproduced here by replacing ``Checkpoint._read_staged``);
``staged``
    the library's path: one set of staging buffers of half the read
    budget, blocks decoded into them and copied out.

Prints wall seconds, client CPU seconds and the peak RSS above the level
before the load (sampled every 5 ms), per round and the medians. Every load
is checked bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time

import torch

from ckptstore.repo.reader import Checkpoint

from ..common.measure import RssSampler, rss_now
from ..common.pinning import pin
from ..common.report import command_line, git_commit
from ..common.servers import start_server
from ..common.verify import scrub, verify
from ..common.systems import BUCKET, CkptSystem
from ..common.workloads import data_a

MiB = 1 << 20


def copy_per_tensor(self, keys, dests, on_bytes=None):
    """The reference: each tensor through a host copy of its own (``Checkpoint.read_into``).

    ``on_bytes`` (progress, since ``eb6be3a``) is not reported: the loads here pass none."""
    self.repo.runtime.map_tensors(lambda k: self.read_into(k, dests[k]), keys)


def run(system, args, want) -> dict:
    like = {k: torch.empty_like(v) for k, v in want.items()}
    scrub(like)
    staged = Checkpoint._read_staged
    res: dict[str, list] = {}
    try:
        for rnd in range(args.rounds):
            for name, fn in (("copy", copy_per_tensor), ("staged", staged)):
                Checkpoint._read_staged = fn
                base = rss_now()
                with system.open("a") as repo, RssSampler() as rs:
                    c0, t0 = time.process_time(), time.perf_counter()
                    repo.load(1, into=like)
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                verify(want, like, f"load_staged {name}")
                scrub(like)
                peak = (rs.peak - base) / MiB
                res.setdefault(name, []).append((wall, cpu, peak))
                print(f"  round {rnd + 1} {name:7s} {wall:6.3f} s  cpu {cpu:5.2f}  peak +{peak:4.0f} MiB", flush=True)
    finally:
        Checkpoint._read_staged = staged
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.experiments.load_staged", description=__doc__.split("\n")[0])
    ap.add_argument("--where", default="s3", choices=("s3", "local"))
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"command: {command_line('benchmarks.experiments.load_staged', argv)}")
    print(f"commit {git_commit()}, {os.cpu_count()} CPUs, workload a {args.gib} GiB fp32 loaded into bf16, "
          f"{args.where}")
    sd = data_a(args.gib)
    want = {k: v.bfloat16() for k, v in sd.items()}
    with contextlib.ExitStack() as stack:
        if args.where == "s3":
            srv = stack.enter_context(start_server("seaweedfs", BUCKET))
            pin(srv.pid, {1})
            os.sched_setaffinity(0, {0})
            print("seaweedfs pinned to CPU 1, this process on CPU 0")
            system = CkptSystem(server=srv)
        else:
            system = CkptSystem(tmp=stack.enter_context(tempfile.TemporaryDirectory(prefix="ckpt-staged-")))
        system.save(sd, "a", 1)
        system.end_saves()
        del sd
        res = run(system, args, want)
    print()
    for name, rows in res.items():
        print(f"median {name:7s} {statistics.median(r[0] for r in rows):6.3f} s  "
              f"cpu {statistics.median(r[1] for r in rows):5.2f}  peak +{statistics.median(r[2] for r in rows):4.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
