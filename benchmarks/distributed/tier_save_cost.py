"""What decoded copies cost a write-through save: ``repo.save`` through a tier, default options vs ``cache_decoded=False``.

Run from the repository root::

    python -m benchmarks.distributed.tier_save_cost [--size-mib 256] [--rounds 3]

``tier_restart``'s state (bf16 weights, fp32 AdamW moments). Each round saves
it once each way (the order alternating), each into a fresh local-directory
repository with a fresh ``cache_dir`` under ``/tmp``, from a warm handle;
prints each time and the medians. The restart side of the trade is
``benchmarks.distributed.tier_restart``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from .tier_restart import state


def main(argv=None) -> int:
    import ckptstore

    ap = argparse.ArgumentParser(prog="python -m benchmarks.distributed.tier_save_cost",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=float, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    src = state(args.size_mib)
    res: dict[str, list[float]] = {"default": [], "off": []}
    for r in range(args.rounds):
        for mode in ("default", "off") if r % 2 == 0 else ("off", "default"):
            d = tempfile.mkdtemp(prefix="tier_save_cost.", dir="/tmp")
            kw = {} if mode == "default" else {"cache_decoded": False}
            try:
                with ckptstore.open(os.path.join(d, "repo"), cache_dir=os.path.join(d, "tier"), **kw) as repo:
                    repo.latest()  # warm: config read, pools made
                    t0 = time.perf_counter()
                    repo.save(src, step=1)
                    res[mode].append(time.perf_counter() - t0)
            finally:
                shutil.rmtree(d, ignore_errors=True)
        print(f"round {r}: " + "  ".join(f"{k} {v[-1]:.3f} s" for k, v in res.items()), flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"{args.size_mib:g} MiB, medians of {args.rounds}: default (decoded copies) {med['default']:.3f} s, "
          f"cache_decoded=False {med['off']:.3f} s: {med['default'] / med['off']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
