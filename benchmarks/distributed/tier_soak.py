"""The node-local tier's budget over many saves, and a 2-process soak sharing one tier (issue 26).

Run from the repository root::

    python -m benchmarks.distributed.tier_soak [--saves 20] [--seconds 60] [--seed N] [--json OUT.json]

Everything runs against local-directory repositories (plain paths) and
tiers under one temporary directory; packs of 1 MiB and chunks of 64 KiB,
so that a budget of a few packs makes eviction run. Every tensor's
contents come from the run's seed, the tensor's index and the step at
which it last changed, so any step can be regenerated and compared bit for
bit (the seed is printed first; ``--seed`` repeats a run).

1. **Budget over ``--saves`` saves of changing data.** One repository
   opened with ``cache_dir=<tmp>/tier`` and ``cache_size`` = 6 packs
   (6 MiB); a state dict of 8 fp32 ``randn`` tensors of 512 KiB (4 MiB
   raw: a write-back save refuses a state dict whose raw size is over
   ``cache_size``, see below), of which 4 get new values at every step (3
   always, the other 5 in turn), so dedup keeps half. After each save the
   tier's bytes are measured two ways: the files the budget counts
   (``ckptstore.tier.cache.tier_files``: packs, segments, chunk files, ``wb/``)
   and every file under ``cache_dir`` (``os.walk``: also ``.tmp/``,
   pending and recent records, marks); a second thread samples both every
   2 ms to catch peaks inside and between saves. Done twice: write-through
   (the default) and ``write_back=True`` (then ``repo.flush()``). Reports
   the maxima against ``cache_size`` + the largest pack the store holds
   (target: never above), the evictions (``repo.tier.stats["evicted"]``),
   and loads every step back from a fresh handle without a tier, bit for
   bit. One more save checks that write-back refuses, before writing
   anything, a state dict (8 x 1 MiB) whose raw size is over ``cache_size``.

2. **Two processes sharing one tier, ``--seconds`` long** (``multiprocessing``,
   "spawn"): a *writer* saving steps 1, 2, 3, ... with ``write_back=True``
   (8 tensors of 256 KiB: 2 new at every step, 4 in turn, 2 never, so
   steps share packs), and a *reader* that opens the repository with the
   same ``cache_dir`` over and over (a fresh handle each time) and loads
   the newest committed step (``repo.latest()``), and every third time also
   an older committed step chosen at random, comparing each bit for bit.
   Both handles have ``cache_size`` = 4 packs, so eviction runs while the
   other process reads and writes. The parent samples the tier's size every
   5 ms. Counted: steps saved, loads, stored bytes by source
   (``repo.read_stats()``), mismatches (wrong data without an error),
   errors by type. At the end the writer flushes, and a fresh handle
   without a tier checks that every step the writer committed is in the
   store and loads bit-exact. ``data_lost`` = mismatches + missing or wrong
   committed steps (target 0).

A benchmark, not a test: it reports the figures and whether each target was
met, and exits 0 unless the run itself failed. About 1.5 minutes with the
defaults on the 2-core VM. See ``benchmarks/README.md`` and
``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback

from ..common.measure import MiB, dir_bytes, loadavg
from ..common.report import command_line, env_line, format_table, git_commit, human, write_results

KiB = 1 << 10
CHUNK_SIZE = 64 << 10
PACK_SIZE = 1 << 20
OPTS = dict(chunk_size=CHUNK_SIZE, pack_size=PACK_SIZE)

# (tensors, bytes each, changed at every step, changed in turn, budget in packs)
BUDGET = dict(n=8, nbytes=512 * KiB, fresh=3, rotating=5, cache_packs=6)
SOAK = dict(n=8, nbytes=256 * KiB, fresh=2, rotating=4, cache_packs=4)


# ---------------------------------------------------------------- data
def version(i: int, step: int, fresh: int, rotating: int) -> int:
    """The step at which tensor ``i`` last got new values (0: its first values, never changed)."""
    if i < fresh:
        return step
    if i < fresh + rotating:
        k = i - fresh
        last = step - ((step - k) % rotating)
        return last if last >= 1 else 0
    return 0


def state(seed: int, step: int, n: int, nbytes: int, fresh: int, rotating: int, **_) -> dict:
    """The state dict of ``step``: deterministic from (seed, tensor index, version)."""
    import torch

    out = {}
    for i in range(n):
        v = version(i, step, fresh, rotating)
        g = torch.Generator().manual_seed(((seed * 1_000_003 + i) * 1_000_033 + v) % (1 << 63))
        out[f"t{i}"] = torch.randn(nbytes // 4 // 256, 256, generator=g)
    return out


def same(expected: dict, got) -> str | None:
    """None when ``got`` holds exactly ``expected``'s tensors bit for bit, else what differs."""
    from ..common.verify import VerificationError, verify

    try:
        verify(expected, got, "load")
    except VerificationError as e:
        return str(e)
    return None


# ---------------------------------------------------------------- sizes
def tier_bytes(cache_dir: str) -> int:
    """What the budget counts: ``tier_files`` (packs, segments, chunk files, pending ``wb/`` files)."""
    return tier_split(cache_dir)[0]


def tier_split(cache_dir: str) -> tuple[int, int]:
    """``tier_files``' bytes: (all of them, those of pending write-back steps under ``wb/``)."""
    from ckptstore.tier.cache import is_pending_file, tier_files

    total = wb = 0
    for path, size, *_ in tier_files(cache_dir):
        total += size
        if is_pending_file(path):
            wb += size
    return total, wb


def largest_pack(url: str) -> int:
    sizes = [os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(url, "packs")) for f in fs]
    return max(sizes, default=0)


class Sampler:
    """A thread measuring a tier every ``interval`` seconds: the maxima of both measures."""

    def __init__(self, cache_dir: str, interval: float):
        self.cache_dir, self.interval = cache_dir, interval
        self.max_tier = self.max_all = self.samples = 0
        self.wb_at_max = 0  # bytes under wb/ (pending steps, never evicted) in the sample of max_tier
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total, wb = tier_split(self.cache_dir)
            if total > self.max_tier:
                self.max_tier, self.wb_at_max = total, wb
            self.max_all = max(self.max_all, dir_bytes(self.cache_dir))
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------- 1. budget over N saves
def budget_run(mode: str, seed: int, saves: int, tmp: str) -> dict:
    import ckptstore

    url, cache = os.path.join(tmp, f"repo-{mode}"), os.path.join(tmp, f"tier-{mode}")
    cache_size = BUDGET["cache_packs"] * PACK_SIZE
    repo = ckptstore.open(url, cache_dir=cache, cache_size=cache_size, write_back=mode == "write-back", **OPTS)
    after, secs, stored = [], [], 0
    t0 = time.perf_counter()
    with Sampler(cache, 0.002) as sampler:
        try:
            for s in range(1, saves + 1):
                sd = state(seed, s, **BUDGET)
                t = time.perf_counter()
                info = repo.save(sd, step=s, metadata={"seed": seed, "step": s})
                secs.append(time.perf_counter() - t)
                stored += info.uploaded_bytes
                after.append({"step": s, "tier": tier_bytes(cache), "all": dir_bytes(cache)})
            if mode == "write-back":
                t = time.perf_counter()
                repo.flush()
                flush_s = time.perf_counter() - t
            else:
                flush_s = 0.0
            stats = dict(repo.tier.stats)
        finally:
            repo.close()
        after.append({"step": "end", "tier": tier_bytes(cache), "all": dir_bytes(cache)})
    wall = time.perf_counter() - t0
    # every step back from the store alone, bit for bit
    checked, bad = 0, []
    with ckptstore.open(url) as fresh:
        steps = fresh.steps()
        for s in steps:
            why = same(state(seed, s, **BUDGET), fresh.load(s))
            checked += 1
            if why:
                bad.append(f"step {s}: {why}")
    missing = sorted(set(range(1, saves + 1)) - set(steps))
    pack = largest_pack(url)
    return {
        "mode": mode, "saves": saves, "cache_size": cache_size, "largest_pack": pack,
        "allowance": cache_size + pack, "stored_bytes": stored, "raw_bytes_per_step": BUDGET["n"] * BUDGET["nbytes"],
        "max_tier_after_save": max(a["tier"] for a in after), "max_all_after_save": max(a["all"] for a in after),
        "max_tier_sampled": max(sampler.max_tier, max(a["tier"] for a in after)),
        "wb_at_max_sampled": sampler.wb_at_max if sampler.max_tier >= max(a["tier"] for a in after) else None,
        "max_all_sampled": max(sampler.max_all, max(a["all"] for a in after)),
        "samples": sampler.samples, "after_each_save": after, "tier_stats": stats, "evicted": stats["evicted"],
        "save_seconds": secs, "flush_seconds": flush_s, "wall_seconds": wall,
        "steps_checked": checked, "steps_missing": missing, "mismatches": bad,
    }


def refusal_check(seed: int, tmp: str) -> dict:
    """Write-back with a state dict whose raw size is over cache_size: refused before anything is written."""
    import ckptstore
    from ckptstore.repo.writeback import WriteBackError

    url, cache = os.path.join(tmp, "repo-refuse"), os.path.join(tmp, "tier-refuse")
    layout = dict(BUDGET, nbytes=1 * MiB)
    out = {"raw_bytes": layout["n"] * layout["nbytes"], "cache_size": BUDGET["cache_packs"] * PACK_SIZE}
    with ckptstore.open(url, cache_dir=cache, cache_size=out["cache_size"], write_back=True, **OPTS) as repo:
        try:
            repo.save(state(seed, 1, **layout), step=1)
            out["refused"], out["error"] = False, None
        except WriteBackError as e:
            out["refused"], out["error"] = True, str(e)
        out["tier_bytes_after"] = tier_bytes(cache)
        out["steps_after"] = repo.steps(pending=True)
    return out


# ---------------------------------------------------------------- 2. two processes, one tier
def _proc_setup() -> None:
    import torch

    torch.set_num_threads(1)


def writer_main(cfg: dict, ready, go, results) -> None:
    """Save steps 1, 2, ... with write-back until the deadline, then flush; put a result dict."""
    out = {"role": "writer", "saved": [], "errors": collections.Counter(), "messages": []}
    try:
        _proc_setup()
        import ckptstore

        repo = ckptstore.open(cfg["url"], cache_dir=cfg["cache"], cache_size=cfg["cache_size"], write_back=True,
                              **OPTS)
        sds = {1: state(cfg["seed"], 1, **SOAK)}
        ready.set()
        go.wait()
        deadline = time.monotonic() + cfg["seconds"]
        step, secs = 0, []
        while time.monotonic() < deadline:
            step += 1
            sd = sds.pop(step, None) or state(cfg["seed"], step, **SOAK)
            t = time.perf_counter()
            try:
                repo.save(sd, step=step, metadata={"seed": cfg["seed"], "step": step})
                out["saved"].append(step)
                secs.append(time.perf_counter() - t)
            except Exception as e:  # noqa: BLE001 - counted and reported
                out["errors"][type(e).__name__] += 1
                if len(out["messages"]) < 5:
                    out["messages"].append(f"save {step}: {type(e).__name__}: {e}")
        t = time.perf_counter()
        try:
            repo.flush()
            out["flushed"] = True
        except Exception as e:  # noqa: BLE001
            out["flushed"] = False
            out["errors"][f"flush {type(e).__name__}"] += 1
            out["messages"].append(f"flush: {type(e).__name__}: {e}")
        out["flush_seconds"] = time.perf_counter() - t
        out["committed"] = sorted(set(out["saved"]) & set(repo.steps())) if not out["flushed"] else out["saved"]
        out["tier_stats"] = dict(repo.tier.stats)
        out["save_seconds_median"] = sorted(secs)[len(secs) // 2] if secs else None
        out["read_stats"] = repo.read_stats()
        repo.close()
    except Exception as e:  # noqa: BLE001
        out["errors"][f"fatal {type(e).__name__}"] += 1
        out["messages"].append(traceback.format_exc())
        ready.set()
    out["errors"] = dict(out["errors"])
    results.put(out)


def reader_main(cfg: dict, ready, go, results) -> None:
    """Open the repository over and over with the shared tier; load the newest committed step (and now
    and then an older one) and compare bit for bit."""
    out = {"role": "reader", "opens": 0, "loads": 0, "loads_latest": 0, "loads_older": 0, "waits": 0,
           "mismatches": [], "errors": collections.Counter(), "messages": [],
           "bytes": {"tier": 0, "peer": 0, "store": 0}, "loads_by_source": collections.Counter(),
           "evicted": 0, "tier_misses": 0, "discarded": 0, "steps_seen": set()}
    try:
        _proc_setup()
        import ckptstore
        from ckptstore.errors import RepositoryNotFoundError

        rng = random.Random(cfg["seed"] + 1)
        ready.set()
        go.wait()
        deadline = time.monotonic() + cfg["seconds"]
        seen_any = False
        while time.monotonic() < deadline:
            repo = None
            try:
                repo = ckptstore.open(cfg["url"], cache_dir=cfg["cache"], cache_size=cfg["cache_size"])
                out["opens"] += 1
                try:
                    latest = repo.latest()
                except RepositoryNotFoundError:
                    if seen_any:
                        raise
                    latest = None
                if latest is None:
                    out["waits"] += 1
                    time.sleep(0.02)
                    continue
                seen_any = True
                todo = [("latest", latest)]
                if out["opens"] % 3 == 0 and latest > 1:
                    todo.append(("older", rng.choice([s for s in repo.steps() if s < latest])))
                for kind, step in todo:
                    before = repo.read_stats()
                    got = repo.load(step)
                    after = repo.read_stats()
                    d = {k: after.get(k, 0) - before.get(k, 0) for k in out["bytes"]}
                    for k in d:
                        out["bytes"][k] += d[k]
                    src = [k for k in ("tier", "peer", "store") if d[k]]
                    out["loads_by_source"]["+".join(src) or "none"] += 1
                    out["loads"] += 1
                    out[f"loads_{kind}"] += 1
                    out["steps_seen"].add(step)
                    why = same(state(cfg["seed"], step, **SOAK), got)
                    if why:
                        out["mismatches"].append(f"step {step} ({kind}): {why}")
            except Exception as e:  # noqa: BLE001 - counted and reported
                out["errors"][type(e).__name__] += 1
                if len(out["messages"]) < 5:
                    out["messages"].append(f"{type(e).__name__}: {e}")
            finally:
                if repo is not None:
                    if repo.tier is not None:
                        for k in ("evicted", "tier_misses", "discarded"):
                            out[k] += repo.tier.stats[k]
                    repo.close()
    except Exception as e:  # noqa: BLE001
        out["errors"][f"fatal {type(e).__name__}"] += 1
        out["messages"].append(traceback.format_exc())
        ready.set()
    out["errors"] = dict(out["errors"])
    out["loads_by_source"] = dict(out["loads_by_source"])
    out["steps_seen"] = len(out["steps_seen"])
    results.put(out)


def soak(seed: int, seconds: float, tmp: str) -> dict:
    import multiprocessing as mp

    import ckptstore

    ctx = mp.get_context("spawn")
    cache_size = SOAK["cache_packs"] * PACK_SIZE
    cfg = {"url": os.path.join(tmp, "repo-soak"), "cache": os.path.join(tmp, "tier-soak"),
           "cache_size": cache_size, "seed": seed, "seconds": seconds}
    results = ctx.Queue()
    go = ctx.Event()
    readies = [ctx.Event(), ctx.Event()]
    procs = [ctx.Process(target=writer_main, args=(cfg, readies[0], go, results), name="writer"),
             ctx.Process(target=reader_main, args=(cfg, readies[1], go, results), name="reader")]
    for p in procs:
        p.start()
    for r in readies:
        r.wait(120)
    got = {}
    with Sampler(cfg["cache"], 0.005) as sampler:
        go.set()
        t0 = time.perf_counter()
        for _ in procs:
            doc = results.get(timeout=seconds + 600)
            got[doc["role"]] = doc
        wall = time.perf_counter() - t0
    for p in procs:
        p.join(60)
    w, r = got["writer"], got["reader"]
    # every step the writer committed: in the store, bit-exact, read without a tier
    missing, wrong = [], []
    t = time.perf_counter()
    with ckptstore.open(cfg["url"]) as fresh:
        steps = set(fresh.steps())
        for s in w.get("committed", []):
            if s not in steps:
                missing.append(s)
                continue
            why = same(state(seed, s, **SOAK), fresh.load(s))
            if why:
                wrong.append(f"step {s}: {why}")
    check_s = time.perf_counter() - t
    extra = sorted(steps - set(w.get("committed", [])))
    pack = largest_pack(cfg["url"])
    return {
        "cache_size": cache_size, "largest_pack": pack, "seconds": seconds, "wall_seconds": wall,
        "writer": w, "reader": r, "final_check_seconds": check_s,
        "committed_missing": missing, "committed_wrong": wrong, "store_steps_not_committed": extra,
        "data_lost": len(r["mismatches"]) + len(missing) + len(wrong),
        "max_tier_sampled": sampler.max_tier, "max_all_sampled": sampler.max_all, "samples": sampler.samples,
        "tier_end": tier_bytes(cfg["cache"]),
    }


# ---------------------------------------------------------------- report
def budget_table(runs: list[dict]) -> str:
    head = ["mode", "saves", "stored", "cache_size", "+ largest pack", "max tier after save", "max tier sampled",
            "of it wb/", "max all files", "evicted", "steps bit-exact", "save s (median)"]
    rows = []
    for r in runs:
        secs = sorted(r["save_seconds"])
        rows.append([r["mode"], str(r["saves"]), human(r["stored_bytes"]), human(r["cache_size"]),
                     human(r["allowance"]), human(r["max_tier_after_save"]), human(r["max_tier_sampled"]),
                     "-" if r["wb_at_max_sampled"] is None else human(r["wb_at_max_sampled"]),
                     human(r["max_all_sampled"]), str(r["evicted"]),
                     f"{r['steps_checked'] - len(r['mismatches'])}/{r['saves']}", f"{secs[len(secs) // 2]:.3f}"])
    return format_table(head, rows, left=1)


def soak_table(s: dict) -> str:
    w, r = s["writer"], s["reader"]
    b = r["bytes"]
    rows = [
        ["steps saved (writer, write-back)", str(len(w.get("saved", [])))],
        ["steps committed after flush", str(len(w.get("committed", [])))],
        ["writer save s (median) / flush s",
         f"{w.get('save_seconds_median') or 0:.3f} / {w.get('flush_seconds', 0):.2f}"],
        ["writer errors", _errors(w)],
        ["writer evictions", str(w.get("tier_stats", {}).get("evicted", 0))],
        ["reader handles opened", str(r["opens"])],
        ["loads (newest committed / older)", f"{r['loads']} ({r['loads_latest']} / {r['loads_older']})"],
        ["distinct steps loaded", str(r["steps_seen"])],
        ["loads by source of their chunks", ", ".join(f"{k} {v}" for k, v in sorted(r["loads_by_source"].items()))],
        ["stored bytes read: tier / peer / store", f"{human(b['tier'])} / {human(b['peer'])} / {human(b['store'])}"],
        ["reader evictions / tier misses / discarded", f"{r['evicted']} / {r['tier_misses']} / {r['discarded']}"],
        ["reader errors", _errors(r)],
        ["mismatches (wrong data, no error)", str(len(r["mismatches"]))],
        ["committed steps missing / wrong in the store",
         f"{len(s['committed_missing'])} / {len(s['committed_wrong'])}"],
        ["max tier sampled (budget files / all files)",
         f"{human(s['max_tier_sampled'])} / {human(s['max_all_sampled'])} (cache_size {human(s['cache_size'])}, "
         f"largest pack {human(s['largest_pack'])})"],
    ]
    return format_table(["", ""], rows, left=2, rule=False)


def _errors(doc: dict) -> str:
    e = doc.get("errors") or {}
    return ", ".join(f"{k} {v}" for k, v in sorted(e.items())) if e else "0"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.distributed.tier_soak", description=__doc__.split("\n")[0])
    ap.add_argument("--saves", type=int, default=20, help="saves of the budget run, each mode (default 20)")
    ap.add_argument("--seconds", type=float, default=60.0, help="length of the 2-process soak (default 60)")
    ap.add_argument("--seed", type=int, default=None, help="data seed (default: random, printed)")
    ap.add_argument("--json", metavar="OUT.json", help="write the results here")
    args = ap.parse_args(argv)
    if args.saves < 1 or args.seconds <= 0:
        ap.error("--saves must be at least 1 and --seconds positive")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    command = command_line("benchmarks.distributed.tier_soak", argv)
    commit = git_commit()
    print(f"command: {command}", flush=True)
    print(env_line() + f", commit {commit}", flush=True)
    print(f"seed {seed} (repeat with --seed {seed})", flush=True)
    tmp = tempfile.mkdtemp(prefix="tiersoak-", dir="/tmp")
    started = time.perf_counter()
    try:
        runs = []
        for mode in ("write-through", "write-back"):
            r = budget_run(mode, seed, args.saves, tmp)
            runs.append(r)
            print(f"budget, {mode}: {r['saves']} saves in {r['wall_seconds']:.1f} s, max tier "
                  f"{human(r['max_tier_sampled'])} ({r['samples']} samples), evicted {r['evicted']}", flush=True)
        refusal = refusal_check(seed, tmp)
        print(f"soak: {args.seconds:g} s, writer and reader spawned", flush=True)
        s = soak(seed, args.seconds, tmp)
    except Exception:
        traceback.print_exc()
        print("FAILED", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total = time.perf_counter() - started

    lines = []

    def line(ok: bool, text: str) -> None:
        lines.append(("met     " if ok else "MISSED  ") + text)

    for r in runs:
        line(r["max_tier_sampled"] <= r["allowance"],
             f"budget, {r['mode']}: the tier's counted files at most {human(r['max_tier_sampled'])} (sampled every "
             f"2 ms and after each save) against cache_size + one pack = {human(r['allowance'])}")
        if r["max_tier_sampled"] > r["allowance"] and r["wb_at_max_sampled"] is not None:
            wb = r["wb_at_max_sampled"]
            lines.append(f"info    budget, {r['mode']}: at that peak {human(wb)} were pending write-back files (wb/, "
                         f"never evicted) and {human(r['max_tier_sampled'] - wb)} evictable cached files")
        above = "above" if r["max_all_sampled"] > r["allowance"] else "within"
        lines.append(f"info    budget, {r['mode']}: every file under cache_dir (.tmp/, records, marks too) at most "
                     f"{human(r['max_all_sampled'])}, {above} cache_size + one pack")
        ok = not r["mismatches"] and not r["steps_missing"] and r["steps_checked"] == r["saves"]
        line(ok, f"budget, {r['mode']}: {r['steps_checked'] - len(r['mismatches'])} of {r['saves']} steps load "
             f"bit-exact from the store (missing: {r['steps_missing'] or 'none'})")
    line(refusal["refused"] and refusal["tier_bytes_after"] == 0 and not refusal["steps_after"],
         f"write-back refuses a {human(refusal['raw_bytes'])} state dict under a {human(refusal['cache_size'])} "
         f"cache_size before writing anything (tier bytes after: {refusal['tier_bytes_after']})")
    line(s["data_lost"] == 0, f"2-process soak: data_lost = {s['data_lost']} (target 0)")
    if s["max_tier_sampled"] > s["cache_size"] + s["largest_pack"]:
        lines.append(f"info    2-process soak: the tier reached {human(s['max_tier_sampled'])}, over cache_size + "
                     f"one pack ({human(s['cache_size'] + s['largest_pack'])}): two processes each see the "
                     "other's files only at their own scans (docs/tier.md, 'Bounded disk'); no target")

    print()
    print(f"Produced by: {command}")
    print(f"  ckptstore at commit {commit}; seed {seed}; local-directory repositories, packs of "
          f"{human(PACK_SIZE)}, chunks of {human(CHUNK_SIZE)}")
    print(f"1. budget: {BUDGET['n']} fp32 randn tensors of {human(BUDGET['nbytes'])} "
          f"({human(BUDGET['n'] * BUDGET['nbytes'])} raw), {BUDGET['fresh'] + 1} new each step; cache_size "
          f"{BUDGET['cache_packs']} packs; 'tier': the files the budget counts (tier_files), 'all files': "
          "everything under cache_dir")
    print(budget_table(runs))
    print()
    print(f"2. soak: writer (write-back) and reader in two spawned processes sharing one cache_dir, "
          f"cache_size {SOAK['cache_packs']} packs, {s['seconds']:g} s; {SOAK['n']} tensors of "
          f"{human(SOAK['nbytes'])}, {SOAK['fresh'] + 1} new each step; final check of "
          f"{len(s['writer'].get('committed', []))} steps in {s['final_check_seconds']:.1f} s")
    print(soak_table(s))
    for who in ("writer", "reader"):
        for m in s[who].get("messages", []):
            print(f"  {who}: {m}")
    for m in (s["reader"]["mismatches"] + s["committed_wrong"])[:10]:
        print(f"  MISMATCH {m}")
    if s["committed_missing"]:
        print(f"  committed steps missing from the store: {s['committed_missing'][:20]}")
    if s["store_steps_not_committed"]:
        print(f"  steps in the store the writer did not report: {s['store_steps_not_committed'][:20]}")
    print(f"data_lost = {s['data_lost']}")
    print()
    print("targets:")
    for c in lines:
        print(f"  {c}")
    print(f"wall time {total:.1f} s; load average at end {loadavg()}")
    if args.json:
        write_results(args.json, command, {
            "commit": commit, "seed": seed, "pack_size": PACK_SIZE, "chunk_size": CHUNK_SIZE,
            "budget_layout": BUDGET, "soak_layout": SOAK, "budget": runs, "refusal": refusal, "soak": s,
            "data_lost": s["data_lost"], "targets": lines, "wall_seconds": total,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
