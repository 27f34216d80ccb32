"""Rank bodies of tests/test_every_step.py's 2-rank restart from the tier, spawned on 2 gloo ranks.

Both ranks are one node (one ``cache_dir``). Step 1 is saved through
``CkptStoreWriter(cache_dir=...)`` with default options, then restored by a
fresh ``CkptStoreReader(cache_dir=...)`` with default options into zeroed
tensors; each rank writes what it read from where, whether the tier keeps
decoded copies, and whether the restore was bit-exact to ``rank<r>.json``.
"""

from __future__ import annotations

import glob
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def state(rank: int) -> dict:
    g = torch.Generator().manual_seed(11 + rank)
    return {
        f"own{rank}.w": torch.randn(64, 256, generator=g).to(torch.bfloat16),
        f"own{rank}.exp_avg": torch.randn(64, 256, generator=g),
        "shared": torch.arange(32 * 256, dtype=torch.float32).reshape(32, 256),  # replicated
    }


def run(rank: int, world: int, port: int, url: str, tmp: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ckptstore.dcp import CkptStoreReader, CkptStoreWriter

    cache = os.path.join(tmp, "node")
    dcp.save(state(rank), storage_writer=CkptStoreWriter(url, step=1, cache_dir=cache, chunk_size=16384))
    dist.barrier()
    want = {**state(0), **state(1)}
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    reader = CkptStoreReader(url, step=1, cache_dir=cache)
    dcp.load(got, storage_reader=reader)
    out = {"read": reader.read_stats(),
           "decoded_files": sum(len(glob.glob(os.path.join(cache, "repos", "*", sub, "*", "*"))) for sub in ("raw", "bands")),
           "equal": all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)}
    reader.close()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
