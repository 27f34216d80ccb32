"""A checkpoint every step: async write-back saves into a host-memory tier, against a host ``clone()``.

Run from the repository root::

    python -m benchmarks.distributed.every_step [--size-mib 512] [--steps 100] [--changed 0.125]
        [--step-seconds 1.0] [--tier /dev/shm] [--json OUT.json]

The state is ``tier_restart``'s: bf16 weights and fp32 AdamW moments,
``--size-mib`` in all. One handle opened on a local-directory repository
(fsynced, on disk) with ``cache_dir`` under ``--tier`` (``/dev/shm``:
host memory), ``write_back=True`` and a ``cache_size`` of 4x the state.
Each of ``--steps`` steps:

1. "trains": changes ``--changed`` of the tensors in place (a different
   subset each step, every tensor in turn), then spends ``--step-seconds``
   (a sleep: the CPUs are the background's meanwhile, as while a GPU computes);
2. times a host ``clone()`` of every tensor (the yardstick: fresh memory,
   as a copy for an async save would be without reused buffers);
3. times ``repo.save(sd, step, blocking=False)``: the time the loop is blocked
   (the snapshot into reused buffers; a wait for the previous save, if the
   background fell behind, is part of it and reported apart);
4. notes the backlog: steps saved but not committed in the store
   (``repo.steps(pending=True)`` minus ``repo.steps()``, plus an async save
   still being written), and the bytes each step gives the background.

At the end ``repo.flush()``; every step is committed, and the last one is
loaded from the store alone and compared bit for bit. Figures: the median
blocking time over the steps after the first (the first copies everything)
against the median clone time, the backlog's largest value in the first
and the last 10 steps, and the bytes drained. Issue 44's target: blocking at
most 1.2x the clone, the backlog not growing over 100 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from ..common.verify import bits_equal
from .tier_restart import state


def run(args) -> dict:
    import ckptstore

    sd = state(args.size_mib)
    keys = sorted(sd)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    root = tempfile.mkdtemp(prefix="every_step.")
    tier = tempfile.mkdtemp(prefix="every_step_tier.", dir=args.tier)
    url = os.path.join(root, "repo")
    repo = ckptstore.open(url, cache_dir=tier, cache_size=4 * nbytes, write_back=True)
    per_step = max(1, round(len(keys) * args.changed))
    rows = []
    fut = None
    try:
        for step in range(1, args.steps + 1):
            if step > 1:
                start = (step - 2) * per_step
                with torch.no_grad():
                    for j in range(per_step):
                        t = sd[keys[(start + j) % len(keys)]]
                        t.add_(torch.ones((), dtype=t.dtype))  # in place: same storage, new bytes
            time.sleep(args.step_seconds)
            t0 = time.perf_counter()
            copy = {k: t.clone() for k, t in sd.items()}
            clone_s = time.perf_counter() - t0
            del copy
            prev = fut
            t0 = time.perf_counter()
            fut = repo.save(sd, step=step, blocking=False)
            blocked = time.perf_counter() - t0
            info = prev.result() if prev is not None else None  # done: the save above waited for it
            committed = set(repo.steps())
            backlog = len(set(repo.steps(pending=True)) - committed) + (0 if fut.done() else 1)
            rows.append({"step": step, "clone_s": clone_s, "blocked_s": blocked, "backlog": backlog,
                         "prev_waited_s": None if info is None else info.waited_seconds,
                         "prev_drained_bytes": None if info is None else info.uploaded_bytes,
                         "prev_unchanged_chunks": None if info is None else info.unchanged_chunks,
                         "prev_new_chunks": None if info is None else info.new_chunks})
            if step % 10 == 0 or step == 1:
                print(f"step {step:4d}: clone {clone_s:.3f} s, save blocked {blocked:.3f} s, backlog {backlog}",
                      flush=True)
        last = fut.result()
        t0 = time.perf_counter()
        repo.flush()
        flush_s = time.perf_counter() - t0
        assert repo.steps() == list(range(1, args.steps + 1)), "every step committed"
        with ckptstore.open(url) as plain:
            got = plain.load(args.steps)
        if not all(bits_equal(got[k], sd[k]) for k in sd):
            raise SystemExit("the last step is not bit-exact")
    finally:
        repo.close()
        shutil.rmtree(tier, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    later = rows[1:]
    waits = [r["prev_waited_s"] for r in rows if r["prev_waited_s"] is not None] + [last.waited_seconds]
    drained = [r["prev_drained_bytes"] for r in rows if r["prev_drained_bytes"] is not None] + [last.uploaded_bytes]
    out = {
        "bytes": nbytes, "steps": args.steps, "changed": args.changed, "tensors_changed_per_step": per_step,
        "step_seconds": args.step_seconds, "tier": args.tier,
        "median_clone_s": statistics.median(r["clone_s"] for r in later),
        "median_blocked_s": statistics.median(r["blocked_s"] for r in later),
        "first_blocked_s": rows[0]["blocked_s"],
        "max_backlog_first10": max(r["backlog"] for r in rows[:10]),
        "max_backlog_last10": max(r["backlog"] for r in rows[-10:]),
        "steps_that_waited": sum(1 for w in waits if w > 0), "max_wait_s": max(waits),
        "drained_bytes_total": sum(drained), "drained_bytes_median_step": statistics.median(drained[1:] or drained),
        "flush_s": flush_s, "rows": rows,
    }
    out["ratio"] = out["median_blocked_s"] / out["median_clone_s"]
    print(f"{nbytes / 2**20:.0f} MiB, {per_step} of {len(keys)} tensors changed a step, {args.steps} steps, "
          f"{args.step_seconds:g} s a step, tier in {args.tier}")
    print(f"save blocked: median {out['median_blocked_s']:.3f} s (first step {out['first_blocked_s']:.3f} s); "
          f"host clone median {out['median_clone_s']:.3f} s: {out['ratio']:.2f}x")
    print(f"backlog: at most {out['max_backlog_first10']} in the first 10 steps, {out['max_backlog_last10']} in the "
          f"last 10; {out['steps_that_waited']} saves waited for the previous one (longest {out['max_wait_s']:.3f} s)")
    print(f"drained: {out['drained_bytes_total'] / 2**20:.1f} MiB in all, median "
          f"{out['drained_bytes_median_step'] / 2**20:.1f} MiB a step; flush at the end {flush_s:.2f} s")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.distributed.every_step", description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=float, default=512)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--changed", type=float, default=0.125, help="share of the tensors changed each step")
    ap.add_argument("--step-seconds", type=float, default=1.0, help="the training step's compute, slept")
    ap.add_argument("--tier", default="/dev/shm", help="where the tier goes (default /dev/shm: host memory)")
    ap.add_argument("--json", help="write every step here")
    args = ap.parse_args(argv)
    out = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
