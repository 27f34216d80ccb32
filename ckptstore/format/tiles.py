"""N-dimensional chunk tiles (format 4.0): a regular grid over each shard of a tiled tensor.

A tensor whose manifest entry has a ``tile`` shape stores each shard as the
tiles of a regular grid anchored at the shard's origin: tile ``(i_0, ..., i_n)``
is the box ``[i_d * t_d, min((i_d + 1) * t_d, size_d))`` of the shard, its bytes
are that box's C-order bytes, and the shard's chunks are its tiles in C order
of the grid (one chunk per tile). A slice along any dimension then reads the
tiles it meets, about its share, where row-major runs read every chunk for a
slice along a dimension other than the first.

:func:`choose_tile` picks the grid from a tensor's shape so that a slice of
1/8 of any dimension, wherever it starts, reads at most 1.25 times its share
of the tensor plus two chunks (:func:`worst_fraction` is the bound checked).
Tensors of fewer than two dimensions or under :func:`min_tiled_bytes` keep row-major runs
(``None``).

Pure: shapes in, shapes and indices out.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

#: A tensor under this many chunks (or under :data:`TILED_FROM` bytes) keeps row-major runs.
MIN_TILED_CHUNKS = 2
#: Tensors from this size are tiled whatever the chunk size (a Llama's 8 MiB q_proj in 4 MiB chunks).
TILED_FROM = 8 << 20
#: Tiles are not made smaller than this to align them to a tensor's eighths (nor than 1/32 of a
#: chunk): smaller ones compress worse and cost more per byte to fetch and decode.
MIN_TILE_BYTES = 128 << 10
#: The slice fraction the grid is sized for, and the slack the bound allows.
SLICE_PARTS = 8
SHARE_SLACK = 1.25
SLACK_CHUNKS = 2


def worst_fraction(n: int, t: int, parts: int = SLICE_PARTS) -> float:
    """The largest fraction of a dimension of ``n`` cut in tiles of ``t`` that a slice of
    ``max(1, n // parts)`` indices reads (its tiles), over every start."""
    if n <= 0:
        return 0.0
    length = max(1, n // parts)
    touched = min(-(-n // t), (length - 1 + t - 1) // t + 1)
    return min(n, touched * t) / n


def min_tiled_bytes(chunk_size: int) -> int:
    """The smallest tensor that is tiled: two chunks, or :data:`TILED_FROM` where chunks are larger."""
    return min(MIN_TILED_CHUNKS * chunk_size, TILED_FROM)


def choose_tile(shape: Sequence[int], itemsize: int, chunk_size: int) -> tuple[int, ...] | None:
    """The tile shape for a tensor of ``shape`` (None: row-major runs, as before format 4.0).

    Each dimension gets the largest tile ``ceil(n / 2**k)`` (so that slices at
    ``n / 2**j`` boundaries meet whole tiles) for which a 1/8 slice of it, wherever it starts,
    reads at most :data:`SHARE_SLACK` times its share plus :data:`SLACK_CHUNKS` chunks (along the first
    dimension one tile's rows of the whole tensor also hold at most two chunks, so a slice of a
    few rows reads at most about twice what runs read), and at most
    ``ceil(n / 8)`` (a slice at the 1/8 boundaries a tensor-parallel plan cuts reads exactly its
    share) while the tile stays at least :data:`MIN_TILE_BYTES`; then, while a tile holds more
    than ``chunk_size`` bytes, its largest dimension (the first of equals, so rows stay long) is
    halved. Tensors of fewer than two dimensions or under :func:`min_tiled_bytes` keep runs.
    """
    shape = tuple(int(n) for n in shape)
    nbytes = math.prod(shape) * itemsize
    if len(shape) < 2 or chunk_size <= 0 or nbytes < min_tiled_bytes(chunk_size):
        return None
    allowed_extra = SLACK_CHUNKS * chunk_size / nbytes
    row = nbytes // shape[0] if shape[0] else nbytes  # bytes of one index of the first dimension
    tile = []
    for d, n in enumerate(shape):
        length = max(1, n // SLICE_PARTS)
        limit = SHARE_SLACK * length / n + allowed_extra
        k, t = 0, n
        # the first dimension: a slab of one tile's rows holds at most two chunks, so a few rows
        # read at most twice what they read as row-major runs
        while t > 1 and (worst_fraction(n, t) > limit or (d == 0 and t * row > SLACK_CHUNKS * chunk_size)):
            k += 1
            t = -(-n // (1 << k))
        tile.append(max(1, t))
    floor = min(MIN_TILE_BYTES, chunk_size // 32)
    for d, n in enumerate(shape):  # aligned to the eighths, where tiles stay large enough
        cap = -(-n // SLICE_PARTS)
        if cap < tile[d] and math.prod(tile[:d] + [cap] + tile[d + 1 :]) * itemsize >= floor:
            tile[d] = cap
    return _within_chunk(tile, itemsize, chunk_size)


def _within_chunk(tile: list, itemsize: int, chunk_size: int) -> tuple[int, ...]:
    """``tile`` with its largest dimension halved (the first of equals) while it holds more than a chunk."""
    while math.prod(tile) * itemsize > chunk_size:
        d = max(range(len(tile)), key=lambda i: (tile[i], -i))
        if tile[d] == 1:
            break
        tile[d] = -(-tile[d] // 2)
    return tuple(tile)


def split_tile(shape: Sequence[int], itemsize: int, chunk_size: int, dim: int) -> tuple[int, ...] | None:
    """The tile shape of a tensor a tensor-parallel plan splits along ``dim``: :data:`SLICE_PARTS`
    blocks along it (``ceil(n / 8)``: a TP rank of up to 8 reads its block's tiles, none of its
    neighbours'), whole along the others, then halved as :func:`choose_tile` does while a tile holds
    more than a chunk. None (runs) for tensors of fewer than two dimensions or under
    :data:`MIN_TILE_BYTES`, and where the grid would be one tile."""
    shape = tuple(int(n) for n in shape)
    if len(shape) < 2 or not 0 <= dim < len(shape) or math.prod(shape) * itemsize < MIN_TILE_BYTES:
        return None
    tile = list(shape)
    tile[dim] = max(1, -(-shape[dim] // SLICE_PARTS))
    out = _within_chunk(tile, itemsize, chunk_size)
    return None if out == shape else out


def grid(sizes: Sequence[int], tile: Sequence[int]) -> tuple[int, ...]:
    """Tiles along each dimension of a shard of ``sizes``."""
    return tuple(-(-int(n) // int(t)) for n, t in zip(sizes, tile))


def count(sizes: Sequence[int], tile: Sequence[int]) -> int:
    """How many tiles (chunks) a shard of ``sizes`` has (0 for an empty shard)."""
    return math.prod(grid(sizes, tile))


def tile_extent(sizes: Sequence[int], tile: Sequence[int],
                pos: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` in the shard of the tile at grid position ``pos``."""
    offs = tuple(int(p) * int(t) for p, t in zip(pos, tile))
    return offs, tuple(min(int(t), int(n) - o) for t, n, o in zip(tile, sizes, offs))


def tile_lengths(sizes: Sequence[int], tile: Sequence[int], itemsize: int) -> np.ndarray:
    """The raw byte length of every tile of a shard, in C order of the grid (int64)."""
    out = np.full((), itemsize, dtype=np.int64)
    for n, t in zip(sizes, tile):
        g = -(-int(n) // int(t))
        per = np.minimum(int(t), int(n) - np.arange(g, dtype=np.int64) * int(t))
        out = np.multiply.outer(out, per)
    return out.reshape(-1)


def positions(sizes: Sequence[int], tile: Sequence[int]):
    """Every tile's grid position, in C order (the order of the shard's chunks)."""
    g = grid(sizes, tile)
    return np.ndindex(*g) if all(g) else iter(())


def meeting(sizes: Sequence[int], tile: Sequence[int], box) -> list[tuple[int, tuple[int, ...]]]:
    """``(chunk index, grid position)`` of every tile of a shard holding an element of ``box``
    (per dimension ``(start, stop, step)`` in shard coordinates), in chunk order."""
    g = grid(sizes, tile)
    per_dim = []
    for (start, stop, step), t in zip(box, tile):
        if stop <= start:
            return []
        if step == 1:
            per_dim.append(range(start // t, (stop - 1) // t + 1))
        else:
            per_dim.append(np.unique(np.arange(start, stop, step, dtype=np.int64) // t).tolist())
    strides = [math.prod(g[d + 1 :]) for d in range(len(g))]
    out = []
    for pos in np.ndindex(*(len(r) for r in per_dim)) if per_dim else [()]:
        p = tuple(int(per_dim[d][i]) for d, i in enumerate(pos))
        out.append((sum(a * s for a, s in zip(p, strides)), p))
    return out


__all__ = ["MIN_TILE_BYTES", "MIN_TILED_CHUNKS", "TILED_FROM", "choose_tile", "split_tile", "min_tiled_bytes", "count", "grid", "meeting", "positions", "tile_extent",
           "tile_lengths", "worst_fraction"]
