"""The non-tensor state trainers save, and the rank bodies that round-trip it through DCP.

Kept in an importable module: spawned ranks find the worker functions and
the dataclasses here (a dataclass loads without listing only when its
module is imported, as in a trainer that defines it).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ckptstore.dcp import CkptStoreReader, CkptStoreWriter


@dataclasses.dataclass
class LoopState:
    """A trainer's bookkeeping, as a plain dataclass."""

    epoch: int = 0
    tokens_seen: int = 0
    best: float = float("inf")
    history: list = dataclasses.field(default_factory=list)
    started: datetime.datetime | None = None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    lr: float = 1e-3
    shape: tuple = (2, 3)


class Opaque:
    """A class no allowlist names: refused unless the caller allows it."""

    def __init__(self, x=1):
        self.x = x

    def __eq__(self, other):
        return type(other) is Opaque and other.x == self.x


def trainer_values(seed: int = 0) -> dict:
    """One of each kind of value the allowlist admits, as trainers save them (deterministic in ``seed``)."""
    random.seed(seed)
    np.random.seed(seed)
    for _ in range(3):
        random.random()
        np.random.rand()
    gen = np.random.default_rng(seed)
    gen.integers(0, 10, 5)
    mt = np.random.Generator(np.random.MT19937(seed))
    mt.random(3)
    when = datetime.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=datetime.timezone(datetime.timedelta(hours=2)))
    return {
        "np_arr": np.arange(12, dtype=np.float32).reshape(3, 4) * (seed + 1),
        "np_fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
        "np_scalar": np.int64(41 + seed),
        "np_legacy_state": np.random.get_state(),
        "np_pcg64_state": gen.bit_generator.state,
        "np_mt19937_state": mt.bit_generator.state,
        "py_random_state": random.getstate(),
        "ordered": collections.OrderedDict([("b", 2), ("a", [1, 2])]),
        "when": {"dt": when, "date": when.date(), "time": datetime.time(3, 4, 5), "delta": datetime.timedelta(days=1, seconds=3)},
        "loop": LoopState(epoch=3 + seed, tokens_seen=10**12, best=0.25, history=[1.0, 0.5], started=when),
        "config": RunConfig(name=f"r{seed}", lr=3e-4, shape=(4, 5)),
        "torch_safe": {"size": torch.Size([2, 3]), "dtype": torch.bfloat16, "device": torch.device("cpu"),
                       "counter": collections.Counter("abca"), "set": {1, 2},
                       "rng": torch.Generator().manual_seed(seed).get_state()},
    }


def blank_values() -> dict:
    """The destination state a resumed trainer builds before loading (other values, same structure)."""
    return trainer_values(seed=12345)


def same(a, b, path="") -> None:
    """Assert ``a`` and ``b`` are the same value: types, dtypes, layouts, contents."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), path
        assert a.flags.f_contiguous == b.flags.f_contiguous, path
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif dataclasses.is_dataclass(a):
        same(vars(a), vars(b), path)
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _init(rank, world, port):
    from .dcp_workers import _init as init

    return init(rank, world, port)


def round_trip_worker(rank, world, port, url, fs_dir, out_path):
    """Save the values beside an FSDP-sharded and a replicated tensor; load them back through every path.

    Direct reads (``exchange_replicated=False``) and the exchanged path (the
    replicated tensor is read once and sent), each compared with what
    PyTorch's ``FileSystemReader`` loads from the same state saved by its
    ``FileSystemWriter``. Rank 0 writes what it checked to ``out_path``.
    """
    from .dcp_workers import _shutdown

    mesh = _init(rank, world, port)
    try:
        full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
        per_rank = {f"rank{rank}": trainer_values(seed=rank)}  # each rank's own RNG states, under its own key
        state = {"sharded": distribute_tensor(full, mesh, [Shard(0)]), "rep": torch.ones(40, 40),
                 "shared": trainer_values(seed=100), **per_rank}
        dcp.save(state, storage_writer=CkptStoreWriter(url, step=1))
        dcp.save(state, storage_writer=FileSystemWriter(fs_dir))
        checked = []
        for exchange in (False, True):
            ours = {"sharded": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)]), "rep": torch.zeros(40, 40),
                    "shared": blank_values(), f"rank{rank}": blank_values()}
            theirs = {"sharded": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)]), "rep": torch.zeros(40, 40),
                      "shared": blank_values(), f"rank{rank}": blank_values()}
            reader = CkptStoreReader(url, step=1, exchange_replicated=exchange)
            dcp.load(ours, storage_reader=reader)
            dcp.load(theirs, storage_reader=FileSystemReader(fs_dir))
            assert reader.last_read_stats["exchange"] is exchange, reader.last_read_stats
            same(ours["shared"], trainer_values(seed=100), "shared")
            same(ours[f"rank{rank}"], trainer_values(seed=rank), f"rank{rank}")
            same({k: ours[k] for k in ("shared", f"rank{rank}")}, {k: theirs[k] for k in ("shared", f"rank{rank}")})
            assert torch.equal(ours["sharded"].full_tensor(), full) and torch.equal(ours["rep"], torch.ones(40, 40))
            checked.append("exchanged" if exchange else "direct")
        # another rank's layout: the replicated placement reads the same values
        dest = {"sharded": distribute_tensor(torch.zeros(64, 8), mesh, [Replicate()]), "shared": blank_values()}
        dcp.load(dest, storage_reader=CkptStoreReader(url, step=1))
        same(dest["shared"], trainer_values(seed=100))
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"checked": checked, "world": dist.get_world_size()}, f)
    finally:
        _shutdown()
