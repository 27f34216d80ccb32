"""A step's manifest as data: chunk references, shards, tensor entries, the manifest, and the
limits and dtypes every version shares (no parsing here; :mod:`ckptstore.format.manifest` reads and writes it)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import FormatError

FORMAT = "ckptstore.manifest"
#: The newest manifest version this ckptstore reads and writes: 4.0, a 3.0 root whose tensors may
#: be stored as N-dimensional tiles (:mod:`ckptstore.format.tiles`). It reads 1.x to 4.x and writes
#: 4.0 for a step with a tiled tensor, 3.0 (:data:`V3`) for any other (see docs/format.md, "Versions").
VERSION = (4, 0)
#: What a step without tiled tensors is written as (3.0: a 2.0 root naming 3.0 chunk-table segments).
V3 = (3, 0)
V1 = (1, 0)
#: A manifest larger than this is refused before it is downloaded.
MAX_MANIFEST_BYTES = 1 << 30
MAX_DIMS = 64
#: Largest tensor (bytes) a manifest may describe: 1 PiB.
MAX_TENSOR_BYTES = 1 << 50
MAX_CHUNK_BYTES = 1 << 31
MAX_KEY_LEN = 4096
MAX_PACK_BYTES = 5 << 40  # S3's object size limit
#: Most shards one 2.0 or 3.0 manifest may describe (its columns are sized from this).
MAX_SHARDS = 1 << 28

#: Every dtype ckptstore stores, by its on-store name.
DTYPES: dict[str, torch.dtype] = {}
for _name in dir(torch):
    _d = getattr(torch, _name)
    if isinstance(_d, torch.dtype):
        if str(_d).startswith("torch.q"):  # quantized tensors carry scale/zero point: refused
            continue
        DTYPES.setdefault(str(_d).removeprefix("torch."), _d)
del _name, _d


def dtype_name(d: torch.dtype) -> str:
    name = str(d).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"dtype {d} cannot be stored")
    return name


def itemsize(dtype: str) -> int:
    return DTYPES[dtype].itemsize


@dataclass(frozen=True)
class ChunkRef:
    """Where one chunk lives and how to decode it."""

    hash: str
    pack: str
    offset: int
    stored_len: int
    raw_len: int
    codec: str


@dataclass(frozen=True)
class TableRef:
    """A shard's chunk records: ``count`` records from ``first`` in segment ``segment`` (2.0)."""

    segment: int
    first: int
    count: int


#: Records per block of a 3.0 chunk-table segment (see :mod:`ckptstore.format.chunk_table`).
SEGMENT_BLOCK_RECORDS = 16


def merkle_depth(nblocks: int) -> int:
    """Levels of a 3.0 segment's Merkle tree over ``nblocks`` blocks: each block's proof length."""
    return max(0, (nblocks - 1).bit_length())


def segment_sizes(header: int, records: int) -> tuple[int, int]:
    """The sizes a segment with this header length and record count has: 2.0 (records only)
    and 3.0 (every block of :data:`SEGMENT_BLOCK_RECORDS` records followed by its Merkle proof)."""
    nblocks = -(-records // SEGMENT_BLOCK_RECORDS)
    depth = merkle_depth(nblocks)
    return header + 56 * records, header + 56 * records + 32 * depth * nblocks


@dataclass(frozen=True)
class SegmentRef:
    """A chunk-table segment a 2.0 or 3.0 root names (see :mod:`ckptstore.format.chunk_table`)."""

    id: str
    size: int
    records: int
    header: int  # bytes [0, header) are the segment's header
    digest: str  # BLAKE3 of the header, hex


@dataclass(frozen=True)
class PackUsage:
    """Which bytes of one pack a 2.0 or 3.0 step's chunks use.

    ``ranges``: sorted, disjoint ``(start, end)`` byte ranges of the step's
    chunks in the pack (adjacent chunks merged); ``chunks``: how many chunks
    the pack holds in all (its table's length; 0 when the writer did not
    know). GC takes the union of the ranges of every kept step: the pack's
    live bytes, exactly, without reading chunk tables.
    """

    chunks: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def live(self) -> int:
        return sum(e - s for s, e in self.ranges)


#: At most this many ranges per pack in a root: beyond it the smallest gaps
#: are closed (live bytes may then count a gap: GC keeps more, never less).
MAX_PACK_RANGES = 32


def merge_ranges(ranges, limit: int | None = None) -> tuple[tuple[int, int], ...]:
    """Sorted, disjoint ``(start, end)`` ranges covering the same bytes.

    With ``limit``, at most that many ranges: the smallest gaps between
    them are closed first (the result then covers a few bytes more).
    """
    out: list[list[int]] = []
    for s, e in sorted(ranges):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    if limit is not None and len(out) > limit:
        gaps = sorted(range(1, len(out)), key=lambda i: out[i][0] - out[i - 1][1], reverse=True)
        keep = sorted(gaps[: limit - 1])  # the largest gaps stay open
        bounds = [0] + keep + [len(out)]
        out = [[out[a][0], out[b - 1][1]] for a, b in zip(bounds, bounds[1:])]
    return tuple((s, e) for s, e in out)


class UnresolvedError(FormatError):
    """A 2.0 shard's chunks were asked for before its chunk table was read."""


@dataclass(frozen=True)
class Shard:
    """A box of the global tensor stored as contiguous C-order bytes.

    ``offsets`` and ``sizes`` give the box in global coordinates; its
    bytes are the concatenation of ``chunks``' raw bytes. In a 2.0 or 3.0 step
    the chunks are in a segment (``table``) until a reader resolves them
    (:meth:`ckptstore.repo.catalog.Catalog.resolve`): ``chunks`` is None until then.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    chunks: tuple[ChunkRef, ...] | None
    table: TableRef | None = None

    def _chunks(self) -> tuple[ChunkRef, ...]:
        if self.chunks is None:
            raise UnresolvedError("the chunk table of this shard was not read (resolve it first)")
        return self.chunks

    @property
    def nbytes(self) -> int:
        return sum(c.raw_len for c in self._chunks())

    def chunk_starts(self) -> list[int]:
        out, pos = [], 0
        for c in self._chunks():
            out.append(pos)
            pos += c.raw_len
        return out


class TensorEntry:
    """One stored tensor: dtype, global shape, shards.

    A 2.0 root keeps a tensor's shard boxes as arrays; :attr:`shards` makes
    :class:`Shard` objects from them on first use, and :meth:`boxes` gives
    the arrays themselves (a reader picks the shards a slice meets with
    them, without a Python object per shard).
    """

    __slots__ = ("key", "dtype", "shape", "_shards", "_offsets", "_sizes", "_tables", "stored_bytes", "nchunks",
                 "tile")

    def __init__(self, key: str, dtype: str, shape: tuple[int, ...], shards=None, *,
                 offsets: np.ndarray | None = None, sizes: np.ndarray | None = None,
                 tables: np.ndarray | None = None, stored_bytes: int | None = None, nchunks: int | None = None,
                 tile: tuple[int, ...] | None = None):
        self.key = key
        self.dtype = dtype
        self.shape = tuple(shape)
        #: The tile shape (format 4.0): each shard's chunks are the tiles of this grid anchored at the
        #: shard's origin, in C order (:mod:`ckptstore.format.tiles`); None: row-major runs.
        self.tile = tuple(int(x) for x in tile) if tile is not None else None
        self._shards = tuple(shards) if shards is not None else None
        self._offsets, self._sizes, self._tables = offsets, sizes, tables
        if self._shards is not None and all(s.chunks is not None for s in self._shards):
            stored_bytes = sum(c.stored_len for s in self._shards for c in s.chunks)
            nchunks = sum(len(s.chunks) for s in self._shards)
        self.stored_bytes = stored_bytes
        self.nchunks = nchunks

    def __repr__(self) -> str:
        tiles = f", tiles {list(self.tile)}" if self.tile is not None else ""
        return f"TensorEntry({self.key!r}, {self.dtype}, {list(self.shape)}, {self.nshards} shard(s){tiles})"

    def __eq__(self, other) -> bool:
        if not isinstance(other, TensorEntry):
            return NotImplemented
        return ((self.key, self.dtype, self.shape, self.tile, self.shards)
                == (other.key, other.dtype, other.shape, other.tile, other.shards))

    __hash__ = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def nshards(self) -> int:
        return len(self._shards) if self._shards is not None else len(self._offsets)

    @property
    def shards(self) -> tuple[Shard, ...]:
        if self._shards is None:
            offs, sizes, tabs = self._offsets.tolist(), self._sizes.tolist(), self._tables.tolist()
            self._shards = tuple(
                Shard(tuple(o), tuple(n), None, TableRef(*t)) for o, n, t in zip(offs, sizes, tabs)
            )
        return self._shards

    def shard(self, i: int) -> Shard:
        """Shard ``i`` (made from the arrays alone when the shards were not materialized)."""
        if self._shards is not None:
            return self._shards[i]
        return Shard(tuple(self._offsets[i].tolist()), tuple(self._sizes[i].tolist()), None,
                     TableRef(*(int(x) for x in self._tables[i])))

    def boxes(self) -> tuple[np.ndarray, np.ndarray]:
        """``(offsets, sizes)``: int64 arrays of shape (shards, dims)."""
        if self._offsets is None:
            n, nd = len(self._shards), len(self.shape)
            self._offsets = np.array([s.offsets for s in self._shards], dtype=np.int64).reshape(n, nd)
            self._sizes = np.array([s.sizes for s in self._shards], dtype=np.int64).reshape(n, nd)
        return self._offsets, self._sizes

    def meeting(self, lo, sizes) -> np.ndarray:
        """Indices of the shards whose boxes overlap the box at ``lo`` of ``sizes`` (empty shards never do)."""
        offs, szs = self.boxes()
        if len(offs) == 0 or offs.shape[1] == 0:
            return np.arange(len(offs))
        lo = np.asarray(lo, dtype=np.int64)
        hi = lo + np.asarray(sizes, dtype=np.int64)
        meet = np.all((offs < hi) & (offs + szs > lo), axis=1) & np.all(szs > 0, axis=1)
        return np.nonzero(meet)[0]

    def known_chunks(self, i: int) -> tuple[ChunkRef, ...] | None:
        """Shard ``i``'s chunks if this entry already holds them (1.0, or built by a writer)."""
        if self._shards is None:
            return None
        return self._shards[i].chunks

    def weight(self) -> int:
        """Estimated bytes this entry holds in memory."""
        w = 400
        if self._offsets is not None:
            w += self._offsets.nbytes + self._sizes.nbytes + (self._tables.nbytes if self._tables is not None else 0)
        if self._shards is not None:
            w += 200 * len(self._shards) + 700 * sum(len(s.chunks) for s in self._shards if s.chunks is not None)
        return w

    def tables(self) -> np.ndarray | None:
        """``(segment, first, count)`` of every shard, an int64 array (shards, 3); None if a shard has none."""
        if self._tables is None:
            if any(s.table is None for s in self._shards):
                return None
            self._tables = np.array(
                [(s.table.segment, s.table.first, s.table.count) for s in self._shards], dtype=np.int64
            ).reshape(-1, 3)
        return self._tables

    def with_shards(self, shards) -> "TensorEntry":
        """The same tensor with other (e.g. resolved) shards."""
        return TensorEntry(self.key, self.dtype, self.shape, shards,
                           stored_bytes=self.stored_bytes, nchunks=self.nchunks, tile=self.tile)


@dataclass(frozen=True)
class Manifest:
    step: int
    created: float
    tensors: dict[str, TensorEntry]
    tree: Any
    packs: dict[str, int]
    metadata: dict = field(default_factory=dict)
    base_step: int | None = None
    stats: dict = field(default_factory=dict)
    dcp: Any = None
    version: tuple[int, int] = V3
    #: 2.0: the chunk-table segments, and which bytes of each pack the step uses.
    segments: tuple[SegmentRef, ...] = ()
    pack_use: dict = field(default_factory=dict)  # pack id -> PackUsage

    def __post_init__(self):
        # A step with a tiled tensor is a 4.0 step (a 3.x reader would take its tiles for runs).
        if self.version == V3 and self.tiled:
            object.__setattr__(self, "version", VERSION)

    def chunk_refs(self):
        """Every chunk reference, for a manifest whose shards are all resolved (1.0, or built by a writer)."""
        for t in self.tensors.values():
            for s in t.shards:
                yield from s._chunks()

    @property
    def tiled(self) -> bool:
        """Whether a tensor of this step is stored as tiles (the step must then be written as 4.0)."""
        return any(t.tile is not None for t in self.tensors.values())

    @property
    def inline(self) -> bool:
        """Whether every shard's chunks are in the manifest itself (1.0)."""
        return self.version[0] < 2


def version_for(tensors) -> tuple[int, int]:
    """The version a new step holding ``tensors`` (:class:`TensorEntry` values) is written as."""
    return VERSION if any(t.tile is not None for t in tensors) else V3


_PACK_ID = re.compile(r"[0-9a-f]{32}")


def is_pack_id(s: object) -> bool:
    """32 lowercase hex digits (a regex: GC parses hundreds of thousands of them per run)."""
    return isinstance(s, str) and _PACK_ID.fullmatch(s) is not None


def even_split(shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray) -> tuple[int, int] | None:
    """``(dim, parts)`` when the boxes cut ``shape`` along one dim as ``torch.chunk`` does, in order.

    Part ``i`` starts at ``min(i * c, n)`` and holds ``max(0, min(c, n - i * c))``
    rows, ``c = ceil(n / parts)``; every other dim is whole. FSDP's dim-0
    sharding is this form, and so is a single whole-tensor shard.
    """
    parts = len(offsets)
    if parts == 0:
        return None
    for dim in range(len(shape)) if shape else ():
        n = shape[dim]
        c = -(-n // parts)
        i = np.arange(parts, dtype=np.int64)
        want_off = np.zeros_like(offsets)
        want_size = np.broadcast_to(np.array(shape, dtype=np.int64), sizes.shape).copy()
        want_off[:, dim] = np.minimum(i * c, n)
        want_size[:, dim] = np.maximum(0, np.minimum(c, n - i * c))
        if np.array_equal(offsets, want_off) and np.array_equal(sizes, want_size):
            return dim, parts
    if not shape and parts == 1:
        return -1, 1  # a 0-d tensor: one whole shard
    return None


def split_boxes(shape: tuple[int, ...], dim: int, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """The boxes of :func:`even_split`'s form."""
    nd = len(shape)
    offsets = np.zeros((parts, nd), dtype=np.int64)
    sizes = np.broadcast_to(np.array(shape, dtype=np.int64), (parts, nd)).copy()
    if dim >= 0:
        n = shape[dim]
        c = -(-n // parts) if parts else 0
        i = np.arange(parts, dtype=np.int64)
        offsets[:, dim] = np.minimum(i * c, n)
        sizes[:, dim] = np.maximum(0, np.minimum(c, n - i * c))
    return offsets, sizes
