"""Reading a box of a tiled shard (format 4.0): only the tiles the box meets.

A tiled shard's chunks are the tiles of a regular grid (:mod:`ckptstore.format.tiles`). A read
of a box fetches the tiles holding an element of it, and puts each tile's part of the box in
place: a tile that lies whole in the box and whose place in the destination is one contiguous
run of its memory (a range of rows, or a box with full trailing dimensions) is decoded straight
into it. The tiles of a *band* (those sharing their first grid index) that all lie whole in a
box spanning the trailing dimensions decode side by side into one buffer of the band, and land
with one copy that writes the band's rows in order once the last of them is in: tile by tile,
that copy writes a few hundred bytes of each row and jumps to the next, at under half the speed
(docs/performance.md, "Tiles"). Any other tile is decoded into a buffer of its own and lands
with one strided copy. A
destination that is not a CPU tensor of the stored dtype (CUDA, another dtype) is filled through
a host buffer of the box and one ``copy_`` at the end, as for row-major shards.
"""

from __future__ import annotations

import math
import threading

import torch

from ..format import manifest as _m
from ..format import tiles as _tiles
from ..format.manifest import Shard, TensorEntry
from ..pipeline.tensors import byte_view, frombuffer_as, int_view
from ..tier import bands as _bands


def _part(box, toff, tsz):
    """The part of ``box`` (shard coordinates, ``(start, stop, step)`` per dim) inside the tile at
    ``toff`` of ``tsz``: ``(tile slices, out slices)``, or None when the tile holds none of it."""
    tile_sl, out_sl = [], []
    for (start, stop, step), o, n in zip(box, toff, tsz):
        lo, hi = max(start, o), min(stop, o + n)
        first = start + -(-(lo - start) // step) * step
        if lo >= hi or first >= hi:
            return None
        cnt = -(-(hi - first) // step)
        tile_sl.append(slice(first - o, first - o + (cnt - 1) * step + 1, step))
        k0 = (first - start) // step
        out_sl.append(slice(k0, k0 + cnt))
    return tuple(tile_sl), tuple(out_sl)


class TileRead:
    """One box of one tiled shard as :meth:`~ckptstore.repo.reader.Checkpoint.read_shards` reads it:
    ``refs`` (the tiles it meets), ``into(k)`` (where tile ``k`` decodes), ``done(k)`` (its copy
    into place, once verified) and ``finish()``."""

    def __init__(self, e: TensorEntry, shard: Shard, local, target: torch.Tensor, pool=None, band_pool=None):
        self.e, self.shard, self.local, self.target = e, shard, local, target
        stored = _m.DTYPES[e.dtype]
        self.stored_dtype = stored
        tiles = []  # the grid position of each tile read
        self.parts = []
        self.refs = []
        for idx, pos in _tiles.meeting(shard.sizes, e.tile, local):
            toff, tsz = _tiles.tile_extent(shard.sizes, e.tile, pos)
            part = _part(local, toff, tsz)
            if part is None:
                continue
            tiles.append(pos)
            self.parts.append((tsz, part[0], part[1]))
            self.refs.append(shard.chunks[idx])
        in_place = (target.device.type == "cpu" and target.dtype == stored and not target.is_conj()
                    and not target.is_neg())
        self.staged = not in_place
        self.dest = target.detach() if in_place else torch.empty(tuple(target.shape), dtype=stored)
        self.pool = pool  # reusable tile-sized buffers (a BufferPool), or None
        self.dest_np = int_view(self.dest)  # the copies into place go through NumPy (None: torch)
        self.scratch: dict[int, tuple] = {}
        self._lock = threading.Lock()
        self.bands: dict[int, _Band] = {}  # tile k -> its band, for the tiles that land by bands
        self.slot: dict[int, int] = {}  # tile k -> its byte offset in its band's buffer
        self.band_pool = band_pool
        self.positions = tiles
        if self.dest_np is not None and self.dest.is_contiguous():
            self._plan_bands()

    def _whole_bands(self, per_band: int) -> list[list[int]]:
        """The tiles (indices k) of each band of the grid whose ``per_band`` tiles this read meets
        all, with every row of the band in the box."""
        by_row: dict[int, list[int]] = {}
        for k, pos in enumerate(self.positions):
            by_row.setdefault(pos[0], []).append(k)
        return [ks for ks in by_row.values()
                if len(ks) == per_band and self.parts[ks[0]][1][0] == slice(0, self.parts[ks[0]][0][0], 1)]

    def tier_bands(self) -> list:
        """``(name, destination bytes, tiles k)`` of each band of this read a band copy in the tier
        (:mod:`ckptstore.tier.bands`) could fill: the box spans every trailing dimension and the
        band's rows, and the destination is contiguous."""
        e, sizes, box = self.e, self.shard.sizes, self.local
        nd = len(sizes)
        if (nd < 2 or box[0][2] != 1 or not self.dest.is_contiguous()
                or any(box[d] != (0, sizes[d], 1) for d in range(1, nd))):
            return []
        per_band = math.prod(_tiles.grid(sizes, e.tile)[1:])
        if per_band < 2:
            return []
        isz = self.stored_dtype.itemsize
        out = []
        for ks in self._whole_bands(per_band):
            tsz, tile_sl, out_sl = self.parts[ks[0]]
            name = _bands.band_name(isz, tsz[0], sizes[1:], e.tile, [self.refs[k].hash for k in ks])
            out.append((name, byte_view(self.dest[out_sl[0]]), ks))
        return out

    def _plan_bands(self) -> None:
        """Group the tiles that land by bands: those of a grid index along the first dimension whose
        box spans every trailing dimension of the shard (a whole number of tiles each), all whole
        in the box and not already contiguous in the destination (one tile across)."""
        e, sizes, box = self.e, self.shard.sizes, self.local
        nd = len(sizes)
        if nd < 2 or any(box[d] != (0, sizes[d], 1) or sizes[d] % e.tile[d] for d in range(1, nd)):
            return
        across = _tiles.grid(sizes, e.tile)[1:]
        per_band = math.prod(across)
        if per_band < 2:
            return
        isz = self.stored_dtype.itemsize
        for ks in self._whole_bands(per_band):  # a band whose rows the box cuts lands tile by tile
            tsz, tile_sl, out_sl = self.parts[ks[0]]
            rows = tsz[0]
            view = self.dest_np[out_sl[0]]
            shape = (rows,) + tuple(x for g, t in zip(across, e.tile[1:]) for x in (g, t))
            tile_bytes = rows * math.prod(e.tile[1:]) * isz
            band = _Band(view.reshape(shape), tuple(across) + (rows,) + tuple(e.tile[1:]),
                         len(ks) * tile_bytes, len(ks))
            for slot, k in enumerate(ks):
                self.bands[k] = band
                self.slot[k] = slot * tile_bytes

    def into(self, k: int):
        """Tile ``k``'s place in the destination when it is one contiguous run there, its slot in its
        band's buffer, else a buffer of its own."""
        band = self.bands.get(k)
        if band is not None:
            with self._lock:
                if band.buf is None:
                    pooled = self.band_pool is not None and band.nbytes <= self.band_pool.size
                    band.buf = (self.band_pool.get() if pooled else bytearray(band.nbytes)), pooled
            off = self.slot[k]
            return memoryview(band.buf[0])[off : off + self.refs[k].raw_len]
        tsz, tile_sl, out_sl = self.parts[k]
        whole = all(s.start == 0 and s.step == 1 and s.stop == n for s, n in zip(tile_sl, tsz))
        if whole:
            sub = self.dest[out_sl]
            if sub.is_contiguous():
                return byte_view(sub)
        # A reused buffer (no fresh memory per tile), given back once the tile is in place.
        n = self.refs[k].raw_len
        pooled = self.pool is not None and n <= self.pool.size
        raw = self.pool.get() if pooled else bytearray(n)
        with self._lock:
            old = self.scratch.pop(k, None)  # a first try (the node-local tier) that missed
            self.scratch[k] = (raw, pooled)
        if old is not None and old[1]:
            self.pool.put(old[0])
        return memoryview(raw)[:n]

    def done(self, k: int) -> None:
        band = self.bands.get(k)
        if band is not None:
            with self._lock:
                band.left -= 1
                last = band.left == 0
            if last:
                band.land(self.stored_dtype.itemsize, self.band_pool)
            return
        with self._lock:
            got = self.scratch.pop(k, None)
        if got is None:
            return
        raw, pooled = got
        try:
            tsz, tile_sl, out_sl = self.parts[k]
            n = self.refs[k].raw_len
            src = frombuffer_as(raw, self.stored_dtype.itemsize, tsz) if self.dest_np is not None else None
            if src is not None:  # NumPy: a memcpy per row, on this (decoding) thread
                self.dest_np[out_sl] = src[tile_sl]
            else:
                tile = torch.frombuffer(raw, dtype=torch.uint8, count=n).view(self.stored_dtype).view(tsz)
                self.dest[out_sl].copy_(tile[tile_sl])
        finally:
            if pooled:
                self.pool.put(raw)

    def release(self) -> None:
        """Give back the buffers of tiles that never completed (a failed read)."""
        with self._lock:
            left, self.scratch = list(self.scratch.values()), {}
            bands = []
            for band in set(self.bands.values()):
                if band.buf is not None:
                    bands.append(band.buf)
                    band.buf = None
        for raw, pooled in left:
            if pooled:
                self.pool.put(raw)
        for raw, pooled in bands:
            if pooled:
                self.band_pool.put(raw)

    def deliver(self, k: int, raw) -> None:  # pragma: no cover - every tile has a destination
        raise AssertionError("a tile read decodes every tile into a destination")

    def finish(self) -> None:
        if self.staged:
            with torch.no_grad():
                self.target.copy_(self.dest)


class _Band:
    """The tiles of one band of a read: a buffer holding them side by side in chunk order (grid
    order along the trailing dimensions), and the destination rows they land in at once."""

    __slots__ = ("dest", "shape", "nbytes", "left", "buf")

    def __init__(self, dest, shape, nbytes: int, count: int):
        self.dest = dest  # the band's rows, viewed as (rows, g_1, t_1, g_2, t_2, ...)
        self.shape = shape  # the buffer, viewed as (g_1, g_2, ..., rows, t_1, t_2, ...)
        self.nbytes, self.left, self.buf = nbytes, count, None

    def land(self, itemsize: int, pool) -> None:
        """Copy the band's tiles into its rows (every tile in and verified), writing them in order."""
        raw, pooled = self.buf
        self.buf = None
        try:
            n = len(self.shape) // 2  # grid axes before the tile's first axis
            src = frombuffer_as(memoryview(raw)[: self.nbytes], itemsize, self.shape)
            order = (n,) + tuple(a for d in range(n) for a in (d, n + 1 + d))
            self.dest[...] = src.transpose(order)
        finally:
            if pooled:
                pool.put(raw)


def box_refs(e: TensorEntry, shard: Shard, local) -> list:
    """The chunks (tiles) a read of box ``local`` of a tiled shard fetches."""
    return [shard.chunks[i] for i, pos in _tiles.meeting(shard.sizes, e.tile, local)
            if _part(local, *_tiles.tile_extent(shard.sizes, e.tile, pos)) is not None]


__all__ = ["TileRead", "box_refs"]
