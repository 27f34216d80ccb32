"""Where the S3 server spends its CPU during a save: Go's own CPU profile of SeaweedFS, per writer.

Run from the repository root::

    python -m benchmarks.experiments.server_profile [--size-gib 1] [--rounds 3]
        [--writers ckptstore,ckptstore-raw,s3torchconnector,dcp-fsspec,raw-put]

Starts SeaweedFS with ``-debug`` (Go's pprof endpoints on a free loopback
port), pinned to CPU 1, with this process on CPU 0 while it saves, as in
``benchmarks.run``. After one unmeasured save, each round saves workload a
(``common.workloads.build_state_dict``, fp32 ``randn``) once per writer while
``/debug/pprof/profile`` records the server for ``--window`` seconds:

- ``ckptstore``: ``Repository.save`` with 64 MiB packs (``benchmarks.run``'s
  options); ``ckptstore-raw`` the same with ``codec="raw"``;
- ``s3torchconnector``: its DCP ``S3StorageWriter`` (when installed);
- ``dcp-fsspec``: DCP ``FsspecWriter`` through s3fs;
- ``raw-put``: boto3 PUTs of random 16 MiB objects from 4 threads, as many
  bytes as ckptstore stored (``benchmarks.run``'s yardstick).

It prints, per writer, the median save time, the server CPU seconds per
stored GiB (``/proc``, median; and from the profiles of all rounds, which
should agree), the top functions by their own time and a split into
buckets by the innermost frame that names a known piece of work (MD5,
CRC, zeroing and copying memory, socket reads, file writes, HTTP). Last,
ckptstore's save time over each other writer's, split into the ratio of
stored bytes, the ratio of server CPU per byte, and the rest (time the
server was not busy). A profile samples at 100 Hz: read differences of a
few percent as noise.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import urllib.request

from ..common.measure import GiB, Timer, median, median_sample
from ..common.pinning import Pinning
from ..common.pprof import Profile
from ..common.report import env_line, git_commit
from ..common.servers import seaweedfs
from ..common.systems import BUCKET, CkptSystem, FsspecSystem, S3tcSystem, optional_peers, raw_put, settle_disk
from ..common.workloads import build_state_dict

#: (bucket, substrings of Go function names), tried in order against each
#: sample's frames from the leaf up: the first frame that matches any rule
#: decides. A system call's own frames (``Syscall6``, ``syscall.pwrite``)
#: match no rule, so its callers decide: a socket read, a file write; one
#: whose callers match nothing falls back to "other syscalls".
RULES = [
    ("md5", ("crypto/md5",)),
    ("sha256", ("sha256",)),
    ("crc32/crc64", ("crc32", "crc64")),
    ("gzip/zstd", ("compress/", "klauspost")),
    ("memclr (zeroing new memory)", ("runtime.memclr",)),
    ("memmove (copying)", ("runtime.memmove",)),
    ("alloc", ("runtime.mallocgc", "runtime.growslice", "runtime.makeslice")),
    ("gc", ("runtime.gcBgMarkWorker", "runtime.gcDrain", "runtime.scanobject", "runtime.scanObject",
            "runtime.gcAssist", "runtime.bgsweep", "runtime.bgscavenge", "runtime.markroot")),
    ("socket read", ("net.(*conn).Read", "net.(*netFD).Read")),
    ("socket write", ("net.(*conn).Write", "net.(*netFD).Write")),
    ("file write/sync", ("os.(*File).Write", "os.(*File).Sync", "os.(*File).pwrite", "os.(*File).write")),
    ("file read", ("os.(*File).Read", "os.(*File).pread", "os.(*File).read")),
    ("scheduler/netpoll", ("runtime.schedule", "runtime.findRunnable", "runtime.netpoll", "runtime.futex",
                           "runtime.usleep", "runtime.notesleep", "runtime.mcall", "runtime.park_m")),
    ("http/grpc", ("net/http", "google.golang.org/grpc", "golang.org/x/net/http2")),
]
FALLBACK = [("other syscalls", ("syscall", "runtime.madvise", "runtime.mmap", "runtime.munmap"))]

WRITERS = ("ckptstore", "ckptstore-raw", "s3torchconnector", "dcp-fsspec", "raw-put")


def fetch_profile(port: int, seconds: int, out: dict) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}/debug/pprof/profile?seconds={seconds}",
                         timeout=seconds + 60) as r:
            out["data"] = r.read()
    except Exception as e:  # reported by the caller
        out["error"] = e


def profiled(port: int, window: int, fn):
    """Run ``fn`` while the server records a CPU profile; returns (fn's result, Profile)."""
    out: dict = {}
    t = threading.Thread(target=fetch_profile, args=(port, window, out), daemon=True)
    t.start()
    time.sleep(0.5)  # the handler has started the profiler before the work begins
    t0 = time.monotonic()
    res = fn()
    took = time.monotonic() - t0
    if took > window - 1:
        print(f"  warning: the save took {took:.1f} s, near or past the {window} s window (--window)")
    t.join()
    if "error" in out:
        raise RuntimeError(f"fetching the server's CPU profile failed: {out['error']!r}")
    return res, Profile(out["data"])


def make_system(w: str, srv):
    if w in ("ckptstore", "ckptstore-raw"):
        return CkptSystem(server=srv, codec="raw" if w == "ckptstore-raw" else None)
    if w == "s3torchconnector":
        return S3tcSystem(srv)
    if w == "dcp-fsspec":
        return FsspecSystem(srv)
    return None  # raw-put


def one_save(w: str, srv, sd, port: int, window: int, pinning: Pinning, raw_bytes: int):
    """One profiled save by writer ``w``: (Timer, stored bytes, Profile); what it wrote is deleted after."""
    system = make_system(w, srv)
    settle_disk()
    with pinning.client():
        if system is None:
            tm, prof = profiled(port, window, lambda: raw_put(srv, raw_bytes, 4))
            return tm, raw_bytes, prof

        def save():
            with Timer(srv.pid) as tm:
                system.save(sd, "a", 1)
                if isinstance(system, CkptSystem):
                    system.end_saves()  # the handle's close is part of a save sequence's cost
            return tm

        tm, prof = profiled(port, window, save)
    stored = system.stored("a")
    system.cleanup("a")
    return tm, stored, prof


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--writers", default=",".join(WRITERS))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians, profiles summed")
    ap.add_argument("--window", type=int, default=30, help="seconds each profile records (longer than a save)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--save-dir", help="also write each raw profile (<writer>-r<round>.pb.gz) here")
    args = ap.parse_args(argv)
    writers = [w for w in args.writers.split(",") if w]
    bad = sorted(set(writers) - set(WRITERS))
    if bad:
        ap.error(f"unknown writers {bad}; choose from {', '.join(WRITERS)}")
    peers, _ = optional_peers()
    if "s3torchconnector" in writers and S3tcSystem not in peers:
        print("s3torchconnector: skipped (not installed: make setup-bench)")
        writers.remove("s3torchconnector")

    print(env_line())
    print(f"commit {git_commit()}; workload a, {args.size_gib:g} GiB fp32 randn; {args.rounds} interleaved rounds")
    sd = build_state_dict(args.size_gib)
    raw_bytes = int(args.size_gib * GiB)
    pinning = Pinning(True)
    from ckptstore.testing.seaweedfs import free_ports

    port = free_ports(1)[0]
    runs: dict[str, list] = {w: [] for w in writers}
    with seaweedfs(BUCKET, extra_args=("-debug", f"-debug.port={port}")) as srv:
        print(f"{srv.info['server']}: {pinning.server(srv.pid)}; pprof on 127.0.0.1:{port}")
        # A first save outside the rounds: imports, clients, the server's first volume.
        one_save(writers[0], srv, sd, port, args.window, pinning, raw_bytes)
        for r in range(args.rounds):
            for w in writers:
                tm, stored, prof = one_save(w, srv, sd, port, args.window, pinning, raw_bytes)
                if w == "ckptstore":
                    raw_bytes = stored  # the raw PUTs send as many bytes as ckptstore stores
                runs[w].append((tm, stored, prof))
                gib = stored / GiB
                print(f"  round {r + 1} {w}: {tm.seconds:.2f} s, {stored / 2**20:.1f} MiB stored, server CPU "
                      f"{tm.server_cpu:.2f} s = {tm.server_cpu / gib:.2f} s/GiB, busy {tm.server_cpu / tm.seconds:.2f}")
                if args.save_dir:
                    os.makedirs(args.save_dir, exist_ok=True)
                    with open(os.path.join(args.save_dir, f"{w}-r{r + 1}.pb.gz"), "wb") as f:
                        f.write(prof.raw)

    summary = {}
    for w, rs in runs.items():
        tm = median_sample(rs)[0]
        stored = median([s for _, s, _ in rs])
        per_gib = median([t.server_cpu / (s / GiB) for t, s, _ in rs])
        total_gib = sum(s for _, s, _ in rs) / GiB
        prof = Profile.merged([p for _, _, p in rs])
        summary[w] = (tm, stored, per_gib, total_gib, prof)
        print(f"\n== {w}: median {tm.seconds:.2f} s, {stored / 2**20:.1f} MiB stored; server CPU {per_gib:.2f} s/GiB "
              f"(/proc, median), {prof.total_seconds / total_gib:.2f} s/GiB (profiles, all rounds)")
        print("  top functions by own time (s/GiB):")
        for f, sec in prof.flat().most_common(args.top):
            print(f"    {sec / total_gib:6.3f}  {f}")

    labels = [lab for lab, _ in RULES + FALLBACK] + ["other"]
    print("\nserver CPU-s per stored GiB, by bucket (innermost matching frame; profiles of all rounds):")
    print(f"{'bucket':<28}" + "".join(f"{w:>18}" for w in summary))
    per = [(prof.buckets(RULES, FALLBACK), g) for _, _, _, g, prof in summary.values()]
    for lab in labels:
        print(f"{lab:<28}" + "".join(f"{b[lab] / g:18.3f}" for b, g in per))
    print(f"{'total (profiles)':<28}" + "".join(f"{p.total_seconds / g:18.3f}" for _, _, _, g, p in summary.values()))
    print(f"{'total (/proc, median)':<28}" + "".join(f"{pg:18.3f}" for _, _, pg, _, _ in summary.values()))

    if "ckptstore" in summary:
        c_tm, c_stored, c_pg, *_ = summary["ckptstore"]
        print("\nckptstore against each writer (medians): save time ratio = stored-bytes ratio x server "
              "CPU per byte ratio x the rest")
        for w, (tm, stored, pg, *_rest) in summary.items():
            if w == "ckptstore":
                continue
            t, b, c = c_tm.seconds / tm.seconds, c_stored / stored, c_pg / pg
            print(f"  {w:<18} time {t:.3f} = bytes {b:.3f} x CPU/byte {c:.3f} x rest {t / (b * c):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
