"""The object-store interface every backend implements.

Keys are relative, ``/``-separated paths under the store's root. Backends
never interpret them beyond that; the repository layer alone decides names.
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
import threading
from dataclasses import dataclass
from typing import Iterator, Sequence

MiB = 1 << 20

#: S3 limits on multipart uploads; every backend enforces them so that a
#: pipeline that works on the local store also works on S3.
MIN_PART_SIZE = 5 * MiB
MAX_PARTS = 10_000


@dataclass(frozen=True)
class ObjectInfo:
    """What :meth:`ObjectStore.head` and :meth:`ObjectStore.list` report.

    Attributes
    ----------
    key:
        The object's key relative to the store root.
    size:
        Size in bytes.
    mtime:
        Last modification, seconds since the epoch (UTC).
    """

    key: str
    size: int
    mtime: float


@dataclass(frozen=True, order=True)
class MultipartInfo:
    """An incomplete multipart upload, as listed for cleanup (ordered by key, then id)."""

    key: str
    upload_id: str
    initiated: float


def check_key(key: str) -> str:
    """Refuse keys that could escape the store root or are not plain paths."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key must be a non-empty string, got {key!r}")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"invalid object key {key!r}")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"invalid object key {key!r}")
    return key


def check_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for r in ranges:
        start, end = int(r[0]), int(r[1])
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range [{start}, {end})")
        out.append((start, end))
    return out


class MultipartUpload(abc.ABC):
    """One in-progress multipart upload.

    All parts but the last must be exactly ``part_size`` bytes; parts may be
    uploaded in any order and concurrently. :meth:`complete` makes the object
    visible at once and whole; :meth:`abort` discards everything.
    """

    def __init__(self, key: str, part_size: int):
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} bytes, got {part_size}")
        self.key = key
        self.part_size = part_size

    @abc.abstractmethod
    def upload_part(self, number: int, data) -> None:
        """Upload part ``number`` (1-based)."""

    @abc.abstractmethod
    def complete(self, nparts: int) -> None:
        """Assemble parts ``1..nparts`` into the object."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard the upload; safe to call more than once."""

    def _check_part(self, number: int, data, final: bool | None = None) -> None:
        if not 1 <= number <= MAX_PARTS:
            raise ValueError(f"part number {number} outside 1..{MAX_PARTS}")
        if len(data) > self.part_size:
            raise ValueError(f"part {number} is {len(data)} bytes, over part_size {self.part_size}")


class ObjectStore(abc.ABC):
    """A flat key -> bytes store with the few operations checkpoints need.

    Errors: a missing object raises :class:`~ckptstore.errors.ObjectNotFoundError`
    (a ``FileNotFoundError``); an exclusive create of an existing key raises
    :class:`~ckptstore.errors.ObjectExistsError` (a ``FileExistsError``).
    """

    #: A URL naming the store root, for messages (credentials never included).
    url: str = ""
    #: Granularity of ``ObjectInfo.mtime`` in seconds (S3 reports whole
    #: seconds). GC adds it to every age it computes, so truncated times
    #: never make an object look older than it is.
    mtime_resolution: float = 0.0
    #: Reached over a network: ``ckptstore.open`` wraps it in a RetryStore.
    remote: bool = False

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Return the whole object."""

    @abc.abstractmethod
    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Return the bytes ``[start, end)`` of each range, in order.

        A range reaching past the end of the object is an error, never a
        short read: callers rely on getting exactly what they asked for.
        """

    @abc.abstractmethod
    def put(self, key: str, data) -> None:
        """Create or replace an object; readers see the old or the new bytes, never a mix."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data) -> None:
        """Create an object only if no object has the key (atomic exclusive create)."""

    @abc.abstractmethod
    def head(self, key: str) -> ObjectInfo:
        """Size and modification time of one object."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in key order."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete an object; deleting a missing object is not an error."""

    @abc.abstractmethod
    def create_multipart(self, key: str, part_size: int) -> MultipartUpload:
        """Start a multipart upload of ``key``."""

    def list_multipart(self, prefix: str = "") -> list[MultipartInfo]:
        """Incomplete multipart uploads under ``prefix`` (for cleanup)."""
        return []

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Abort one incomplete multipart upload named by :meth:`list_multipart`."""

    def exists(self, key: str) -> bool:
        from ..errors import ObjectNotFoundError

        try:
            self.head(key)
        except ObjectNotFoundError:
            return False
        return True

    def close(self) -> None:
        """Release connections and threads."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class BufferPool:
    """Reusable part buffers: the save path allocates no fresh large buffers.

    A fresh allocation over 32 MiB costs page faults on every first touch
    (measured here at about 2 s per GiB) while reusing a buffer copies at
    memory speed. At most ``keep`` idle buffers are retained.
    """

    def __init__(self, size: int, keep: int = 8):
        self.size = size
        self.keep = keep
        self._free: list[bytearray] = []
        self._lock = threading.Lock()
        self.allocated = 0

    def get(self) -> bytearray:
        with self._lock:
            if self._free:
                return self._free.pop()
            self.allocated += 1
        return bytearray(self.size)

    def put(self, buf: bytearray) -> None:
        if len(buf) != self.size:
            return
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)


class ParallelUploader:
    """Feeds the parts of one multipart upload to a thread pool, window-bounded.

    ``write`` accepts bytes of any size and copies them once into a part
    buffer (from ``buffers``, reused across parts and uploads); a full part
    is submitted at once, and at most ``window`` parts are in flight for this
    upload (further writes block); the pool may be shared with other
    uploads. ``close`` uploads the last part, waits, and completes; any
    failure aborts the upload and re-raises. A small object (one short part)
    becomes a plain PUT.
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
    ):
        self.store = store
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

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._size

    def write(self, data) -> None:
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

    def close(self) -> int:
        """Finish the object; returns its size."""
        if self._closed:
            return self._size
        self._closed = True
        try:
            if self._mpu is None:
                # Small object: one plain PUT is cheaper than a multipart upload.
                data = bytes(memoryview(self._buf)[: self._fill]) if self._buf is not None else b""
                self.store.put(self.key, data)
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
