"""Where a restore from the node-local tier spends its time: one rank's share, one process, for a profiler.

Run from the repository root, under a sampling profiler::

    .venv/bin/python -m benchmarks.distributed.tier_profile --dir DIR --prepare [--size-gib 1.0] [--world 4] \\
        [--cache-decoded default|off]
    py-spy record --native -r 250 -f raw -o tier.raw -- .venv/bin/python -m benchmarks.distributed.tier_profile \\
        --dir DIR [--size-gib 1.0] [--world 4] [--repeat 5] [--only ckpt-tier] [--cpus 0]
    .venv/bin/python -m benchmarks.distributed.tier_profile --summarize tier.raw

``--prepare`` saves rank 0's share of ``benchmarks.distributed.tier``'s state dict (the
same ``dcp_compare`` layout and seed, plain tensors: one process, no process
group) through ``CkptStoreWriter`` to a local-directory repository with a
``cache_dir`` under DIR (write-through), and with DCP's ``FileSystemWriter``;
a run without it (the one to profile) restores it ``--repeat`` times each
way into preallocated tensors:
``CkptStoreReader(cache_dir=...)`` (every chunk from the tier's pack copies;
the repository's metadata from the local directory) and
``FileSystemReader``, alternating, and prints each time. ``--summarize``
folds a py-spy raw file into the share of samples per phase of the restore
(by the innermost frame that names one) and per leaf function.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import warnings

import torch

from ..common.verify import bits_equal, scrub
from ..common.workloads import local_shape, sharded_layout

#: Phases of a restore, by the frames that name them; a sample goes to the innermost frame that names one.
PHASES = (
    ("zstd decode", ("_unzstd", "ZstdDecompressor")),
    ("BLAKE3 hash check", ("hash_bytes", "blake3", "hash_into")),
    ("byte-group reverse transform (numpy)", ("_unlow3", "_bytegroup_decode", "_ungroup", "fromnumeric")),
    ("fresh read buffers (mmap MAP_POPULATE)", ("_populated",)),
    ("decoded copy reads (readinto, page cache)", ("read_raw_into",)),
    ("pack copy reads (preadv, page cache)", ("local.py",)),
    ("thread hand-offs (pool submit, results, wake-ups)", ("ThreadPoolExecutor.submit", "notify_all (threading",
                                                           "set_result (concurrent", "add_result (concurrent")),
    ("DCP reads from files (FileSystemReader)", ("filesystem.py",)),
    ("torch.load of DCP items", ("serialization.py",)),
    ("idle: waiting for work or a result", ("Condition.wait", "thread.py:81", "_wait_for_tstate_lock",
                                            "Condition.notify", "thread.py:88", "thread.py:90")),
    ("the profiler script's own check and scrub", ("bits_equal", "scrub", "tier_profile.py:61", "tier_profile.py:71")),
    ("imports and first-use setup", ("importlib", "_create_fn", "_compile_bytecode")),
    ("DCP planning, metadata, other ckptstore code", ("ckptstore/", "checkpoint/")),
)
#: Not work of a restore: left out of the shares.
NOT_WORK = {"idle: waiting for work or a result", "the profiler script's own check and scrub",
            "imports and first-use setup", "no Python frame"}


def run(args) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from ckptstore.dcp import CkptStoreReader, CkptStoreWriter

    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(0 * 1_000_003 + 0)
    src = {n: torch.randn(local_shape(s, args.world), generator=g) for n, s in sharded_layout(args.size_gib, args.world)}
    repo, cache, fs = (os.path.join(args.dir, d) for d in ("repo", "tier", "fs"))
    nbytes = sum(t.numel() * 4 for t in src.values())
    print(f"{len(src)} tensors, {nbytes / 2**20:.0f} MiB (rank 0 of {args.world})", flush=True)
    if args.prepare:
        dcp.save(src, storage_writer=FileSystemWriter(fs))
        opts = {"default": {}, "off": {"cache_decoded": False}}[args.cache_decoded]
        dcp.save(src, storage_writer=CkptStoreWriter(repo, step=1, cache_dir=cache, pack_size=64 << 20, **opts))
        os.sync()
        print(f"saved under {args.dir}")
        return 0
    dst = {n: torch.empty_like(t) for n, t in src.items()}
    systems = {"ckpt-tier": lambda: CkptStoreReader(repo, step=1, cache_dir=cache),
               "dcp-fs": lambda: FileSystemReader(fs)}
    if args.only:
        systems = {args.only: systems[args.only]}
    for i in range(args.repeat):
        for name, make in systems.items():
            scrub(dst)
            reader = make()
            t0, c0 = time.perf_counter(), time.process_time()
            dcp.load(dst, storage_reader=reader)
            secs, cpu = time.perf_counter() - t0, time.process_time() - c0
            if hasattr(reader, "close"):
                reader.close()
            if not all(bits_equal(dst[n], src[n]) for n in src):
                raise SystemExit(f"{name}: not bit-exact")
            print(f"round {i}: {name:<10} {secs:6.3f} s  CPU {cpu:6.3f} s", flush=True)
    return 0


def summarize(path: str, restores: int = 10, hz: int = 250) -> int:
    """Fold a py-spy ``-f raw`` file: samples per restore phase, as shares of the samples that are work.

    Threads are sampled independently, so a thread waiting for the GIL or
    the CPU counts like one running: the shares say where the restore's
    threads are, not CPU time exactly.
    """
    phases: collections.Counter = collections.Counter()
    for line in open(path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not n.isdigit():
            continue
        frames = [f for f in stack.split(";") if f]
        hit = next((name for f in reversed(frames) for name, keys in PHASES if any(k in f for k in keys)),
                   "no Python frame" if not frames else "other")
        phases[hit] += int(n)
    work = sum(v for k, v in phases.items() if k not in NOT_WORK)
    print(f"{sum(phases.values())} samples at {hz} Hz over {restores} restores; {work} in the restores' work "
          f"({work / restores / hz * 1000:.0f} ms of samples a restore)")
    for name, n in phases.most_common():
        share = "" if name in NOT_WORK else f"{100 * n / work:5.1f}%"
        print(f"  {share:>6} {n:6d}  {n / restores / hz * 1000:7.1f} ms a restore  {name}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.distributed.tier_profile", description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="the whole step's size; one rank's share is restored")
    ap.add_argument("--world", type=int, default=4, help="ranks of the save whose rank 0 share is used (default 4)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cpus", default="0", help="CPUs to run on (default 0, as benchmarks.distributed.tier's pinned ranks; '' all)")
    ap.add_argument("--dir", help="where the prepared checkpoints are")
    ap.add_argument("--prepare", action="store_true", help="save the checkpoints under --dir, then exit")
    ap.add_argument("--cache-decoded", choices=("default", "off"), default="default",
                    help="--prepare: the tier's save with default options (decoded copies where the budget has "
                         "room) or cache_decoded=False (pack copies only)")
    ap.add_argument("--only", choices=["ckpt-tier", "dcp-fs"], help="restore only this way")
    ap.add_argument("--summarize", metavar="RAW", help="fold a py-spy raw file instead of running "
                    "(--repeat: the restores it sampled; --hz: its sampling rate)")
    ap.add_argument("--hz", type=int, default=250, help="the profile's sampling rate, for --summarize")
    args = ap.parse_args(argv)
    if args.summarize:
        return summarize(args.summarize, args.repeat, args.hz)
    if not args.dir:
        ap.error("--dir is needed (the checkpoints, saved there by --prepare)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
