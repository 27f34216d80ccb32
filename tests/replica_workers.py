"""Rank bodies of the peer-replica tests (tests/test_replicas.py), spawned on 2 gloo ranks.

Each rank is one "node": its own ``cache_dir`` (``node<rank>``). A rank
saves step 1 with ``CkptStoreWriter(..., replicas=...)``, flushes, then the
test's ``damage`` runs on rank 0's node (wiped, or wiped with a peer copy
damaged), and every rank loads step 1 back through its tier with DCP,
writing what it read from where to ``rank<r>.json``.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def state(rank: int) -> dict:
    g = torch.Generator().manual_seed(7 + rank)
    return {
        f"own{rank}": torch.randn(96, 512, generator=g),  # written by this rank alone
        "shared": torch.arange(64 * 512, dtype=torch.float32).reshape(64, 512),  # replicated
    }


def _packs(cache: str) -> list[str]:
    return sorted(os.path.basename(p)[: -len(".pack")]
                  for p in glob.glob(os.path.join(cache, "repos", "*", "*packs", "*", "*.pack"))
                  + glob.glob(os.path.join(cache, "repos", "*", "wb", "packs", "*", "*.pack")))


def run(rank: int, world: int, port: int, url: str, tmp: str, replicas: int, write_back: bool, damage: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ckptstore.dcp import CkptStoreReader, CkptStoreWriter

    cache = os.path.join(tmp, f"node{rank}")
    out: dict = {}
    writer = CkptStoreWriter(url, step=1, cache_dir=cache, write_back=write_back, replicas=replicas,
                             chunk_size=16384, pack_size=256 << 10)
    dcp.save(state(rank), storage_writer=writer)
    out["wrote"] = sorted(writer._packs_written)
    out["wrote_bytes"] = sum(writer._packs_written.values())
    writer.flush()  # collective: every rank's uploads and replicas are done
    out["replica_stats"] = None if writer._replicator is None else dict(writer._replicator.stats)
    out["packs_after_flush"] = _packs(cache)
    writer.close()
    if rank == 0:
        with open(os.path.join(tmp, "wrote0.json"), "w") as f:
            json.dump(out["wrote"], f)
    dist.barrier()
    if rank == 0 and damage in ("wipe", "wipe-damaged-copy"):
        shutil.rmtree(cache)
    if rank == 1 and damage == "wipe-damaged-copy":
        # flip one byte in the middle of each copy this node keeps of node 0's packs
        theirs = json.load(open(os.path.join(tmp, "wrote0.json")))
        for p in glob.glob(os.path.join(cache, "repos", "*", "packs", "*", "*.pack")):
            if os.path.basename(p)[: -len(".pack")] in theirs:
                with open(p, "r+b") as f:
                    f.seek(os.path.getsize(p) // 2)
                    b = f.read(1)
                    f.seek(-1, 1)
                    f.write(bytes([b[0] ^ 0xFF]))
    dist.barrier()
    want = {**state(0), **state(1)}
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    reader = CkptStoreReader(url, step=1, cache_dir=cache)
    dcp.load(got, storage_reader=reader)
    out["read"] = reader.read_stats()
    out["peer"] = reader.last_peer_stats
    out["equal"] = all(torch.equal(got[k], want[k]) for k in want)
    reader.close()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def run_broken(rank: int, world: int, port: int, url: str, tmp: str) -> None:
    """Rank 1's replicas fail (injected); rank 0's wait for it times out. Both flushes raise, naming
    the ranks; the save itself is committed and reads back."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import ckptstore
    from ckptstore.dcp import CkptStoreWriter
    from ckptstore.dcp.replicas import Replicator

    if rank == 1:
        def broken(self, step, packs):
            raise RuntimeError("injected: the peer link is down")

        Replicator._replicate = broken
    cache = os.path.join(tmp, f"node{rank}")
    writer = CkptStoreWriter(url, step=1, cache_dir=cache, replicas=1, replica_timeout=3, chunk_size=16384)
    dcp.save(state(rank), storage_writer=writer)
    out: dict = {}
    try:
        writer.flush()
        out["flush"] = "returned"
    except Exception as e:  # noqa: BLE001 - what the test checks
        out["flush"] = f"{type(e).__name__}: {e}"
    with ckptstore.open(url) as plain:
        out["steps"] = plain.steps()
    writer.flush()  # reported once: the next flush returns (the replicas stay off for this writer)
    out["later"] = "returned"
    writer.close()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def run_async(rank: int, world: int, port: int, url: str, tmp: str) -> None:
    """Two ``dcp.async_save`` calls with ``replicas=1``, a collective of the training loop running
    while each save is under way; then a flush."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import ckptstore
    from ckptstore.dcp import CkptStoreWriter

    cache = os.path.join(tmp, f"node{rank}")
    # async_save's own group, as DCP asks: its collectives run on a background thread, beside the
    # training loop's on the default group (one group from two threads deadlocks)
    pg = dist.new_group(backend="gloo")
    writer = CkptStoreWriter(url, cache_dir=cache, replicas=1, chunk_size=16384, replica_timeout=60,
                             process_group=pg)
    for step in (1, 2):
        sd = state(rank)
        sd["shared"] = sd["shared"] + step
        fut = dcp.async_save(sd, checkpoint_id=f"{url}/step-{step}", storage_writer=writer, process_group=pg)
        dist.all_reduce(torch.ones(1))  # the training loop's own collective while the save runs
        fut.result()
    writer.flush()
    out = {"stats": dict(writer._replicator.stats), "packs": _packs(cache)}
    with ckptstore.open(url) as plain:
        out["steps"] = plain.steps()
    writer.close()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
