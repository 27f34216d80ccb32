"""Chunk-table segments: the 3.0 layout (small blocks, a Merkle root in the header) and
the 2.0 layout older repositories hold, read side by side."""

from __future__ import annotations

import random
import struct

import blake3
import numpy as np
import pytest

from ckptstore.errors import FormatError, UnsupportedVersionError
from ckptstore.format import chunk_table as ct
from ckptstore.format.manifest import ChunkRef
from ckptstore.format.model import segment_sizes

SEED = 1234


def _refs(n: int, npacks: int = 3, seed: int = SEED) -> list[ChunkRef]:
    rng = random.Random(seed)
    packs = [blake3.blake3(f"p{seed}:{i}".encode()).hexdigest()[:32] for i in range(npacks)]
    out = []
    for i in range(n):
        raw = rng.randrange(1, 1 << 20)
        codec = rng.choice(["raw", "zstd", "bgz"])
        stored = raw if codec == "raw" else rng.randrange(1, raw + 1)
        out.append(ChunkRef(blake3.blake3(f"{seed}:{i}".encode()).hexdigest(), rng.choice(packs),
                            rng.randrange(0, 1 << 40), stored, raw, codec))
    return out


def _encode(refs):
    b = ct.TableBuilder()
    for r in refs:
        b.add(r)
    return b.encode()


def _read(data: bytes, hlen: int, digest: bytes, first: int, count: int):
    """The refs of records [first, first + count) the way a reader gets them: header, then blocks."""
    h = ct.parse_header(data[:hlen], digest.hex(), "seg")
    recs = []
    for b in h.blocks_for(first, count):
        lo, hi = h.block_range(b)
        recs.append((b, ct.parse_block(h, b, data[lo:hi], "seg")))
    rows = np.concatenate([r for _, r in recs]) if recs else np.zeros(0, ct.RECORD)
    base = recs[0][0] * h.block_records if recs else 0
    return ct.refs(h, rows[first - base : first - base + count])


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 33, 48, 100, 257, 1000])
def test_3_0_segments_round_trip_any_run_and_have_the_size_the_root_expects(n):
    refs = _refs(n)
    data, hlen, digest = _encode(refs)
    assert struct.unpack_from("<8sHH", data)[1:] == (3, 0)
    assert len(data) == segment_sizes(hlen, n)[1]
    h = ct.parse_header(data[:hlen], digest.hex(), "seg")
    assert (h.major, h.block_records, h.nblocks) == (3, 16, -(-n // 16))
    assert h.depth == max(0, (h.nblocks - 1).bit_length())
    # blocks and their proofs tile the segment, back to back
    ends = [hlen] + [h.block_range(b)[1] for b in range(h.nblocks)]
    assert [h.block_range(b)[0] for b in range(h.nblocks)] == ends[:-1] and ends[-1] == len(data)
    rng = random.Random(SEED + n)
    for _ in range(20):
        first = rng.randrange(0, n + 1)
        count = rng.randrange(0, n - first + 1)
        assert list(_read(data, hlen, digest, first, count)) == refs[first : first + count], (SEED, n, first, count)


def test_3_0_header_stays_small_however_many_blocks():
    small, hs, _ = _encode(_refs(16, npacks=1))
    big, hb, _ = _encode(_refs(20_000, npacks=1))
    assert hs == hb == 40 + 16 + 32  # fixed part, one pack id, the Merkle root
    h = ct.parse_header(big[:hb], blake3.blake3(big[:hb]).hexdigest(), "seg")
    lo, hi = h.block_range(600)
    assert hi - lo == 16 * 56 + 32 * 11  # one block of 1250 costs 896 bytes and an 11-digest proof


@pytest.mark.parametrize("what", ["record", "proof", "swap", "other segment"])
def test_a_damaged_or_misplaced_3_0_block_is_refused(what):
    refs = _refs(100)
    data, hlen, digest = _encode(refs)
    h = ct.parse_header(data[:hlen], digest.hex(), "seg")
    lo, hi = h.block_range(2)
    block = bytearray(data[lo:hi])
    if what == "record":
        block[5] ^= 1
    elif what == "proof":
        block[-1] ^= 1
    elif what == "swap":  # a valid block, at the wrong index
        lo1, hi1 = h.block_range(1)
        block = bytearray(data[lo1:hi1])
    else:  # the same index of a segment with other records
        other, ho, _ = _encode(_refs(100, seed=SEED + 1))
        block = bytearray(other[lo:hi])
    with pytest.raises(FormatError, match="block 2 does not match its digest"):
        ct.parse_block(h, 2, bytes(block), "seg")
    with pytest.raises(FormatError, match="block 2 is 3 bytes"):
        ct.parse_block(h, 2, b"abc", "seg")


def _rehash(head: bytearray):
    return ct.parse_header(bytes(head), blake3.blake3(bytes(head)).hexdigest(), "seg")


def test_a_newer_segment_major_or_a_bent_3_0_header_is_refused_and_a_newer_minor_is_read():
    data, hlen, digest = _encode(_refs(40))
    head = bytearray(data[:hlen])
    struct.pack_into("<H", head, 8, 4)  # major 4: a layout this version does not know
    with pytest.raises(UnsupportedVersionError, match=r"segment format 4.0 is newer than this ckptstore reads \(3.x\)"):
        _rehash(head)
    head = bytearray(data[:hlen])
    struct.pack_into("<H", head, 10, 7)  # a newer minor only adds: read as 3.0
    h = _rehash(head)
    assert (h.major, h.nrecords) == (3, 40)
    lo, hi = h.block_range(2)
    assert ct.refs(h, ct.parse_block(h, 2, data[lo:hi], "seg")) == tuple(_refs(40)[32:40])
    head = bytearray(data[:hlen])
    struct.pack_into("<I", head, 12, 32)  # 3.0 with blocks of another size
    with pytest.raises(FormatError, match="blocks of 16 records, not 32"):
        _rehash(head)


def _encode_2_0(refs) -> tuple[bytes, int, bytes]:
    """A 2.0 segment, byte for byte as ckptstore wrote them before 3.0 (the layout
    ``docs/format.md`` gives): 1024-record blocks, every block's digest in the header."""
    packs = list(dict.fromkeys(r.pack for r in refs))
    rec = np.zeros(len(refs), dtype=ct.RECORD)
    for i, r in enumerate(refs):
        rec[i] = (np.frombuffer(bytes.fromhex(r.hash), np.uint8), packs.index(r.pack), ct.CODEC_IDS[r.codec],
                  (0, 0, 0), r.offset, r.stored_len, r.raw_len)
    body = rec.tobytes()
    bs = 1024 * 56
    digests = b"".join(blake3.blake3(body[i : i + bs]).digest() for i in range(0, len(body), bs))
    pk = b"".join(bytes.fromhex(p) for p in packs)
    off = 40 + len(pk) + len(digests)
    header = struct.pack("<8sHHIIIQQ", b"CKPTSEG2", 2, 0, 1024, len(packs), len(digests) // 32, len(refs), off)
    header += pk + digests
    return header + body, len(header), blake3.blake3(header).digest()


def test_2_0_segments_with_many_blocks_still_read():
    refs = _refs(2500)
    data, hlen, digest = _encode_2_0(refs)
    assert len(data) == segment_sizes(hlen, 2500)[0]
    h = ct.parse_header(data[:hlen], digest.hex(), "seg")
    assert (h.major, h.block_records, len(h.digests)) == (2, 1024, 3)
    assert list(_read(data, hlen, digest, 1000, 1100)) == refs[1000:2100]
    assert list(_read(data, hlen, digest, 0, 2500)) == refs
    lo, hi = h.block_range(1)
    bad = bytearray(data[lo:hi])
    bad[100] ^= 1
    with pytest.raises(FormatError, match="block 1 does not match its digest"):
        ct.parse_block(h, 1, bytes(bad), "seg")


def test_merkle_proofs_fold_to_the_root_for_every_leaf_count():
    for n in range(1, 70):
        leaves = [blake3.blake3(bytes([i])).digest() for i in range(n)]
        root, proofs = ct.merkle(leaves)
        assert all(len(p) == max(0, (n - 1).bit_length()) for p in proofs)
        for i, leaf in enumerate(leaves):
            assert ct._fold(leaf, i, proofs[i]) == root, (n, i)
            if n > 1:
                assert ct._fold(leaf, (i + 1) % n, proofs[i]) != root  # the same leaf elsewhere


def test_segments_several_ranks_need_are_read_once_and_adopted_after_the_same_checks(tmp_path):
    # issue 44 item 4: ChunkTables.read_shared reads a segment two "ranks" need once (whole, one
    # request); a handle that adopts the bytes reads nothing more of it; damaged bytes are refused
    import torch

    import ckptstore
    from ckptstore.storage.wrappers import CountingStore

    url = str(tmp_path / "repo")
    with ckptstore.open(url, chunk_size=4096) as repo:
        repo.save({f"t{i}": torch.arange(i * 3000, (i + 1) * 3000, dtype=torch.float32) for i in range(40)}, step=1)
    keys = [f"t{i}" for i in range(40)]
    with ckptstore.open(url) as coord, ckptstore.open(url) as other:
        man = coord.manifest(1)
        assert not man.inline and len(man.segments) == 1
        counting = CountingStore(coord.tables.store)
        coord.tables.store = counting
        needs = [{(k, 0) for k in keys[:30]}, {(k, 0) for k in keys[20:]}, {("t0", 0)}]
        shared = coord.tables.read_shared(man, needs)
        assert counting.calls["get_ranges"] == 1 and len(counting.reads) == 1  # the segment whole, once
        assert all(len(s) == 1 for s in shared)
        seg_id, head, blocks = shared[1][0]
        assert seg_id == man.segments[0].id and blocks

        # adopted: the other handle resolves rank 1's shards without reading the segment
        theirs = CountingStore(other.tables.store)
        other.tables.store = theirs
        other.tables.adopt(man, shared[1])
        got = other.tables.resolve(man, sorted(needs[1]))
        assert theirs.calls["get_ranges"] == 0 and set(got) == needs[1]
        with ckptstore.open(url) as fresh:
            assert got == fresh.tables.resolve(man, sorted(needs[1]))  # the same records as a read

        # a flipped byte in a block, or a header that is not the root's, is refused and not kept
        with ckptstore.open(url) as third:
            b, data = blocks[0]
            bad = bytearray(data)
            bad[7] ^= 1
            with pytest.raises(FormatError):
                third.tables.adopt(man, [(seg_id, head, [(b, bytes(bad))])])
            with pytest.raises(FormatError):
                third.tables.adopt(man, [(seg_id, head[:-1] + bytes([head[-1] ^ 1]), blocks)])
            assert third.tables._blocks.get((seg_id, b)) is None
