"""One process restarting from the node-local tier with default options, against DCP's FileSystemReader.

Run from the repository root::

    python -m benchmarks.distributed.tier_restart [--size-mib 512] [--rounds 3] [--dir DIR] [--cpus 0]
        [--compact] [--json OUT.json]

The state: bf16 weights and their fp32 AdamW moments (``exp_avg``,
``exp_avg_sq``), ``--size-mib`` in all, in 8 layers. It is saved once with
DCP's ``FileSystemWriter`` to a local directory, and once with ``repo.save``
to a local-directory repository opened with ``cache_dir=`` and nothing else
(write-through: what the save writes stays in the tier; with ``--compact``
also a second tier saved with ``cache_decoded=False``, the tier as saves
wrote it before decoded copies were the default). Then, in interleaved
rounds, each restore into the same preallocated tensors (NaN-scrubbed
first), page cache warm for every leg:

``dcp-fs``      ``dcp.load(sd, storage_reader=FileSystemReader(dir))``
``tier``        a fresh ``ckptstore.open(url, cache_dir=tier)``, ``repo.load(1, into=sd)``
``tier-compact``  the same from the ``cache_decoded=False`` tier (``--compact``)

The saves are timed once each too (what keeping decoded copies costs a save).

Every restore is checked bit for bit; a tier restore must read 0 chunk bytes
from the store (``repo.read_stats()``). Medians of ``--rounds``; issue 44's
target: ``tier`` at most 1.2x ``dcp-fs``.
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
import warnings

import torch

from ..common.verify import bits_equal, scrub

LAYERS = 8


def state(size_mib: float, seed: int = 0) -> dict:
    """bf16 weights and fp32 moments (10 bytes a parameter), ``size_mib`` in all, 8 layers."""
    g = torch.Generator().manual_seed(seed)
    per_layer = int(size_mib * 2**20 / 10 / LAYERS)
    cols = 1024
    rows = max(1, per_layer // cols)
    sd = {}
    for i in range(LAYERS):
        w = torch.randn(rows, cols, generator=g)
        sd[f"model.layer{i}.weight"] = w.to(torch.bfloat16)
        sd[f"optim.layer{i}.exp_avg"] = torch.randn(rows, cols, generator=g) * 1e-3
        sd[f"optim.layer{i}.exp_avg_sq"] = torch.rand(rows, cols, generator=g) * 1e-6
    return sd


def run(args) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    import ckptstore

    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    warnings.filterwarnings("ignore")
    root = args.dir or tempfile.mkdtemp(prefix="tier_restart.")
    src = state(args.size_mib)
    nbytes = sum(t.numel() * t.element_size() for t in src.values())
    fs, url, tier, compact = (os.path.join(root, d) for d in ("fs", "repo", "tier", "tier_compact"))
    saves = {}
    t0 = time.perf_counter()
    dcp.save(src, storage_writer=FileSystemWriter(fs))
    saves["dcp-fs"] = time.perf_counter() - t0
    with ckptstore.open(url, cache_dir=tier) as repo:
        t0 = time.perf_counter()
        repo.save(src, step=1)
        saves["tier"] = time.perf_counter() - t0
    if args.compact:
        curl = url + "_compact"
        with ckptstore.open(curl, cache_dir=compact, cache_decoded=False) as repo:
            t0 = time.perf_counter()
            repo.save(src, step=1)
            saves["tier-compact"] = time.perf_counter() - t0
    os.sync()
    dst = {k: torch.empty_like(t) for k, t in src.items()}

    def dcp_fs():
        dcp.load(dst, storage_reader=FileSystemReader(fs))

    def from_tier(u, t):
        def go():
            with ckptstore.open(u, cache_dir=t) as repo:
                repo.load(1, into=dst)
                got = repo.read_stats()
            if got["store"]:
                raise SystemExit(f"{t}: {got['store']} chunk bytes came from the store, not the tier")
        return go

    legs = {"dcp-fs": dcp_fs, "tier": from_tier(url, tier)}
    if args.compact:
        legs["tier-compact"] = from_tier(curl, compact)
    times: dict[str, list[float]] = {k: [] for k in legs}
    for leg in legs.values():  # warm the page cache and the imports
        leg()
    for r in range(args.rounds):
        for name, leg in legs.items():
            scrub(dst)
            t0 = time.perf_counter()
            leg()
            times[name].append(time.perf_counter() - t0)
            if not all(bits_equal(dst[k], src[k]) for k in src):
                raise SystemExit(f"{name}: not bit-exact")
        print(f"round {r}: " + "  ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"bytes": nbytes, "rounds": times, "median": med, "save_s": saves,
           "ratio": {k: med[k] / med["dcp-fs"] for k in med}, "cpus": args.cpus,
           "tier_bytes": {t: _du(p) for t, p in (("tier", tier), ("tier-compact", compact)) if os.path.isdir(p)}}
    print(f"{nbytes / 2**20:.0f} MiB, medians of {args.rounds}: "
          + ", ".join(f"{k} {med[k]:.3f} s ({out['ratio'][k]:.2f}x dcp-fs)" for k in med))
    print("saves (once each, untimed legs of the target): " + ", ".join(f"{k} {v:.3f} s" for k, v in saves.items()))
    print("tier bytes on disk: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in out["tier_bytes"].items()))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.distributed.tier_restart", description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=float, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", help="where to save (default: a temporary directory, removed after)")
    ap.add_argument("--cpus", default="", help="CPUs to run on, e.g. '0' (default: all)")
    ap.add_argument("--compact", action="store_true", help="also restore from a tier saved with cache_decoded=False")
    ap.add_argument("--json", help="write every round here")
    args = ap.parse_args(argv)
    out = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
