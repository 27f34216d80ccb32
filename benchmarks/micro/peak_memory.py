"""Peak memory of a save beyond the state dict itself.

Builds a state dict of ``--size-gib`` of fp32 tensors, then saves it with
ckptstore to a local directory (or ``--url``) while a thread samples this
process's resident set size every 5 ms. Reports the peak RSS above the level
just before the save started, next to the configured ``max_inflight_bytes``
budget; also for a load into preallocated tensors.

    python -m benchmarks.micro.peak_memory [--size-gib 4] [--budget-mib 512] [--url PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

import ckptstore

from ..common.measure import MiB, RssSampler, rss_now
from ..common.report import command_line, write_results
from ..common.verify import bits_equal

# main's benchmarks/micro/load_module.py and scale.py (written after this branch
# forked) import these two names from here; they are the shared helpers.
# Once they import from .common.measure, these aliases can go.


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--budget-mib", type=int, default=512)
    ap.add_argument("--url")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    n = int(args.size_gib * (1 << 30) / 4)
    per = 64 * MiB // 4
    g = torch.Generator().manual_seed(0)
    sd = {}
    i = 0
    while n > 0:
        k = min(per, n)
        sd[f"t{i}"] = torch.randn(k, generator=g)
        n -= k
        i += 1
    tmp = None
    url = args.url
    if url is None:
        tmp = tempfile.mkdtemp(prefix="ckpt-peak-")
        url = os.path.join(tmp, "repo")
    repo = ckptstore.open(url, max_inflight_bytes=args.budget_mib * MiB)
    base = rss_now()
    t0 = time.perf_counter()
    with RssSampler() as s:
        info = repo.save(sd, step=1)
    save_s = time.perf_counter() - t0
    save_extra = s.peak - base
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}  # touched: RSS counts them before the load
    base2 = rss_now()
    t0 = time.perf_counter()
    with RssSampler() as s2:
        repo.load(1, into=dest)
    load_s = time.perf_counter() - t0
    load_extra = s2.peak - base2
    ok = all(bits_equal(dest[k], v) for k, v in sd.items())
    repo.close()
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    logical = info.logical_bytes
    command = command_line("benchmarks.micro.peak_memory", argv)
    print("command:", command)
    print(f"state dict {logical / 2**30:.2f} GiB in {len(sd)} tensors; budget max_inflight_bytes = {args.budget_mib} MiB")
    print(f"save: {save_s:.1f} s, peak RSS above the state dict: {save_extra / MiB:.0f} MiB")
    print(f"load(into=): {load_s:.1f} s, peak RSS above the destination: {load_extra / MiB:.0f} MiB; bit-exact: {ok}")
    if args.json:
        write_results(args.json, command, {
            "logical_bytes": logical, "budget_bytes": args.budget_mib * MiB, "save_seconds": save_s,
            "save_extra_bytes": save_extra, "load_seconds": load_s, "load_extra_bytes": load_extra, "equal": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
