"""Writes tests/data/repo_v1: a real format-1.0 repository, made by ckptstore
as of commit 3601330 (the last that wrote 1.0 manifests). Kept as test data
so that every later version is tested against bytes an older one wrote.

    git worktree add /tmp/oldck 3601330
    cd /tmp/oldck && PYTHONPATH=. python /path/to/tests/data/make_v1_repo.py OUT_DIR

Contents: steps 1 and 2 saved by ``repo.save`` (step 2 dedups against 1),
step 3 saved through DCP by 2 ranks (a tensor sharded in two), step 4
deleted (a tombstone), tag ``best`` -> 2. Every tensor is derived from
fixed seeds (see ``state``), so tests rebuild the expected values.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPTS = dict(chunk_size=16 << 10, pack_size=1 << 20, part_size=5 << 20)


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    frozen = torch.randn(64, 256, generator=torch.Generator().manual_seed(7))  # same in every step
    return {
        "model": {"frozen": frozen, "head": torch.randn(32, 64, generator=g),
                  "bf16": torch.randn(40, 40, generator=g).bfloat16()},
        "meta": {"epoch": step, "name": "v1"},
    }


def expected(step: int) -> dict:
    """What ``repo.load(step)`` gives for steps 1 and 2 (``state`` as saved)."""
    return {"model": state(step)["model"], "meta": state(step)["meta"]}


def dcp_state(rank: int | None = None, world: int = 2):
    g = torch.Generator().manual_seed(303)
    big = torch.randn(96, 48, generator=g)
    small = torch.randn(10, generator=g)
    return big, small


def _dcp_worker(rank, world, port, url):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptstore.dcp import CkptStoreWriter

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    big, small = dcp_state()
    sd = {"big": distribute_tensor(big, mesh, [Shard(0)]), "small": small, "epoch": 3}
    dcp.save(sd, storage_writer=CkptStoreWriter(url, step=3, **OPTS))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main(out: str) -> None:
    import ckptstore

    url = os.path.abspath(out)
    repo = ckptstore.open(url, **OPTS)
    for step in (1, 2):
        repo.save(state(step), step=step, metadata={"loss": 1.0 / step})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_dcp_worker, args=(2, port, url), nprocs=2, join=True)
    repo.save(state(4), step=4)
    repo.delete(4)
    repo.tag(2, "best")
    repo.close()


if __name__ == "__main__":
    main(sys.argv[1])
