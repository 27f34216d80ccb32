"""A checkpoint every step for a long run: does the process stay flat? (issue 44 item 3)

Run from the repository root::

    python -m benchmarks.distributed.step_soak [--steps 1000] [--mode single|dcp|both] [--keep-last 3]
        [--json OUT.json]

Two legs, each saving once a step for ``--steps`` steps against a
local-directory repository, with a node-local tier (``cache_dir``,
``cache_size``), write-back saves (``write_back=True``), retention
(``keep_last``) and a garbage collector running concurrently on a handle of
its own (a thread, every ``--gc-every`` steps, with the repository's short
grace period, ``--grace`` seconds):

* ``single``: one process, ``repo.save(state, step=s)`` every step;
* ``dcp``: 2 gloo ranks (spawned), each with its own tier (two "nodes"), a
  new ``CkptStoreWriter(..., write_back=True, replicas=1)`` every step as
  torchtitan's integration makes them (the previous writer closed after the
  next save), ``dcp.save`` of 8 DTensors sharded over the ranks.

The state: 8 fp32 tensors (``--tensor-kib`` each, per rank), one of them (in
turn) new at each step, so 1/8 of the state changes between steps.

Sampled every ``--sample-every`` steps after the save: resident memory
(``VmRSS``), open file descriptors (``/proc/self/fd``), threads, process
groups (``torch.distributed``'s own map, the ``dcp`` leg), the tier's bytes
(the files its budget counts) against ``cache_size``, pending write-back
steps, the store's committed steps and packs against what ``keep_last``
keeps, and what the saving handle caches (manifests, tombstones, segment
headers; buffer pools; on the ``dcp`` leg the replicas' groups). For telling
the allocator's retention from a leak: ``--malloc-trim`` (glibc's
``malloc_trim(0)`` before each sample), ``--probe`` (glibc's ``mallinfo2``
and arenas), ``--probe-objects`` (Python objects and torch tensors alive).
Figures after warm-up (the first ``--warmup`` steps: thread pools
grow to their size, caches fill) are reported as first / max / last. At the
end: ``flush``, the GC thread stopped, one last GC run with the grace period
passed (a clock ahead of it: nothing is in flight then), and the store must
hold exactly the ``keep_last`` newest steps and only the packs they
reference; the last step is restored from a fresh handle and compared bit
for bit; every error is counted.

:func:`run_single` and :func:`run_dcp` are what ``tests/test_step_soak.py``
runs at 30 steps (counts, never times). A benchmark, not a test: it prints
the figures and exits 0 unless the run itself failed. See
``docs/performance.md``, "A checkpoint every step for weeks".
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
import traceback

KiB = 1 << 10
MiB = 1 << 20
OPTS = dict(chunk_size=64 * KiB, pack_size=1 * MiB)
TENSORS = 8


# ---------------------------------------------------------------- the state
def state(step: int, tensor_kib: int, rank: int = 0, world: int = 1) -> dict:
    """Step ``step``'s values: tensor ``i`` last changed at the newest step ``t <= step`` with ``t = i (mod 8)``."""
    import torch

    out = {}
    rows = tensor_kib * KiB // 4 // 256
    for i in range(TENSORS):
        version = max(0, step - (step - i) % TENSORS)
        g = torch.Generator().manual_seed(1_000 * i + version)
        out[f"layers.{i}.weight"] = torch.randn(rows * world, 256, generator=g)[rank * rows:(rank + 1) * rows]
    return out


# ---------------------------------------------------------------- what a process holds
def process_counts() -> dict:
    """This process's resident memory (bytes), open descriptors, threads and process groups."""
    rss = threads = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * KiB
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return {"rss": rss, "fds": len(os.listdir("/proc/self/fd")), "threads": threads, "groups": process_groups()}


def process_groups() -> int:
    """Process groups torch.distributed holds in this process (0 without one)."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return 0
        return len(dist.distributed_c10d._world.pg_map)
    except Exception:  # noqa: BLE001 - a torch without the map: not counted
        return -1


_LIBC = None


def _libc():
    """glibc through ctypes, or None (another C library: no ``malloc_trim``/``mallinfo2``)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.malloc_trim, libc.mallinfo2  # noqa: B018 - both present (glibc 2.33 on)
            _LIBC = libc
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC or None


def malloc_trim() -> bool:
    """``malloc_trim(0)``: glibc returns the free memory of every arena to the system (False: no glibc)."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def malloc_counts() -> dict:
    """glibc's ``mallinfo2`` over every arena (bytes): in use, free in arenas, mmapped; and the arenas."""
    import ctypes

    libc = _libc()
    if libc is None:
        return {}

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = Mallinfo2
    m = libc.mallinfo2()
    arenas = 0
    try:  # malloc_info's XML names every heap: <heap nr="...">
        buf, size = ctypes.c_char_p(), ctypes.c_size_t()
        libc.open_memstream.restype = ctypes.c_void_p
        f = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        libc.malloc_info(0, ctypes.c_void_p(f))
        libc.fclose(ctypes.c_void_p(f))
        arenas = ctypes.string_at(buf, size.value).count(b"<heap nr=")
        libc.free(buf)
    except Exception:  # noqa: BLE001 - not counted
        arenas = -1
    return {"malloc_used": m.uordblks + m.hblkhd, "malloc_free": m.fordblks, "malloc_mmapped": m.hblkhd,
            "malloc_arena": m.arena, "malloc_arenas": arenas}


def object_counts() -> dict:
    """Python objects alive, torch tensors among them and their storages' bytes (after a full collection)."""
    import gc

    import torch

    gc.collect()
    objs = gc.get_objects()
    tensors = [o for o in objs if isinstance(o, torch.Tensor)]
    storages = {}
    for t in tensors:
        try:
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        except Exception:  # noqa: BLE001 - a meta or sparse tensor
            pass
    return {"objects": len(objs), "tensors": len(tensors), "tensor_bytes": sum(storages.values())}


def handle_counts(repo) -> dict:
    """What a repository handle holds that could grow a save at a time: cached manifests and
    tombstones, buffer pools (idle buffers, buffers ever allocated), replica groups and replicators."""
    out = {"manifests": len(repo._manifests._items),
           "tombstones": len(repo._tombstones._items), "segment_headers": len(repo.tables._headers._items),
           "table_blocks": len(repo.tables._blocks._items)}
    pools = dict(repo.runtime._buffer_pools)
    out["pools"] = {n: [p.size, len(p._free), p.allocated] for n, p in pools.items()}
    try:
        from ckptstore.dcp import replicas

        out["replica_groups"], out["replicators"] = len(replicas._GROUPS), len(replicas._LAST)
    except Exception:  # noqa: BLE001 - no torch.distributed
        pass
    return out


def store_counts(url: str) -> dict:
    """Committed steps (manifests) and the packs and segments a local-directory repository holds
    (a file the concurrent GC deletes between the listing and its size is not counted)."""
    def count(sub: str, suffix: str) -> tuple[int, int]:
        n = size = 0
        for root, _, files in os.walk(os.path.join(url, sub)):
            for f in files:
                if f.endswith(suffix):
                    try:
                        size += os.path.getsize(os.path.join(root, f))
                    except FileNotFoundError:
                        continue
                    n += 1
        return n, size

    manifests, _ = count("manifests", ".json")
    packs, pack_bytes = count("packs", ".pack")
    segments, _ = count("segments", ".seg")
    return {"steps": manifests, "packs": packs, "pack_bytes": pack_bytes, "segments": segments}


def tier_bytes(cache_dir: str) -> int:
    """What the tier's budget counts (``tier_files``: packs, segments, chunk files, pending files)."""
    from ckptstore.tier.cache import tier_files

    return sum(size for _, size, *_ in tier_files(cache_dir))


class GCThread:
    """A concurrent GC on a handle of its own: one ``plan_gc(keep_last=...).execute()`` each time it is poked."""

    def __init__(self, url: str, keep_last: int):
        import ckptstore

        self.repo = ckptstore.open(url)
        self.keep_last = keep_last
        self.runs = 0
        self.deleted_steps = 0
        self.errors: list[str] = []
        self._poke = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="soak-gc", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        self._poke.set()

    def _run(self) -> None:
        while True:
            self._poke.wait()
            self._poke.clear()
            if self._stop:
                return
            try:
                res = self.repo.plan_gc(keep_last=self.keep_last).execute()
                self.runs += 1
                self.deleted_steps += len(res.deleted_steps)
            except Exception as e:  # noqa: BLE001 - counted and reported
                self.errors.append(f"gc: {type(e).__name__}: {e}")

    def stop(self) -> None:
        self._stop = True
        self._poke.set()
        self._thread.join()
        self.repo.close()


def final_gc(url: str, keep_last: int, grace: float) -> dict:
    """One GC with the grace period passed (nothing in flight any more), then what the store holds,
    against what the kept steps reference."""
    import ckptstore

    with ckptstore.open(url) as repo:
        repo.plan_gc(keep_last=keep_last, clock=lambda: time.time() + grace + 60).execute()
        steps = repo.steps()
        live = set()
        for s in steps:
            live.update(repo.manifest(s).packs)
    got = store_counts(url)
    return {"steps": steps, "packs": got["packs"], "referenced_packs": len(live), "segments": got["segments"],
            "pack_bytes": got["pack_bytes"]}


def bit_exact(want: dict, got: dict) -> list[str]:
    import torch

    bad = [k for k, v in want.items() if k not in got or not torch.equal(got[k].view(torch.int32), v.view(torch.int32))]
    return bad


def _sample(samples: list, step: int, url: str, cache_dir: str, extra: dict | None = None, *,
            trim: bool = False, probe: bool = False, objects: bool = False) -> None:
    trim_s = None
    if trim:
        t = time.perf_counter()
        malloc_trim()
        trim_s = time.perf_counter() - t
    row = {"step": step, **process_counts(), "tier": tier_bytes(cache_dir), **{f"store_{k}": v for k, v in
                                                                                store_counts(url).items()}}
    row.update(extra or {})
    if trim_s is not None:
        row["malloc_trim_s"] = trim_s  # what the call cost (a figure to report, never to assert)
    if probe:
        row.update(malloc_counts())
    if objects:
        row.update(object_counts())
    samples.append(row)


# ---------------------------------------------------------------- one process
def run_single(root: str, steps: int, *, keep_last: int = 3, gc_every: int = 5, sample_every: int = 10,
               tensor_kib: int = 256, cache_packs: int = 24, grace: float = 60.0, trim: bool = False,
               probe: bool = False, objects: bool = False) -> dict:
    """``steps`` write-back saves in this process with a concurrent GC; the figures (see the module docstring)."""
    import ckptstore

    url, cache = os.path.join(root, "repo"), os.path.join(root, "tier")
    cache_size = cache_packs * OPTS["pack_size"]
    errors: list[str] = []
    samples: list[dict] = []
    repo = ckptstore.open(url, cache_dir=cache, cache_size=cache_size, write_back=True, grace=grace, **OPTS)
    gc = None
    t0 = time.perf_counter()
    try:
        repo.save(state(0, tensor_kib), step=0)  # the repository exists before the collector opens it
        gc = GCThread(url, keep_last)
        _sample(samples, 0, url, cache, {"pending": len(repo.pending_steps()), **handle_counts(repo)}, trim=trim,
                probe=probe,
                objects=objects)
        for s in range(1, steps + 1):
            try:
                repo.save(state(s, tensor_kib), step=s)
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(f"save {s}: {type(e).__name__}: {e}")
            if s % gc_every == 0:
                gc.poke()
            if s % sample_every == 0 or s == steps:
                _sample(samples, s, url, cache, {"pending": len(repo.pending_steps()), **handle_counts(repo)},
                        trim=trim, probe=probe, objects=objects)
        repo.flush()
    except Exception as e:  # noqa: BLE001
        errors.append(f"run: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        if gc is not None:
            gc.stop()
            errors += gc.errors
        repo.close()
    seconds = time.perf_counter() - t0
    final = final_gc(url, keep_last, grace)
    with ckptstore.open(url, cache_dir=cache, cache_size=cache_size) as fresh:
        last = fresh.latest()
        bad = bit_exact(state(last, tensor_kib), fresh.load(last)) if last is not None else ["no step"]
    return {"mode": "single", "steps": steps, "keep_last": keep_last, "cache_size": cache_size,
            "pack_size": OPTS["pack_size"], "samples": samples, "errors": errors, "final": final,
            "last_step": last, "last_step_bad": bad, "gc_runs": gc.runs if gc else 0,
            "gc_deleted_steps": gc.deleted_steps if gc else 0, "seconds": seconds}


# ---------------------------------------------------------------- 2 ranks through ckptstore.dcp
def _dcp_rank(rank: int, world: int, port: int, cfg: dict) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptstore.dcp import CkptStoreReader, CkptStoreWriter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    url, cache = cfg["url"], os.path.join(cfg["root"], f"tier{rank}")
    opts = dict(cache_dir=cache, cache_size=cfg["cache_size"], write_back=True, grace=cfg["grace"], **OPTS)
    errors: list[str] = []
    samples: list[dict] = []
    out = {"rank": rank}

    def sd_of(step: int, zero: bool = False) -> dict:
        sd = {}
        for k, v in state(step, cfg["tensor_kib"], rank, world).items():
            sd[k] = distribute_tensor(torch.zeros(v.shape[0] * world, v.shape[1]), mesh, [Shard(0)])
            if not zero:
                sd[k].to_local().copy_(v)
        return sd

    gc = None
    prev = None
    t0 = time.perf_counter()
    try:
        for s in range(0, cfg["steps"] + 1):
            w = CkptStoreWriter(url, step=s, replicas=1, **opts)
            try:
                dcp.save(sd_of(s), storage_writer=w)
            except BaseException as e:  # noqa: BLE001 - counted (DCP's CheckpointException is a BaseException)
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                errors.append(f"save {s}: {type(e).__name__}: {str(e)[:500]}")
            if prev is not None:
                prev.close()  # as torchtitan's integration releases the writers of earlier saves
            prev = w
            if s == 0 and rank == 0:
                gc = GCThread(url, cfg["keep_last"])
            if gc is not None and s and s % cfg["gc_every"] == 0:
                gc.poke()
            if s % cfg["sample_every"] == 0 or s == cfg["steps"]:
                _sample(samples, s, url, cache, handle_counts(prev._get_repo()),
                        trim=cfg["trim"], probe=cfg["probe"], objects=cfg["objects"])
        prev.flush()  # a collective: every rank's uploads, commits and replicas
        prev.close()
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        errors.append(f"run: {type(e).__name__}: {str(e)[:500]}\n{traceback.format_exc()}")
    finally:
        if gc is not None:
            gc.stop()
            errors += gc.errors
    out["seconds"] = time.perf_counter() - t0
    dist.barrier()
    if rank == 0:
        out["final"] = final_gc(url, cfg["keep_last"], cfg["grace"])
        out["gc_runs"], out["gc_deleted_steps"] = (gc.runs, gc.deleted_steps) if gc else (0, 0)
    dist.barrier()
    try:
        r = CkptStoreReader(url, cache_dir=cache, cache_size=cfg["cache_size"])
        try:
            got = sd_of(0, zero=True)
            dcp.load(got, storage_reader=r)
            last = r._ckpt.step
        finally:
            r.close()
        want = state(last, cfg["tensor_kib"], rank, world)
        out["last_step"] = last
        out["last_step_bad"] = bit_exact(want, {k: v.to_local() for k, v in got.items()})
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        errors.append(f"restore: {type(e).__name__}: {str(e)[:500]}")
        out["last_step_bad"] = ["restore failed"]
    out["samples"], out["errors"] = samples, errors
    with open(os.path.join(cfg["root"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads may abort a clean interpreter exit


def run_dcp(root: str, steps: int, *, keep_last: int = 3, gc_every: int = 5, sample_every: int = 10,
            tensor_kib: int = 128, cache_packs: int = 24, grace: float = 60.0, start_method: str = "spawn",
            trim: bool = False, probe: bool = False, objects: bool = False) -> dict:
    """``steps`` DCP saves on 2 spawned gloo ranks (write-back, replicas=1, a new writer a save)."""
    import torch.multiprocessing as mp

    from ckptstore.testing import free_port

    world = 2
    cfg = {"url": os.path.join(root, "repo"), "root": root, "steps": steps, "keep_last": keep_last,
           "gc_every": gc_every, "sample_every": sample_every, "tensor_kib": tensor_kib,
           "cache_size": cache_packs * OPTS["pack_size"], "grace": grace, "trim": trim, "probe": probe,
           "objects": objects}
    mp.start_processes(_dcp_rank, args=(world, free_port(), cfg), nprocs=world, join=True, start_method=start_method)
    ranks = [json.load(open(os.path.join(root, f"rank{r}.json"))) for r in range(world)]
    r0 = ranks[0]
    return {"mode": "dcp", "steps": steps, "keep_last": keep_last, "cache_size": cfg["cache_size"],
            "pack_size": OPTS["pack_size"], "ranks": ranks, "samples": r0["samples"],
            "errors": [e for r in ranks for e in r["errors"]], "final": r0.get("final"),
            "last_step": r0.get("last_step"), "last_step_bad": [b for r in ranks for b in r.get("last_step_bad", [])],
            "gc_runs": r0.get("gc_runs", 0), "gc_deleted_steps": r0.get("gc_deleted_steps", 0),
            "seconds": max(r["seconds"] for r in ranks)}


# ---------------------------------------------------------------- report
def after_warmup(samples: list[dict], warmup: int) -> list[dict]:
    return [s for s in samples if s["step"] >= warmup]


def flat(samples: list[dict], key: str) -> tuple:
    """``(first, max, last)`` of ``key`` over the samples."""
    vals = [s[key] for s in samples]
    return (vals[0], max(vals), vals[-1]) if vals else (None, None, None)


def summary(res: dict, warmup: int) -> list[list[str]]:
    from ..common.report import human

    late = after_warmup(res["samples"], warmup)
    rows = []
    for key, what, fmt in (("rss", "resident memory", human), ("fds", "open file descriptors", str),
                           ("threads", "threads", str), ("groups", "process groups", str),
                           ("tier", "tier bytes (budget files)", human), ("store_steps", "committed steps in the store", str),
                           ("store_packs", "packs in the store", str), ("store_pack_bytes", "pack bytes in the store", human),
                           ("manifests", "manifests the saving handle caches", str)):
        first, top, last = flat(late, key)
        if first is None:
            continue
        rows.append([what, fmt(first), fmt(top), fmt(last)])
    return rows


def report(res: dict, warmup: int) -> str:
    from ..common.report import format_table, human

    f = res["final"] or {}
    lines = [f"{res['mode']}: {res['steps']} steps in {res['seconds']:.0f} s, keep_last {res['keep_last']}, "
             f"cache_size {human(res['cache_size'])} (packs of {human(res['pack_size'])}); GC ran "
             f"{res['gc_runs']} times concurrently, deleting {res['gc_deleted_steps']} steps",
             f"after warm-up (step {warmup} on), sampled every few steps:",
             format_table(["", f"at step {warmup}", "max", "at the end"], summary(res, warmup), left=1),
             f"after flush and a last GC with the grace period passed: steps {f.get('steps')}, packs "
             f"{f.get('packs')} (the kept steps reference {f.get('referenced_packs')}), segments {f.get('segments')}",
             f"last step {res['last_step']} restored bit-exact: {not res['last_step_bad']}"
             + (f" (differ: {res['last_step_bad'][:5]})" if res["last_step_bad"] else ""),
             f"errors: {len(res['errors'])}"]
    lines += [f"  {e}" for e in res["errors"][:10]]
    return "\n".join(lines)


def main(argv=None) -> int:
    from ..common.report import command_line, env_line, git_commit, write_results

    ap = argparse.ArgumentParser(prog="python -m benchmarks.distributed.step_soak", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--mode", choices=("single", "dcp", "both"), default="both")
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--gc-every", type=int, default=5, help="steps between GC runs (default 5)")
    ap.add_argument("--sample-every", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=None, help="steps before the flatness figures (default steps/10)")
    ap.add_argument("--grace", type=float, default=60.0, help="the repository's GC grace period, seconds (default 60)")
    ap.add_argument("--malloc-trim", action="store_true",
                    help="call glibc's malloc_trim(0) before each sample (tells the allocator's retention from a leak)")
    ap.add_argument("--probe", action="store_true",
                    help="also sample glibc's mallinfo2 and arenas, Python objects and torch tensors alive, and "
                         "what the repository handle caches (slow: a gc.collect a sample)")
    ap.add_argument("--probe-objects", action="store_true",
                    help="also count Python objects and torch tensors alive (gc.get_objects: it can make a tuple "
                         "another thread is building fail with SystemError, so the run may count errors)")
    ap.add_argument("--json", metavar="OUT.json")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2")
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    command = command_line("benchmarks.distributed.step_soak", argv)
    print(f"command: {command}", flush=True)
    print(env_line() + f", commit {git_commit()}", flush=True)
    results = []
    for mode in (("single", "dcp") if args.mode == "both" else (args.mode,)):
        root = tempfile.mkdtemp(prefix=f"stepsoak-{mode}-", dir="/tmp")
        try:
            run = run_single if mode == "single" else run_dcp
            res = run(root, args.steps, keep_last=args.keep_last, gc_every=args.gc_every,
                      sample_every=args.sample_every, grace=args.grace, trim=args.malloc_trim, probe=args.probe,
                      objects=args.probe_objects)
        except Exception:
            traceback.print_exc()
            print("FAILED", file=sys.stderr)
            return 1
        finally:
            shutil.rmtree(root, ignore_errors=True)
        results.append(res)
        print()
        print(report(res, warmup), flush=True)
    if args.json:
        write_results(args.json, command, {"commit": git_commit(), "warmup": warmup, "runs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
