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
import time

from ..errors import SaveBacklogError
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
    """The previous step's references of the blocks this snapshot found unchanged."""
    if prev is None:
        return None
    step, chunk_size, refs = prev
    if chunk_size != snap.chunk_size:
        return None
    out = {}
    for key, flags in snap.unchanged.items():
        old = refs.get(key)
        if flags is None or old is None or len(old) != len(flags) or not any(flags):
            continue
        out[key] = [r if same else None for r, same in zip(old, flags)]
    return KnownChunks(step, chunk_size, out) if out else None


__all__ = ["AsyncSaver", "SaveBacklogError"]
