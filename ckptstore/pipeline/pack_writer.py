"""The one pack writer: chunks appended in order, packs streamed as multipart uploads.

A pack is ``header | chunk bytes ... | table | footer`` (:mod:`ckptstore.format.pack`).
:class:`PackWriter` appends encoded chunks to the current pack, whose
:class:`~ckptstore.storage.upload.ParallelUploader` cuts ``part_size`` parts
and uploads them on the I/O pool (at most ``window`` parts in flight per
pack, part buffers from the handle's pool; on a local store the pieces
go straight to their offsets in the pack's file instead, see
:class:`~ckptstore.storage.upload.ParallelUploader`); a pack that reaches
``pack_size`` is sealed (table and footer written, upload completed) on the
seal pool while the next one fills, at most ``packs_in_flight`` at once.
:meth:`PackWriter.finish` waits for every pack and checks that each one
exists with the size written (format invariant 3) before the caller may
name it in a manifest. Saves, DCP writes, ``cp``/``import`` and GC's repack
all write packs through it.

With a node-local tier (``mirror``, :mod:`ckptstore.tier.cache`), each pack is
also written, as it is uploaded, to the tier's file of the same key (local
positional writes of the same chunk buffers): a restart on this node then
reads the pack from local disk. The tier's copy never fails a save: an
error writing it (a full disk) abandons the copy, warns once, and the save
goes on against the store alone.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import threading
from typing import Callable

from ..format import pack as _pack
from ..errors import ObjectNotFoundError, PackVanishedError, StorageError
from ..format.layout import new_pack_id, pack_key
from ..format.manifest import ChunkRef
from .options import RepoOptions
from .runtime import Runtime
from ..storage.base import ObjectStore
from ..storage.upload import ParallelUploader

log = logging.getLogger(__name__)


def part_window(options: RepoOptions, reserved: int) -> int:
    """Parts in flight per pack, so that every pack in flight fits the memory budget.

    ``reserved`` bytes of ``max_inflight_bytes`` are used elsewhere (chunks
    being encoded); the rest holds ``(packs_in_flight + 1) x (window + 1)``
    part buffers.
    """
    o = options
    per_pack = max(1, (o.max_inflight_bytes - reserved) // (o.part_size * (o.packs_in_flight + 1)))
    return max(1, min(8, per_pack - 1))


class _Acks:
    """One pack's chunks in order, reported (``on_acked(raw_len, stored_len)``) once the store has
    acknowledged every byte up to each one's end: progress counts bytes the store took, not queued ones."""

    def __init__(self, on_acked: Callable[[int, int], None]):
        self.on_acked = on_acked
        self._chunks: collections.deque = collections.deque()  # (end offset in the pack, raw, stored)
        self._upto = 0
        self._lock = threading.Lock()

    def chunk(self, end: int, raw_len: int, stored_len: int) -> None:
        with self._lock:
            if end > self._upto:
                self._chunks.append((end, raw_len, stored_len))
                return
        self.on_acked(raw_len, stored_len)

    def acked(self, upto: int) -> None:
        done = []
        with self._lock:
            self._upto = max(self._upto, upto)
            while self._chunks and self._chunks[0][0] <= self._upto:
                done.append(self._chunks.popleft())
        for _, raw, stored in done:
            self.on_acked(raw, stored)


class PackWriter:
    """Writes chunks into new packs of one store; see the module docstring.

    ``on_acked(raw_len, stored_len)`` (optional) is called for each chunk
    once the store has acknowledged all of its bytes (from the thread that
    saw the acknowledgement): what progress bars count.
    """

    def __init__(self, store: ObjectStore, runtime: Runtime, options: RepoOptions, window: int, mirror=None,
                 on_acked: Callable[[int, int], None] | None = None):
        self.store = store
        # on_acked(raw_len, stored_len) for each chunk once the store holds all of its bytes
        self.on_acked = on_acked
        self.runtime = runtime
        self.o = options
        self.window = window
        self.mirror = mirror  # a Tier, or None
        self._buffers = runtime.buffers("parts", options.part_size, (options.packs_in_flight + 1) * (window + 1))
        self._open: tuple[str, _pack.PackBuilder, ParallelUploader] | None = None
        self._copy: ParallelUploader | None = None  # the open pack's copy in the tier
        self._sealing: list[tuple[str, int, cf.Future]] = []
        self._copies: list[tuple[str, int, cf.Future]] = []
        self.sizes: dict[str, int] = {}  # packs verified complete, by finish()
        self.counts: dict[str, int] = {}  # chunks written into each pack
        self.created: list[str] = []  # every pack this writer started, in order (a failed save deletes them)
        self._acks: _Acks | None = None  # the open pack's chunks not yet acknowledged by the store

    # -- the tier's copy
    def _start_copy(self, pid: str) -> None:
        tier = self.mirror
        if tier is None or not tier.writable:
            return
        try:
            self._copy = ParallelUploader(tier.pack_store(), pack_key(pid), self.o.part_size, self.runtime.io,
                                          window=self.window, direct=True)
            self._copy.write(_pack.header())
        except OSError as e:
            self._drop_copy(e)

    def _copy_write(self, fn, arg) -> None:
        if self._copy is None:
            return
        try:
            fn(arg)
        except OSError as e:
            self._drop_copy(e)

    def _drop_copy(self, e: BaseException) -> None:
        if self._copy is not None:
            try:
                self._copy.abort()
            except Exception:  # noqa: BLE001 - the copy is abandoned either way
                pass
            self._copy = None
        self.mirror.copy_failed(e)

    def _finish_copies(self) -> None:
        for pid, expected, fut in self._copies:
            try:
                size = fut.result()
            except OSError as e:
                self.mirror.copy_failed(e)
                self.mirror.discard_pack(pid)
                continue
            if size != expected:
                log.warning("ckptstore: node-local tier: pack %s copy is %d bytes, expected %d", pid, size, expected)
                self.mirror.discard_pack(pid)
            else:
                self.mirror.added(size)
        self._copies.clear()

    def add(self, h: str, codec: str, pieces, raw_len: int) -> ChunkRef:
        """Append one encoded chunk (``pieces``: buffers whose bytes are its stored form)."""
        if self._open is None:
            pid = new_pack_id()
            self.created.append(pid)  # before its first request: an interrupted upload is still known
            self._acks = _Acks(self.on_acked) if self.on_acked is not None else None
            up = ParallelUploader(self.store, pack_key(pid), self.o.part_size, self.runtime.io,
                                  window=self.window, buffers=self._buffers,
                                  on_acked=None if self._acks is None else self._acks.acked)
            up.write(_pack.header())
            self._open = (pid, _pack.PackBuilder(), up)
            self._start_copy(pid)
        pid, builder, up = self._open
        stored_len = sum(len(p) for p in pieces)
        e = builder.add(h, codec, stored_len, raw_len)
        self.counts[pid] = self.counts.get(pid, 0) + 1
        if self._acks is not None:
            self._acks.chunk(e.offset + stored_len, raw_len, stored_len)
        up.write_many(pieces)
        self._copy_write(lambda ps: self._copy.write_many(ps), pieces)
        if builder.size >= self.o.pack_size:
            self.seal()
        return ChunkRef(h, pid, e.offset, stored_len, raw_len, codec)

    def seal(self) -> None:
        """Finish the open pack (if any) in the background."""
        if self._open is None:
            return
        pid, builder, up = self._open
        self._open = None
        tail = builder.tail()
        up.write(tail)
        expected = builder.final_size()
        copy, self._copy = self._copy, None
        if copy is not None:
            try:
                copy.write(tail)
                self._copies.append((pid, expected, self.runtime.seal.submit(copy.close)))
            except OSError as e:
                self._copy = copy
                self._drop_copy(e)
        while len(busy := [f for _, _, f in self._sealing if not f.done()]) >= self.o.packs_in_flight:
            cf.wait(busy, return_when=cf.FIRST_COMPLETED)
        self._sealing.append((pid, expected, self.runtime.seal.submit(up.close)))

    def finish(self) -> dict[str, int]:
        """Seal, wait for every pack, check each exists with its size: pack id -> size."""
        self.seal()
        for pid, expected, fut in self._sealing:
            size = fut.result()
            if size != expected:
                raise StorageError(f"pack {pid}: wrote {size} bytes, expected {expected}")
        self._finish_copies()
        store = self.store

        def head(item):
            pid, expected, _ = item
            try:
                return pid, expected, store.head(pack_key(pid)).size
            except ObjectNotFoundError:
                raise PackVanishedError(
                    f"{store.url}/{pack_key(pid)}: pack vanished after its upload completed "
                    "(collected by gc after the save outlived the grace period?)"
                ) from None

        for pid, expected, got in self.runtime.io.map(head, self._sealing):
            if got != expected:
                raise StorageError(f"{store.url}/{pack_key(pid)}: stored size {got}, expected {expected}")
            self.sizes[pid] = got
        self._sealing.clear()
        return dict(self.sizes)

    def abort(self) -> None:
        """Abandon the open pack and wait for sealing ones (finished packs stay, unreferenced, until
        the failed save deletes them, :func:`ckptstore.repo.save.discard_uncommitted`, or GC)."""
        if self._open is not None:
            self._open[2].abort()
            self._open = None
        if self._copy is not None:
            try:
                self._copy.abort()
            except Exception:  # noqa: BLE001
                pass
            self._copy = None
        for _, _, fut in self._sealing:
            try:
                fut.result()
            except BaseException:
                pass
        self._sealing.clear()
        for _, _, fut in self._copies:
            try:
                fut.result()  # a finished copy of a pack that exists stays: it is that pack, byte for byte
            except BaseException:
                pass
        self._copies.clear()
