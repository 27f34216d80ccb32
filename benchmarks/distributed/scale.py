"""Metadata at scale: format 2.x roots and chunk-table segments against 1.0 manifests.

    python -m benchmarks.distributed.scale [--sizes 100GB,1TB,10TB] [--fsdp] [--gc-steps 1000]
                               [--v1 100GB,1TB] [--json OUT]
    python -m benchmarks.distributed.scale --requests [--ranks 8] [--json OUT]

``--requests``: requests by kind of a save and a restore, measured at
``--ranks`` ranks and modelled at 1,000 (:mod:`.request_budget`).

Drives the real save/commit/load/GC code with synthetic chunk hashes (no
tensor bytes are hashed or stored): each simulated rank writes its
chunk-table segment through ``save.write_segment``, the DCP coordinator's
root is built by ``dcp.build_manifest`` from DCP ``Metadata`` and per-rank
``WriteResult`` objects and committed by ``StepCommit``; restore and dedup
read through ``Checkpoint.resolve`` / ``save.dedup_share``; GC is
``plan_gc``. All objects live in a ``MemoryStore`` behind a
``CountingStore``, which counts the metadata bytes each operation reads.

Layouts (1000 ranks; every tensor split along dim 0 over all ranks, FSDP
style; 4 MiB chunks):

- ``100GB``: 25 tensors, 1 chunk per shard: 25k shards, 25k chunks
- ``1TB``: 25 tensors, 10 chunks per shard: 25k shards, 250k chunks
- ``10TB``: 26 tensors, 100 chunks per shard: 26k shards, 2.6M chunks
- ``fsdp``: 1000 tensors, 1 chunk of 100 KiB per shard: 1M shards, 100 GB

For each: root size; a rank restoring its share (1/1000): metadata bytes
read, CPU, peak traced memory; one tensor restored whole (each of the 1000
ranks' parts of it): metadata bytes and requests; a saving rank's dedup metadata against the
same layout as base; the coordinator's ``finish`` (peak traced memory, CPU).
``--v1`` sizes also build the equivalent 1.0 manifest (one JSON document
with every chunk) and time what a restoring rank pays for it today.
``--gc-steps N`` commits N steps of the 1 TB layout (10% of every step's
shards changed) and times ``plan_gc`` over them (CPU, peak RSS growth), then
the plan's ``execute`` (CPU, wall, RSS growth), and checks that every kept step
is listed and every pack it names still exists.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc

import blake3
import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from ckptstore.format import manifest as _m
from ckptstore.format.chunk_table import TableBuilder
from ckptstore.clock import ManualClock
from ckptstore.dcp.metadata import _ItemResult, _RankInfo, build_manifest
from ckptstore.format.layout import PACK_PREFIX, pack_id_of_key, pack_key
from ckptstore.format.manifest import ChunkRef
from ckptstore.format.model import segment_sizes
from ckptstore.repo.repository import Repository
from ckptstore.repo.save import StepCommit, dedup_share, pack_usage, write_segment
from ckptstore.storage.memory import MemoryStore
from ckptstore.storage.wrappers import CountingStore

MiB = 1 << 20
RANKS = 1000
LAYOUTS = {
    "100GB": dict(tensors=25, chunks=1, chunk=4 * MiB),
    "1TB": dict(tensors=25, chunks=10, chunk=4 * MiB),
    "10TB": dict(tensors=26, chunks=100, chunk=4 * MiB),
    "fsdp": dict(tensors=1000, chunks=1, chunk=100 << 10),
}
PACK_BYTES = 256 * MiB


def _hashes(n: int, salt: bytes) -> list[str]:
    """``n`` distinct synthetic BLAKE3 digests (hex), deterministic in ``salt``."""
    h = blake3.blake3(salt).digest(length=32 * n)
    return [h[32 * i : 32 * (i + 1)].hex() for i in range(n)]


class Layout:
    """One simulated step: every rank's shards, chunks, packs and segment."""

    def __init__(self, name: str, ranks: int = RANKS):
        spec = LAYOUTS[name]
        self.name = name
        self.ranks = ranks
        self.tensors = spec["tensors"]
        self.chunks = spec["chunks"]
        self.chunk = spec["chunk"]
        self.rows = ranks * 4  # each shard: 4 rows
        self.row_bytes = self.chunks * self.chunk // 4
        self.cols = self.row_bytes // 4  # fp32

    @property
    def nshards(self) -> int:
        return self.tensors * self.ranks

    @property
    def nchunks(self) -> int:
        return self.nshards * self.chunks

    @property
    def logical(self) -> int:
        return self.nchunks * self.chunk

    def fqn(self, t: int) -> str:
        return f"model.layers.{t}.weight"

    def rank_refs(self, rank: int, step: int, changed: set[int] | None = None, prev=None) -> list[list[ChunkRef]]:
        """Chunk references of rank ``rank``'s shards (one list per tensor).

        Shards whose tensor index is in ``changed`` get new chunks in new packs;
        the others reuse ``prev`` (the same rank's refs of the previous step).
        """
        out = []
        per_pack = max(1, (PACK_BYTES - 4096) // (self.chunk // 2))
        pos = 0
        pack = None
        salt_pack = f"{self.name}:{step}:{rank}"
        for t in range(self.tensors):
            if prev is not None and (changed is None or t not in changed):
                out.append(prev[t])
                continue
            refs = []
            stored = self.chunk // 2  # packs are dense: chunks back to back
            for k, h in enumerate(_hashes(self.chunks, f"{salt_pack}:{t}".encode())):
                if pack is None or pos >= per_pack:
                    pack = blake3.blake3(f"{salt_pack}:pack:{t}:{k}".encode()).hexdigest()[:32]
                    pos = 0
                refs.append(ChunkRef(h, pack, 16 + pos * stored, stored, self.chunk, "zstd"))
                pos += 1
            out.append(refs)
        return out


def _metadata(layout: Layout) -> Metadata:
    sdm = {}
    for t in range(layout.tensors):
        chunks = [
            ChunkStorageMetadata(offsets=torch.Size([4 * r, 0]), sizes=torch.Size([4, layout.cols]))
            for r in range(layout.ranks)
        ]
        sdm[layout.fqn(t)] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size([layout.rows, layout.cols]),
            chunks=chunks,
        )
    return Metadata(state_dict_metadata=sdm, planner_data={layout.fqn(t): (layout.fqn(t),) for t in range(layout.tensors)})


_MD_CACHE: dict = {}
_SEEN_PACKS: set = set()


def _placeholder_segment(repo: Repository, builder: TableBuilder):
    """A segment object GC can list, without its records (GC never reads them): keeps the simulated
    store of 1000 steps x 1000 ranks in memory."""
    from ckptstore.format.layout import new_pack_id, segment_key
    from ckptstore.format.manifest import SegmentRef

    n = len(builder)
    sid = new_pack_id()
    repo.store.put(segment_key(sid), b"")
    header = 40 + 32
    return SegmentRef(sid, segment_sizes(header, n)[1], n, header, "0" * 64)


def write_step(repo: Repository, layout: Layout, step: int, refs_by_rank: list, touch_packs: bool = True,
               measure: bool = True, placeholder_segments: bool = False):
    """Every rank writes its segment; the coordinator builds and commits the root.

    Returns ``(root bytes, finish CPU s, finish peak traced bytes)`` (``measure=False``: no second,
    untraced build for the CPU figure, and no tracing).
    """
    store = repo.store
    results = []
    for rank, refs in enumerate(refs_by_rank):
        builder = TableBuilder()
        runs = [builder.extend(r) for r in refs]
        seg = _placeholder_segment(repo, builder) if placeholder_segments else write_segment(repo, builder)
        flat = [c for r in refs for c in r]
        sizes = {}
        for c in flat:
            sizes.setdefault(c.pack, PACK_BYTES)
        if touch_packs:
            for p in sizes:
                if p not in _SEEN_PACKS:
                    _SEEN_PACKS.add(p)
                    store.put(pack_key(p), b"")
        info = _RankInfo(rank, seg, sizes, pack_usage(flat, {p: PACK_BYTES // (layout.chunk // 2) for p in sizes}), {})
        rank_results = []
        nbytes = 4 * layout.cols * 4
        for t, (first, count) in enumerate(runs):
            sd = _ItemResult(rank, False, nbytes, first, count, sum(c.stored_len for c in refs[t]),
                             info if t == 0 else None)
            rank_results.append(WriteResult(
                index=MetadataIndex(layout.fqn(t), torch.Size([4 * rank, 0]), rank),
                size_in_bytes=nbytes, storage_data=sd))
        results.append(rank_results)
    md = _MD_CACHE.get(layout.name)
    if md is None:
        md = _MD_CACHE[layout.name] = _metadata(layout)
    secs = peak = 0
    if measure:
        # CPU without tracing (tracemalloc slows Python down several times), then
        # the peak of what finish allocates over its inputs, traced, and the commit.
        c0 = time.process_time()
        _m.to_json(build_manifest(step, md, results))
        secs = time.process_time() - c0
        tracemalloc.start()
    commit = StepCommit(repo, step, base=None)
    commit.begin()
    man = build_manifest(step, md, results)
    body = commit.commit(man)
    if measure:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    commit.end()
    return len(body), secs, peak


def _rank_boxes(layout: Layout, rank: int):
    return [(layout.fqn(t), (4 * rank, 0), (4, layout.cols)) for t in range(layout.tensors)]


def restore_share(store: CountingStore, layout: Layout, step: int, rank: int) -> dict:
    """A fresh handle reads the root and the chunk tables of one rank's boxes."""
    def once():
        repo = Repository(store)
        ckpt = repo.checkpoint(step)
        pairs = []
        for key, lo, size in _rank_boxes(layout, rank):
            e = ckpt.entry(key)
            pairs += [(key, int(i)) for i in e.meeting(lo, size)]
        ckpt.resolve(pairs)
        n = sum(len(ckpt.shards(k, [i])[0].chunks) for k, i in pairs)
        repo.close()
        return n

    store.reset()
    c0 = time.process_time()
    nrefs = once()
    secs = time.process_time() - c0
    read = store.read_by_prefix["manifests"] + store.read_by_prefix["segments"]
    tracemalloc.start()
    once()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"metadata_read": read, "share_records_bytes": nrefs * 56, "cpu_s": secs, "peak": peak, "chunks": nrefs}


def restore_tensor(store: CountingStore, layout: Layout, step: int, t: int) -> dict:
    """A fresh handle resolves every shard of one tensor (each rank's part of it): metadata bytes
    and requests (a ranged read or a GET each)."""
    store.reset()
    repo = Repository(store)
    ckpt = repo.checkpoint(step)
    key = layout.fqn(t)
    e = ckpt.entry(key)
    ckpt.resolve([(key, i) for i in range(e.nshards)])
    n = sum(len(s.chunks) for s in ckpt.shards(key, range(e.nshards)))
    repo.close()
    read = store.read_by_prefix["manifests"] + store.read_by_prefix["segments"]
    return {"metadata_read": read, "requests": store.calls["get"] + len(store.reads), "chunks": n,
            "segments_read": len({k for k, _, _ in store.reads if k.startswith("segments/")})}


def dedup_of_share(store: CountingStore, layout: Layout, step: int, rank: int) -> dict:
    repo = Repository(store)
    repo.manifest(step)
    store.reset()
    refs = dedup_share(repo, step, _rank_boxes(layout, rank))
    read = store.read_by_prefix["manifests"] + store.read_by_prefix["segments"]
    repo.close()
    return {"dedup_metadata_read": read, "dedup_chunks": len(refs), "share_records_bytes": len(refs) * 56}


def v1_manifest(layout: Layout, refs_by_rank) -> bytes:
    """The same step as one 1.0 manifest (what main wrote before 2.0)."""
    tensors = {}
    for t in range(layout.tensors):
        shards = tuple(
            _m.Shard((4 * r, 0), (4, layout.cols), tuple(refs_by_rank[r][t])) for r in range(layout.ranks)
        )
        tensors[layout.fqn(t)] = _m.TensorEntry(layout.fqn(t), "float32", (layout.rows, layout.cols), shards)
    packs = {c.pack: PACK_BYTES for r in refs_by_rank for ts in r for c in ts}
    man = _m.Manifest(step=1, created=time.time(), tensors=tensors,
                      tree={"d": [[k, {"t": k}] for k in tensors]}, packs=packs, version=_m.V1)
    return _m.to_json(man)


def v1_restore(raw: bytes) -> dict:
    c0 = time.process_time()
    m = _m.from_json(raw)
    secs = time.process_time() - c0
    del m
    tracemalloc.start()
    m = _m.from_json(raw)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del m
    return {"metadata_read": len(raw), "cpu_s": secs, "peak": peak}


from ..common.measure import RssSampler as Sampler  # noqa: E402
from ..common.measure import rss_now as rss  # noqa: E402


def gc_bench(steps: int) -> dict:
    """``steps`` steps of the 1 TB layout, 10% of the shards new each step; time plan_gc.

    Roots are committed through the real DCP coordinator path; segments are
    empty placeholder objects (GC lists them, never reads them).
    """
    layout = Layout("1TB")
    store = MemoryStore()
    clock = ManualClock()
    repo = Repository(store, clock=clock, chunk_size=4 * MiB)
    prev = [None] * layout.ranks
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        changed = set(rng.choice(layout.tensors, max(1, layout.tensors // 10), replace=False).tolist())
        refs = [layout.rank_refs(r, step, None if step == 1 else changed, prev[r]) for r in range(layout.ranks)]
        write_step(repo, layout, step, refs, measure=False, placeholder_segments=True)
        prev = refs
        if step % 50 == 0:
            print(f"  gc setup: {step}/{steps} steps committed ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    del prev, refs
    clock.advance(repo.grace() + 10)
    fresh = Repository(store, clock=clock)
    import gc as _pygc

    _pygc.collect()
    base = rss()
    c0 = time.process_time()
    with Sampler() as sampler:
        plan = fresh.plan_gc(keep_last=10)
    secs = time.process_time() - c0
    peak = sampler.peak
    out = {"steps": steps, "plan_cpu_s": secs, "rss_before": base, "peak_rss": peak, "growth": peak - base,
           "delete_steps": len(plan.delete_steps), "delete_packs": len(plan.delete_packs),
           "delete_segments": len(plan.delete_segments), "packs": plan.stats["packs"]}
    # Execute: each batch of deletions re-checked against a listing within half the margin.
    kept = sorted(set(fresh.steps()) - set(plan.delete_steps))
    last = {"t": time.perf_counter()}

    def progress(what, done, total):
        now = time.perf_counter()
        if now - last["t"] >= 30 or done == total:
            last["t"] = now
            print(f"  gc execute: {what} {done}/{total}", file=sys.stderr)

    _pygc.collect()
    base = rss()
    c0, w0 = time.process_time(), time.perf_counter()
    with Sampler() as sampler:
        res = plan.execute(progress=progress)
    out.update({"execute_cpu_s": time.process_time() - c0, "execute_wall_s": time.perf_counter() - w0,
                "execute_growth": sampler.peak - base, "deleted_steps": len(res.deleted_steps),
                "deleted_packs": len(res.deleted_packs), "deleted_segments": len(res.deleted_segments),
                "skipped": len(res.skipped_steps) + len(res.skipped_packs)})
    # What is kept still restores: every step GC kept is listed and every pack its root names exists.
    after = Repository(store, clock=clock)
    left = sorted(after.steps())
    if left != kept:
        raise AssertionError(f"GC kept steps {left[:5]}..., expected {kept[:5]}...")
    packs = {pack_id_of_key(o.key) for o in store.list(PACK_PREFIX)}
    missing = sum(1 for st in left for pid in after.step_refs(st).packs if pid not in packs)
    if missing:
        raise AssertionError(f"GC deleted {missing} pack(s) a kept step references")
    out["kept_steps"] = len(left)
    return out


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return str(n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100GB,1TB,10TB")
    ap.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--v1", default="100GB,1TB", help="sizes whose 1.0 manifest is built and parsed too")
    ap.add_argument("--gc-steps", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--requests", action="store_true",
                    help="requests by kind of a save and a restore instead: measured on --ranks ranks "
                         "through a request-logging proxy, modelled at 1,000 (request_budget.py)")
    ap.add_argument("--ranks", type=int, default=None, help="ranks of --requests (8) or --rate-cap (4)")
    ap.add_argument("--rate-cap", type=float, default=None,
                    help="answers throttled under a cap of this many requests/s, adaptive rate on and off")
    a = ap.parse_args(argv)
    if a.rate_cap:
        from .request_budget import main_cap

        print(f"command: python -m benchmarks.distributed.scale {' '.join(argv if argv is not None else sys.argv[1:])}")
        return main_cap(a.ranks or 4, a.rate_cap, a.json)
    if a.requests:
        from .request_budget import main as requests_main

        print(f"command: python -m benchmarks.distributed.scale {' '.join(argv if argv is not None else sys.argv[1:])}")
        return requests_main(a.ranks or 8, a.json)
    names = [s for s in a.sizes.split(",") if s] + (["fsdp"] if a.fsdp else [])
    v1 = {s for s in a.v1.split(",") if s}
    rows = []
    print(f"command: python -m benchmarks.distributed.scale {' '.join(argv if argv is not None else sys.argv[1:])}")
    for name in names:
        layout = Layout(name)
        store = CountingStore(MemoryStore())
        repo = Repository(store, chunk_size=layout.chunk)
        t0 = time.perf_counter()
        refs = [layout.rank_refs(r, 1) for r in range(layout.ranks)]
        root, fin_cpu, fin_peak = write_step(repo, layout, 1, refs, touch_packs=False)
        row = {"layout": name, "shards": layout.nshards, "chunks": layout.nchunks, "logical": layout.logical,
               "root_bytes": root, "finish_cpu_s": fin_cpu, "finish_peak": fin_peak,
               "segments_bytes": sum(o.size for o in store.inner.list("segments/"))}
        row.update({f"restore_{k}": v for k, v in restore_share(store, layout, 1, rank=RANKS // 2).items()})
        row.update(dedup_of_share(store, layout, 1, rank=RANKS // 2))
        row.update({f"tensor_{k}": v for k, v in restore_tensor(store, layout, 1, layout.tensors // 2).items()})
        if name in v1:
            raw = v1_manifest(layout, refs)
            row.update({f"v1_{k}": v for k, v in v1_restore(raw).items()})
            row["v1_manifest_bytes"] = len(raw)
            del raw
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        repo.close()
        del refs
        print(f"{name}: root {human(row['root_bytes'])}, share read {human(row['restore_metadata_read'])} "
              f"({row['restore_cpu_s']:.2f} s CPU), finish {row['finish_cpu_s']:.2f} s / "
              f"{human(row['finish_peak'])}", file=sys.stderr)

    head = ["layout", "shards", "chunks", "root (2.0)", "1.0 manifest", "share: metadata read", "share CPU s",
            "share peak", "1.0 read/CPU", "dedup metadata", "dedup share", "finish CPU s", "finish peak",
            "one tensor: metadata / requests"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        v1s = (f"{human(r['v1_metadata_read'])} / {r['v1_cpu_s']:.2f} s / {human(r['v1_peak'])}"
               if "v1_cpu_s" in r else "-")
        print("| " + " | ".join([
            r["layout"], f"{r['shards']:,}", f"{r['chunks']:,}", human(r["root_bytes"]),
            human(r["v1_manifest_bytes"]) if "v1_manifest_bytes" in r else "-",
            human(r["restore_metadata_read"]), f"{r['restore_cpu_s']:.3f}", human(r["restore_peak"]), v1s,
            human(r["dedup_metadata_read"]), human(r["share_records_bytes"]),
            f"{r['finish_cpu_s']:.2f}", human(r["finish_peak"]),
            f"{human(r['tensor_metadata_read'])} / {r['tensor_requests']:,}",
        ]) + " |")
    out = {"rows": rows}
    if a.gc_steps:
        g = gc_bench(a.gc_steps)
        out["gc"] = g
        print(f"\nplan_gc over {g['steps']} steps of the 1TB layout: {g['plan_cpu_s']:.1f} s CPU, "
              f"RSS grew by {human(g['growth'])} while planning (peak {human(g['peak_rss'])}, "
              f"{human(g['rss_before'])} before, the simulated store included); "
              f"{g['packs']} packs, plan deletes {g['delete_steps']} steps, {g['delete_packs']} packs, "
              f"{g['delete_segments']} segments")
        print(f"execute: {g['execute_cpu_s']:.1f} s CPU, {g['execute_wall_s']:.1f} s wall, RSS grew by "
              f"{human(g['execute_growth'])}; deleted {g['deleted_steps']} steps, {g['deleted_packs']} packs, "
              f"{g['deleted_segments']} segments, skipped {g['skipped']}; the {g['kept_steps']} kept steps "
              f"are listed and every pack they name exists")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
