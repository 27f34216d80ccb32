"""Multipart uploads fed from a thread pool, and the part buffers they reuse."""

from __future__ import annotations

import concurrent.futures as cf
import mmap
import threading
from typing import Callable

import numpy as np

from .base import MAX_PARTS, MultipartUpload, ObjectStore


def _populated(size: int):
    """``size`` bytes of fresh memory with its pages already mapped (one
    ``mmap(MAP_POPULATE)`` instead of a page fault per 4 KiB on first
    write), or a plain uninitialised array where that is not available."""
    flags = getattr(mmap, "MAP_POPULATE", 0)
    if flags and size:
        try:
            return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)
        except (OSError, ValueError):
            pass
    return np.empty(size, dtype=np.uint8)


class BufferPool:
    """Reusable part buffers: the save path allocates no fresh large buffers.

    A fresh allocation over 32 MiB costs page faults on every first touch
    while reusing a buffer copies at memory speed (``docs/performance.md``,
    "Two figures the code's docstrings used to carry"). At most ``keep`` idle buffers are retained.
    """

    def __init__(self, size: int, keep: int = 8, zeroed: bool = True):
        self.size = size
        self.keep = keep
        self.zeroed = zeroed
        self._free: list = []
        self._lock = threading.Lock()
        self.allocated = 0

    def get(self):
        """A ``size``-byte buffer: a zero-filled ``bytearray``, or with
        ``zeroed=False`` memory whose pages are mapped in one call and whose
        bytes are undefined (:func:`_populated`)."""
        with self._lock:
            if self._free:
                return self._free.pop()
            self.allocated += 1
        return bytearray(self.size) if self.zeroed else _populated(self.size)

    def put(self, buf: bytearray) -> None:
        if len(buf) != self.size:
            return
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)

    def clear(self) -> None:
        """Drop the idle buffers (those in use come back and are kept as usual)."""
        with self._lock:
            self._free.clear()


class ParallelUploader:
    """Feeds the parts of one multipart upload to a thread pool, window-bounded.

    ``write`` accepts bytes of any size and copies them once into a part
    buffer (from ``buffers``, reused across parts and uploads); a full part
    is submitted at once, and at most ``window`` parts are in flight for this
    upload (further writes block); the pool may be shared with other
    uploads. ``close`` uploads the last part, waits, and completes; any
    failure aborts the upload and re-raises. A small object (one short part)
    becomes a plain PUT.

    Where the store's uploads take positional writes (``positional_multipart``:
    local files) the uploader is *direct*: each :meth:`write_many` goes
    straight to its offset in the object (one ``pwritev`` of the caller's
    buffers on the calling thread, no part buffer, no copy), and ``close``
    completes the upload with the size written. Either way the caller may
    reuse its buffers as soon as ``write``/``write_many`` returns.
    ``direct=False`` forces parts.

    ``on_acked(n)``, if given, is called as the store acknowledges the
    object's bytes: ``n`` is the length of its longest prefix the store has
    taken (every part up to there uploaded; a direct write once it is
    written; a plain PUT once it returns), never decreasing, from whichever
    thread saw the acknowledgement. Progress bars count these bytes, not
    bytes handed to the uploads.
    """

    def __init__(
        self,
        store: ObjectStore,
        key: str,
        part_size: int,
        pool: cf.Executor,
        window: int = 4,
        budget: threading.Semaphore | None = None,
        buffers: BufferPool | None = None,
        direct: bool | None = None,
        on_acked: Callable[[int], None] | None = None,
    ):
        self.store = store
        self.direct = bool(getattr(store, "positional_multipart", False)) if direct is None else direct
        self.key = key
        self.part_size = part_size
        self.pool = pool
        self._sem = threading.Semaphore(max(1, window))
        self._budget = budget
        self._buffers = buffers if buffers is not None and buffers.size == part_size else BufferPool(part_size, keep=0)
        self._buf: bytearray | None = None
        self._fill = 0
        self._futures: list[cf.Future] = []
        self._nparts = 0
        self._size = 0
        self._mpu: MultipartUpload | None = None
        self._closed = False
        self._on_acked = on_acked
        self._done_parts: set[int] = set()  # parts the store acknowledged beyond the prefix
        self._prefix_parts = 0  # parts 1..n all acknowledged
        self._ack_lock = threading.Lock()

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._size

    def write(self, data) -> None:
        if self.direct:
            self.write_many((data,))
            return
        if self._closed:
            raise ValueError("write to a closed uploader")
        mv = memoryview(data).cast("B")
        self._size += len(mv)
        while len(mv):
            if self._buf is None:
                self._buf, self._fill = self._buffers.get(), 0
            n = min(len(mv), self.part_size - self._fill)
            self._buf[self._fill : self._fill + n] = mv[:n]
            self._fill += n
            mv = mv[n:]
            if self._fill == self.part_size:
                buf, self._buf = self._buf, None
                self._submit(buf, self.part_size)
        self._raise_failed()

    def write_many(self, buffers) -> None:
        """Append ``buffers`` in order (a chunk's pieces)."""
        if not self.direct:
            for b in buffers:
                self.write(b)
            return
        if self._closed:
            raise ValueError("write to a closed uploader")
        try:
            if self._mpu is None:
                self._mpu = self.store.create_multipart(self.key, self.part_size)
            self._size += self._mpu.write_at(self._size, buffers)
        except BaseException:
            self.abort()
            raise
        if self._on_acked is not None:
            self._on_acked(self._size)

    def _raise_failed(self) -> None:
        for f in self._futures:
            if f.done() and f.exception() is not None:
                self.abort()
                raise f.exception()

    def _submit(self, buf: bytearray, length: int) -> None:
        if self._mpu is None:
            self._mpu = self.store.create_multipart(self.key, self.part_size)
        self._nparts += 1
        if self._nparts > MAX_PARTS:
            raise ValueError(f"{self.key}: more than {MAX_PARTS} parts; raise part_size")
        number = self._nparts
        self._sem.acquire()
        if self._budget is not None:
            self._budget.acquire()

        def run():
            try:
                # A full part goes as the bytearray itself (S3 sends it uncopied).
                self._mpu.upload_part(number, buf if length == len(buf) else memoryview(buf)[:length])
                self._acked(number)
            finally:
                self._buffers.put(buf)
                self._sem.release()
                if self._budget is not None:
                    self._budget.release()

        try:
            self._futures.append(self.pool.submit(run))
        except BaseException:
            self._buffers.put(buf)
            self._sem.release()
            if self._budget is not None:
                self._budget.release()
            raise

    def _acked(self, number: int) -> None:
        """Part ``number`` is in the store: report the acknowledged prefix if it grew."""
        if self._on_acked is None:
            return
        with self._ack_lock:
            self._done_parts.add(number)
            grew = False
            while self._prefix_parts + 1 in self._done_parts:
                self._prefix_parts += 1
                self._done_parts.discard(self._prefix_parts)
                grew = True
            if grew:
                # every part but the last is part_size long
                self._on_acked(min(self._size, self._prefix_parts * self.part_size))

    def close(self) -> int:
        """Finish the object; returns its size."""
        if self._closed:
            return self._size
        self._closed = True
        if self.direct:
            try:
                if self._mpu is None:
                    self.store.put(self.key, b"")
                else:
                    self._mpu.complete_written(self._size)
            except BaseException:
                self.abort()
                raise
            return self._size
        try:
            if self._mpu is None:
                # Small object: one plain PUT is cheaper than a multipart upload.
                data = bytes(memoryview(self._buf)[: self._fill]) if self._buf is not None else b""
                self.store.put(self.key, data)
                if self._on_acked is not None:
                    self._on_acked(self._size)
            else:
                if self._buf is not None and self._fill:
                    self._closed = False
                    buf, self._buf = self._buf, None
                    self._submit(buf, self._fill)
                    self._closed = True
                for f in self._futures:
                    f.result()
                self._mpu.complete(self._nparts)
        except BaseException:
            self.abort()
            raise
        finally:
            if self._buf is not None:
                self._buffers.put(self._buf)
                self._buf = None
        return self._size

    def abort(self) -> None:
        self._closed = True
        for f in self._futures:
            f.cancel()
        for f in self._futures:
            try:
                f.result()
            except BaseException:
                pass
        if self._mpu is not None:
            try:
                self._mpu.abort()
            except Exception:
                pass
