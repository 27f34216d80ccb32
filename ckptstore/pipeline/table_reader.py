"""Reading 2.0 chunk tables: only the records of the shards asked for.

:class:`ChunkTables` turns shards of a 2.0 or 3.0 manifest into their chunk
references. For each segment involved it reads the header once (cached,
checked against the root's digest), then range-reads only the blocks of
records covering the shards asked for, each checked against the header,
concurrently across segments. Every reference is checked against the
root: its pack is one the step lists, its bytes lie inside that pack, and
a shard's records add up to exactly its box's bytes. 1.0 manifests carry
their chunks inline and pass through untouched.

Segments several ranks of a DCP job need (issue 44) are read once for the
job: :meth:`ChunkTables.read_shared` reads each one (whole, in one ranged
GET, when it is small) and returns the bytes of its header and of the
blocks the ranks need; every rank takes them with :meth:`ChunkTables.adopt`,
which checks the header against the root's digest and every block against
the header exactly as a read from the store does, and keeps them for its
reads, so a rank then reads only what it alone needs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import defaultdict
from typing import Iterable, Iterator

import numpy as np

from ..format import chunk_table as _ct
from ..format import tiles as _tiles
from ..errors import FormatError, MissingDataError, ObjectNotFoundError
from ..format.layout import segment_key
from ..format.manifest import ChunkRef, Manifest, SegmentRef, Shard, TensorEntry, itemsize
from .runtime import LRUCache, Runtime
from ..storage.base import ObjectStore

#: Segment headers a handle keeps (3.0: about 100 bytes and 16 a pack; 2.0: also 32 a block).
HEADER_CACHE_BYTES = 64 << 20
#: Record blocks another rank read for this one (:meth:`ChunkTables.adopt`) a handle keeps.
ADOPTED_BLOCK_BYTES = 64 << 20
#: A segment read for several ranks is read whole, in one request, up to this size.
WHOLE_SEGMENT_BYTES = 4 << 20


class ChunkTables:
    """Chunk records of 2.0 shards, read by share; see the module docstring."""

    def __init__(self, store: ObjectStore, runtime: Runtime, tier=None):
        self.store = store
        self.runtime = runtime
        self.tier = tier
        self._headers: LRUCache[str, _ct.SegmentHeader] = LRUCache(HEADER_CACHE_BYTES, lambda h: h.cache_weight)
        #: ``(segment id, block) -> records``, only blocks another rank read and sent (checked on arrival)
        self._blocks: LRUCache[tuple[str, int], np.ndarray] = LRUCache(ADOPTED_BLOCK_BYTES, lambda a: a.nbytes + 64)

    def _sources(self, segment_id: str) -> list[ObjectStore]:
        """Where to read a segment, nearest first: the node-local tier's copies (a write-back
        step's), then the store. A tier copy can move (a pending one is renamed into the cache
        when its step commits) or be evicted between this look and the read; a read that finds
        it gone, short or failing its check goes on to the next source."""
        out: list[ObjectStore] = []
        if self.tier is not None:
            key = segment_key(segment_id)
            if os.path.isfile(os.path.join(self.tier.root, "wb", key)):
                out += [self.tier.pending.durable, self.tier.store]  # pending, or just committed
            elif os.path.isfile(os.path.join(self.tier.root, key)):
                out.append(self.tier.store)
        out.append(self.store)
        return out

    def _read_from(self, segment_id: str, ranges, parse, where: str):
        """``parse(datas)`` of ``ranges`` of a segment, from the first source that has them whole and valid."""
        sources = self._sources(segment_id)
        for src in sources:
            last = src is sources[-1]
            try:
                datas = src.get_ranges(segment_key(segment_id), ranges) if ranges else []
                return parse(datas)
            except ObjectNotFoundError:
                if last:
                    raise MissingDataError(f"{where} is missing; the step cannot be restored") from None
            except ValueError as e:
                if last:
                    raise FormatError(f"{where} is shorter than the manifest says: {e}") from None
            except (FormatError, OSError):
                if last:
                    raise
        raise AssertionError("unreachable")

    # ------------------------------------------------------------ headers
    def header(self, man: Manifest, seg: SegmentRef) -> _ct.SegmentHeader:
        h = self._headers.get(seg.id)
        if h is not None:
            return h
        where = self._where(man, seg)
        h = self._read_from(seg.id, [(0, seg.header)], lambda datas: _parse_header(bytes(datas[0]), seg, where), where)
        self._headers.put(seg.id, h)
        return h

    def forget(self, segment_ids: Iterable[str]) -> None:
        """Drop what is cached of these segments (their step was deleted)."""
        for sid in segment_ids:
            self._headers.pop(sid)

    def _where(self, man: Manifest, seg: SegmentRef) -> str:
        return f"{self.store.url}: step {man.step}: chunk-table segment {seg.id}"

    # ------------------------------------------------------------ segments several ranks need
    def segments_of(self, man: Manifest, wanted: Iterable[tuple[str, int]]) -> dict[int, list[tuple[str, int, int, int]]]:
        """The segments holding the records of shards ``wanted``: ``{segment: [(key, shard, first, count)]}``
        (1.0 shards, and shards whose chunks the manifest carries, need none)."""
        by_seg: dict[int, list[tuple[str, int, int, int]]] = defaultdict(list)
        for key, i in wanted:
            t = man.tensors[key]
            if t.known_chunks(i) is not None:
                continue
            seg, first, count = (int(x) for x in t.tables()[i])
            by_seg[seg].append((key, i, first, count))
        return by_seg

    def read_shared(self, man: Manifest, needs: list[set[tuple[str, int]]]) -> list[tuple]:
        """Read once the segments more than one of ``needs`` (one set of shards a rank) touches.

        Returns, per entry of ``needs``, ``((segment id, header bytes, ((block, bytes), ...)), ...)``:
        the header and the record blocks that rank needs of each shared segment, for
        :meth:`adopt`. A segment of at most :data:`WHOLE_SEGMENT_BYTES` is read whole in one
        request; a larger one as its header, then the blocks any of the ranks needs.
        """
        if man.inline:
            return [() for _ in needs]
        per_rank = [self.segments_of(man, want) for want in needs]
        readers: dict[int, int] = defaultdict(int)
        for segs in per_rank:
            for seg in segs:
                readers[seg] += 1
        shared = sorted(seg for seg, n in readers.items() if n > 1)
        if not shared:
            return [() for _ in needs]
        items: dict[int, list] = defaultdict(list)
        for segs in per_rank:
            for seg in shared:
                items[seg] += segs.get(seg, [])
        got: dict[int, tuple[_ct.SegmentHeader, bytes, dict[int, bytes]]] = {}

        def one(seg: int) -> None:
            got[seg] = self._read_blocks_raw(man, seg, items[seg])

        if len(shared) == 1:
            one(shared[0])
        else:
            for _ in self.runtime.io.map(one, shared):
                pass
        out = []
        for segs in per_rank:
            mine = []
            for seg in shared:
                if seg not in segs:
                    continue
                header, head, blocks = got[seg]
                want = sorted({b for _, _, f, c in segs[seg] for b in header.blocks_for(f, c)})
                mine.append((man.segments[seg].id, head, tuple((b, blocks[b]) for b in want)))
            out.append(tuple(mine))
        return out

    def _read_blocks_raw(self, man: Manifest, seg: int, items) -> tuple[_ct.SegmentHeader, bytes, dict[int, bytes]]:
        """A segment's header (parsed, and its bytes) and the bytes of the blocks ``items`` need, from the
        nearest source; every block checked against the header before it is sent anywhere."""
        sref = man.segments[seg]
        where = self._where(man, sref)
        if sref.size <= WHOLE_SEGMENT_BYTES:
            def parse_whole(datas):
                data = bytes(datas[0])
                return _parse_header(data[: sref.header], sref, where), data

            header, data = self._read_from(sref.id, [(0, sref.size)], parse_whole, where)
            head = data[: sref.header]
            fetch = lambda blks: {b: data[slice(*header.block_range(b))] for b in blks}  # noqa: E731
        else:
            head, header = self._read_from(
                sref.id, [(0, sref.header)], lambda datas: (bytes(datas[0]), _parse_header(bytes(datas[0]), sref, where)),
                where)

            def fetch(blks):
                ranges = [header.block_range(b) for b in blks]
                datas = self._read_from(sref.id, ranges, lambda d: [bytes(x) for x in d], where)
                return dict(zip(blks, datas))

        self._headers.put(sref.id, header)
        blks = sorted({b for _, _, f, c in items for b in header.blocks_for(f, c)})
        blocks = fetch(blks)
        for b in blks:
            _ct.parse_block(header, b, blocks[b], where)  # never send what this rank would refuse
        return header, head, blocks

    def adopt(self, man: Manifest, shared) -> None:
        """Keep segment bytes another rank read (:meth:`read_shared`), after the same checks as a read.

        The header must match the root's digest and every block its header; anything that
        does not raises :class:`~ckptstore.errors.FormatError` and is not kept (the caller
        then reads for itself).
        """
        by_id = {s.id: s for s in man.segments}
        for seg_id, head, parts in shared:
            sref = by_id.get(seg_id)
            if sref is None:
                raise FormatError(f"{self.store.url}: step {man.step}: segment {seg_id} received from another rank "
                                  "is not one the step lists")
            where = self._where(man, sref) + " (received from another rank)"
            header = _parse_header(bytes(head), sref, where)
            blocks = {}
            for b, data in parts:
                b = int(b)
                if not 0 <= b < header.nblocks:
                    raise FormatError(f"{where}: block {b} received, the segment has {header.nblocks}")
                blocks[b] = _ct.parse_block(header, b, bytes(data), where)
            self._headers.put(sref.id, header)
            for b, recs in blocks.items():
                self._blocks.put((sref.id, b), recs)

    # ------------------------------------------------------------ shards
    def resolve(self, man: Manifest, wanted: Iterable[tuple[str, int]]) -> dict[tuple[str, int], tuple[ChunkRef, ...]]:
        """The chunk references of shards ``(tensor key, shard index)`` of ``man``."""
        out: dict[tuple[str, int], tuple[ChunkRef, ...]] = {}
        by_seg: dict[int, list[tuple[str, int, int, int]]] = defaultdict(list)
        for key, i in wanted:
            t = man.tensors[key]
            known = t.known_chunks(i)
            if known is not None:  # 1.0, or a manifest this handle just wrote
                out[(key, i)] = known
                continue
            seg, first, count = (int(x) for x in t.tables()[i])
            by_seg[seg].append((key, i, first, count))
        if not by_seg:
            return out

        def one(seg: int) -> None:
            out.update(self._read(man, seg, by_seg[seg]))

        if len(by_seg) == 1:
            one(next(iter(by_seg)))
        else:
            for _ in self.runtime.io.map(one, list(by_seg)):
                pass
        return out

    def resolved(self, man: Manifest, key: str, indices: Iterable[int] | None = None) -> TensorEntry:
        """Tensor ``key`` with its shards (all, or ``indices``) carrying their chunks."""
        t = man.tensors[key]
        if man.inline:
            return t
        idx = range(t.nshards) if indices is None else sorted(set(indices))
        got = self.resolve(man, ((key, i) for i in idx))
        shards = list(t.shards)
        for i in idx:
            s = shards[i]
            shards[i] = Shard(s.offsets, s.sizes, got[(key, i)], s.table)
        return t.with_shards(shards)

    def iter_shards(self, man: Manifest) -> Iterator[tuple[str, int, tuple[ChunkRef, ...]]]:
        """Every shard's chunks, ``(key, shard index, refs)``, reading one segment at a time."""
        if man.inline:
            for key, t in man.tensors.items():
                for i, s in enumerate(t.shards):
                    yield key, i, s.chunks
            return
        by_seg: dict[int, list[tuple[str, int, int, int]]] = defaultdict(list)
        for key, t in man.tensors.items():
            tabs = t.tables()
            for i in range(t.nshards):
                seg, first, count = (int(x) for x in tabs[i])
                by_seg[seg].append((key, i, first, count))
        for seg in sorted(by_seg):
            for (key, i), refs in self._read(man, seg, by_seg[seg]).items():
                yield key, i, refs

    def resolve_all(self, man: Manifest) -> Manifest:
        """``man`` with every shard's chunks in it (each segment read once); 1.0 as it is.

        For whole-step operations (``cp``, ``diff``): memory grows with the
        step's chunks.
        """
        if man.inline:
            return man
        got: dict[str, list] = {key: list(t.shards) for key, t in man.tensors.items()}
        for key, i, refs in self.iter_shards(man):
            s = got[key][i]
            got[key][i] = Shard(s.offsets, s.sizes, refs, s.table)
        return dataclasses.replace(man, tensors={k: t.with_shards(got[k]) for k, t in man.tensors.items()})

    def iter_chunks(self, man: Manifest) -> Iterator[ChunkRef]:
        """Every chunk reference of a step (a full read of its chunk tables)."""
        for _, _, refs in self.iter_shards(man):
            yield from refs

    # ------------------------------------------------------------ internals
    def _read(self, man: Manifest, seg: int, items: list[tuple[str, int, int, int]]):
        sref = man.segments[seg]
        header = self.header(man, sref)
        where = f"{self.store.url}: step {man.step}: chunk-table segment {sref.id}"
        blocks = sorted({b for _, _, f, c in items for b in header.blocks_for(f, c)})
        kept = {b: r for b in blocks if (r := self._blocks.get((sref.id, b))) is not None}
        blocks = [b for b in blocks if b not in kept]  # what another rank sent is not read again
        runs: list[list[int]] = []
        for b in blocks:
            if runs and runs[-1][1] == b - 1:
                runs[-1][1] = b
            else:
                runs.append([b, b])
        ranges = [(header.block_range(a)[0], header.block_range(b)[1]) for a, b in runs]

        def parse(datas) -> dict[int, np.ndarray]:
            recs: dict[int, np.ndarray] = {}
            for (a, b), data in zip(runs, datas):
                mv = memoryview(data)
                base = header.block_range(a)[0]
                for blk in range(a, b + 1):
                    lo, hi = header.block_range(blk)
                    recs[blk] = _ct.parse_block(header, blk, bytes(mv[lo - base : hi - base]), where)
            return recs

        recs = self._read_from(sref.id, ranges, parse, where) if ranges else {}
        recs.update(kept)
        br = header.block_records
        out = {}
        for key, i, first, count in items:
            if count == 0:
                rows = np.zeros(0, dtype=_ct.RECORD)
            else:
                parts = []
                for blk in header.blocks_for(first, count):
                    lo = max(first, blk * br) - blk * br
                    hi = min(first + count, (blk + 1) * br) - blk * br
                    parts.append(recs[blk][lo:hi])
                rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
            refs = _ct.refs(header, rows)
            self._check(man, key, i, refs, where)
            out[(key, i)] = refs
        return out

    def _check(self, man: Manifest, key: str, i: int, refs: tuple[ChunkRef, ...], where: str) -> None:
        t = man.tensors[key]
        offs, sizes = t.boxes()
        want = math.prod(int(x) for x in sizes[i]) * itemsize(t.dtype)
        got = sum(r.raw_len for r in refs)
        if got != want:
            raise FormatError(f"{where}: tensor {key!r} shard {i}: records hold {got} bytes, the box needs {want}")
        if t.tile is not None:
            lengths = _tiles.tile_lengths([int(x) for x in sizes[i]], t.tile, itemsize(t.dtype))
            if len(lengths) != len(refs) or any(int(a) != r.raw_len for a, r in zip(lengths, refs)):
                raise FormatError(f"{where}: tensor {key!r} shard {i}: its records are not the tiles "
                                  f"{list(t.tile)} of its box")
        for r in refs:
            size = man.packs.get(r.pack)
            if size is None:
                raise FormatError(f"{where}: tensor {key!r}: a record names pack {r.pack}, which the step does not list")
            if r.offset + r.stored_len > size:
                raise FormatError(
                    f"{where}: tensor {key!r}: chunk at [{r.offset}, {r.offset + r.stored_len}) is past the end "
                    f"of pack {r.pack} ({size} bytes)"
                )


def _parse_header(data: bytes, seg: SegmentRef, where: str) -> _ct.SegmentHeader:
    h = _ct.parse_header(data, seg.digest, where)
    if h.nrecords != seg.records:
        raise FormatError(f"{where}: holds {h.nrecords} records, the manifest says {seg.records}")
    return h
