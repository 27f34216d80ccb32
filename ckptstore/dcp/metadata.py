"""A step's manifest from DCP's write results, and DCP's ``Metadata`` from a manifest (no pickle)."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult
import numpy as np

from ..format import manifest as _m
from ..errors import FormatError
from ..format.manifest import Manifest, PackUsage, SegmentRef, TensorEntry, merge_ranges
from ..format.tree import decode_value, encode_value, leaf_values, tensor_paths


@dataclass(frozen=True)


class _RankInfo:
    """What a rank wrote, carried to the coordinator on its first result (O(packs), never O(chunks))."""

    rank: int
    segment: SegmentRef | None  # its chunk-table segment (None when it wrote no item)
    packs: dict  # pack id -> size, every pack its chunk references name
    use: dict  # pack id -> PackUsage: which bytes of it its references use
    stats: dict  # its byte counts


@dataclass(frozen=True, slots=True)


class _ItemResult:
    """A rank's record of one written item: where its chunk records are in the rank's segment."""

    rank: int
    bytes_item: bool
    nbytes: int
    first: int
    count: int
    stored: int
    info: _RankInfo | None = None  # on the first result of a rank
    tile: tuple[int, ...] | None = None  # the tile shape the item was cut in (format 4.0), None: runs


@dataclass
class _Ranks:
    """What the ranks' results say about the step as a whole (the first result of each rank)."""

    stats: dict
    seg_of_rank: dict[int, int]  # rank -> its segment's position in ``segments``
    segments: list[SegmentRef]
    packs: dict[str, int | None]
    use: dict[str, list]
    pack_chunks: dict[str, int]

    def segment(self, step: int, sd: _ItemResult, fqn: str) -> int:
        g = self.seg_of_rank.get(sd.rank)
        if g is None:
            raise FormatError(f"step {step}: {fqn!r}: rank {sd.rank} wrote no chunk-table segment")
        return g


def _gather_ranks(step: int, results: list[list[WriteResult]]) -> _Ranks:
    stats = {"logical_bytes": 0, "new_bytes": 0, "stored_bytes": 0, "reused_bytes": 0, "pack_bytes": 0,
             "segment_bytes": 0}
    out = _Ranks(stats, {}, [], {}, {}, {})
    ranks: dict[str, dict] = {}
    for rank_results in results:
        for wr in rank_results:
            sd = wr.storage_data
            if not isinstance(sd, _ItemResult):
                raise FormatError(f"step {step}: a write result carries no ckptstore data (mixed storage writers?)")
            info = sd.info
            if info is None:
                continue
            if info.rank in out.seg_of_rank:
                raise FormatError(f"step {step}: rank {info.rank} reported twice")
            if info.segment is not None:
                out.seg_of_rank[info.rank] = len(out.segments)
                out.segments.append(info.segment)
            for p, size in info.packs.items():
                if out.packs.get(p) is None:
                    out.packs[p] = size
            for p, u in info.use.items():
                out.use.setdefault(p, []).extend(u.ranges)
                out.pack_chunks[p] = max(out.pack_chunks.get(p, 0), u.chunks)
            ranks[str(info.rank)] = info.stats
            for k in stats:
                stats[k] += info.stats.get(k, 0)
    stats["ranks"] = ranks
    return out


def _placements(results: list[list[WriteResult]]):
    """Where each item landed: by DCP's index hint (fqn -> position in md.chunks -> (offsets, result)),
    and by (fqn, offsets) for items without one."""
    placed: dict[str, dict[int, tuple]] = {}
    by_offset: dict[tuple[str, tuple | None], _ItemResult] = {}
    for rank_results in results:
        for wr in rank_results:
            idx = wr.index
            if idx.index is not None:
                placed.setdefault(idx.fqn, {})[idx.index] = (idx.offset, wr.storage_data)
            else:
                by_offset[(idx.fqn, tuple(idx.offset) if idx.offset is not None else None)] = wr.storage_data
    return placed, by_offset


def _bytes_entry(step: int, fqn: str, hints: dict, by_offset: dict, ranks: _Ranks) -> TensorEntry:
    sd = by_offset.get((fqn, None))
    if sd is None and len(hints) == 1:
        sd = next(iter(hints.values()))[1]
    if sd is None or not sd.bytes_item:
        raise FormatError(f"step {step}: bytes item {fqn!r} was not written exactly once")
    n = sd.nbytes
    return TensorEntry(
        fqn, "uint8", (n,), offsets=np.zeros((1, 1), np.int64), sizes=np.array([[n]], np.int64),
        tables=np.array([[ranks.segment(step, sd, fqn), sd.first, sd.count]], np.int64), stored_bytes=sd.stored,
        nchunks=sd.count,
    )


def _tensor_entry(step: int, fqn: str, md, hints: dict, by_offset: dict, ranks: _Ranks) -> TensorEntry:
    shape = tuple(md.size)
    dtype = _m.dtype_name(md.properties.dtype)
    isz = _m.itemsize(dtype)
    chunks = md.chunks
    n, nd = len(chunks), len(shape)
    offs = np.array([tuple(c.offsets) for c in chunks], dtype=np.int64).reshape(n, nd)
    sizes = np.array([tuple(c.sizes) for c in chunks], dtype=np.int64).reshape(n, nd)
    tabs = np.empty((n, 3), dtype=np.int64)
    stored = nchunks = 0
    tiles = set()
    for i, c in enumerate(chunks):
        hint = hints.get(i)
        sd = hint[1] if hint is not None and tuple(hint[0]) == tuple(c.offsets) else None
        if sd is None:
            sd = by_offset.get((fqn, tuple(c.offsets)))
            if sd is None:  # a hint at another position
                sd = next((h[1] for h in hints.values() if tuple(h[0]) == tuple(c.offsets)), None)
        if sd is None:
            raise FormatError(f"step {step}: no rank wrote tensor {fqn!r} at offsets {tuple(c.offsets)}")
        want = math.prod(c.sizes) * isz
        if sd.nbytes != want:
            raise FormatError(
                f"step {step}: tensor {fqn!r} at {tuple(c.offsets)}: wrote {sd.nbytes} bytes, planned "
                f"{tuple(c.sizes)} ({want} bytes)"
            )
        tabs[i] = (ranks.segment(step, sd, fqn), sd.first, sd.count)
        stored += sd.stored
        nchunks += sd.count
        tiles.add(tuple(sd.tile) if getattr(sd, "tile", None) is not None else None)
    if len(tiles) > 1:
        raise FormatError(f"step {step}: tensor {fqn!r}: ranks cut its shards in different tiles "
                          f"{sorted(map(str, tiles))} (ranks with different chunk_size or tiles options?)")
    tile = tiles.pop() if tiles else None
    return TensorEntry(fqn, dtype, shape, offsets=offs, sizes=sizes, tables=tabs, stored_bytes=stored, nchunks=nchunks,
                       tile=tile)


def _dcp_section(metadata: Metadata, bytes_keys: list[str]) -> dict:
    """What DCP's own metadata needs besides the tensors: bytes items, version, planner data, storage meta."""
    planner_data = metadata.planner_data
    try:
        pd_node = encode_value(planner_data) if planner_data is not None else None
    except TypeError:
        pd_node = None  # a custom planner's private data; not needed to load tensors
    sm = metadata.storage_meta
    return {
        "bytes": bytes_keys,
        "version": metadata.version,
        "planner_data": pd_node,
        "storage_meta": None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id,
            "load_id": sm.load_id,
            "modules": list(sm.modules or []),
        },
    }


def build_manifest(
    step: int, metadata: Metadata, results: list[list[WriteResult]], base_step=None, user_metadata=None
) -> Manifest:
    """The root of a DCP save, from DCP's global metadata and every rank's results.

    O(ranks + packs + shards) work and memory: each result carries where its
    item's records are in its rank's segment, never the chunk records.
    Shard boxes and table runs are filled into arrays, placed by the index
    hints DCP's default planner writes (``MetadataIndex.index``), by offsets
    otherwise.
    """
    ranks = _gather_ranks(step, results)
    placed, by_offset = _placements(results)
    tensors: dict[str, TensorEntry] = {}
    bytes_keys: list[str] = []
    for fqn, md in metadata.state_dict_metadata.items():
        hints = placed.get(fqn, {})
        if isinstance(md, BytesStorageMetadata):
            tensors[fqn] = _bytes_entry(step, fqn, hints, by_offset, ranks)
            bytes_keys.append(fqn)
        else:
            tensors[fqn] = _tensor_entry(step, fqn, md, hints, by_offset, ranks)
    tree = _tree_from_planner_data([k for k in tensors if k not in bytes_keys], metadata.planner_data)
    return Manifest(
        step=step,
        created=time.time(),
        tensors=tensors,
        tree=tree,
        packs=ranks.packs,
        metadata=user_metadata or {},
        base_step=base_step,
        stats=ranks.stats,
        dcp=_dcp_section(metadata, bytes_keys),
        segments=tuple(ranks.segments),
        pack_use={p: PackUsage(ranks.pack_chunks.get(p, 0), merge_ranges(r, _m.MAX_PACK_RANGES))
                  for p, r in ranks.use.items()},
    )


def _tree_from_planner_data(keys: list[str], planner_data) -> dict:
    """Nest tensor fqns by the paths DCP's planner recorded (flat if unknown)."""
    paths = {}
    if isinstance(planner_data, dict):
        for k in keys:
            p = planner_data.get(k)
            if isinstance(p, (tuple, list)) and p and all(type(x) in (str, int) for x in p):
                paths[k] = tuple(p)
    if len(paths) != len(keys):
        return {"d": [[k, {"t": k}] for k in keys]}
    root: dict = {}
    for k in keys:
        node = root
        p = paths[k]
        for part in p[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                return {"d": [[k, {"t": k}] for k in keys]}
            node = nxt
        if p[-1] in node:
            return {"d": [[k, {"t": k}] for k in keys]}
        node[p[-1]] = k

    def to_node(d):
        return {"d": [[name, {"t": v} if isinstance(v, str) else to_node(v)] for name, v in d.items()]}

    return to_node(root)


def metadata_from_manifest(man: Manifest) -> Metadata:
    """DCP ``Metadata`` for a step (saved through DCP or by ``repo.save``)."""
    sdm: dict[str, Any] = {}
    if man.dcp is not None:
        bytes_keys = set(man.dcp.get("bytes", []))
        for key, e in man.tensors.items():
            if key in bytes_keys:
                sdm[key] = BytesStorageMetadata()
            else:
                sdm[key] = _tensor_md(e)
        pd = man.dcp.get("planner_data")
        planner_data = decode_value(pd) if pd is not None else None
        sm = man.dcp.get("storage_meta")
        storage_meta = StorageMeta(**{k: v for k, v in sm.items()}) if sm else None
        return Metadata(
            state_dict_metadata=sdm,
            planner_data=planner_data,
            storage_meta=storage_meta,
            version=man.dcp.get("version"),
        )
    paths = tensor_paths(man.tree)
    planner_data: dict[str, tuple] = {}
    for key, e in man.tensors.items():
        sdm[key] = _tensor_md(e)
        planner_data[key] = paths.get(key, (key,))
    for key, (_, path) in leaf_values(man.tree).items():
        sdm.setdefault(key, BytesStorageMetadata())
        planner_data.setdefault(key, path)
    return Metadata(state_dict_metadata=sdm, planner_data=planner_data)


def _tensor_md(e: TensorEntry) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=_m.DTYPES[e.dtype]),
        size=torch.Size(e.shape),
        chunks=[
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n))
            for o, n in zip(*(a.tolist() for a in e.boxes()))
        ],
    )
