"""Chunk-table segments (format 2.0): where every chunk of a step's shards lives.

A segment is written once, by one writer (a DCP rank, or a whole
single-process save), and holds the chunk records of the shards that
writer saved, each shard's chunks as one contiguous run of records, in
chunk order. The step's root manifest names every segment with its size,
record count, header length and the BLAKE3 digest of its header, and each
shard with ``(segment, first record, count)``. A reader that restores its
share range-reads the header of each segment it needs, checks it against
the root, then only the blocks of records covering its shards, each checked
against the digest the header lists. No Python object is made per record
until a caller asks for :class:`~ckptstore.format.manifest.ChunkRef` values.

Layout (integers little-endian)::

    header   40 bytes   b"CKPTSEG2", u16 major, u16 minor, u32 block_records,
                        u32 npacks, u32 nblocks, u64 nrecords, u64 records_offset
    packs    npacks x 16 bytes: the pack ids records refer to (raw bytes of the hex id)
    digests  nblocks x 32 bytes: BLAKE3 of each block of records
             (bytes [0, records_offset) are the "header" the root's digest covers)
    records  nrecords x 56 bytes, in blocks of block_records records:
               32 bytes  BLAKE3-256 of the chunk's raw bytes
               u32       pack index (into ``packs``)
               u8        codec id (0 raw, 1 zstd, 2 bgz)
               3 zero bytes
               u64       offset of the stored bytes in the pack
               u32       stored length
               u32       raw length

This module is pure: bytes in, bytes (and arrays) out.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Sequence

import blake3
import numpy as np

from . import manifest as _m
from ..errors import FormatError
from .manifest import ChunkRef
from .pack import CODEC_IDS, CODEC_NAMES

MAGIC = b"CKPTSEG2"
VERSION = (2, 0)
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
#: Records per digest block (56 KiB): the unit a reader fetches and checks.
BLOCK_RECORDS = 1024
#: Bounds checked before anything is allocated.
MAX_RECORDS = 1 << 32
MAX_PACKS = 1 << 24

assert HEADER.size == 40 and RECORD_SIZE == 56


@dataclass(frozen=True)
class SegmentHeader:
    """What a segment's header says (after its digest was checked against the root)."""

    packs: tuple[str, ...]
    nrecords: int
    block_records: int
    digests: tuple[bytes, ...]
    records_offset: int

    def blocks_for(self, first: int, count: int) -> range:
        """The blocks holding records ``[first, first + count)``."""
        if count == 0:
            return range(0)
        return range(first // self.block_records, (first + count - 1) // self.block_records + 1)

    def block_range(self, b: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of block ``b`` in the segment."""
        lo = b * self.block_records
        hi = min(self.nrecords, lo + self.block_records)
        return self.records_offset + lo * RECORD_SIZE, self.records_offset + hi * RECORD_SIZE


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
        nblocks = -(-n // BLOCK_RECORDS)
        digests = b"".join(
            blake3.blake3(body[b * BLOCK_RECORDS * RECORD_SIZE : (b + 1) * BLOCK_RECORDS * RECORD_SIZE]).digest()
            for b in range(nblocks)
        )
        packs = b"".join(bytes.fromhex(p) for p in self._packs)
        records_offset = HEADER.size + len(packs) + len(digests)
        head = HEADER.pack(MAGIC, *VERSION, BLOCK_RECORDS, len(self._packs), nblocks, n, records_offset)
        header = head + packs + digests
        return header + body, len(header), blake3.blake3(header).digest()


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
    _m.check_version([major, minor], where)
    if not 0 < block_records <= 1 << 20 or npacks > MAX_PACKS or nrecords > MAX_RECORDS:
        raise FormatError(f"{where}: header fields out of range")
    if nblocks != -(-nrecords // block_records) or records_offset != HEADER.size + 16 * npacks + 32 * nblocks:
        raise FormatError(f"{where}: header sizes are inconsistent")
    if len(data) != records_offset:
        raise FormatError(f"{where}: header is {len(data)} bytes, expected {records_offset}")
    p0 = HEADER.size
    packs = tuple(data[p0 + 16 * i : p0 + 16 * (i + 1)].hex() for i in range(npacks))
    d0 = p0 + 16 * npacks
    digests = tuple(data[d0 + 32 * i : d0 + 32 * (i + 1)] for i in range(nblocks))
    return SegmentHeader(packs, nrecords, block_records, digests, records_offset)


def parse_block(header: SegmentHeader, b: int, data: bytes, where: str) -> np.ndarray:
    """The records of block ``b`` (a structured array), after checking its digest."""
    lo, hi = header.block_range(b)
    if len(data) != hi - lo:
        raise FormatError(f"{where}: block {b} is {len(data)} bytes, expected {hi - lo}")
    if blake3.blake3(data).digest() != header.digests[b]:
        raise FormatError(f"{where}: block {b} does not match its digest (corrupted)")
    rec = np.frombuffer(data, dtype=RECORD)
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
