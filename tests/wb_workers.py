"""Rank bodies of the DCP write-back tests (tests/test_writeback.py), spawned on 2 gloo ranks.

Each rank is one "node": its own ``cache_dir``. Uploads wait for a gate
file, so the test sees the steps pending; ``leave`` makes the ranks exit
after the save without uploading (``os._exit``: no flush at exit), as
processes that died.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

GATE = "open-the-gate"


def state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        f"own{rank}": torch.randn(64, 256, generator=g),  # written by this rank alone
        "shared": torch.arange(4096, dtype=torch.float32) + step,  # replicated: written by one rank
    }


def _gate(tmp: str):
    from ckptstore.repo.writeback import WriteBack

    real = WriteBack._upload

    def gated(self, key, size):
        while not os.path.exists(os.path.join(tmp, GATE)):
            time.sleep(0.02)
        return real(self, key, size)

    WriteBack._upload = gated


def dcp_write_back(rank: int, world: int, port: int, url: str, tmp: str, leave: bool) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import ckptstore
    from ckptstore.dcp import CkptStoreWriter

    _gate(tmp)
    cache = os.path.join(tmp, f"node{rank}")
    out: dict = {}
    writer = CkptStoreWriter(url, step=1, cache_dir=cache, write_back=True, chunk_size=16384)
    dcp.save(state(rank, 1), storage_writer=writer)
    with ckptstore.open(url) as plain:
        out["committed_after_save"] = plain.steps()
    with ckptstore.open(url, cache_dir=cache) as mine:
        out["pending_here"] = mine.pending_steps()
    dist.barrier()
    if leave:
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        os._exit(0)  # died: nothing flushed at exit
    if rank == 0:
        open(os.path.join(tmp, GATE), "w").close()
    writer.flush()  # rank 1: its uploads and marker; rank 0: also the commit, once rank 1's marker is in
    dist.barrier()
    with ckptstore.open(url) as plain:
        out["committed_after_flush"] = plain.steps()
        out["uploads_left"] = [o.key for o in plain.store.list("uploads/")]
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
