"""The chunk pipeline of a save: :class:`ChunkWriter`.

It cuts tensors into chunks (byte views of row-major runs, or the tiles of
format 4.0, copied out as they are queued), hashes and compresses them on the
CPU pool (small tiles by groups of about a chunk, one task each), and appends
the new ones in order to packs through the one
:class:`~ckptstore.pipeline.pack_writer.PackWriter`; chunks the dedup base or
this save already holds are referenced instead. The commit protocol around it
is :mod:`.save`'s.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import math
import threading
from typing import Callable

import numpy as np
import torch

from ..format import codec as _codec
from ..format import tiles as _tiles
from ..format.manifest import ChunkRef
from ..pipeline.pack_writer import PackWriter, part_window
from ..pipeline.tensors import frombuffer_as, host_tensor, int_view, tensor_bytes, tile_bytes
from ..tier import bands as _bands
from .catalog import Catalog


class _Length:
    """Stands for the bytes of a chunk found unchanged (never read): only its length is used."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


class _Member:
    """Chunk ``i`` of a group prepared by one task: its result is item ``i`` of the group's."""

    __slots__ = ("future", "i")

    def __init__(self, future: cf.Future, i: int):
        self.future, self.i = future, i

    def result(self):
        return self.future.result()[self.i]


class _Tile:
    """One tile of a tensor being saved: its bytes are copied out by :meth:`fill` (on a CPU
    worker), into a buffer of ``pool`` where there is one (given back by :meth:`release`).
    ``banded``: the tier keeps the tensor's decoded copy by bands (no copy of this tile)."""

    __slots__ = ("host", "a", "isz", "offsets", "sizes", "pool", "n", "piece", "buf", "banded")

    def __init__(self, host, a, isz: int, offsets, sizes, pool, banded: bool = False):
        self.host, self.a, self.isz, self.offsets, self.sizes, self.pool = host, a, isz, offsets, sizes, pool
        self.n = math.prod(sizes) * isz
        self.piece = self.buf = None
        self.banded = banded

    def __len__(self) -> int:
        return self.n

    def fill(self) -> memoryview:
        if self.pool is None or not 0 < self.n <= self.pool.size:
            self.piece = tile_bytes(self.host, self.offsets, self.sizes)
            return self.piece
        self.buf = self.pool.get()
        box = tuple(slice(b, b + k) for b, k in zip(self.offsets, self.sizes))
        np.copyto(frombuffer_as(self.buf, self.isz, self.sizes), self.a[box])
        self.piece = memoryview(self.buf)[: self.n]
        return self.piece

    def release(self) -> None:
        buf, self.buf, self.piece = self.buf, None, None
        if buf is not None:
            self.pool.put(buf)


class _BandCopies:
    """The band copies (:mod:`ckptstore.tier.bands`) of one tiled tensor being saved: as its tiles'
    references arrive (in grid order), each band whose tiles are all known is kept in the tier,
    its rows taken straight from the tensor."""

    __slots__ = ("mv", "isz", "shape", "tile", "per_band", "row_bytes", "next")

    def __init__(self, host: torch.Tensor, tile):
        self.mv = tensor_bytes(host)
        self.isz = host.element_size()
        self.shape, self.tile = tuple(host.shape), tuple(tile)
        self.per_band = math.prod(_tiles.grid(self.shape, tile)[1:])
        self.row_bytes = math.prod(self.shape[1:]) * self.isz
        self.next = 0  # the first band not yet kept

    @staticmethod
    def wanted(host: torch.Tensor, tile) -> bool:
        """Whether a tensor's decoded copy is kept by bands: 2-D and up, more than one tile across."""
        return host.dim() >= 2 and host.numel() > 0 and math.prod(_tiles.grid(tuple(host.shape), tile)[1:]) > 1

    def arrived(self, refs: list, writer: "ChunkWriter") -> None:
        while len(refs) >= (self.next + 1) * self.per_band:
            b = self.next
            self.next += 1
            r0 = b * self.tile[0]
            r1 = min(r0 + self.tile[0], self.shape[0])
            hashes = [r.hash for r in refs[b * self.per_band : (b + 1) * self.per_band]]
            name = _bands.band_name(self.isz, r1 - r0, self.shape[1:], self.tile, hashes)
            writer.keep_band(name, self.mv[r0 * self.row_bytes : r1 * self.row_bytes])


class _BandedRefs(list):
    """The chunk references of a tiled tensor whose decoded copy the tier keeps by bands."""

    __slots__ = ("bands",)


def _in_buffer(piece, buf: bytearray) -> bool:
    """Whether ``piece`` (a buffer) points into ``buf``'s memory."""
    if not isinstance(piece, (memoryview, np.ndarray)):
        return False
    a = np.frombuffer(buf, dtype=np.uint8)
    return np.may_share_memory(np.asarray(piece), a)


class ChunkWriter:
    """Ordered chunk pipeline: hash+compress in parallel, append in order.

    ``add(tensor)`` returns the list that :meth:`finish` fills with the
    tensor's chunk references. Memory: at most ``max_inflight_bytes / 4`` of
    chunks are being hashed and encoded; the rest of the budget holds part
    buffers (:func:`~ckptstore.pipeline.pack_writer.part_window`). ``on_bytes(n)`` is called
    as each chunk of ``n`` raw bytes is done: at once for a chunk the dedup
    base or this save already holds, once the store has acknowledged all of
    its stored bytes for a new one (from the thread that saw that; not when
    it is handed to the uploads, which run up to ``max_inflight_bytes``
    ahead).
    """

    def __init__(self, cat: Catalog, base_refs: dict[str, ChunkRef], on_bytes: Callable[[int], None] | None = None,
                 store=None):
        self.cat = cat
        self.on_bytes = on_bytes
        o = self.o = cat.options
        self.cpu = cat.runtime.cpu
        self.base = base_refs
        self.written: dict[str, ChunkRef] = {}
        self.pending: collections.deque = collections.deque()
        self.pending_bytes = 0
        self.lookahead = max(2 * o.chunk_size, min(o.max_inflight_bytes // 4, 4 * o.workers * o.chunk_size))
        # A write-back save writes its packs into the tier (``store``), with no second copy.
        self.packs = PackWriter(cat.store if store is None else store, cat.runtime, o, part_window(o, self.lookahead),
                                mirror=cat.tier if store is None else None,
                                on_acked=None if on_bytes is None else (lambda raw, stored: on_bytes(raw)))
        self.raw_tier = (cat.tier if cat.tier is not None and cat.tier.decoded is not False and cat.tier.writable
                         else None)
        self.raw_writes: list[cf.Future] = []  # decoded copies being written (they read the caller's memory)
        self._raw_lock = threading.Lock()
        self.scratch = cat.runtime.buffers("scratch", o.chunk_size, self.lookahead // o.chunk_size + o.workers + 1)

        self.logical = self.reused = self.new_raw = self.new_stored = 0
        self.new_chunks = self.reused_chunks = self.unchanged_chunks = 0

    def stats(self, packs: dict[str, int]) -> dict:
        """Byte counts of this save, as manifests record them."""
        return {
            "logical_bytes": self.logical,
            "new_bytes": self.new_raw,
            "stored_bytes": self.new_stored,
            "reused_bytes": self.reused,
            "pack_bytes": sum(packs.values()),
        }

    def add(self, t: torch.Tensor, known: list | None = None, tile: tuple[int, ...] | None = None) -> list:
        """Queue a tensor's chunks; ``known[j]``, where given, is the reference of chunk ``j`` found
        unchanged (byte for byte) since the dedup base: taken without hashing if the base holds it.

        With ``tile`` (format 4.0), the chunks are the tensor's tiles of that shape, in C order of
        the grid (:mod:`ckptstore.format.tiles`), each copied out of the tensor as it is queued
        (a tile ``known`` unchanged is not copied); ``known[j]`` is then tile ``j``'s reference."""
        refs: list = []
        if tile is not None:
            host = host_tensor(t)
            shape = tuple(host.shape)
            lengths = _tiles.tile_lengths(shape, tile, host.element_size()).tolist()
            extents = (_tiles.tile_extent(shape, tile, pos) for pos in _tiles.positions(shape, tile))
            banded = self.raw_tier is not None and _BandCopies.wanted(host, tile)
            if banded:
                refs = _BandedRefs()
                refs.bands = _BandCopies(host, tile)
            pieces = self._tile_pieces(host, tile, extents, banded)
        else:
            mv = tensor_bytes(t)
            cs = self.o.chunk_size
            lengths = [min(cs, len(mv) - off) for off in range(0, len(mv), cs)]
            pieces = (lambda off=off: mv[off : off + cs] for off in range(0, len(mv), cs))
        dtype = str(t.dtype).removeprefix("torch.")
        judged: list = [None] * _codec.JUDGED_SLOTS  # the tensor's byte-plane judgements, shared by its chunks
        # Chunks under half a chunk (tiles) go to the CPU pool by groups of about a chunk: one task
        # and one future per group, not per tile (a hand-off between threads each).
        group: list = []
        group_bytes = 0

        def submit_group() -> None:
            nonlocal group, group_bytes
            if group:
                fut = self.cpu.submit(self._prepare_many, group, dtype, judged)
                for i, piece in enumerate(group):
                    self.pending.append((piece, _Member(fut, i), refs, dtype))
                    self.pending_bytes += len(piece)
                group, group_bytes = [], 0

        for j, (n, make) in enumerate(zip(lengths, pieces)):
            self.logical += n
            ref = known[j] if known is not None and j < len(known) else None
            if ref is not None and ref.raw_len == n and self.base.get(ref.hash) is not None:
                submit_group()  # the chunks before it first: pending is in chunk order
                fut = cf.Future()
                fut.set_result((ref.hash, None, None, None))
                self.unchanged_chunks += 1
                self.pending.append((_Length(n), fut, refs, dtype))
                self.pending_bytes += n
                continue
            while self.pending and self.pending_bytes + group_bytes + n > self.lookahead:
                self._drain_one()  # the open group waits: the chunks queued before it are drained
            if group and group_bytes + n > self.lookahead:
                submit_group()
            piece = make()
            if 2 * n <= self.o.chunk_size:
                group.append(piece)
                group_bytes += n
                if group_bytes >= self.o.chunk_size:
                    submit_group()
                continue
            submit_group()
            fut = self.cpu.submit(self._prepare, piece, dtype, judged)
            self.pending.append((piece, fut, refs, dtype))
            self.pending_bytes += len(piece)
        submit_group()
        return refs

    def _prepare_many(self, pieces: list, dtype, judged) -> list:
        """:meth:`_prepare` for each of a group of small chunks, in one task."""
        return [self._prepare(piece, dtype, judged) for piece in pieces]

    def _tile_pieces(self, host: torch.Tensor, tile, extents, banded: bool = False):
        """``make()`` per tile: a :class:`_Tile` whose bytes a CPU worker copies out of the tensor
        (with NumPy, into a reused buffer of the tile's size where it can: :meth:`_drain_one` gives
        it back once the pack writer has its bytes). ``banded``: the tier keeps band copies of the
        tensor (:class:`_BandCopies`), none of its tiles."""
        a = int_view(host)
        isz = host.element_size()
        pool = None
        if a is not None and (self.raw_tier is None or banded):  # a tile's decoded copy would hold the buffer
            size = math.prod(min(t, n) for t, n in zip(tile, host.shape)) * isz
            if size:
                # One pool per power of two: tensors of a few tile sizes take turns without
                # rebuilding a pool (fresh, faulted-in memory) at each change of size.
                size = 1 << (size - 1).bit_length()
                pool = self.cat.runtime.buffers(f"tile-copies-{size}", size,
                                                self.lookahead // size + self.o.workers + 1, zeroed=False)
        for offs, sizes in extents:
            yield lambda o=offs, z=sizes: _Tile(host, a, isz, o, z, pool, banded)

    def _prepare(self, piece, dtype, judged=None):
        """Hash and encode one chunk (on a CPU worker; a tile is copied out of its tensor first).

        Returns ``(hash, codec, pieces, scratch)``; ``scratch`` (or None)
        backs ``pieces`` and goes back to the pool once they are copied out.
        """
        banded = False
        if isinstance(piece, _Tile):
            banded = piece.banded
            piece = piece.fill()
        h = _codec.hash_bytes(piece)
        if h in self.base or h in self.written:
            return h, None, None, None
        if self.raw_tier is not None and not banded and self.raw_tier.keep_decoded(len(piece)):
            # cache_decoded: loads on this node read it in place. Written on the I/O pool, not by this
            # hashing thread (a page-cache write can stall on write-back); finish() waits for them.
            fut = self.cat.runtime.io.submit(self.raw_tier.put_raw, h, piece)
            with self._raw_lock:
                self.raw_writes.append(fut)
        scratch = self.scratch.get() if len(piece) == self.scratch.size else None
        codec, pieces = _codec.encode_pieces(piece, self.o.codec, self.o.level, dtype, scratch, judged)
        if scratch is not None and not any(_in_buffer(p, scratch) for p in pieces):
            self.scratch.put(scratch)
            scratch = None
        return h, codec, pieces, scratch

    def _drain_one(self) -> None:
        piece, fut, refs, dtype = self.pending.popleft()
        self.pending_bytes -= len(piece)
        try:
            self._append(piece, fut, refs, dtype)
        finally:
            if isinstance(piece, _Tile):  # its bytes are in the pack (or the chunk was a duplicate)
                piece.release()

    def _append(self, piece, fut, refs, dtype) -> None:
        h, codec, stored, scratch = fut.result()
        if isinstance(piece, _Tile):
            piece = piece.piece
        try:
            ref = self.written.get(h) or self.base.get(h)
            if ref is not None:
                self.reused += len(piece)
                self.reused_chunks += 1
                if self.on_bytes is not None:
                    self.on_bytes(len(piece))  # nothing to upload
            else:
                if stored is None:  # raced with a chunk that was then not written
                    codec, stored = _codec.encode_pieces(piece, self.o.codec, self.o.level, dtype)
                ref = self.packs.add(h, codec, stored, len(piece))
                self.written[h] = ref
                self.new_raw += len(piece)
                self.new_stored += ref.stored_len
                self.new_chunks += 1
        finally:
            if scratch is not None:
                self.scratch.put(scratch)
        refs.append(ref)
        if type(refs) is _BandedRefs:
            refs.bands.arrived(refs, self)

    def keep_band(self, name: str, rows) -> None:
        """Keep a band copy in the tier (written on the I/O pool, which hashes it; :meth:`finish`
        waits): touched if the tier holds it already, nothing where the budget has no room."""
        if _bands.has_band(self.raw_tier, name) or not self.raw_tier.keep_decoded(len(rows)):
            return
        fut = self.cat.runtime.io.submit(_bands.put_band, self.raw_tier, name, rows)
        with self._raw_lock:
            self.raw_writes.append(fut)

    def drain(self) -> None:
        """Append every pending chunk and start sealing the open pack (returns before it is sealed).

        Every chunk reference is known afterwards, so the caller can write
        the chunk table while the last pack is still being completed (its
        ``fsync`` on a local store); :meth:`finish` then waits for the packs.
        """
        while self.pending:
            self._drain_one()
        self.packs.seal()

    def finish(self) -> dict[str, int]:
        """Write out every chunk; pack id -> size of each pack written, all verified complete."""
        self.drain()
        try:
            return self.packs.finish()
        finally:
            self._wait_raw()

    def _wait_raw(self) -> None:
        """Wait for the decoded copies (``put_raw`` never raises): none may read the tensors after the save."""
        with self._raw_lock:
            writes, self.raw_writes = self.raw_writes, []
        cf.wait(writes)

    def abort(self) -> None:
        futures = [getattr(fut, "future", fut) for _, fut, _, _ in self.pending]
        for fut in futures:
            fut.cancel()
        cf.wait(futures)  # a running _prepare may still queue a decoded copy
        self.pending.clear()
        self._wait_raw()
        self.packs.abort()

    def started(self) -> list[str]:
        """Ids of every pack this writer started (after :meth:`abort`: what a failed save deletes)."""
        return list(self.packs.created)
