"""Pure planning of reads: index -> boxes -> byte runs -> chunks -> requests.

Nothing here does I/O; every function is unit-tested without a store.

Vocabulary
----------
box
    per dimension a ``(start, stop, step)`` triple with ``step >= 1`` and
    ``start <= stop``; it selects ``range(start, stop, step)`` of that dim.
run
    a ``[start, end)`` byte range of a C-contiguous array.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

Box = tuple[tuple[int, int, int], ...]

#: Above this many runs, the innermost box dimensions are widened to full
#: rows (reading a little more, planning far less).
MAX_RUNS = 1 << 20


def normalize_index(index: Any, shape: Sequence[int]) -> tuple[Box, tuple[int, ...]]:
    """Turn a NumPy-style basic index into a box and the dims to squeeze.

    Supports ints, slices with positive steps, and one Ellipsis. Raises
    ``IndexError``/``TypeError`` like tensor indexing does.
    """
    if index is None:
        index = ()
    if not isinstance(index, tuple):
        index = (index,)
    if sum(1 for i in index if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis")
    if Ellipsis in index:
        pos = index.index(Ellipsis)
        fill = len(shape) - (len(index) - 1)
        if fill < 0:
            raise IndexError(f"too many indices for tensor of dimension {len(shape)}")
        index = index[:pos] + (slice(None),) * fill + index[pos + 1 :]
    if len(index) > len(shape):
        raise IndexError(f"too many indices for tensor of dimension {len(shape)}")
    index = index + (slice(None),) * (len(shape) - len(index))
    box, squeeze = [], []
    for d, (ix, n) in enumerate(zip(index, shape)):
        if isinstance(ix, slice):
            start, stop, step = ix.indices(n)
            if step < 1:
                raise IndexError("slices with negative or zero steps are not supported")
            stop = max(start, stop)
            box.append((start, stop, step))
        elif isinstance(ix, (int, np.integer)) and not isinstance(ix, bool):
            i = int(ix)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for dimension {d} with size {n}")
            i %= n
            box.append((i, i + 1, 1))
            squeeze.append(d)
        else:
            raise TypeError(f"unsupported index element {ix!r}; use ints, slices and ...")
    return tuple(box), tuple(squeeze)


def box_len(b: tuple[int, int, int]) -> int:
    start, stop, step = b
    return max(0, -(-(stop - start) // step))


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(box_len(b) for b in box)


def intersect(box: Box, offsets: Sequence[int], sizes: Sequence[int]):
    """Intersect a global box with a shard's extent.

    Returns ``(local_box, out_box)`` or ``None`` when they do not meet:
    ``local_box`` indexes the shard, ``out_box`` (steps of 1) the result
    of the whole request where the shard's part lands.
    """
    local, out = [], []
    for (start, stop, step), o, n in zip(box, offsets, sizes):
        lo, hi = max(start, o), min(stop, o + n)
        if lo >= hi:
            return None
        first = start + -(-(lo - start) // step) * step  # first selected >= lo
        if first >= hi:
            return None
        count = -(-(hi - first) // step)
        local.append((first - o, first - o + (count - 1) * step + 1, step))
        k0 = (first - start) // step
        out.append((k0, k0 + count, 1))
    return tuple(local), tuple(out)


def byte_runs(shape: Sequence[int], itemsize: int, box: Box) -> np.ndarray:
    """Byte runs (``[:, 0]`` starts, ``[:, 1]`` ends) covering a box.

    Runs are in ascending order and may be merged when adjacent. When the
    exact list would exceed ``MAX_RUNS``, inner dimensions are widened so the
    runs cover a superset of the box.
    """
    nd = len(shape)
    if nd == 0:
        return np.array([[0, itemsize]], dtype=np.int64)
    if any(box_len(b) == 0 for b in box):
        return np.zeros((0, 2), dtype=np.int64)
    strides = [itemsize * math.prod(shape[d + 1 :]) for d in range(nd)]
    box = list(box)
    # Find the innermost dim k such that dims after k are fully selected.
    k = nd - 1
    while k > 0 and box[k] == (0, shape[k], 1):
        k -= 1
    # Widen while the number of runs is too large.
    def nruns(k):
        n = math.prod(box_len(box[d]) for d in range(k))
        if box[k][2] != 1:
            n *= box_len(box[k])
        return n

    while k > 0 and nruns(k) > MAX_RUNS:
        k -= 1
        box[k + 1 :] = [(0, shape[d], 1) for d in range(k + 1, nd)]
        box[k] = (box[k][0], box[k][0] + (box_len(box[k]) - 1) * box[k][2] + 1, 1)
    if nruns(k) > MAX_RUNS:  # k == 0 with a step: read the span
        box[0] = (box[0][0], box[0][0] + (box_len(box[0]) - 1) * box[0][2] + 1, 1)
    start, stop, step = box[k]
    if step == 1:
        inner = [(start * strides[k], stop * strides[k])]
    else:
        inner = [(i * strides[k], (i + 1) * strides[k]) for i in range(start, stop, step)]
    base = np.zeros(1, dtype=np.int64)
    for d in range(k):
        idx = np.arange(box[d][0], box[d][1], box[d][2], dtype=np.int64) * strides[d]
        base = (base[:, None] + idx[None, :]).reshape(-1)
    inner_arr = np.array(inner, dtype=np.int64)
    runs = (base[:, None, None] + inner_arr[None, :, :]).reshape(-1, 2)
    return runs


def chunks_for_runs(chunk_starts: Sequence[int], total: int, runs: np.ndarray) -> list[int]:
    """Indices of the chunks (given their start offsets) that any run touches."""
    if len(runs) == 0 or total == 0:
        return []
    starts = np.asarray(chunk_starts, dtype=np.int64)
    first = np.searchsorted(starts, runs[:, 0], side="right") - 1
    last = np.searchsorted(starts, runs[:, 1] - 1, side="right") - 1
    needed = set()
    for a, b in zip(first.tolist(), last.tolist()):
        needed.update(range(a, b + 1))
    return sorted(needed)


@dataclass(frozen=True)
class RangeRequest:
    """One GET of ``[start, end)`` of one pack, serving several chunks."""

    pack: str
    start: int
    end: int
    items: tuple[int, ...]  # caller's item indices served by this request


def coalesce(
    items: Sequence[tuple[str, int, int]], max_gap: int = 1 << 20, max_request: int = 32 << 20
) -> list[RangeRequest]:
    """Group ``(pack, start, end)`` items into few range requests.

    Items of one pack whose gap is at most ``max_gap`` bytes merge into one
    request, as long as it stays at most ``max_request`` bytes (a single item
    larger than that is a request of its own). Item order is preserved in
    each request's ``items``.
    """
    by_pack: dict[str, list[tuple[int, int, int]]] = {}
    for i, (pack, s, e) in enumerate(items):
        by_pack.setdefault(pack, []).append((s, e, i))
    out = []
    for pack in sorted(by_pack):
        group = sorted(by_pack[pack])
        cur_s, cur_e, cur_items = group[0][0], group[0][1], [group[0][2]]
        for s, e, i in group[1:]:
            if s - cur_e <= max_gap and max(e, cur_e) - cur_s <= max_request:
                cur_e = max(cur_e, e)
                cur_items.append(i)
            else:
                out.append(RangeRequest(pack, cur_s, cur_e, tuple(cur_items)))
                cur_s, cur_e, cur_items = s, e, [i]
        out.append(RangeRequest(pack, cur_s, cur_e, tuple(cur_items)))
    return out
