"""``save(blocking=False)``: a snapshot into reused buffers, the rest of the save in the background.

The call blocks the caller for what it must, and no more:

1. if the previous async save of the handle is still writing (its future not
   done), wait for it, at most ``async_wait`` seconds (:class:`SaveBacklogError`
   past that, nothing saved); its snapshot buffers are what this one compares
   against and overwrites. A wait is logged and reported
   (``StepInfo.waited_seconds``): one save per step is only sustainable while
   the background keeps up, and the wait says when it does not;
2. the snapshot (:class:`~ckptstore.pipeline.snapshot.Snapshots`): each
   ``chunk_size`` block of each CPU tensor compared with the previous
   snapshot's bytes and copied only if it differs;
3. the save is queued on the handle's background thread with the chunks found
   unchanged (:class:`~ckptstore.repo.save.KnownChunks`: the previous step's
   references, used without hashing when that step is the dedup base).

On a handle with ``write_back=True`` the background save writes the step into
the tier and records it pending (its future resolves then); its upload and
commit follow on the write-back thread, at most ``write_back_steps`` steps
behind. So with a host-memory tier (``/dev/shm``) a training loop saving every
step blocks for the snapshot, and a backlog that would grow shows as a wait.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import math
import time

import numpy as np

from ..errors import SaveBacklogError
from ..format import tiles as _tiles
from ..pipeline.snapshot import Snapshot, Snapshots
from .catalog import Catalog
from .save import KnownChunks, StepInfo, save_step

log = logging.getLogger(__name__)


class AsyncSaver:
    """The async saves of one handle, in order; see the module docstring."""

    def __init__(self, cat: Catalog):
        self.cat = cat
        self.snapshots = Snapshots(cat.options.chunk_size, cat.runtime.cpu)
        self.last: cf.Future | None = None
        self._last_step: int | None = None
        #: (step, chunk size, {key: refs}) of the last async save, set once it has succeeded.
        self._prev: tuple[int, int, dict] | None = None

    @property
    def staging(self) -> dict:
        """The snapshot buffers by key (reused by the next async save)."""
        return self.snapshots.buffers

    def wait_previous(self, step: int) -> float:
        """Wait (bounded) for the previous async save to finish writing; seconds waited."""
        last = self.last
        if last is None or last.done():
            return 0.0
        bound = self.cat.options.async_wait
        t0 = time.perf_counter()
        cf.wait([last], timeout=bound)
        waited = time.perf_counter() - t0
        if not last.done():
            raise SaveBacklogError(
                f"{self.cat.url}: step {step}: the previous async save (step {self._last_step}) is still being "
                f"written after {waited:.1f} s (async_wait={bound}); nothing of step {step} was saved. Save less "
                "often, or raise async_wait"
            )
        log.info("ckptstore: step %d waited %.3f s for the async save of step %s to finish writing",
                 step, waited, self._last_step)
        return waited

    def submit(self, tree, tensors, step, metadata, base, progress=None) -> cf.Future:
        t0 = time.perf_counter()
        waited = self.wait_previous(step)
        prev, self._prev = self._prev, None  # a later save sees refs only of the save just before it
        self.snapshots.chunk_size = self.cat.options.chunk_size
        snap = self.snapshots.take(tensors)
        known = _known(prev, snap) if base == "latest" else None
        blocked = time.perf_counter() - t0
        fut = self.cat.runtime.background.submit(self._save, tree, snap, step, metadata, base, progress, known,
                                                 blocked, waited)
        self.last, self._last_step = fut, step
        return fut

    def _save(self, tree, snap: Snapshot, step, metadata, base, progress, known, blocked, waited) -> StepInfo:
        refs: dict = {}
        info = save_step(self.cat, tree, snap.tensors, step, metadata, base, progress, known, refs)
        self._prev = (step, self.cat.options.chunk_size, refs)  # the chunk size the refs were cut with
        return dataclasses.replace(info, blocked_seconds=blocked, waited_seconds=waited)


def _known(prev: tuple[int, int, dict] | None, snap: Snapshot) -> KnownChunks | None:
    """The previous step's references of the chunks this snapshot found unchanged: of each block
    compared, or, for a tensor saved as tiles, of each tile every block of whose byte span is
    unchanged."""
    if prev is None:
        return None
    step, chunk_size, refs = prev
    if chunk_size != snap.chunk_size:
        return None
    out, tiles = {}, {}
    for key, flags in snap.unchanged.items():
        old, tile = refs.get(key, (None, None))
        tiles[key] = tile
        if flags is None or old is None or not any(flags):
            continue
        if tile is not None:
            same = _tiles_unchanged(snap.tensors[key], tile, flags, chunk_size)
            if same is not None and len(same) == len(old):
                out[key] = [r if s else None for r, s in zip(old, same)]
        elif len(old) == len(flags):
            out[key] = [r if same else None for r, same in zip(old, flags)]
    return KnownChunks(step, chunk_size, out, {k: tiles[k] for k in out}) if out else None


def _tiles_unchanged(t, tile, flags: list[bool], chunk_size: int) -> list[bool] | None:
    """Per tile of ``t`` (a host snapshot, C-contiguous), whether every ``chunk_size`` block its
    bytes lie in was found unchanged (None when the tile shape does not fit the tensor)."""
    shape = tuple(t.shape)
    if len(tile) != len(shape):
        return None
    isz = t.element_size()
    strides = [isz * math.prod(shape[d + 1 :]) for d in range(len(shape))]
    changed = np.concatenate([[0], np.cumsum(~np.asarray(flags, dtype=bool))])
    out = []
    for pos in _tiles.positions(shape, tile):
        offs, sizes = _tiles.tile_extent(shape, tile, pos)
        lo = sum(o * s for o, s in zip(offs, strides))
        hi = sum((o + n - 1) * s for o, n, s in zip(offs, sizes, strides)) + isz
        a, b = lo // chunk_size, (hi - 1) // chunk_size
        out.append(b < len(flags) and changed[b + 1] == changed[a])
    return out


__all__ = ["AsyncSaver", "SaveBacklogError"]
