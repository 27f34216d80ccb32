"""Process bodies for the multi-rank tile tests (test_tiles, test_compat_v3_0), spawned with gloo.

Each rank writes what it saw (bit-exact or not, store bytes read) to a JSON file in the
test's tmp dir; the test asserts on those.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Shard, distribute_tensor

from ckptstore.dcp import CkptStoreReader, CkptStoreWriter

from .dcp_workers import _CountingReader, _init, _shutdown


def _write(out_dir: str, rank: int, doc: dict) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(doc, f)


def reshard_load_worker(rank, world, port, url, so, step, tensors, dim, out_dir, opts=None):
    """Load ``tensors`` (name -> path of the full value, a ``torch.save`` file of the test) into
    DTensors ``Shard(dim)``; report whether each local shard is bit-exact and the pack bytes read.
    ``opts``: the reader's repository options (``coalesce_gap=0``: the bytes read are those asked for)."""
    mesh = _init(rank, world, port)
    try:
        full = {k: torch.load(p, weights_only=True) for k, p in tensors.items()}
        sd = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(dim)]) for k, v in full.items()}
        reader = _CountingReader(url, step=step, storage_options=so, **(opts or {}))
        dcp.load(sd, storage_reader=reader)
        bad = [k for k, v in sd.items() if not torch.equal(v.to_local(), full[k].chunk(world, dim)[rank])]
        store = reader._repo.store
        _write(out_dir, rank, {"bad": bad, "packs": store.read_by_prefix.get("packs", 0)})
    finally:
        _shutdown()


def save_worker(rank, world, port, url, tensors, dim, opts):
    """Save ``tensors`` (name -> path of the full value) as DTensors ``Shard(dim)`` at step 1."""
    mesh = _init(rank, world, port)
    try:
        full = {k: torch.load(p, weights_only=True) for k, p in tensors.items()}
        sd = {k: distribute_tensor(v, mesh, [Shard(dim)]) for k, v in full.items()}
        dcp.save(sd, storage_writer=CkptStoreWriter(url, step=1, **opts))
    finally:
        _shutdown()
