"""Repository tunables: every limit is named here, with its default."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Mapping

from ..format import codec as _codec
from ..format import manifest as _m
from ..format.layout import DEFAULT_GRACE
from ..storage.base import MAX_PARTS, MIN_PART_SIZE
from .tp_plan import TPPlan

MiB = 1 << 20

#: I/O threads and largest range request for stores that are not remote
#: (unless given explicitly).
LOCAL_IO_WORKERS = 4
LOCAL_MAX_REQUEST = 8 * MiB

#: Options a repository's config records; a handle adopts the recorded
#: value of each unless the caller gave it explicitly.
CONFIG_OPTIONS = ("chunk_size", "pack_size", "codec", "level")


@dataclass
class RepoOptions:
    """Tunables of a repository handle.

    chunk_size: raw bytes per chunk (dedup and range-read granularity).
    pack_size: target bytes per pack object.
    part_size: multipart part size (S3: at least 5 MiB; at least the store's
        ``min_part_size``; grown so that a pack needs at most 10,000 parts).
        Every part of an upload but the last has exactly this size.
    workers: threads hashing and compressing.
    io_workers: concurrent requests (parts in flight, ranged GETs); at
        most ``LOCAL_IO_WORKERS`` (4) on a local or memory store unless given.
    max_inflight_bytes: memory budget for chunks and parts in flight.
    packs_in_flight: sealed packs still uploading while the next fills.
    level: zstd level.
    codec: "zstd" or "raw".
    coalesce_gap: merge range reads of one pack separated by at most this.
    max_request: largest single ranged GET (at most ``LOCAL_MAX_REQUEST``,
        8 MiB, on a local or memory store unless given).
    tensor_workers: tensors loaded at once by ``load``.
    grace: GC grace period in seconds, recorded in the config of a new
        repository (the repository's recorded value wins otherwise).
    manifest_cache_bytes: parsed manifests kept in memory by a handle, by
        their estimated size (least recently used ones are dropped).
    tiles: store tensors of two or more dimensions and more than two chunks as
        N-dimensional tiles (format 4.0, :mod:`ckptstore.format.tiles`), so that a
        slice along any dimension reads about its share; False writes row-major
        runs only (3.0 steps, readable by ckptstore before tiles). A tensor whose
        dedup base holds it with the same shape and dtype keeps the base's
        layout either way (its unchanged chunks are then referenced again).
    tile_plan: a tensor-parallel plan (as :func:`ckptstore.load_module` takes it:
        name pattern -> split dimension, None, or a Hugging Face style name,
        :mod:`ckptstore.pipeline.tp_plan`) that saves align tiles to: a tensor
        of two or more dimensions it splits is tiled into 8 blocks along that
        dimension, whole along the others (a tile at most a chunk), so that a
        TP rank of up to 8 reads only its block, also for tensors too small
        for the default grid; the others are tiled as without it. Needs
        ``tiles``; the dedup base's layout still wins for a tensor it holds.
    async_wait: seconds ``save(blocking=False)`` waits for the handle's
        previous async save, still writing, before it refuses
        (:class:`~ckptstore.repo.async_save.SaveBacklogError`).

    ``explicit`` holds the names the caller gave (those win over the
    repository's recorded config and over the local-store defaults).
    """

    chunk_size: int = 4 * MiB
    pack_size: int = 256 * MiB
    part_size: int = 16 * MiB
    workers: int = max(2, min(8, os.cpu_count() or 2))
    io_workers: int = 16
    max_inflight_bytes: int = 512 * MiB
    packs_in_flight: int = 2
    level: int = _codec.DEFAULT_LEVEL
    codec: str = "zstd"
    coalesce_gap: int = 1 * MiB
    max_request: int = 32 * MiB
    tensor_workers: int = 4
    grace: float = DEFAULT_GRACE
    manifest_cache_bytes: int = 256 * MiB
    async_wait: float = 600.0
    tiles: bool = True
    tile_plan: Mapping | None = None
    explicit: frozenset = field(default=frozenset(), repr=False, compare=False)

    @classmethod
    def from_kwargs(cls, remote: bool, **kwargs) -> "RepoOptions":
        """Options a caller gave, with the defaults for a local or remote store."""
        names = {f.name for f in fields(cls)} - {"explicit"}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown repository option(s) {unknown}; known: {sorted(names)}")
        o = cls(**kwargs, explicit=frozenset(kwargs))
        o.check()
        if not remote:
            # A local directory gains nothing from 16 threads and 32 MiB
            # requests, and each thread's malloc arena keeps its freed
            # request buffers: loading 4 GiB peaked at +627 MiB RSS with the
            # remote defaults, +64 MiB with these (and ran faster); see
            # docs/performance.md. Explicit options win.
            if "io_workers" not in o.explicit:
                o.io_workers = min(o.io_workers, LOCAL_IO_WORKERS)
            if "max_request" not in o.explicit:
                o.max_request = min(o.max_request, LOCAL_MAX_REQUEST)
        return o

    def adopt(self, values: dict, names=CONFIG_OPTIONS) -> None:
        """Take ``values[name]`` for each of ``names`` the caller did not give."""
        for name in names:
            if name not in self.explicit and name in values:
                setattr(self, name, values[name])
        self.check()

    def check(self) -> None:
        if self.chunk_size < 4096 or self.chunk_size > _m.MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_size must be in [4096, {_m.MAX_CHUNK_BYTES}], got {self.chunk_size}")
        if self.part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} (S3's minimum), got {self.part_size}")
        # No pack may need more parts than S3 allows (a pack is pack_size plus at most a chunk
        # and its table): the part size grows with pack_size.
        need = -(-(self.pack_size + 2 * self.chunk_size + MiB) // MAX_PARTS)
        if self.part_size < need:
            self.part_size = -(-need // MiB) * MiB
        if not (self.grace >= 0):
            raise ValueError("grace must be a non-negative number of seconds")
        if self.pack_size < 1:
            raise ValueError("pack_size must be positive")
        if self.codec not in _codec.CODECS:
            raise ValueError(f"codec must be one of {_codec.CODECS}, got {self.codec!r}")
        for name in ("workers", "io_workers", "packs_in_flight", "tensor_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if not (self.async_wait >= 0):
            raise ValueError(f"async_wait must be a number of seconds >= 0, got {self.async_wait!r}")
        if self.manifest_cache_bytes < 0:
            raise ValueError("manifest_cache_bytes must not be negative")
        if self.tile_plan is not None:
            TPPlan(self.tile_plan, 0, 1)  # every entry checked now (TPPlanError names the bad one)
            if not self.tiles:
                raise ValueError("tile_plan needs tiles=True: a plan aligns tiles, and tiles=False writes runs")
