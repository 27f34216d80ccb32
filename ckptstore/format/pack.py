"""Pack objects: many compressed chunks, then a table describing them.

Layout (all integers little-endian)::

    header   16 bytes   b"CKPTPACK", u16 major, u16 minor, 4 zero bytes
    chunks   stored bytes of each chunk, back to back, in write order
    table    N entries of 64 bytes:
               32 bytes  BLAKE3-256 of the chunk's raw bytes
               u64       offset of the stored bytes from the pack's start
               u64       stored length
               u64       raw length
               u8        codec id (0 raw, 1 zstd, 2 bgz)
               7 zero bytes
    footer   40 bytes   u64 table offset, u32 N, 4 zero bytes,
                        16 bytes BLAKE3 of the table (truncated), b"CKPTEND1"

A pack is streamable (the writer never seeks back) and self-describing: the
footer locates the table, the table lists every chunk, so an index can be
rebuilt from packs alone. This module is pure: it builds and parses bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import blake3

from ..errors import FormatError

MAGIC = b"CKPTPACK"
END_MAGIC = b"CKPTEND1"
VERSION = (1, 0)
HEADER = struct.Struct("<8sHH4x")
ENTRY = struct.Struct("<32sQQQB7x")
FOOTER = struct.Struct("<QI4x16s8s")
HEADER_SIZE = HEADER.size
FOOTER_SIZE = FOOTER.size
CODEC_IDS = {"raw": 0, "zstd": 1, "bgz": 2}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
#: A table larger than this is refused before it is read (about 16M chunks).
MAX_TABLE_ENTRIES = 1 << 24

assert HEADER_SIZE == 16 and ENTRY.size == 64 and FOOTER_SIZE == 40


@dataclass(frozen=True)
class PackEntry:
    """One chunk inside a pack."""

    hash: str
    offset: int
    stored_len: int
    raw_len: int
    codec: str


def header() -> bytes:
    return HEADER.pack(MAGIC, *VERSION)


class PackBuilder:
    """Tracks offsets while chunks are appended; emits header and tail bytes.

    The caller writes ``header()`` first, then for each chunk calls
    :meth:`add` and writes the stored bytes, then writes :meth:`tail`.
    """

    def __init__(self):
        self.size = HEADER_SIZE
        self.entries: list[PackEntry] = []

    def add(self, hash_hex: str, codec: str, stored_len: int, raw_len: int) -> PackEntry:
        e = PackEntry(hash_hex, self.size, stored_len, raw_len, codec)
        self.entries.append(e)
        self.size += stored_len
        return e

    def tail(self) -> bytes:
        table = b"".join(
            ENTRY.pack(bytes.fromhex(e.hash), e.offset, e.stored_len, e.raw_len, CODEC_IDS[e.codec])
            for e in self.entries
        )
        digest = blake3.blake3(table).digest()[:16]
        footer = FOOTER.pack(self.size, len(self.entries), digest, END_MAGIC)
        return table + footer

    def final_size(self) -> int:
        return self.size + ENTRY.size * len(self.entries) + FOOTER_SIZE


def parse_header(data: bytes) -> tuple[int, int]:
    if len(data) < HEADER_SIZE:
        raise FormatError("pack header truncated")
    magic, major, minor = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FormatError("not a ckptstore pack (bad magic)")
    return major, minor


def parse_footer(data: bytes, pack_size: int) -> tuple[int, int, bytes]:
    """Return ``(table_offset, n_entries, digest)`` after checking bounds."""
    if len(data) != FOOTER_SIZE:
        raise FormatError("pack footer truncated")
    table_off, n, digest, magic = FOOTER.unpack(data)
    if magic != END_MAGIC:
        raise FormatError("pack footer has bad magic (truncated or not a pack)")
    if n > MAX_TABLE_ENTRIES:
        raise FormatError(f"pack table claims {n} entries, over the limit {MAX_TABLE_ENTRIES}")
    if table_off < HEADER_SIZE or table_off + n * ENTRY.size + FOOTER_SIZE != pack_size:
        raise FormatError("pack footer does not match the pack's size")
    return table_off, n, digest


def parse_table(data: bytes, n: int, digest: bytes, table_off: int) -> list[PackEntry]:
    if len(data) != n * ENTRY.size:
        raise FormatError("pack table truncated")
    if blake3.blake3(data).digest()[:16] != digest:
        raise FormatError("pack table checksum mismatch")
    out = []
    end = HEADER_SIZE
    for i in range(n):
        h, off, slen, rlen, cid = ENTRY.unpack_from(data, i * ENTRY.size)
        if cid not in CODEC_NAMES:
            raise FormatError(f"pack table entry {i} has unknown codec id {cid}")
        if off < HEADER_SIZE or off + slen > table_off:
            raise FormatError(f"pack table entry {i} points outside the chunk area")
        out.append(PackEntry(h.hex(), off, slen, rlen, CODEC_NAMES[cid]))
        end = max(end, off + slen)
    return out


def read_table(store, key: str) -> list[PackEntry]:
    """Read a pack's chunk table with two ranged reads (footer, then table)."""
    size = store.head(key).size
    if size < HEADER_SIZE + FOOTER_SIZE:
        raise FormatError(f"{key}: {size} bytes is too small to be a pack")
    (head, foot) = store.get_ranges(key, [(0, HEADER_SIZE), (size - FOOTER_SIZE, size)])
    parse_header(head)
    table_off, n, digest = parse_footer(foot, size)
    (table,) = store.get_ranges(key, [(table_off, table_off + n * ENTRY.size)])
    return parse_table(table, n, digest, table_off)
