"""Staging: reading stored tensors into destinations that cannot take decoded chunks.

The reading path of :func:`ckptstore.load_module`, of
``Repository.load(into=...)`` for destinations on CUDA, of another dtype or
not contiguous, and of ``ckptstore.integrations.hf.lazy_state_dict``:

- :class:`TensorReader` reads a stored tensor, or a slice of it, into a
  destination tensor (or a new one on a device). A contiguous CPU
  destination of the stored dtype receives the decoded chunks directly;
  any other (an accelerator, another dtype, a non-contiguous tensor) gets
  them block by block through :class:`StagingBuffers`.
- :class:`StagingBuffers` is a fixed set of reusable host buffers (pinned
  when a CUDA destination is served). Each block is decoded into a free
  buffer, copied to its destination (``non_blocking`` to CUDA, an event
  recorded after the copy), and the buffer is reused only after that
  event completed.
- :func:`plan_blocks` (pure) cuts a box into blocks that fit one buffer,
  each a contiguous byte run of the stored tensor, so chunks decode
  straight into the buffer.

Below :mod:`ckptstore.repo.reader` in the import order: a checkpoint is used
through its methods (``entry``, ``read_box``, ``largest_chunks``, ``meeting``,
``repo``), not imported.
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from ..format import manifest as _m
from . import planner as _plan
from .tensors import castable, writable_in_place

MiB = 1 << 20

#: Default total size of the staging buffers (at most a quarter of the
#: read budget, and never more than leaves room for the largest request).
STAGING_BYTES = 64 * MiB
#: Staging buffers are cut in multiples of this.
STAGING_ALIGN = 4096



# ---------------------------------------------------------------- blocks (pure)
@dataclass(frozen=True)
class Block:
    """One piece of a read: ``box`` in stored coordinates, ``out`` (slices) in the result's."""

    box: _plan.Box
    out: tuple[slice, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return _plan.box_shape(self.box)


def plan_blocks(shape: Sequence[int], itemsize: int, box: _plan.Box, limit: int) -> Iterator[Block]:
    """Cut ``box`` of a tensor of ``shape`` into blocks of at most ``limit`` bytes.

    Blocks run along the first dimension ``d`` whose rows (``shape[d+1:]``,
    full) fit ``limit``: a block fixes one selected index of each dimension
    before ``d``, takes several selected indices of ``d`` and the box of the
    dimensions after it. Where the box is whole along the dimensions after
    ``d`` with steps of 1 (a whole tensor, as :func:`load_module` reads),
    every block is one contiguous byte run of the stored tensor. The span of
    stored rows a block touches is at most ``limit`` bytes too (a reader
    buffering whole rows for a strided box stays within it), except when one
    element exceeds ``limit``.
    """
    nd = len(shape)
    if nd == 0 or any(_plan.box_len(b) == 0 for b in box):
        yield Block(tuple(box), tuple(slice(None) for _ in box))
        return
    row = [itemsize * math.prod(shape[k + 1 :]) for k in range(nd)]
    d = next((k for k in range(nd) if row[k] <= limit), nd - 1)
    start, _, step = box[d]
    n = _plan.box_len(box[d])
    # k selected indices with step s span (k - 1) * s + 1 rows of row[d] bytes
    k = max(1, (limit // row[d] - 1) // step + 1)
    outer = [range(_plan.box_len(b)) for b in box[:d]]

    def rec(dim: int, fixed: list[int]) -> Iterator[list[int]]:
        if dim == d:
            yield fixed
            return
        for j in outer[dim]:
            yield from rec(dim + 1, fixed + [j])

    for js in rec(0, []):
        lead = tuple((box[i][0] + j * box[i][2], box[i][0] + j * box[i][2] + 1, 1) for i, j in enumerate(js))
        lead_out = tuple(slice(j, j + 1) for j in js)
        for j0 in range(0, n, k):
            j1 = min(n, j0 + k)
            sub = (start + j0 * step, start + (j1 - 1) * step + 1, step)
            yield Block(lead + (sub,) + tuple(box[d + 1 :]), lead_out + (slice(j0, j1),) + (slice(None),) * (nd - d - 1))


def _tile_groups(b: tuple[int, int, int], t: int) -> list[tuple[int, int]]:
    """The selected indices of one box dimension (``(start, stop, step)``) grouped by the tile of
    size ``t`` holding them: ``(first, end)`` positions among the selected indices."""
    n = _plan.box_len(b)
    start, _, step = b
    if step == 1:
        cuts = list(range(((start // t) + 1) * t - start, n, t)) if n else []
    else:
        ids = (start + np.arange(n, dtype=np.int64) * step) // t
        cuts = (np.nonzero(np.diff(ids))[0] + 1).tolist()
    bounds = [0] + cuts + [n]
    return [(a, z) for a, z in zip(bounds, bounds[1:]) if z > a]


def plan_tile_blocks(tile: Sequence[int], itemsize: int, box: _plan.Box, limit: int) -> Iterator[Block]:
    """Cut ``box`` of a tiled tensor into blocks of at most ``limit`` bytes that end on tile
    boundaries (of a grid anchored at the origin), so that no tile is fetched for two blocks.

    Along the first dimension, whole slabs of tiles go together while they fit; a slab that does
    not fit is cut the same way along the next dimension (one tile thick in this one). A block of
    a single tile larger than ``limit`` is cut into rows by :func:`plan_blocks`' rule.
    """
    nd = len(box)
    if nd == 0 or any(_plan.box_len(b) == 0 for b in box):
        yield Block(tuple(box), tuple(slice(None) for _ in box))
        return

    def sub(b, a, z):
        start, _, step = b
        return (start + a * step, start + (z - 1) * step + 1, step)

    def pieces(lead: tuple, lead_out: tuple) -> Iterator[Block]:
        # One tile larger than a block: element rows of it, the last dimension in pieces.
        per = max(1, limit // itemsize)
        for js in itertools.product(*(range(_plan.box_len(b)) for b in lead[:-1])):
            fixed = tuple(sub(b, j, j + 1) for b, j in zip(lead[:-1], js))
            fixed_out = tuple(slice(o.start + j, o.start + j + 1) for o, j in zip(lead_out[:-1], js))
            n = _plan.box_len(lead[-1])
            for c in range(0, n, per):
                e = min(n, c + per)
                yield Block(fixed + (sub(lead[-1], c, e),),
                            fixed_out + (slice(lead_out[-1].start + c, lead_out[-1].start + e),))

    def rec(d: int, lead: tuple, lead_out: tuple) -> Iterator[Block]:
        thick = math.prod(_plan.box_len(b) for b in lead)  # the dims before d, a tile thick each
        rest = itemsize * thick * math.prod(_plan.box_len(b) for b in box[d + 1 :])
        groups = _tile_groups(box[d], int(tile[d]))
        i = 0
        while i < len(groups):
            a, z = groups[i]
            if (z - a) * rest > limit:
                here = lead + (sub(box[d], a, z),)
                out = lead_out + (slice(a, z),)
                yield from rec(d + 1, here, out) if d + 1 < nd else pieces(here, out)
                i += 1
                continue
            j = i + 1
            while j < len(groups) and (groups[j][1] - a) * rest <= limit:
                j += 1
            z = groups[j - 1][1]
            yield Block(lead + (sub(box[d], a, z),) + tuple(box[d + 1 :]),
                        lead_out + (slice(a, z),) + (slice(None),) * (nd - d - 1))
            i = j

    yield from rec(0, (), ())


# ---------------------------------------------------------------- staging
class _Slot:
    __slots__ = ("buf", "event")

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.event = None  # the last copy out of this buffer, not yet known complete

    def view(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        n = math.prod(shape) * dtype.itemsize
        return self.buf[:n].view(dtype).view(tuple(shape))


class StagingBuffers:
    """``slots`` reusable host buffers of ``slot_bytes`` each (allocated on first use).

    Parameters
    ----------
    slot_bytes, slots:
        Size and number of buffers: at most ``slot_bytes * slots`` bytes
        exist at once.
    pin:
        Allocate pinned (page-locked) memory, so copies to CUDA run
        asynchronously.
    budget, room:
        A :class:`~ckptstore.pipeline.runtime.ByteBudget` to reserve the buffers'
        bytes in for as long as they live (:meth:`close` gives them back),
        so the staging memory comes out of the read budget instead of on top
        of it; ``room`` is the largest request the reads will make, which
        the reservation leaves free (see :meth:`ByteBudget.reserve`; a
        budget too small for both holds only what fits).

    Attributes
    ----------
    allocated_bytes: bytes of buffers allocated so far.
    max_in_use: the most buffers held at once.
    charged: bytes reserved in ``budget``.
    """

    def __init__(self, slot_bytes: int, slots: int, *, pin: bool = False, budget=None, room: int = 0):
        if slot_bytes < 1 or slots < 1:
            raise ValueError("staging needs at least one buffer of at least one byte")
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.pin = pin
        self.allocated_bytes = 0
        self.max_in_use = 0
        self._free: list[_Slot] = []
        self._all: list[_Slot] = []
        self._in_use = 0
        self._cv = threading.Condition()
        self._budget = budget
        self._room = room
        self.charged = budget.reserve(slot_bytes * slots, room) if budget is not None else 0

    @property
    def capacity(self) -> int:
        return self.slot_bytes * self.slots

    def acquire(self) -> _Slot:
        """A free buffer; waits for one, and for the last copy out of it."""
        with self._cv:
            while not self._free and len(self._all) >= self.slots:
                self._cv.wait()
            if self._free:
                slot = self._free.pop()
            else:
                slot = _Slot(torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self.pin))
                self._all.append(slot)
                self.allocated_bytes += self.slot_bytes
            self._in_use += 1
            self.max_in_use = max(self.max_in_use, self._in_use)
        if slot.event is not None:
            slot.event.synchronize()
            slot.event = None
        return slot

    def release(self, slot: _Slot, event=None) -> None:
        """Return a buffer; ``event`` (``synchronize()``) completes the copy still reading it."""
        slot.event = event
        with self._cv:
            self._in_use -= 1
            self._free.append(slot)
            self._cv.notify()

    def transfer(self, src: torch.Tensor, dst: torch.Tensor):
        """Copy a staged block ``src`` into ``dst``; returns an event to wait on, or None.

        To CUDA the copy is queued on the destination device's current
        stream (``non_blocking``: the host does not wait), and an event
        recorded after it. A cast happens on the device (the block goes over
        in the stored dtype). Elsewhere the copy is synchronous.
        """
        if dst.device.type == "cuda":
            with torch.cuda.device(dst.device):
                if dst.dtype != src.dtype:
                    tmp = torch.empty(src.shape, dtype=src.dtype, device=dst.device)
                    tmp.copy_(src, non_blocking=True)
                    dst.copy_(tmp)
                else:
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(dst.device))
            return event
        dst.copy_(src)
        return None

    def copy_out(self, slot: _Slot, src: torch.Tensor, dst: torch.Tensor) -> None:
        """:meth:`transfer` ``src`` (a view of ``slot``) into ``dst``, then release the slot."""
        try:
            event = self.transfer(src, dst)
        except BaseException:
            self.release(slot)
            raise
        self.release(slot, event)

    def synchronize(self) -> None:
        """Wait for every copy out of the buffers."""
        for slot in list(self._all):
            ev = slot.event
            if ev is not None:
                ev.synchronize()
                slot.event = None

    def close(self) -> None:
        """Wait for every copy, drop the buffers, give the budget back."""
        try:
            self.synchronize()
        finally:
            self._free.clear()
            self._all.clear()
            if self.charged:
                charged, self.charged = self.charged, 0
                self._budget.unreserve(charged, self._room)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def staging_sizes(ckpt, staging_bytes: int | None = None, room: int = 0, chunk: int = 0) -> tuple[int, int, int]:
    """``(slot_bytes, slots, room)`` of the staging buffers for reads of ``ckpt``.

    Total size: ``staging_bytes``, default :data:`STAGING_BYTES` but at most
    a quarter of the handle's read budget; cut into ``tensor_workers + 2``
    buffers (one per tensor being read, two more for copies in flight).
    ``room``: the largest range request the reads may make (the largest
    chunk given, or ``max_request``), which their reservation in the read
    budget leaves free.

    ``chunk``, the chunk size of what will be read (its largest raw chunk),
    makes a buffer a multiple of it where one fits: blocks are whole rows
    (:func:`plan_blocks`), so wherever a row's bytes divide the chunk size a
    block ends on a chunk boundary and no chunk is fetched for two blocks
    (with 4096-byte alignment alone, 9% more pack bytes were read for a cast
    load of 256 MiB in 4 MiB chunks).
    """
    o = ckpt.repo.options
    limit = ckpt.repo.runtime.read_budget().limit
    slots = o.tensor_workers + 2
    total = staging_bytes if staging_bytes is not None else min(STAGING_BYTES, limit // 4)
    per = total // slots
    unit = math.lcm(chunk, STAGING_ALIGN) if chunk > 0 else STAGING_ALIGN
    if unit > per:
        unit = STAGING_ALIGN
    slot_bytes = max(STAGING_ALIGN, per // unit * unit)
    return slot_bytes, slots, max(room, o.max_request)


def make_staging(ckpt, *, pin: bool, staging_bytes: int | None = None, room: int = 0, chunk: int = 0,
                 cls: type[StagingBuffers] = StagingBuffers) -> StagingBuffers:
    """Staging buffers sized by :func:`staging_sizes`, reserved in ``ckpt``'s read budget."""
    slot_bytes, slots, room = staging_sizes(ckpt, staging_bytes, room, chunk)
    return cls(slot_bytes, slots, pin=pin, budget=ckpt.repo.runtime.read_budget(), room=room)


# ---------------------------------------------------------------- reading
class TensorReader:
    """Reads stored tensors, or slices of them, into tensors on any device.

    The one reading path of :func:`load_module` and of
    ``ckptstore.integrations.hf.lazy_state_dict``.

    Parameters
    ----------
    checkpoint:
        The step to read.
    staging:
        Buffers for destinations that cannot take decoded bytes directly;
        default: a small set made for each such read (and closed after it).
    """

    def __init__(self, checkpoint, staging: StagingBuffers | None = None):
        self.checkpoint = checkpoint
        self.staging = staging

    @property
    def step(self) -> int:
        return self.checkpoint.step

    def _where(self, key: str) -> str:
        return f"{self.checkpoint.repo.url}: step {self.checkpoint.step}: tensor {key!r}"

    def read(self, key: str, index: Any = None, *, device=None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new tensor holding ``key`` (or its slice ``index``) on ``device`` (default CPU).

        ``dtype`` (default: the stored one) may be another floating (or
        complex) dtype; values are cast like ``Tensor.copy_``.
        """
        e = self.checkpoint.entry(key)
        box, squeeze = _plan.normalize_index(index, e.shape)
        shape = [n for d, n in enumerate(_plan.box_shape(box)) if d not in squeeze]
        out = torch.empty(shape, dtype=dtype or _m.DTYPES[e.dtype], device=device if device is not None else "cpu")
        return self._read(e, box, squeeze, out, None)

    def read_into(self, key: str, dest: torch.Tensor, index: Any = None,
                  on_bytes: Callable[[int], None] | None = None) -> torch.Tensor:
        """Fill ``dest`` (any device; the shape of the tensor, or of its slice ``index``).

        ``on_bytes(n)`` is called as parts of ``dest`` (``n`` bytes of it)
        are filled. Returns ``dest``.
        """
        e = self.checkpoint.entry(key)
        box, squeeze = _plan.normalize_index(index, e.shape)
        return self._read(e, box, squeeze, dest, on_bytes)

    def _read(self, e, box, squeeze, dest: torch.Tensor, on_bytes) -> torch.Tensor:
        stored = _m.DTYPES[e.dtype]
        want = tuple(n for d, n in enumerate(_plan.box_shape(box)) if d not in squeeze)
        if tuple(dest.shape) != want or not castable(stored, dest.dtype):
            raise ValueError(
                f"{self._where(e.key)} is {e.dtype}{list(e.shape)}; the destination of "
                f"{list(want)} is {str(dest.dtype).removeprefix('torch.')}{list(dest.shape)}"
                + ("" if tuple(dest.shape) != want else
                   " (values are cast only between floating dtypes, or between complex dtypes)")
            )
        target = dest.detach()
        for d in squeeze:  # views: the squeezed dims back as size-1 dims
            target = target.unsqueeze(d)
        if writable_in_place(target) and target.dtype == stored:
            self.checkpoint.read_box(e, box, target)
        elif target.numel():
            self._staged(e, box, target, on_bytes)
            return dest
        if on_bytes is not None:
            on_bytes(dest.numel() * dest.element_size())
        return dest

    def _staged(self, e, box, target: torch.Tensor, on_bytes) -> None:
        staging, own = self.staging, False
        if staging is None:
            limit = self.checkpoint.repo.runtime.read_budget().limit
            room, chunk = self.checkpoint.largest_chunks([e.key], self.checkpoint.meeting(e, box))
            staging = make_staging(self.checkpoint, pin=target.device.type == "cuda" and torch.cuda.is_available(),
                                   staging_bytes=min(16 * MiB, limit // 4), room=room, chunk=chunk)
            own = True
        try:
            stored = _m.DTYPES[e.dtype]
            per = target.element_size()
            blocks = (plan_blocks(e.shape, stored.itemsize, box, staging.slot_bytes) if e.tile is None
                      else plan_tile_blocks(e.tile, stored.itemsize, box, staging.slot_bytes))
            for blk in blocks:
                slot = staging.acquire()
                try:
                    view = slot.view(stored, blk.shape)
                    self.checkpoint.read_box(e, blk.box, view)
                except BaseException:
                    staging.release(slot)
                    raise
                staging.copy_out(slot, view, target[blk.out])
                if on_bytes is not None:
                    on_bytes(view.numel() * per)
        finally:
            if own:
                staging.close()
