"""The node-local tier (issue 26): restarts on the same nodes, resharded, and with one node's tier wiped.

Run from the repository root::

    python -m benchmarks.distributed.tier [--size-gib 1.0] [--rounds 3] [--json OUT.json] [--no-pin] [--seed 0] [--cache-decoded {default,on,off}]

One SeaweedFS server (``weed server -s3`` on loopback, pinned to its own CPU
unless ``--no-pin``; the ranks then run on the other CPU(s)). Ranks are
``torch.multiprocessing`` processes with gloo on 127.0.0.1; a "node" is a
group of ranks sharing one ``cache_dir``. The state dict is
``dcp_compare``'s: fp32 ``randn`` DTensors sharded on dim 0.

1. **Restart on the same nodes** (4 ranks, nodes {0,1} and {2,3}): the step
   is saved once with ``CkptStoreWriter(cache_dir=<the rank's node>)``
   (write-through), once with DCP's ``FileSystemWriter`` to a local
   directory (and once more without a tier, to another prefix, to show what
   write-through costs a save); then, for ``--rounds`` rounds in a rotating order, three
   restores into the same preallocated DTensors: ``dcp-fs``
   (``FileSystemReader``), ``ckpt-tier`` (``CkptStoreReader`` with the node's
   ``cache_dir``) and ``ckpt-store`` (``CkptStoreReader``, no tier). Every
   ckptstore reader is a fresh handle whose store counts what it reads
   (``CountingStore``: pack bytes and metadata bytes, per rank).
2. **One node's tier wiped** (same 4 ranks): node 1's ``cache_dir`` removed,
   then one restore with the tiers; node 1's ranks read their share from
   the object store. A second restore shows what the first kept. Then the
   step is saved again with ``replicas=1`` (other tiers, another prefix),
   ``writer.flush()`` waits for the copies, node 1's tier is removed, and
   one restore reads node 1's share from node 0's copies.
3. **Resharded restart 4 -> 2 ranks on one node holding everything** (a
   new 2-rank job): a ``cache_dir`` holding both nodes' tier files (hard
   links of the files as phase 1 left them, before the wipe: byte for byte
   what one node running all 4 ranks would hold), restored into 2-rank
   DTensors, next to ``FileSystemReader`` and the store without the tier.

Phase 1 starts with an untimed save to SeaweedFS (a fresh server grows its
volumes on its first writes), and phases 1 and 3 with one untimed restore
of each system (a fresh
process's first restore pays for imports, pools and clients, whichever
system it uses).

Every restore is compared bit for bit with the saved shards. See
``benchmarks/README.md`` and ``docs/performance.md``.
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

from ..common.measure import MiB, cpu_self, loadavg
from ..common.pinning import Pinning
from ..common.report import command_line, env_line, format_table, git_commit, human, write_results
from ..common.servers import free_port, seaweedfs
from ..common.verify import VerificationError, bits_equal, differing_elements, scrub
from ..common.workloads import local_shape, make_dtensor, sharded_layout

BUCKET = "tierbench"
PACK_SIZE = 64 * MiB
NODE_RANKS = 2
ORDERS = (("dcp-fs", "ckpt-tier", "ckpt-store"), ("ckpt-tier", "ckpt-store", "dcp-fs"),
          ("ckpt-store", "dcp-fs", "ckpt-tier"))


# ---------------------------------------------------------------- data
def rank_shards(cfg: dict, rank: int, world: int) -> dict[str, torch.Tensor]:
    """The local shards of ``rank`` of the ``world``-rank save (one seeded generator per rank)."""
    g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + rank)
    return {n: torch.randn(local_shape(s, world), generator=g, dtype=torch.float32)
            for n, s in sharded_layout(cfg["size_gib"], cfg["save_world"])}


def expected_shards(cfg: dict, rank: int, world: int) -> dict[str, torch.Tensor]:
    """What ``rank`` of a ``world``-rank restore holds: the saving ranks' shards it covers, concatenated."""
    per = cfg["save_world"] // world
    parts = [rank_shards(cfg, r, cfg["save_world"]) for r in range(rank * per, (rank + 1) * per)]
    return {n: torch.cat([p[n] for p in parts]) if per > 1 else parts[0][n] for n in parts[0]}


# ---------------------------------------------------------------- a reader that counts
def counting_reader(url: str, **kw):
    """A ``CkptStoreReader`` whose repository reads through a ``CountingStore`` (``reader.counting``)."""
    from ckptstore.dcp import CkptStoreReader
    from ckptstore.repo.repository import Repository
    from ckptstore.storage import open_store
    from ckptstore.storage.retry import RetryStore
    from ckptstore.storage.wrappers import CountingStore

    class CountingReader(CkptStoreReader):
        counting = None

        def _get_repo(self):
            if self._repo is None:
                self.counting = CountingStore(RetryStore(open_store(self.url, self.storage_options)))
                self._repo = Repository(self.counting, **self.options)
            return self._repo

    return CountingReader(url, **kw)


def reader_stats(reader) -> dict:
    c = reader.counting
    packs = c.read_by_prefix.get("packs", 0)
    return {"store_pack_bytes": packs, "store_meta_bytes": c.bytes_read - packs,
            "by_prefix": dict(c.read_by_prefix), "read_stats": reader._get_repo().read_stats(),
            "tier": dict(reader._get_repo().tier.stats) if reader._get_repo().tier is not None else None}


# ---------------------------------------------------------------- worker side
class Rank:
    """One rank's process group, destination DTensors and timed restores."""

    def __init__(self, rank: int, world: int, port: int, cfg: dict):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if cfg["client_cpus"]:
            os.sched_setaffinity(0, set(cfg["client_cpus"]))  # before any thread starts: they inherit it
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        self.dist, self.rank, self.world, self.cfg = dist, rank, world, cfg
        self.mesh = init_device_mesh("cpu", (world,))
        self.shapes = sharded_layout(cfg["size_gib"], cfg["save_world"])
        self.rows: list[dict] = []

    def dtensors(self, local: dict) -> dict:
        return {n: make_dtensor(local[n], self.mesh, s) for n, s in self.shapes}

    def prepare(self, want: dict) -> None:
        self.want = want
        self.dst_local = {n: torch.empty_like(t) for n, t in want.items()}
        self.dst = self.dtensors(self.dst_local)

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def check(self, what: str) -> None:
        """Every rank compares its shards with what was saved; any rank's failure fails all."""
        err = None
        for n, want in self.want.items():
            got = self.dst[n].to_local()
            if got.data_ptr() != self.dst_local[n].data_ptr():
                err = f"{n}: not loaded into the preallocated tensor"
            elif not bits_equal(got, want):
                err = f"{n}: {differing_elements(got, want)} of {want.numel()} elements differ"
            if err:
                break
        errs = [None] * self.world
        self.dist.all_gather_object(errs, err and f"rank {self.rank}: {err}")
        bad = [e for e in errs if e]
        if bad:
            raise VerificationError(f"{what}: not bit-exact: " + "; ".join(bad))

    def timed(self, phase: str, system: str, fn, round_: int | None = None, quiet: bool = False) -> dict:
        """Run ``fn`` on every rank after a barrier; the row (rank 0's copy is kept) has every rank's figures."""
        gc.collect()
        self.dist.barrier()
        cpu0, t0 = cpu_self(), time.perf_counter()
        extra = fn()
        seconds, cpu = time.perf_counter() - t0, cpu_self() - cpu0
        per = [None] * self.world
        self.dist.all_gather_object(per, {"seconds": seconds, "cpu": cpu, **(extra or {})})
        row = {"phase": phase, "system": system, "round": round_, "world": self.world,
               "seconds": max(p["seconds"] for p in per), "cpu_seconds": sum(p["cpu"] for p in per), "ranks": per}
        if self.rank == 0 and not quiet:
            self.rows.append(row)
            print(f"  .. {phase:<8} {system:<14} round {round_ if round_ is not None else '-'}  "
                  f"{row['seconds']:7.2f} s  (ranks " + ", ".join(f"{p['seconds']:.2f}" for p in per)
                  + (f"; store pack bytes {human(sum(p.get('store_pack_bytes', 0) for p in per))}"
                     if "store_pack_bytes" in per[0] else "") + ")", flush=True)
        return row

    def warm_up(self, cache_dir: str) -> None:
        """One untimed restore of each system: imports, pools, clients and the page cache, as a restarted
        job has them after its first read (the first restore of a fresh process pays for them, whichever it is)."""
        t0 = time.perf_counter()
        for system in ORDERS[0]:
            self.restore("warm-up", system, None, cache_dir=cache_dir, quiet=True)
        self.log(f"  .. warm-up: one untimed restore of each system, {time.perf_counter() - t0:.1f} s")

    def restore(self, phase: str, system: str, round_: int | None = None, cache_dir: str | None = None,
                quiet: bool = False, url: str | None = None) -> dict:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        cfg = self.cfg
        scrub(self.dst_local)

        def run():
            if system == "dcp-fs":
                dcp.load(self.dst, storage_reader=FileSystemReader(cfg["fs_path"]))
                return {}
            opts = {"cache_dir": cache_dir} if system != "ckpt-store" else {}
            reader = counting_reader(url or cfg["url"], step=1, storage_options=cfg["storage_options"], **opts)
            dcp.load(self.dst, storage_reader=reader)
            stats = reader_stats(reader)
            reader.close()
            return stats

        row = self.timed(phase, system, run, round_, quiet)
        self.check(f"{phase} {system} round {round_}")
        return row

    def close(self) -> None:
        self.dist.barrier()
        self.dist.destroy_process_group()


def node_dir(cfg: dict, node: int) -> str:
    return os.path.join(cfg["tmp"], f"node{node}")


def worker_nodes(rank: int, world: int, port: int, cfg: dict) -> None:
    """Phases 1 and 2: save, restart rounds, then node 1's tier wiped."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ckptstore.dcp import CkptStoreWriter

    r = Rank(rank, world, port, cfg)
    try:
        src = rank_shards(cfg, rank, world)
        r.prepare(src)
        mine = node_dir(cfg, rank // NODE_RANKS)
        sd = r.dtensors(src)

        def save(writer):
            def f():
                dcp.save(sd, storage_writer=writer)
                if hasattr(writer, "close"):
                    writer.close()
            return f

        so = cfg["storage_options"]
        # untimed: a fresh SeaweedFS grows its volumes on its first writes, which the first timed save would pay for
        save(CkptStoreWriter(cfg["url"] + "-warmup", step=1, storage_options=so, pack_size=PACK_SIZE))()
        r.log("  .. warm-up: one untimed save to SeaweedFS (another prefix)")
        r.timed("save", "dcp-fs", save(FileSystemWriter(cfg["fs_path"])))
        r.timed("save", "ckpt-tier", save(CkptStoreWriter(cfg["url"], step=1, storage_options=so, cache_dir=mine,
                                                          pack_size=PACK_SIZE, **cfg["tier_opts"])))
        # the same save without a tier (another prefix): what write-through costs a save
        r.timed("save", "ckpt-store", save(CkptStoreWriter(cfg["url"] + "-plain", step=1, storage_options=so,
                                                           pack_size=PACK_SIZE)))
        if rank == 0:
            os.sync()  # the saves' dirty pages written out before anything is timed
        r.warm_up(mine)
        for i in range(cfg["rounds"]):
            for system in ORDERS[i % len(ORDERS)]:
                r.restore("restart", system, i, cache_dir=mine)
        r.dist.barrier()
        if rank == 0:
            _link_tree(node_dir(cfg, 0), cfg["one_node"])
            _link_tree(node_dir(cfg, 1), cfg["one_node"])
            shutil.rmtree(node_dir(cfg, 1))
            r.log("node 1's tier removed (a node that comes back with an empty disk)")
        r.restore("wiped", "ckpt-tier", 0, cache_dir=mine)
        r.restore("wiped", "ckpt-tier", 1, cache_dir=mine)
        # 2b: the same step saved with replicas=1 (own tiers, another prefix), node 1's tier wiped again
        rep_dir, rep_url = mine + "-rep", cfg["url"] + "-replicas"
        w = CkptStoreWriter(rep_url, step=1, storage_options=so, cache_dir=rep_dir, pack_size=PACK_SIZE, replicas=1)
        r.timed("save", "ckpt-replicas", lambda: dcp.save(sd, storage_writer=w) and None)
        r.timed("flush", "ckpt-replicas", lambda: w.flush())
        w.close()
        r.dist.barrier()
        if rank == 0:
            shutil.rmtree(node_dir(cfg, 1) + "-rep")
            r.log("node 1's tier of the replicas=1 save removed")
        r.restore("wiped-rep", "ckpt-tier", 0, cache_dir=rep_dir, url=rep_url)
        if rank == 0:
            with open(cfg["out_nodes"], "w") as f:
                json.dump({"rows": r.rows, "tensors": len(r.shapes)}, f, default=str)
    finally:
        r.close()


def worker_reshard(rank: int, world: int, port: int, cfg: dict) -> None:
    """Phase 3: the 4-rank step restored by 2 ranks of one node whose tier holds everything."""
    r = Rank(rank, world, port, cfg)
    try:
        r.prepare(expected_shards(cfg, rank, world))
        r.warm_up(cfg["one_node"])
        for i in range(cfg["rounds"]):
            for system in ORDERS[i % len(ORDERS)]:
                r.restore("reshard", system, i, cache_dir=cfg["one_node"])
        if rank == 0:
            with open(cfg["out_reshard"], "w") as f:
                json.dump({"rows": r.rows}, f, default=str)
    finally:
        r.close()


def _link_tree(src: str, dst: str) -> None:
    """Hard-link every file of ``src`` into ``dst`` (same relative paths; existing ones kept)."""
    for dirpath, _, files in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        if rel.split(os.sep)[-1] == ".tmp" or f"{os.sep}.tmp" in rel:
            continue
        os.makedirs(os.path.join(dst, rel), exist_ok=True)
        for name in files:
            try:
                os.link(os.path.join(dirpath, name), os.path.join(dst, rel, name))
            except FileExistsError:
                pass


# ---------------------------------------------------------------- main side
def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return (s[(n - 1) // 2] + s[n // 2]) / 2 if n else float("nan")


def _sum(row: dict, key: str, ranks=None) -> int:
    return sum(p.get(key, 0) for i, p in enumerate(row["ranks"]) if ranks is None or i in ranks)


def summarize(rows: list[dict]) -> list[dict]:
    """One line per (phase, system): median, min and max seconds over rounds, bytes from the store."""
    out = []
    keys = list(dict.fromkeys((r["phase"], r["system"]) for r in rows if r["phase"] not in ("wiped", "wiped-rep")))
    for phase, system in keys:
        mine = [r for r in rows if (r["phase"], r["system"]) == (phase, system)]
        secs = [r["seconds"] for r in mine]
        out.append({
            "phase": phase, "system": system, "rounds": len(mine), "median": _median(secs),
            "min": min(secs), "max": max(secs), "cpu_median": _median([r["cpu_seconds"] for r in mine]),
            "store_pack_bytes": max(_sum(r, "store_pack_bytes") for r in mine),
            "meta_per_rank": max((p.get("store_meta_bytes", 0) for r in mine for p in r["ranks"]), default=0),
            "tier_bytes": max(sum(p.get("read_stats", {}).get("tier", 0) for p in r["ranks"]) for r in mine),
        })
    return out


def targets(rows: list[dict], summary: list[dict], tensors: int, chunk_size: int) -> list[str]:
    med = {(s["phase"], s["system"]): s for s in summary}
    lines = []

    def line(ok: bool, text: str) -> None:
        lines.append(("met     " if ok else "MISSED  ") + text)

    tier, fs, store = (med.get(("restart", k)) for k in ("ckpt-tier", "dcp-fs", "ckpt-store"))
    if tier and fs and store:
        line(tier["store_pack_bytes"] == 0, f"restart on the same nodes: object-store pack bytes "
             f"{tier['store_pack_bytes']} (target 0; worst round, all ranks)")
        line(tier["meta_per_rank"] <= MiB, f"restart: metadata read from the store {human(tier['meta_per_rank'])} "
             "a rank at most (target <= 1 MiB)")
        a = tier["median"] / fs["median"]
        line(a <= 1.3, f"restart: tier restore / FileSystemReader = {a:.2f}x ({tier['median']:.2f} vs "
             f"{fs['median']:.2f} s, medians of {tier['rounds']}) (target <= 1.3x)")
        b = tier["median"] / store["median"]
        line(b <= 0.3, f"restart: tier restore / restore from SeaweedFS without the tier = {b:.2f}x "
             f"({tier['median']:.2f} vs {store['median']:.2f} s) (target <= 0.3x)")
    rs = med.get(("reshard", "ckpt-tier"))
    if rs:
        line(rs["store_pack_bytes"] == 0, f"resharded restart 4 -> 2 ranks on one node: object-store pack bytes "
             f"{rs['store_pack_bytes']} (target 0)")
    wiped = [r for r in rows if r["phase"] == "wiped"]
    plain = [r for r in rows if (r["phase"], r["system"]) == ("restart", "ckpt-store")]
    if wiped and plain:
        node1 = set(range(NODE_RANKS, 2 * NODE_RANKS))
        share = max(_sum(r, "store_pack_bytes", node1) for r in plain)
        allow = share + 2 * chunk_size * tensors
        got = _sum(wiped[0], "store_pack_bytes")
        line(got <= allow, f"node 1's tier wiped, no replicas: object-store pack bytes {human(got)} "
             f"(node 1 ranks {human(_sum(wiped[0], 'store_pack_bytes', node1))}); node 1's share "
             f"{human(share)}, target <= share + 2 chunks x {tensors} tensors = {human(allow)}")
        if len(wiped) > 1:
            again = _sum(wiped[1], "store_pack_bytes")
            lines.append(f"info    the restore after that: object-store pack bytes {again} (what the first "
                         "one read was kept in node 1's tier)")
    for r in rows:
        if r["phase"] == "wiped-rep":
            got = _sum(r, "store_pack_bytes")
            peer = sum(p.get("read_stats", {}).get("peer", 0) for p in r["ranks"])
            line(got == 0, f"node 1's tier wiped, replicas=1: object-store pack bytes {got} (target 0); "
                 f"{human(peer)} read from the peer's copies")
    return lines


def table(summary: list[dict]) -> str:
    base = {s["phase"]: s for s in summary if s["system"] == "dcp-fs"}
    head = ["phase", "system", "rounds", "median s", "min s", "max s", "vs dcp-fs", "store pack bytes",
            "metadata/rank", "from tier", "CPU s (ranks)"]
    lines = []
    for s in summary:
        b = base.get(s["phase"])
        fs_system = s["system"] == "dcp-fs"
        lines.append([s["phase"], s["system"], str(s["rounds"]), f"{s['median']:.2f}", f"{s['min']:.2f}",
                      f"{s['max']:.2f}", f"{s['median'] / b['median']:.2f}x" if b else "-",
                      "-" if fs_system else human(s["store_pack_bytes"]),
                      "-" if fs_system else human(s["meta_per_rank"]),
                      "-" if fs_system else human(s["tier_bytes"]), f"{s['cpu_median']:.1f}"])
    return format_table(head, lines, left=2)


def wiped_table(rows: list[dict]) -> str:
    head = ["restore", "seconds"] + [f"rank {i} store pack bytes" for i in range(2 * NODE_RANKS)]
    lines = []
    for r in rows:
        if r["phase"] in ("wiped", "wiped-rep"):
            name = f"wiped #{r['round'] + 1}" if r["phase"] == "wiped" else "wiped, replicas=1"
            lines.append([name, f"{r['seconds']:.2f}"] + [human(p.get("store_pack_bytes", 0)) for p in r["ranks"]])
    return format_table(head, lines, left=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.distributed.tier", description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="the step's size over all ranks (default 1.0)")
    ap.add_argument("--rounds", type=int, default=3, help="restores of each system per phase (default 3)")
    ap.add_argument("--json", metavar="OUT.json", help="write the results here")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the server and the ranks to CPUs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-decoded", choices=("default", "on", "off"), default="default",
                    help="the tier's saves keep chunks decoded too: 'default' (cache_decoded=None: where the budget "
                         "has room), 'on' (True), 'off' (False: pack copies only, as saves wrote before issue 44)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    world = 2 * NODE_RANKS
    sharded_layout(args.size_gib, world)

    import torch.multiprocessing as mp

    from ckptstore.pipeline.options import RepoOptions

    command = command_line("benchmarks.distributed.tier", argv)
    commit = git_commit()
    pinning = Pinning(enabled=not args.no_pin)
    print(f"command: {command}", flush=True)
    print(env_line(threads=f"{world} ranks, 1 torch thread each") + f", commit {commit}", flush=True)
    pin_text = (f"pinning: SeaweedFS on CPU {','.join(map(str, sorted(pinning.server_cpus)))}, every rank on CPU "
                f"{','.join(map(str, sorted(pinning.client_cpus)))} in every phase, local restores included"
                if pinning.enabled else "pinning: off (--no-pin, or a single CPU)")
    print(pin_text, flush=True)
    mod = importlib.import_module("benchmarks.distributed.tier")  # spawned ranks import the workers by this name
    tmp = tempfile.mkdtemp(prefix="tierbench-", dir="/tmp")
    cfg = {"size_gib": args.size_gib, "seed": args.seed, "rounds": args.rounds, "tmp": tmp, "save_world": world,
           "fs_path": os.path.join(tmp, "dcp-fs"), "one_node": os.path.join(tmp, "one-node"),
           "out_nodes": os.path.join(tmp, "nodes.json"), "out_reshard": os.path.join(tmp, "reshard.json"),
           "client_cpus": sorted(pinning.client_cpus) if pinning.enabled else None,
           "tier_opts": {"default": {}, "on": {"cache_decoded": True}, "off": {"cache_decoded": False}}[args.cache_decoded]}
    started = time.perf_counter()
    try:
        with seaweedfs(BUCKET) as server:
            print(f"server: {server.info['server']} at {server.endpoint}, {pinning.server(server.pid)}", flush=True)
            cfg.update(url=f"s3://{BUCKET}/tier", storage_options=server.storage_options())
            mp.spawn(mod.worker_nodes, args=(world, free_port(), cfg), nprocs=world, join=True)
            mp.spawn(mod.worker_reshard, args=(NODE_RANKS, free_port(), cfg), nprocs=NODE_RANKS, join=True)
            server_cpus = pinning.check(server.pid)
        with open(cfg["out_nodes"]) as f:
            nodes = json.load(f)
        with open(cfg["out_reshard"]) as f:
            reshard = json.load(f)
    except Exception:
        traceback.print_exc()
        print("FAILED", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total = time.perf_counter() - started
    rows = nodes["rows"] + reshard["rows"]
    summary = summarize([r for r in rows if r["phase"] not in ("save", "flush")])
    chunk = RepoOptions.from_kwargs(True).chunk_size
    checks = targets(rows, summary, nodes["tensors"], chunk)
    saves = {r["system"]: r["seconds"] for r in rows if r["phase"] == "save"}
    flushes = {r["system"]: r["seconds"] for r in rows if r["phase"] == "flush"}

    print()
    print(f"Produced by: {command}")
    print(f"  ckptstore at commit {commit}; {args.size_gib:g} GiB fp32 randn in {nodes['tensors']} tensors, DTensors "
          f"Shard(0) over {world} ranks (nodes: ranks 0-1 and 2-3, one cache_dir each"
          f"{'' if args.cache_decoded == 'default' else ', cache_decoded=' + str(args.cache_decoded == 'on')}); SeaweedFS pinned: "
          f"{server_cpus}; packs of {human(PACK_SIZE)}, chunks of {human(chunk)}")
    print(f"  saves (once each, no target): dcp-fs {saves.get('dcp-fs', 0):.2f} s; ckptstore to SeaweedFS with "
          f"write-through to the tier {saves.get('ckpt-tier', 0):.2f} s, then without a tier (another prefix) "
          f"{saves.get('ckpt-store', 0):.2f} s; with replicas=1 (another prefix) {saves.get('ckpt-replicas', 0):.2f} s, "
          f"then writer.flush() (replicas done) {flushes.get('ckpt-replicas', 0):.2f} s")
    print("  seconds: max over ranks, clock started after a barrier; medians over rounds (rotating order); "
          "'store pack bytes': packs read from SeaweedFS, all ranks, worst round; 'metadata/rank': other "
          "objects (manifest, segments, config), worst rank; 'from tier': chunk bytes the tier delivered. "
          "Every restore verified bit-exact.")
    print(table(summary))
    print()
    print(wiped_table(rows))
    print()
    print("targets:")
    for c in checks:
        print(f"  {c}")
    print(f"wall time {total:.1f} s; load average at end {loadavg()}")
    if args.json:
        write_results(args.json, command, {
            "commit": commit, "size_gib": args.size_gib, "rounds": args.rounds, "pack_size": PACK_SIZE,
            "chunk_size": chunk, "tensors": nodes["tensors"], "pinning": pin_text,
            "rows": rows, "summary": summary, "targets": checks, "wall_seconds": total,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
