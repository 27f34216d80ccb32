"""Restoring replicated state on several ranks: the exchange on and off, on moto and SeaweedFS.

Run from the repository root::

    python -m benchmarks.distributed.replicated [--mib 256] [--ranks 4] [--backends moto,seaweedfs]
                                    [--repeat 2] [--json OUT.json]

``--ranks`` processes (gloo on 127.0.0.1, 1 torch thread each) hold the same
state dict, every tensor replicated (DDP): a 3/8 embedding, 1/2 in eight
square matrices, the rest in smaller matrices and 100 vectors; random bits
as fp32 (incompressible). It is saved once through DCP (``CkptStoreWriter``,
DCP's dedup, ckptstore's balance; ``pack_size`` 64 MiB, ``chunk_size``
4 MiB), then loaded with ``dcp.load`` into the same (zeroed) tensors with
``CkptStoreReader(exchange_replicated=False)`` (``off``: every rank
fetches everything, as before) and ``exchange_replicated=True`` (each
region is fetched by one rank and delivered to the others), point to
point (``p2p``, the default below 16 ranks) and by all-gather
(``all-gather``, ``exchange_all_gather_ranks=2``), alternating the order,
``--repeat`` times each. Every load is checked bit for bit against the saved bytes
(BLAKE3 per tensor); a mismatch exits non-zero.

Columns: seconds = the slowest rank's ``dcp.load`` (a barrier before the
clock starts), best of the repeats; pack bytes fetched from the store
(total over ranks, and the largest rank over the mean); ranged GET
requests (total); the exchange's bytes sent by the busiest rank. Servers:
moto (``ckptstore.testing.moto``, threads of the parent process, which
is otherwise idle while the ranks run), SeaweedFS (``weed server -s3``,
``ckptstore.testing.seaweedfs``), both on loopback; on the 2-core machine
the server, the ranks and gloo share the same two CPUs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shlex
import sys
import tempfile
import time

import torch

MiB = 1 << 20
BUCKET = "replbench"
OPTS = dict(chunk_size=4 * MiB, pack_size=64 * MiB)


def state(mib: int, seed: int = 7) -> dict:
    """The replicated state dict, about ``mib`` MiB of fp32 random bits."""
    g = torch.Generator().manual_seed(seed)
    total = mib * MiB // 4  # elements

    def rnd(*shape):
        return torch.empty(math.prod(shape), dtype=torch.int32).random_(generator=g).view(torch.float32).reshape(shape)

    cols = 1024
    sd = {"emb": rnd(max(1, total * 3 // 8 // cols), cols)}
    side = max(1, int(math.sqrt(total // 16)))
    sd.update({f"layer{i}.w": rnd(side, side) for i in range(8)})
    small = max(1, int(math.sqrt(total // 8 // 4)))
    sd.update({f"proj{i}.w": rnd(small, small) for i in range(3)})
    sd.update({f"norm{i}": rnd(4096) for i in range(100)})
    return sd


def _digest(sd: dict) -> dict:
    import blake3

    return {k: blake3.blake3(v.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest() for k, v in sd.items()}


def worker(rank: int, world: int, port: int, cfg: dict) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import CkptStoreReader, CkptStoreWriter
    from ckptstore.repo.repository import Repository
    from ckptstore.storage import open_store
    from ckptstore.storage.wrappers import CountingStore

    class CountingReader(CkptStoreReader):
        def _get_repo(self):
            if self._repo is None:
                store = CountingStore(open_store(self.url, self.storage_options))
                self._repo = Repository(store, **self.options)
            return self._repo

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    import datetime

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        url, so = cfg["url"], cfg["storage_options"]
        sd = state(cfg["mib"])
        want = _digest(sd)
        writer = CkptStoreWriter(url, step=1, storage_options=so, **OPTS)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=writer)
        save_s = time.perf_counter() - t0
        rows = []
        modes = ["off", "p2p", "all-gather"]
        for rep in range(cfg["repeat"]):
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                for v in sd.values():
                    v.zero_()
                reader = CountingReader(url, step=1, storage_options=so, exchange_replicated=mode != "off",
                                        exchange_all_gather_ranks=2 if mode == "all-gather" else 1 << 30, **OPTS)
                dist.barrier()
                t0 = time.perf_counter()
                dcp.load(sd, storage_reader=reader)
                took = time.perf_counter() - t0
                store = reader._repo.store
                got = _digest(sd)
                rows.append({"exchange": mode, "rep": rep, "seconds": took,
                             "packs": store.read_by_prefix["packs"],
                             "gets": store.calls["get_ranges"] + store.calls["read_range_into"],
                             "stats": reader.last_read_stats, "bad": [k for k in want if got[k] != want[k]]})
                reader.close()
        gathered = [None] * world
        dist.all_gather_object(gathered, {"rows": rows, "save_s": save_s, "save": writer.last_rank_stats})
        if rank == 0:
            with open(cfg["out"], "w") as f:
                json.dump({"ranks": gathered, "logical": sum(v.numel() * 4 for v in sd.values())}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _servers(names):
    """Each server in turn (only ckptstore.testing's starters: no other benchmark module is needed)."""
    for name in names:
        if name == "moto":
            from ckptstore.testing.moto import MotoServer

            # threads of this (otherwise idle) parent process; the ranks are processes of their own
            with MotoServer() as server:
                server.create_bucket(BUCKET)
                yield name, server.storage_options()
        elif name == "seaweedfs":
            from ckptstore.testing.seaweedfs import SeaweedFS

            with SeaweedFS() as weed:
                weed.create_bucket(BUCKET)
                yield name, weed.storage_options()
        else:
            raise SystemExit(f"unknown backend {name!r} (moto, seaweedfs)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--backends", default="moto,seaweedfs")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    from ckptstore.testing.moto import free_port

    command = f"{sys.executable} -m benchmarks.distributed.replicated" + "".join(
        " " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    print(f"command: {command}\n{os.cpu_count()} CPUs, {args.ranks} ranks, load average at start {_loadavg()}",
          flush=True)
    target = importlib.import_module("benchmarks.distributed.replicated").worker
    results, bad = {}, False
    tmp = tempfile.mkdtemp(prefix="replbench-", dir="/tmp")
    for name, so in _servers(args.backends.split(",")):
        out = os.path.join(tmp, f"{name}.json")
        cfg = {"url": f"s3://{BUCKET}/{name}", "storage_options": so, "mib": args.mib,
               "repeat": args.repeat, "out": out}
        mp.spawn(target, args=(args.ranks, free_port(), cfg), nprocs=args.ranks, join=True)
        with open(out) as f:
            results[name] = json.load(f)
    print(f"\nload average at end {_loadavg()}")
    print("\n| store | exchange | seconds (best) | all runs | pack bytes fetched | largest rank / mean | "
          "ranged GETs | busiest rank sent |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, res in results.items():
        ranks = res["ranks"]
        nrows = len(ranks[0]["rows"])
        for exchange in ("off", "p2p", "all-gather"):
            runs = []
            for i in range(nrows):
                rs = [r["rows"][i] for r in ranks]
                if rs[0]["exchange"] != exchange:
                    continue
                bad = bad or any(x["bad"] for x in rs)
                runs.append((max(x["seconds"] for x in rs), rs))
            best, rs = min(runs, key=lambda t: t[0])
            packs = [x["packs"] for x in rs]
            mean = sum(packs) / len(packs)
            print(f"| {name} | {exchange} | {best:.2f} | "
                  f"{', '.join(f'{s:.2f}' for s, _ in runs)} | {sum(packs) / MiB:.1f} MiB | "
                  f"{max(packs) / mean:.3f} | {sum(x['gets'] for x in rs)} | "
                  f"{max(x['stats']['sent_bytes'] for x in rs) / MiB:.1f} MiB |")
        saved = [r["save"]["logical_bytes"] for r in ranks]
        print(f"| {name} | save | {max(r['save_s'] for r in ranks):.2f} | | written per rank: "
              f"{', '.join(f'{s / MiB:.1f}' for s in saved)} MiB | {max(saved) / (sum(saved) / len(saved)):.3f} | | |")
    logical = next(iter(results.values()))["logical"]
    print(f"\nstate: {logical / MiB:.1f} MiB replicated on {args.ranks} ranks; every load checked bit for bit")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "results": results}, f, indent=1)
    if bad:
        print("VERIFICATION FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
