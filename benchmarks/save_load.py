"""Save/load benchmark: torch.save, DCP, ckptstore (local dir and moto S3).

Run from the repository root::

    python -m benchmarks.save_load [--size-gib 1.0] [--json OUT.json] [--skip-s3]

One process builds one synthetic fp32 state dict (values from ``torch.randn``)
and, on that same data, times:

* ``torch.save`` to a file on local disk plus ``fsync`` / ``torch.load``
  (``weights_only=True``);
* ``torch.distributed.checkpoint`` with ``FileSystemWriter`` /
  ``FileSystemReader`` (single process, no process group; files fsynced);
* ckptstore to a local directory: save step 1, save step 2 of the same data
  (dedup: uploads only a manifest), ``load(1)``, ``load(1, into=...)`` and
  one 128-row slice read;
* the same ckptstore steps on a moto S3 server on loopback (64 MiB packs).

Every load is compared bit for bit (``torch.equal``) with the source; any
difference raises and the run exits non-zero. An untimed torch.save/load
round runs first (page cache and fresh-memory warm-up). Timings are single
shots (``--repeat N``: fastest of N) on a warm page cache; see
``benchmarks/README.md`` for the caveats.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch

import ckptstore

from .common.data import build_state_dict
from .common.measure import GiB, MiB, Timer, dir_bytes, loadavg, rss_now, rss_peak, rss_peak_children
from .common.report import command_line, env_line, format_table, human, write_results
from .common.servers import moto_process, moto_thread
from .common.verify import VerificationError, nbytes, scrub, verify

BUCKET = "ckptbench"
S3_PACK_SIZE = 64 * MiB
SLICE_ROWS = 128


def empty_like(sd: dict) -> dict:
    """Preallocated destination tensors (pages touched once, outside timing)."""
    return {k: torch.zeros_like(v) for k, v in sd.items()}


class Results:
    def __init__(self, logical: int, quiet: bool = False):
        self.logical = logical
        self.quiet = quiet  # warm-up: measure nothing
        self.rows: list[dict] = []
        self.repeat = 1

    def add(self, section: str, op: str, kind: str, tm: "Timer", logical: int | None = None,
            written: int | None = None, note: str = "") -> dict | None:
        if self.quiet:
            return None
        logical = self.logical if logical is None else logical
        seconds = tm.seconds
        row = {
            "section": section,
            "operation": op,
            "kind": kind,  # "save" | "load" | "read"
            "seconds": seconds,
            "logical_bytes": logical,
            "gb_per_s": logical / seconds / 1e9 if seconds > 0 else None,
            "written_bytes": written,
            "cpu_seconds": tm.cpu,
            "server_cpu_seconds": tm.server_cpu,
            "minor_page_faults": tm.minflt,
            "rss_peak_bytes": rss_peak(),
            "rss_after_bytes": rss_now(),
            "note": note,
        }
        self.rows.append(row)
        print(f"  .. {kind:<4}  {section:<12} {op:<36} {seconds:8.2f} s", flush=True)
        return row

    def finish(self) -> None:
        base = {"save": self._first("save"), "load": self._first("load"), "read": self._first("load")}
        for r in self.rows:
            b = base.get(r["kind"])
            r["vs_torch"] = r["seconds"] / b if b else None

    def _first(self, kind):
        for r in self.rows:
            if r["section"] == "torch" and r["kind"] == kind:
                return r["seconds"]
        return None

    def table(self) -> str:
        head = ["operation", "seconds", "GB/s", "written", "vs torch", "CPU s", "moto CPU s", "peak RSS"]
        lines = []
        for r in self.rows:
            ratio = r.get("vs_torch")
            lines.append([
                f"{r['section']}: {r['operation']}",
                f"{r['seconds']:.3f}",
                f"{r['gb_per_s']:.3f}" if r["gb_per_s"] is not None else "-",
                human(r["written_bytes"]) if r["written_bytes"] is not None else "-",
                f"{ratio:.2f}x" if ratio is not None else "-",
                f"{r['cpu_seconds']:.2f}",
                f"{r['server_cpu_seconds']:.2f}" if r["server_cpu_seconds"] is not None else "-",
                f"{r['rss_peak_bytes'] / GiB:.2f} GiB",
            ])
        return format_table(head, lines, left=1)


# ---------------------------------------------------------------- torch
def bench_torch(sd: dict, tmp: str, res: Results) -> None:
    path = os.path.join(tmp, "torch", "ckpt.pt")
    os.makedirs(os.path.dirname(path))
    with Timer() as tm:
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
    res.add("torch", "torch.save + fsync", "save", tm, written=os.path.getsize(path))

    with Timer() as tm:
        loaded = torch.load(path, weights_only=True)
    res.add("torch", "torch.load(weights_only=True)", "load", tm)
    verify(sd, loaded, "torch.load")
    del loaded
    shutil.rmtree(os.path.dirname(path))


# ---------------------------------------------------------------- DCP
def bench_dcp(sd: dict, like: dict, tmp: str, res: Results) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    path = os.path.join(tmp, "dcp")
    with warnings.catch_warnings():
        # "torch.distributed is disabled, unavailable or uninitialized,
        # assuming the intent is to ... in a single process": that is the intent.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        with Timer() as tm:
            dcp.save(sd, storage_writer=FileSystemWriter(path))  # sync_files=True: fsyncs
        res.add("dcp", "dcp.save(FileSystemWriter)", "save", tm, written=dir_bytes(path))

        scrub(like)
        with Timer() as tm:
            dcp.load(like, storage_reader=FileSystemReader(path))
    res.add("dcp", "dcp.load(FileSystemReader) in place", "load", tm)
    verify(sd, like, "dcp.load")
    shutil.rmtree(path)


# ---------------------------------------------------------------- ckptstore
def bench_ckptstore(section: str, url: str, storage_options, options: dict, sd: dict, like: dict,
                    res: Results, report: dict, server_pid: int | None = None) -> None:
    infos = []
    repo = ckptstore.open(url, storage_options=storage_options, **options)
    try:
        for step, label in ((1, "save step 1"), (2, "save step 2 (same data)")):
            with Timer(server_pid) as tm:
                info = repo.save(sd, step=step)
            infos.append(info.as_dict())
            note = (f"new {human(info.new_bytes)} -> {human(info.stored_bytes)} "
                    f"(x{info.compression_ratio:.3f}), reused {human(info.reused_bytes)}, "
                    f"{info.packs} packs, StepInfo.seconds {info.seconds:.2f}")
            res.add(section, label, "save", tm, written=info.uploaded_bytes, note=note)
        stats = repo.stats()
    finally:
        repo.close()

    # A fresh handle for loads, as a restarted job has: no manifest cache.
    repo = ckptstore.open(url, storage_options=storage_options, **options)
    try:
        with Timer(server_pid) as tm:
            loaded = repo.load(1)
        res.add(section, "load(1)", "load", tm)
        verify(sd, loaded, f"{section} load(1)")
        del loaded

        scrub(like)
        with Timer(server_pid) as tm:
            out = repo.load(1, into=like)
        res.add(section, "load(1, into=preallocated)", "load", tm)
        if out is not like:
            raise VerificationError(f"{section} load(1, into=...) returned a new dict, not `into`")
        verify(sd, like, f"{section} load(1, into=...)")

        key = "embed_tokens.weight"
        with Timer(server_pid) as tm:
            part = repo.checkpoint(1).read(key, (slice(0, SLICE_ROWS), slice(None)))
        want = sd[key][:SLICE_ROWS]
        res.add(section, f"read {key}[:{SLICE_ROWS}]", "read", tm, logical=want.numel() * want.element_size())
        verify({key: want}, {key: part}, f"{section} checkpoint(1).read(slice)")
    finally:
        repo.close()
    report[section] = {"url": url, "options": options, "saves": infos, "stats": stats}


# ---------------------------------------------------------------- main
def run_suite(args, sd: dict, like: dict, res: Results, report: dict) -> None:
    """Every row once, on the same data; temp files removed whatever happens."""
    local_opts: dict = {}
    s3_opts = {"pack_size": S3_PACK_SIZE}
    tmp = tempfile.mkdtemp(prefix="ckptbench-", dir="/tmp")
    try:
        bench_torch(sd, tmp, res)
        bench_dcp(sd, like, tmp, res)
        bench_ckptstore("ckpt-local", os.path.join(tmp, "repo"), None, local_opts, sd, like, res, report)
        shutil.rmtree(os.path.join(tmp, "repo"))
        if not args.skip_s3:
            server_cm = moto_thread(BUCKET) if args.moto_in_process else moto_process(BUCKET)
            with server_cm as server:
                bench_ckptstore("ckpt-s3moto", f"s3://{BUCKET}/bench", server.storage_options(), s3_opts,
                                sd, like, res, report, server_pid=server.pid)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def best_of(runs: list[Results]) -> Results:
    """Per row, the repetition with the shortest wall time (all samples kept)."""
    out = Results(runs[0].logical)
    out.repeat = len(runs)
    for i, row in enumerate(runs[0].rows):
        samples = [r.rows[i] for r in runs]
        best = dict(min(samples, key=lambda r: r["seconds"]))
        best["samples_seconds"] = [r["seconds"] for r in samples]
        out.rows.append(best)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.save_load", description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="state dict size (default 1.0)")
    ap.add_argument("--json", metavar="OUT.json", help="write the results here")
    ap.add_argument("--skip-s3", action="store_true", help="skip the moto S3 rows")
    ap.add_argument("--moto-in-process", action="store_true",
                    help="run moto in a thread of this process (shares the GIL and the RSS) "
                         "instead of a child process")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every row N times and report the fastest (default 1)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the untimed torch.save/torch.load round before the measurements")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")

    command = command_line("benchmarks.save_load", argv)
    print(f"command: {command}", flush=True)
    print(env_line(), flush=True)

    t0 = time.perf_counter()
    sd = build_state_dict(args.size_gib, args.seed)
    logical = nbytes(sd)
    big = sum(1 for t in sd.values() if t.numel() >= 4096 * 4096)
    print(f"state dict: {len(sd)} fp32 tensors ({big} of 4096x4096), {logical / GiB:.3f} GiB "
          f"(built in {time.perf_counter() - t0:.1f} s)", flush=True)
    like = empty_like(sd)

    if not args.no_warmup:
        # On a VM the first write of ~1 GiB into the page cache, and the first
        # touch of ~1 GiB of fresh memory, cost seconds of kernel time that
        # would otherwise be charged to whichever row runs first (torch.save,
        # torch.load). One untimed torch.save/torch.load round pays them here.
        t0 = time.perf_counter()
        tmp = tempfile.mkdtemp(prefix="ckptbench-warmup-", dir="/tmp")
        try:
            bench_torch(sd, tmp, Results(logical, quiet=True))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"warm-up (untimed torch.save + torch.load): {time.perf_counter() - t0:.1f} s", flush=True)

    report: dict = {}
    runs: list[Results] = []
    moto_rss = None
    started = time.perf_counter()
    for rep in range(args.repeat):
        if args.repeat > 1:
            print(f"repetition {rep + 1} of {args.repeat}", flush=True)
        res = Results(logical)
        run_suite(args, sd, like, res, report)
        runs.append(res)
        if not args.skip_s3 and not args.moto_in_process:
            moto_rss = rss_peak_children()
    total = time.perf_counter() - started
    res = best_of(runs)
    res.finish()

    print()
    print(f"Produced by: {command}")
    print(f"Data: {len(sd)} fp32 randn tensors, {logical / GiB:.3f} GiB logical "
          f"({logical / 1e9:.3f} GB); GB/s = logical bytes / seconds / 1e9.")
    print("'vs torch' = seconds / torch.save seconds for saves, / torch.load seconds for loads and reads.")
    print("'CPU s' = user+system CPU seconds of this process during the operation (2 cores: at most 2x wall); "
          "'moto CPU s' = the same for the moto server child process.")
    if args.repeat > 1:
        print(f"Each row: fastest of {args.repeat} repetitions (every sample is in the JSON).")
    else:
        print("Each row: one measurement (use --repeat N for the fastest of N).")
    print(res.table())
    print()
    for r in runs[-1].rows:
        if r["note"]:
            print(f"  {r['section']}: {r['operation']}: {r['note']}")
    for section, rep in report.items():
        st = rep["stats"]
        print(f"  {section}: repository holds {st['packs']} packs, {human(st['stored_bytes'])} for "
              f"{human(st['logical_bytes'])} logical over {st['steps']} steps "
              f"(dedup x{st['dedup_ratio']:.2f}, compression x{st['compression_ratio']:.3f}); "
              f"options {rep['options'] or 'defaults'}")
    peak = rss_peak()
    print(f"peak RSS of this process: {peak / GiB:.2f} GiB (ru_maxrss; the state dict itself is "
          f"{logical / GiB:.2f} GiB and the preallocated load target another {logical / GiB:.2f} GiB)")
    if moto_rss is not None:
        print(f"peak RSS of the moto server child: {moto_rss / GiB:.2f} GiB")
    print(f"benchmark wall time (excluding data generation): {total:.1f} s; load average at end {loadavg()} "
          f"(above ~1 at the start means something else was using the {os.cpu_count()} CPUs)")

    if args.json:
        write_results(args.json, command, {
            "data": {"tensors": len(sd), "logical_bytes": logical, "seed": args.seed,
                     "size_gib": args.size_gib},
            "repeat": args.repeat,
            "warmup": not args.no_warmup,
            "rows": res.rows,
            "ckptstore": report,
            "peak_rss_bytes": peak,
            "moto_peak_rss_bytes": moto_rss,
            "moto_in_process": bool(args.moto_in_process) and not args.skip_s3,
            "wall_seconds": total,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
