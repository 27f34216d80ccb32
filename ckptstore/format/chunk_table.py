"""Chunk-table segments (formats 2.0 and 3.0): where every chunk of a step's shards lives.

A segment is written once, by one writer (a DCP rank, or a whole
single-process save), and holds the chunk records of the shards that
writer saved, each shard's chunks as one contiguous run of records, in
chunk order. The step's root manifest names every segment with its size,
record count, header length and the BLAKE3 digest of its header, and each
shard with ``(segment, first record, count)``. A reader that restores its
share range-reads the header of each segment it needs, checks it against
the root, then only the blocks of records covering its shards, each checked
against the header. No Python object is made per record until a caller asks
for :class:`~ckptstore.format.manifest.ChunkRef` values.

Two layouts, told apart by the header's major version (both readable):

- **3.0** (written since format 3.0): blocks of 16 records (896 bytes), each followed
  by its Merkle proof; the header carries one 32-byte Merkle root over the
  blocks, so it stays small however many blocks the segment has, and a
  reader wanting one shard of a segment reads the header and one block of
  about 1 KB. This is what keeps one tensor of a 1000-rank step cheap.
- **2.0**: blocks of 1024 records (56 KiB), the header listing every
  block's digest.

Layout (integers little-endian)::

    header   40 bytes   b"CKPTSEG2", u16 major, u16 minor, u32 block_records,
                        u32 npacks, u32 nblocks, u64 nrecords, u64 records_offset
    packs    npacks x 16 bytes: the pack ids records refer to (raw bytes of the hex id)
    2.0: digests  nblocks x 32 bytes: BLAKE3 of each block of records
    3.0: root     32 bytes: the Merkle root of the blocks (below)
             (bytes [0, records_offset) are the "header" the root manifest's digest covers)
    blocks   2.0: nrecords x 56 bytes, in blocks of block_records records
             3.0: block b at records_offset + b * (block_records * 56 + depth * 32):
                  its records, then its proof: depth sibling digests, leaf level first
    record   32 bytes  BLAKE3-256 of the chunk's raw bytes
             u32       pack index (into ``packs``)
             u8        codec id (0 raw, 1 zstd, 2 bgz)
             3 zero bytes
             u64       offset of the stored bytes in the pack
             u32       stored length
             u32       raw length

The 3.0 Merkle tree: ``depth = ceil(log2(nblocks))`` (0 for one block);
leaf ``i`` is ``BLAKE3(0x00 || block i's records)`` for ``i < nblocks`` and 32
zero bytes up to ``2**depth``; a node is ``BLAKE3(0x01 || left || right)``; the
root of zero blocks is 32 zero bytes. A block's proof lists, from the leaf
level up, the sibling of the node on its path.

This module is pure: bytes in, bytes (and arrays) out.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Sequence

import blake3
import numpy as np

from . import manifest as _m
from ..errors import FormatError, UnsupportedVersionError
from .manifest import ChunkRef
from .model import SEGMENT_BLOCK_RECORDS, merkle_depth
from .pack import CODEC_IDS, CODEC_NAMES

MAGIC = b"CKPTSEG2"
#: The layout this version writes (readers take majors 2 and 3).
VERSION = (3, 0)
HEADER = struct.Struct("<8sHHIIIQQ")
RECORD = np.dtype(
    [
        ("hash", "u1", (32,)),
        ("pack", "<u4"),
        ("codec", "u1"),
        ("pad", "u1", (3,)),
        ("offset", "<u8"),
        ("stored", "<u4"),
        ("raw", "<u4"),
    ]
)
RECORD_SIZE = RECORD.itemsize
#: Records per block in 3.0 (896 bytes and a proof): the unit a reader fetches and checks.
BLOCK_RECORDS = SEGMENT_BLOCK_RECORDS
#: Records per block of the 2.0 layout (56 KiB).
BLOCK_RECORDS_V20 = 1024
_EMPTY = bytes(32)
#: Bounds checked before anything is allocated.
MAX_RECORDS = 1 << 32
MAX_PACKS = 1 << 24

assert HEADER.size == 40 and RECORD_SIZE == 56


@dataclass(frozen=True)
class SegmentHeader:
    """What a segment's header says (after its digest was checked against the root).

    ``digests`` lists each block's digest (2.0); ``root`` is the blocks' Merkle
    root and ``depth`` the length of each block's proof (3.0).
    """

    packs: tuple[str, ...]
    nrecords: int
    block_records: int
    digests: tuple[bytes, ...]
    records_offset: int
    major: int = 2
    root: bytes = b""
    depth: int = 0

    @property
    def nblocks(self) -> int:
        return -(-self.nrecords // self.block_records)

    def blocks_for(self, first: int, count: int) -> range:
        """The blocks holding records ``[first, first + count)``."""
        if count == 0:
            return range(0)
        return range(first // self.block_records, (first + count - 1) // self.block_records + 1)

    def block_records_of(self, b: int) -> int:
        lo = b * self.block_records
        return min(self.nrecords, lo + self.block_records) - lo

    def block_range(self, b: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of block ``b`` in the segment (3.0: its proof included)."""
        if self.major == 2:
            lo = b * self.block_records
            hi = min(self.nrecords, lo + self.block_records)
            return self.records_offset + lo * RECORD_SIZE, self.records_offset + hi * RECORD_SIZE
        start = self.records_offset + b * (self.block_records * RECORD_SIZE + 32 * self.depth)
        return start, start + self.block_records_of(b) * RECORD_SIZE + 32 * self.depth

    @property
    def cache_weight(self) -> int:
        """Rough bytes this header holds in memory (for caches)."""
        return 200 + 32 * len(self.digests) + 48 * len(self.packs)


def _leaf(records: bytes) -> bytes:
    return blake3.blake3(b"\x00" + records).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return blake3.blake3(b"\x01" + left + right).digest()


def merkle(leaves: list[bytes]) -> tuple[bytes, list[list[bytes]]]:
    """``(root, proofs)`` of ``leaves``: ``proofs[i]`` is leaf ``i``'s sibling path, leaf level first."""
    if not leaves:
        return _EMPTY, []
    depth = merkle_depth(len(leaves))
    level = leaves + [_EMPTY] * ((1 << depth) - len(leaves))
    proofs: list[list[bytes]] = [[] for _ in leaves]
    for _ in range(depth):
        for i in range(len(leaves)):
            pos = i >> len(proofs[i])
            proofs[i].append(level[pos ^ 1])
        level = [_node(level[j], level[j + 1]) for j in range(0, len(level), 2)]
    return level[0], proofs


def _fold(leaf: bytes, index: int, proof: list[bytes]) -> bytes:
    """The root that ``leaf`` at ``index`` with sibling path ``proof`` leads to."""
    h = leaf
    for sib in proof:
        h = _node(sib, h) if index & 1 else _node(h, sib)
        index >>= 1
    return h


# ---------------------------------------------------------------- writing
class TableBuilder:
    """Collects chunk records, in order, for one segment."""

    def __init__(self):
        self._packs: dict[str, int] = {}
        self._rows: list[tuple] = []

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, ref: ChunkRef) -> None:
        p = self._packs.get(ref.pack)
        if p is None:
            p = self._packs[ref.pack] = len(self._packs)
        self._rows.append((bytes.fromhex(ref.hash), p, CODEC_IDS[ref.codec], ref.offset, ref.stored_len, ref.raw_len))

    def extend(self, refs: Sequence[ChunkRef]) -> tuple[int, int]:
        """Append a shard's chunks; returns its ``(first, count)`` run."""
        first = len(self._rows)
        for r in refs:
            self.add(r)
        return first, len(self._rows) - first

    def encode(self) -> tuple[bytes, int, bytes]:
        """``(segment bytes, header length, header digest)``."""
        n = len(self._rows)
        rec = np.zeros(n, dtype=RECORD)
        if n:
            rec["hash"] = np.frombuffer(b"".join(r[0] for r in self._rows), dtype=np.uint8).reshape(n, 32)
            rec["pack"] = [r[1] for r in self._rows]
            rec["codec"] = [r[2] for r in self._rows]
            rec["offset"] = [r[3] for r in self._rows]
            rec["stored"] = [r[4] for r in self._rows]
            rec["raw"] = [r[5] for r in self._rows]
        body = rec.tobytes()
        packs = b"".join(bytes.fromhex(p) for p in self._packs)
        size = BLOCK_RECORDS * RECORD_SIZE
        blocks = [body[i : i + size] for i in range(0, len(body), size)]
        root, proofs = merkle([_leaf(b) for b in blocks])
        records_offset = HEADER.size + len(packs) + 32
        head = HEADER.pack(MAGIC, *VERSION, BLOCK_RECORDS, len(self._packs), len(blocks), n, records_offset)
        header = head + packs + root
        parts = [header]
        for b, proof in zip(blocks, proofs):
            parts.append(b)
            parts.extend(proof)
        return b"".join(parts), len(header), blake3.blake3(header).digest()


# ---------------------------------------------------------------- reading
def parse_header(data: bytes, digest_hex: str, where: str) -> SegmentHeader:
    """Parse a segment's header bytes ``[0, header_len)``, checking the root's digest."""
    if blake3.blake3(data).hexdigest() != digest_hex:
        raise FormatError(f"{where}: header does not match the manifest's digest (corrupted or replaced)")
    if len(data) < HEADER.size:
        raise FormatError(f"{where}: header is truncated")
    magic, major, minor, block_records, npacks, nblocks, nrecords, records_offset = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FormatError(f"{where}: not a ckptstore chunk-table segment")
    if major > VERSION[0]:
        raise UnsupportedVersionError(
            f"{where}: segment format {major}.{minor} is newer than this ckptstore reads "
            f"({VERSION[0]}.x); upgrade ckptstore"
        )
    if major < 2:
        raise FormatError(f"{where}: unknown segment format {major}.{minor}")
    if major >= 3 and block_records != BLOCK_RECORDS:
        raise FormatError(f"{where}: a {major}.{minor} segment has blocks of {BLOCK_RECORDS} records, not {block_records}")
    if not 0 < block_records <= 1 << 20 or npacks > MAX_PACKS or nrecords > MAX_RECORDS:
        raise FormatError(f"{where}: header fields out of range")
    tail = 32 * nblocks if major == 2 else 32
    if nblocks != -(-nrecords // block_records) or records_offset != HEADER.size + 16 * npacks + tail:
        raise FormatError(f"{where}: header sizes are inconsistent")
    if len(data) != records_offset:
        raise FormatError(f"{where}: header is {len(data)} bytes, expected {records_offset}")
    p0 = HEADER.size
    packs = tuple(data[p0 + 16 * i : p0 + 16 * (i + 1)].hex() for i in range(npacks))
    d0 = p0 + 16 * npacks
    if major == 2:
        digests = tuple(data[d0 + 32 * i : d0 + 32 * (i + 1)] for i in range(nblocks))
        return SegmentHeader(packs, nrecords, block_records, digests, records_offset)
    root = bytes(data[d0 : d0 + 32])
    return SegmentHeader(packs, nrecords, block_records, (), records_offset, 3, root, merkle_depth(nblocks))


def parse_block(header: SegmentHeader, b: int, data: bytes, where: str) -> np.ndarray:
    """The records of block ``b`` (a structured array), after checking them against the header."""
    lo, hi = header.block_range(b)
    if len(data) != hi - lo:
        raise FormatError(f"{where}: block {b} is {len(data)} bytes, expected {hi - lo}")
    if header.major == 2:
        body = data
        ok = blake3.blake3(data).digest() == header.digests[b]
    else:
        n = header.block_records_of(b) * RECORD_SIZE
        body = data[:n]
        proof = [bytes(data[n + 32 * i : n + 32 * (i + 1)]) for i in range(header.depth)]
        ok = _fold(_leaf(body), b, proof) == header.root
    if not ok:
        raise FormatError(f"{where}: block {b} does not match its digest (corrupted)")
    rec = np.frombuffer(body, dtype=RECORD)
    if len(rec) and (int(rec["pack"].max()) >= len(header.packs) or int(rec["codec"].max()) > max(CODEC_NAMES)):
        raise FormatError(f"{where}: block {b} has a record with an unknown pack or codec")
    raw = rec["codec"] == CODEC_IDS["raw"]
    if np.any(raw & (rec["stored"] != rec["raw"])) or np.any(rec["raw"] > _m.MAX_CHUNK_BYTES):
        raise FormatError(f"{where}: block {b} has an invalid record")
    return rec


def refs(header: SegmentHeader, rec: np.ndarray) -> tuple[ChunkRef, ...]:
    """``ChunkRef`` values of some records."""
    hashes = rec["hash"].tobytes()
    packs, codecs = header.packs, CODEC_NAMES
    out = []
    for i, (p, c, off, sl, rl) in enumerate(
        zip(rec["pack"].tolist(), rec["codec"].tolist(), rec["offset"].tolist(), rec["stored"].tolist(), rec["raw"].tolist())
    ):
        out.append(ChunkRef(hashes[32 * i : 32 * (i + 1)].hex(), packs[p], off, sl, rl, codecs[c]))
    return tuple(out)
