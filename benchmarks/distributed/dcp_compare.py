"""Multi-rank DCP benchmark: ckptstore's DCP backend against DCP's own writers.

Run from the repository root::

    python -m benchmarks.distributed.dcp_compare [--size-gib 1.0] [--ranks 2] [--json OUT.json]

``--ranks`` processes (torch.multiprocessing spawn, gloo on 127.0.0.1) each
hold their half (1/N) of one synthetic fp32 ``randn`` state dict, as DTensors
sharded on dim 0 over a CPU device mesh. On that same data, and the same moto
S3 server (in a child process), it times ``dcp.save`` and ``dcp.load`` (into
preallocated DTensors of the same sharding) for:

* ``dcp-fs``: ``FileSystemWriter`` / ``FileSystemReader`` to a local temp dir
  (the baseline of the ratio columns);
* ``dcp-fs-zstd``: ``FileSystemWriter(path, _extensions=[ZStandard()])``, read
  back by a plain ``FileSystemReader`` (its default extension registry knows
  ``stream.zstd``);
* ``ckpt-local``: ``CkptStoreWriter`` / ``CkptStoreReader`` on a local dir,
  step 1 and step 2 of the same data (dedup);
* ``ckpt-s3``: the same on ``s3://dcpbench/ckpt`` on moto, ``pack_size`` 64 MiB;
* ``dcp-fsspec-s3``: ``FsspecWriter`` / ``FsspecReader`` on
  ``s3://dcpbench/fsspec`` on moto (s3fs options as keyword arguments).

Every time is the maximum over ranks of one rank's wall time, the clock
started right after a barrier. Every load is compared bit for bit with the
rank's local shards; a difference fails the run. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

import torch

import ckptstore

from ..common.measure import GiB, MiB, cpu_self, dir_bytes, loadavg, proc_cpu
from ..common.report import command_line, env_line, format_table, human, write_results
from ..common.servers import S3Server, free_port, moto_process
from ..common.workloads import local_shape, make_dtensor, sharded_layout
from ..common.verify import VerificationError, bits_equal, differing_elements, scrub

BUCKET = "dcpbench"
S3_PACK_SIZE = 64 * MiB
BACKENDS = ("dcp-fs", "dcp-fs-zstd", "ckpt-local", "ckpt-s3", "dcp-fsspec-s3")
BASELINE = "dcp-fs"


# ---------------------------------------------------------------- worker side
def _init(rank, world, port):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def worker(rank: int, world: int, port: int, cfg: dict) -> None:
    import torch.distributed as dist

    mesh = _init(rank, world, port)
    try:
        _worker_body(rank, world, mesh, cfg)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _worker_body(rank, world, mesh, cfg):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from ckptstore.dcp import CkptStoreReader, CkptStoreWriter

    t_build = time.perf_counter()
    shapes = sharded_layout(cfg["size_gib"], world)
    g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + rank)
    src_local = {n: torch.randn(local_shape(s, world), generator=g, dtype=torch.float32) for n, s in shapes}
    dst_local = {n: torch.empty_like(t) for n, t in src_local.items()}  # pages touched by scrub(dst_local) below
    src = {n: make_dtensor(src_local[n], mesh, s) for n, s in shapes}
    dst = {n: make_dtensor(dst_local[n], mesh, s) for n, s in shapes}
    local_bytes = sum(t.numel() * t.element_size() for t in src_local.values())
    sizes = [None] * world
    dist.all_gather_object(sizes, local_bytes)
    logical = sum(sizes)
    build_s = time.perf_counter() - t_build

    so = cfg["storage_options"]
    tmp = cfg["tmp"]
    server_pid = cfg["server_pid"]
    server = S3Server.from_spec(cfg["server"]) if rank == 0 and cfg["server"] is not None else None
    rows: list[dict] = []
    ckpt_stats: dict = {}

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    def check(what):
        """Every rank compares its shards; any rank's failure fails all of them."""
        err = None
        try:
            for n, want in src_local.items():
                d = dst[n]
                got = d.to_local()
                if d.placements != src[n].placements or tuple(d.shape) != tuple(src[n].shape):
                    raise VerificationError(f"{n}: placements/shape changed to {d.placements} {tuple(d.shape)}")
                if got.dtype != want.dtype or got.shape != want.shape:
                    raise VerificationError(f"{n}: local shard is {got.dtype}{list(got.shape)}, "
                                            f"expected {want.dtype}{list(want.shape)}")
                if got.data_ptr() != dst_local[n].data_ptr():
                    raise VerificationError(f"{n}: load did not write into the preallocated tensor")
                if not bits_equal(got, want):
                    raise VerificationError(f"{n}: {differing_elements(got, want)} of {want.numel()} elements differ")
        except Exception as e:
            err = f"rank {rank}: {type(e).__name__}: {e}"
        errs = [None] * world
        dist.all_gather_object(errs, err)
        errs = [e for e in errs if e]
        if errs:
            raise VerificationError(f"{what}: load is not bit-exact: " + "; ".join(errs))

    def timed(backend, op, kind, fn, stored=None, note_fn=None):
        """Run ``fn`` on every rank after a barrier; rank 0 records the row."""
        gc.collect()
        dist.barrier()
        srv0 = proc_cpu(server_pid) if rank == 0 else None
        cpu0 = cpu_self()
        t0 = time.perf_counter()
        extra = fn()
        seconds = time.perf_counter() - t0
        cpu = cpu_self() - cpu0
        per_rank = [None] * world
        dist.all_gather_object(per_rank, {"seconds": seconds, "cpu": cpu, "extra": extra})
        if rank != 0:
            return None
        srv1 = proc_cpu(server_pid)
        secs = max(r["seconds"] for r in per_rank)
        row = {
            "backend": backend,
            "operation": op,
            "kind": kind,
            "seconds": secs,
            "rank_seconds": [r["seconds"] for r in per_rank],
            "logical_bytes": logical,
            "gb_per_s": logical / secs / 1e9 if secs > 0 else None,
            "cpu_seconds": sum(r["cpu"] for r in per_rank),
            "rank_cpu_seconds": [r["cpu"] for r in per_rank],
            "server_cpu_seconds": srv1 - srv0 if srv0 is not None and srv1 is not None else None,
            "rank_extra": [r["extra"] for r in per_rank],
            "stored_bytes": None,
            "note": "",
        }
        if stored is not None:
            row.update(stored())
        if note_fn is not None:
            row["note"] = note_fn(row)
        rows.append(row)
        print(f"  .. {kind:<4}  {backend:<14} {op:<28} {secs:8.2f} s  (ranks: "
              + ", ".join(f"{s:.2f}" for s in row["rank_seconds"]) + ")", flush=True)
        return row

    def dir_stored(path):
        def f():
            return {"stored_bytes": dir_bytes(path)}
        return f

    def s3_stored(prefix, before=None):
        def f():
            total, count = server.prefix_stats(prefix)
            d = {"stored_bytes": total, "objects": count, "prefix_total_bytes": total}
            if before is not None:
                d["stored_bytes"] = total - before[0]
                d["objects"] = count - before[1]
                d["added"] = True
            return d
        return f

    # ---- the DCP calls
    def dcp_save(writer):
        def f():
            dcp.save(src, storage_writer=writer)
            stats = getattr(writer, "last_rank_stats", None)
            if hasattr(writer, "close"):
                writer.close()
            return stats
        return f

    def dcp_load(reader):
        def f():
            dcp.load(dst, storage_reader=reader)
            if hasattr(reader, "close"):
                reader.close()
        return f

    def load_row(backend, make_reader):
        scrub(dst_local)
        reader = make_reader()
        timed(backend, "dcp.load", "load", dcp_load(reader))
        check(f"{backend} dcp.load")

    def ckpt_note(row):
        st = [s for s in row["rank_extra"] if s]
        if not st:
            return ""
        new = sum(s["new_bytes"] for s in st)
        stored_b = sum(s["stored_bytes"] for s in st)
        reused = sum(s["reused_bytes"] for s in st)
        return (f"ranks' new {human(new)} -> {human(stored_b)} stored, reused {human(reused)}")

    t_all = time.perf_counter()

    # ---- warm-up (untimed): page cache and the destination's pages
    scrub(dst_local)
    if cfg["warmup"]:
        t0 = time.perf_counter()
        path = os.path.join(tmp, "warmup")
        dcp.save(src, storage_writer=FileSystemWriter(path))
        dcp.load(dst, storage_reader=FileSystemReader(path))
        check("warm-up FileSystemReader")
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
        log(f"warm-up (untimed dcp.save + dcp.load with FileSystemWriter/Reader): {time.perf_counter() - t0:.1f} s")

    backends = cfg["backends"]
    pack = {"pack_size": S3_PACK_SIZE}

    if "dcp-fs" in backends:
        path = os.path.join(tmp, "dcp-fs")
        timed("dcp-fs", "dcp.save", "save", dcp_save(FileSystemWriter(path)), stored=dir_stored(path))
        load_row("dcp-fs", lambda: FileSystemReader(path))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)

    if "dcp-fs-zstd" in backends:
        path = os.path.join(tmp, "dcp-fs-zstd")
        timed("dcp-fs-zstd", "dcp.save", "save", dcp_save(FileSystemWriter(path, _extensions=[ZStandard()])),
              stored=dir_stored(path))
        load_row("dcp-fs-zstd", lambda: FileSystemReader(path))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)

    if "ckpt-local" in backends:
        path = os.path.join(tmp, "ckpt-local")
        timed("ckpt-local", "dcp.save step 1", "save", dcp_save(CkptStoreWriter(path, step=1)),
              stored=dir_stored(path), note_fn=ckpt_note)
        before = dir_bytes(path) if rank == 0 else 0
        timed("ckpt-local", "dcp.save step 2 (same data)", "save", dcp_save(CkptStoreWriter(path, step=2)),
              stored=lambda: {"stored_bytes": dir_bytes(path) - before, "added": True}, note_fn=ckpt_note)
        load_row("ckpt-local", lambda: CkptStoreReader(path, step=1))
        dist.barrier()
        if rank == 0:
            repo = ckptstore.open(path)
            ckpt_stats["ckpt-local"] = repo.stats()
            repo.close()
            shutil.rmtree(path)

    if "ckpt-s3" in backends and so is not None:
        url, prefix = f"s3://{BUCKET}/ckpt", "ckpt"
        timed("ckpt-s3", "dcp.save step 1", "save",
              dcp_save(CkptStoreWriter(url, step=1, storage_options=so, **pack)),
              stored=s3_stored(prefix), note_fn=ckpt_note)
        before = server.prefix_stats(prefix) if rank == 0 else None
        timed("ckpt-s3", "dcp.save step 2 (same data)", "save",
              dcp_save(CkptStoreWriter(url, step=2, storage_options=so, **pack)),
              stored=s3_stored(prefix, before), note_fn=ckpt_note)
        load_row("ckpt-s3", lambda: CkptStoreReader(url, step=1, storage_options=so))
        dist.barrier()
        if rank == 0:
            repo = ckptstore.open(url, storage_options=so)
            ckpt_stats["ckpt-s3"] = repo.stats()
            repo.close()
            server.delete_prefix(prefix)

    if "dcp-fsspec-s3" in backends and so is not None:
        url, prefix = f"s3://{BUCKET}/fsspec", "fsspec"
        timed("dcp-fsspec-s3", "dcp.save", "save", dcp_save(FsspecWriter(url, **so)), stored=s3_stored(prefix))
        load_row("dcp-fsspec-s3", lambda: FsspecReader(url, **so))
        dist.barrier()
        if rank == 0:
            server.delete_prefix(prefix)

    dist.barrier()
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump({
                "rows": rows,
                "logical_bytes": logical,
                "rank_bytes": sizes,
                "tensors": len(shapes),
                "build_seconds": build_s,
                "wall_seconds": time.perf_counter() - t_all,
                "ckptstore_stats": ckpt_stats,
            }, f, default=str)


# ---------------------------------------------------------------- main side
def table(rows: list[dict]) -> str:
    base = {}
    for r in rows:
        if r["backend"] == BASELINE:
            base.setdefault(r["kind"], r)
    head = ["backend", "operation", "seconds", "GB/s", "bytes stored", "time vs dcp-fs",
            "bytes vs dcp-fs", "CPU s (ranks)", "moto CPU s"]
    lines = []
    for r in rows:
        b = base.get(r["kind"])
        t_ratio = r["seconds"] / b["seconds"] if b else None
        sb = r.get("stored_bytes")
        bb = base.get("save")
        b_ratio = sb / bb["stored_bytes"] if sb is not None and bb and bb.get("stored_bytes") else None
        stored_txt = "-" if sb is None else (("+" if r.get("added") else "") + human(sb))
        lines.append([
            r["backend"],
            r["operation"],
            f"{r['seconds']:.2f}",
            f"{r['gb_per_s']:.3f}" if r["gb_per_s"] is not None else "-",
            stored_txt,
            f"{t_ratio:.2f}x" if t_ratio is not None else "-",
            f"{b_ratio:.4f}" if b_ratio is not None else "-",
            f"{r['cpu_seconds']:.1f}",
            f"{r['server_cpu_seconds']:.1f}" if r["server_cpu_seconds"] is not None else "-",
        ])
    return format_table(head, lines, left=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.distributed.dcp_compare", description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="total state dict size over all ranks (default 1.0)")
    ap.add_argument("--ranks", type=int, default=2, help="processes (gloo ranks), default 2")
    ap.add_argument("--json", metavar="OUT.json", help="write the results here")
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help=f"comma-separated subset of {','.join(BACKENDS)} (default: all)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the untimed FileSystemWriter save + load before the measurements")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        ap.error(f"unknown backends {unknown}; choose from {list(BACKENDS)}")
    if args.ranks < 1:
        ap.error("--ranks must be at least 1")
    try:
        sharded_layout(args.size_gib, args.ranks)  # fail early on an indivisible shape
    except ValueError as e:
        ap.error(str(e))

    command = command_line("benchmarks.distributed.dcp_compare", argv)
    print(f"command: {command}", flush=True)
    print(env_line(threads=f"{args.ranks} ranks (1 torch thread each)"), flush=True)

    import torch.multiprocessing as mp

    # Spawned ranks must find the worker under its module name, not __main__.
    target = importlib.import_module("benchmarks.distributed.dcp_compare").worker
    need_s3 = any(b in backends for b in ("ckpt-s3", "dcp-fsspec-s3"))
    tmp = tempfile.mkdtemp(prefix="dcpbench-", dir="/tmp")
    out = os.path.join(tmp, "result.json")
    started = time.perf_counter()
    try:
        cfg = {"size_gib": args.size_gib, "seed": args.seed, "tmp": tmp, "out": out,
               "backends": backends, "warmup": not args.no_warmup,
               "storage_options": None, "server_pid": None, "server": None}
        if need_s3:
            with moto_process(BUCKET) as server:
                cfg.update(storage_options=server.storage_options(), server_pid=server.pid, server=server.spec())
                mp.spawn(target, args=(args.ranks, free_port(), cfg), nprocs=args.ranks, join=True)
        else:
            mp.spawn(target, args=(args.ranks, free_port(), cfg), nprocs=args.ranks, join=True)
        with open(out) as f:
            result = json.load(f)
    except Exception:
        traceback.print_exc()
        print("FAILED", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total = time.perf_counter() - started

    rows = result["rows"]
    logical = result["logical_bytes"]
    print()
    print(f"Produced by: {command}")
    print(f"Data: {result['tensors']} fp32 randn tensors as DTensors sharded on dim 0 over {args.ranks} ranks, "
          f"{logical / GiB:.3f} GiB logical ({logical / 1e9:.3f} GB) in total, "
          f"{human(result['rank_bytes'][0])} per rank; GB/s = total logical bytes / seconds / 1e9.")
    print("seconds = max over ranks of each rank's wall time (clock started after a barrier). "
          "'bytes stored' = size of the directory / objects under the prefix ('+': added by that save). "
          "'time vs dcp-fs' = seconds / dcp-fs seconds of the same kind (save or load); "
          "'bytes vs dcp-fs' = bytes stored / dcp-fs bytes stored. 'CPU s' = user+system CPU of all ranks; "
          "'moto CPU s' = the moto server child's.")
    print(table(rows))
    print()
    for r in rows:
        if r["note"]:
            print(f"  {r['backend']}: {r['operation']}: {r['note']}")
    for name, st in result["ckptstore_stats"].items():
        print(f"  {name}: repository holds {st['packs']} packs, {human(st['stored_bytes'])} for "
              f"{human(st['logical_bytes'])} logical over {st['steps']} steps "
              f"(dedup x{st['dedup_ratio']:.2f}, compression x{st['compression_ratio']:.3f})")
    print(f"Every load verified bit-exact (the bytes of each rank's local shards). "
          f"Wall time {total:.1f} s (ranks' data built in {result['build_seconds']:.1f} s); "
          f"load average at end {loadavg()}.")

    if args.json:
        write_results(args.json, command, {
            "data": {"tensors": result["tensors"], "logical_bytes": logical, "rank_bytes": result["rank_bytes"],
                     "size_gib": args.size_gib, "ranks": args.ranks, "seed": args.seed},
            "s3_pack_size": S3_PACK_SIZE,
            "warmup": not args.no_warmup,
            "rows": rows,
            "ckptstore_stats": result["ckptstore_stats"],
            "wall_seconds": total,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
