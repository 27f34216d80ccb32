"""Peak memory of a save beyond the state dict itself.

Builds a state dict of ``--size-gib`` of fp32 tensors, then saves it with
ckptstore to a local directory (or ``--url``) while a thread samples this
process's resident set size every 5 ms. Reports the peak RSS above the level
just before the save started, next to the configured ``max_inflight_bytes``
budget; also for a load into preallocated tensors.

    python -m benchmarks.peak_memory [--size-gib 4] [--budget-mib 512] [--url PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import torch

import ckptstore

MiB = 1 << 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Sampler:
    def __init__(self, period: float = 0.005):
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.period)

    def __enter__(self):
        self.peak = rss()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())


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
    base = rss()
    t0 = time.perf_counter()
    with Sampler() as s:
        info = repo.save(sd, step=1)
    save_s = time.perf_counter() - t0
    save_extra = s.peak - base
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}  # touched: RSS counts them before the load
    base2 = rss()
    t0 = time.perf_counter()
    with Sampler() as s2:
        repo.load(1, into=dest)
    load_s = time.perf_counter() - t0
    load_extra = s2.peak - base2
    ok = all(torch.equal(dest[k], v) for k, v in sd.items())
    repo.close()
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    logical = info.logical_bytes
    print("command:", " ".join([sys.executable, "-m", "benchmarks.peak_memory", *(argv if argv is not None else sys.argv[1:])]))
    print(f"state dict {logical / 2**30:.2f} GiB in {len(sd)} tensors; budget max_inflight_bytes = {args.budget_mib} MiB")
    print(f"save: {save_s:.1f} s, peak RSS above the state dict: {save_extra / MiB:.0f} MiB")
    print(f"load(into=): {load_s:.1f} s, peak RSS above the destination: {load_extra / MiB:.0f} MiB; bit-exact: {ok}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"logical_bytes": logical, "budget_bytes": args.budget_mib * MiB, "save_seconds": save_s,
                       "save_extra_bytes": save_extra, "load_seconds": load_s, "load_extra_bytes": load_extra,
                       "equal": ok}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
