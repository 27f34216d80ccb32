"""Before/after on local disk: two library trees side by side in one run.

Run from the repository root::

    python -m benchmarks.tools.ab --lib before=/tmp/ckpt-main --lib after=. [--workloads a,e,b]
                            [--repeat 3] [--stages] [--json OUT]

Each ``--lib NAME=PATH`` names a directory holding a ``ckptstore`` package
(a checkout, or ``git archive main ckptstore | tar -x -C DIR``). Every
library runs in its own worker process (``PYTHONPATH=PATH``, checked
against ``ckptstore.__file__``), which builds the workloads' data itself
(b once, by the parent, through a ``torch.save`` file) and answers
commands; rounds are interleaved (round r runs every library's DCP and
ckptstore save and load, the order of the libraries alternating), so
noise from other tenants spreads over both alike. Rows report the median
round and the CPU seconds of the worker during it.

Per round and library: DCP ``FileSystemWriter`` save (fsyncs, like
``benchmarks.run``'s ``dcp-fs``) and ``FileSystemReader`` load in place;
ckptstore ``ckptstore.open(dir).save`` (a fresh handle, opened inside the
timing as in ``benchmarks.run``) and ``load(1, into=...)`` on a fresh
handle. Every load is compared bit for bit.

``--stages`` wraps the pipeline's functions in the workers (hash, encode,
copy into part buffers, part writes, fsync, small objects, commit steps,
decode, range reads, waits on futures and semaphores) and reports, per
stage, exclusive wall and thread-CPU seconds summed over threads, CPU-s
per GiB, and the main thread's share (its critical path). Names that a
tree does not have are skipped, so both trees can be profiled alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

MiB = 1 << 20
GiB = 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------- stage accounting (workers)
class Stages:
    """Exclusive wall and thread-CPU time per stage, per thread kind (main or pool)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.tls = threading.local()
        self.data: dict[tuple[str, bool], list[float]] = {}

    def reset(self):
        with self.lock:
            self.data = {}

    def wrap(self, owner, attr: str, name: str) -> bool:
        fn = getattr(owner, attr, None)
        if fn is None or getattr(fn, "_ab_stage", None):
            return False
        stages = self

        def wrapper(*a, **k):
            stack = getattr(stages.tls, "stack", None)
            if stack is None:
                stack = stages.tls.stack = []
            w0, c0 = time.perf_counter(), time.thread_time()
            stack.append([0.0, 0.0])
            try:
                return fn(*a, **k)
            finally:
                cw, cc = stack.pop()
                w, c = time.perf_counter() - w0, time.thread_time() - c0
                if stack:
                    stack[-1][0] += w
                    stack[-1][1] += c
                main = threading.current_thread() is threading.main_thread()
                with stages.lock:
                    d = stages.data.setdefault((name, main), [0, 0.0, 0.0])
                    d[0] += 1
                    d[1] += w - cw
                    d[2] += c - cc

        wrapper._ab_stage = True
        wrapper.__name__ = getattr(fn, "__name__", attr)
        setattr(owner, attr, wrapper)
        return True

    def snapshot(self) -> dict:
        with self.lock:
            return {f"{n}|{'main' if m else 'pool'}": v[:] for (n, m), v in self.data.items()}


def install_stages(stages: Stages) -> list[str]:
    """Wrap whatever of the known pipeline functions this tree has; returns the stages wrapped."""
    import concurrent.futures as cf
    import importlib

    targets = [
        ("ckptstore.format.codec", None, "hash_bytes", "hash"),
        ("ckptstore.format.codec", None, "encode_pieces", "encode"),
        ("ckptstore.format.codec", None, "decode", "decode"),
        ("ckptstore.format.codec", None, "decode_into", "decode"),
        ("ckptstore.format.codec", None, "decode_verified", "decode"),
        ("ckptstore.format.codec", None, "decode_verified_into", "decode"),
        ("ckptstore.storage.upload", "ParallelUploader", "write", "append to upload (copy/queue)"),
        ("ckptstore.storage.local", "_LocalMultipart", "upload_part", "write part (pwrite)"),
        ("ckptstore.storage.local", "_LocalMultipart", "write_at", "write piece (pwritev)"),
        ("ckptstore.storage.local", "_LocalMultipart", "complete", "complete pack (fsync, rename)"),
        ("ckptstore.storage.local", "LocalStore", "put", "small objects (put)"),
        ("ckptstore.storage.local", "LocalStore", "put_if_absent", "small objects (put)"),
        ("ckptstore.storage.local", "LocalStore", "get", "small objects (get, list, head)"),
        ("ckptstore.storage.local", "LocalStore", "head", "small objects (get, list, head)"),
        ("ckptstore.storage.local", "LocalStore", "list", "small objects (get, list, head)"),
        ("ckptstore.storage.local", "LocalStore", "exists", "small objects (get, list, head)"),
        ("ckptstore.storage.local", "LocalStore", "delete", "small objects (put)"),
        ("ckptstore.storage.local", "LocalStore", "get_ranges", "read ranges (pread)"),
        ("ckptstore.storage.local", "LocalStore", "get_ranges_into", "read ranges (pread)"),
        ("ckptstore.repo.save", "StepCommit", "begin", "begin (config, lease, base)"),
        ("ckptstore.repo.save", "StepCommit", "commit", "commit (manifest)"),
        ("ckptstore.repo.save", "StepCommit", "end", "end (lease)"),
        ("ckptstore.repo.save", None, "write_segment", "chunk-table segment"),
        ("ckptstore.pipeline.pack_writer", "PackWriter", "finish", "finish packs (wait, head)"),
        ("ckptstore.repo.catalog", "Catalog", "manifest", "read manifest"),
        ("os", None, "fsync", "fsync"),
        ("os", None, "fdatasync", "fsync"),
        ("concurrent.futures", "Future", "result", "wait (future)"),
        ("concurrent.futures", None, "wait", "wait (future)"),
        ("threading", "Semaphore", "acquire", "wait (window/budget)"),
        ("ckptstore.pipeline.runtime", "ByteBudget", "acquire", "wait (window/budget)"),
    ]
    done = []
    for mod, cls, attr, name in targets:
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        owner = getattr(m, cls, None) if cls else m
        if owner is not None and stages.wrap(owner, attr, name):
            done.append(f"{mod}.{cls + '.' if cls else ''}{attr}")
    del cf
    return done


# ---------------------------------------------------------------- worker
def build(wl: str, bfile: str | None):
    import torch

    sys.path.insert(0, ROOT)
    from benchmarks.common.workloads import build

    if wl == "b":  # built once by the parent (see main), so that every tree loads the same bytes
        return torch.load(bfile, weights_only=True)
    return build(wl, 1.0)


def worker(lib: str, bfile: str | None, stages_on: bool) -> int:
    import resource

    import torch

    import ckptstore

    here = os.path.realpath(os.path.dirname(ckptstore.__file__))
    if not here.startswith(os.path.realpath(lib) + os.sep):
        print(json.dumps({"error": f"ckptstore imported from {here}, not from {lib}"}), flush=True)
        return 2
    sys.path.insert(0, ROOT)
    from benchmarks.common.verify import scrub, verify

    stages = Stages()
    wrapped = install_stages(stages) if stages_on else []

    def cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    data: dict = {}
    tmp = tempfile.mkdtemp(prefix="ckpt-ab-", dir="/tmp")
    print(json.dumps({"ready": here, "wrapped": wrapped}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            wl, system = cmd["wl"], cmd["system"]
            if wl not in data:
                data.clear()
                gc.collect()
                sd = build(wl, bfile)
                data[wl] = (sd, {k: torch.zeros_like(v) for k, v in sd.items()})
            sd, like = data[wl]
            path = os.path.join(tmp, f"{wl}-{system}")
            out = {"wl": wl, "system": system}
            if system == "dcp-fs":
                import warnings

                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

                warnings.filterwarnings("ignore")

                def save():
                    dcp.save(sd, storage_writer=FileSystemWriter(path))

                def load():
                    dcp.load(like, storage_reader=FileSystemReader(path))
            else:
                def save():
                    repo = ckptstore.open(path)
                    out["info"] = repo.save(sd, step=1).as_dict()
                    return repo

                def load():
                    with ckptstore.open(path) as repo:
                        repo.load(1, into=like)

            for op, fn in (("save", save), ("load", load)):
                if op == "load":
                    scrub(like)
                gc.collect()
                stages.reset()
                c0, t0 = cpu(), time.perf_counter()
                r = fn()
                out[f"{op}_s"] = time.perf_counter() - t0
                out[f"{op}_cpu"] = cpu() - c0
                if stages_on:
                    out[f"{op}_stages"] = stages.snapshot()
                if r is not None:
                    r.close()  # outside the timing, as in benchmarks.run
            verify(sd, like, f"{wl} {system} load")
            out["stored"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
            shutil.rmtree(path, ignore_errors=True)
            print(json.dumps(out), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


# ---------------------------------------------------------------- parent
def start_worker(name: str, lib: str, bfile: str | None, stages_on: bool) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(lib) + os.pathsep + ROOT)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", os.path.abspath(lib)]
    if bfile:
        cmd += ["--bfile", bfile]
    if stages_on:
        cmd.append("--stages")
    # cwd outside the checkout: the library comes from PYTHONPATH only.
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/")
    hello = json.loads(p.stdout.readline() or '{"error": "worker died"}')
    if "error" in hello:
        raise SystemExit(f"{name}: {hello['error']}")
    print(f"{name}: ckptstore from {hello['ready']}" + (f", {len(hello['wrapped'])} functions wrapped"
                                                         if stages_on else ""), flush=True)
    return p


def ask(p: subprocess.Popen, wl: str, system: str) -> dict:
    p.stdin.write(json.dumps({"wl": wl, "system": system}) + "\n")
    p.stdin.flush()
    line = p.stdout.readline()
    if not line:
        raise SystemExit(f"worker died during {wl} {system}")
    return json.loads(line)


def median_of(rs: list[dict], key: str) -> dict:
    return sorted(rs, key=lambda r: r[key])[(len(rs) - 1) // 2]


def stage_table(r: dict, op: str, nbytes: int) -> list[str]:
    st = r.get(f"{op}_stages") or {}
    rows: dict[str, list[float]] = {}
    for k, (n, w, c) in st.items():
        name, kind = k.rsplit("|", 1)
        d = rows.setdefault(name, [0, 0.0, 0.0, 0.0, 0.0])
        d[0] += n
        d[1] += w
        d[2] += c
        if kind == "main":
            d[3] += w
            d[4] += c
    gib = nbytes / GiB
    out = [f"      {'stage':<34} {'calls':>6} {'wall s':>7} {'CPU s':>6} {'CPU s/GiB':>9} {'main wall':>9}"]
    for name, (n, w, c, mw, mc) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
        out.append(f"      {name:<34} {n:>6} {w:>7.3f} {c:>6.3f} {c / gib:>9.3f} {mw:>9.3f}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tools.ab", description=__doc__.split("\n")[0])
    ap.add_argument("--lib", action="append", default=[], metavar="NAME=PATH",
                    help="a library tree to measure (repeat; at least one)")
    ap.add_argument("--workloads", default="a,e,b", help="comma-separated subset of a,e,b")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stages", action="store_true", help="per-stage wall/CPU accounting in the workers")
    ap.add_argument("--no-dcp", action="store_true", help="skip the DCP FileSystemWriter rows")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--worker", metavar="LIB", help=argparse.SUPPRESS)
    ap.add_argument("--bfile", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.bfile, args.stages)
    libs = []
    for spec in args.lib:
        name, _, path = spec.partition("=")
        if not path or not os.path.isdir(os.path.join(path, "ckptstore")):
            ap.error(f"--lib {spec!r}: want NAME=PATH with PATH/ckptstore/")
        libs.append((name, path))
    if not libs:
        ap.error("give at least one --lib")
    wls = [w.strip() for w in args.workloads.split(",") if w.strip()]
    sys.path.insert(0, ROOT)
    from benchmarks.common.report import env_line

    print(f"command: python -m benchmarks.tools.ab {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(env_line() + f", load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    bfile = None
    tmpdir = tempfile.mkdtemp(prefix="ckpt-ab-b-", dir="/tmp")
    try:
        if "b" in wls:
            import torch

            from benchmarks.common.workloads import data_b

            t0 = time.perf_counter()
            bfile = os.path.join(tmpdir, "b.pt")
            torch.save(data_b(), bfile)
            print(f"b built in {time.perf_counter() - t0:.1f} s", flush=True)
        workers = {name: start_worker(name, path, bfile, args.stages) for name, path in libs}
        systems = [] if args.no_dcp else ["dcp-fs"]
        systems.append("ckptstore")
        results: dict[tuple[str, str, str], list[dict]] = {}
        sizes: dict[str, int] = {}
        for wl in wls:
            for rnd in range(args.repeat):
                order = libs if rnd % 2 == 0 else libs[::-1]
                for name, _ in order:
                    for system in systems:
                        r = ask(workers[name], wl, system)
                        if system == "ckptstore":
                            sizes[wl] = r["info"]["logical_bytes"]
                        results.setdefault((wl, name, system), []).append(r)
                        print(f"  .. {wl} r{rnd} {name:<8} {system:<9} save {r['save_s']:6.3f} s "
                              f"({r['save_cpu']:5.2f} CPU s)  load {r['load_s']:6.3f} s ({r['load_cpu']:5.2f} CPU s)",
                              flush=True)
        for p in workers.values():
            p.stdin.close()
            p.wait()
        print()
        print(f"medians of {args.repeat} rounds; load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print("'/dcp': the median over rounds of (this save / the DCP save just before it, same worker); "
              "'min': the smallest of those ratios")
        print(f"{'wl':<3} {'library':<8} {'system':<9} {'save s':>7} {'CPU s/GiB':>9} {'/dcp':>6} {'min':>6} "
              f"{'load s':>7} {'CPU s/GiB':>9} {'/dcp':>6} {'min':>6} {'stored MiB':>10}")
        summary = []
        for wl in wls:
            gib = sizes.get(wl, GiB) / GiB
            for name, _ in libs:
                dcp = results.get((wl, name, "dcp-fs"))
                for system in systems:
                    rs = results[(wl, name, system)]
                    s, lo = median_of(rs, "save_s"), median_of(rs, "load_s")
                    ratios = {}
                    for op in ("save", "load"):
                        if dcp and system != "dcp-fs":
                            rr = sorted(x[f"{op}_s"] / d[f"{op}_s"] for x, d in zip(rs, dcp))
                            ratios[op] = (rr[(len(rr) - 1) // 2], rr[0])
                    fmt = lambda op: (f"{ratios[op][0]:6.3f} {ratios[op][1]:6.3f}" if op in ratios  # noqa: E731
                                      else "     -      -")
                    print(f"{wl:<3} {name:<8} {system:<9} {s['save_s']:7.3f} {s['save_cpu'] / gib:9.2f} {fmt('save')} "
                          f"{lo['load_s']:7.3f} {lo['load_cpu'] / gib:9.2f} {fmt('load')} {s['stored'] / MiB:10.1f}")
                    summary.append({"workload": wl, "library": name, "system": system,
                                    "save_seconds": s["save_s"], "save_cpu": s["save_cpu"],
                                    "load_seconds": lo["load_s"], "load_cpu": lo["load_cpu"],
                                    "all_save_seconds": [x["save_s"] for x in rs],
                                    "all_load_seconds": [x["load_s"] for x in rs], "stored": s["stored"],
                                    "save_over_dcp": ratios.get("save"), "load_over_dcp": ratios.get("load")})
                    if args.stages and system == "ckptstore":
                        for op, r in (("save", s), ("load", lo)):
                            print(f"    {op} stages ({name}, median round: {r[op + '_s']:.3f} s wall, "
                                  f"{r[op + '_cpu']:.2f} CPU s):")
                            print("\n".join(stage_table(r, op, sizes.get(wl, GiB))))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": sys.argv, "libs": libs, "rows": summary,
                           "raw": {"|".join(k): v for k, v in results.items()}}, f, indent=1)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
