"""The object-store interface every backend implements.

Keys are relative, ``/``-separated paths under the store's root. Backends
never interpret them beyond that; the repository layer alone decides names.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from ..errors import TransientStorageError

MiB = 1 << 20

#: S3 limits on multipart uploads; every backend enforces them so that a
#: pipeline that works on the local store also works on S3.
MIN_PART_SIZE = 5 * MiB
MAX_PARTS = 10_000
#: Bytes a streaming :meth:`ObjectStore.read_range_into` reads between two
#: progress reports (a chunk is decoded as soon as its bytes are in).
READ_PIECE = 1 * MiB


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


class RangeReplyError(ValueError):
    """A ranged read asked for bytes past the object's end (remote stores raise it as ``ValueError``)."""


def check_range_reply(where: str, start: int, end: int, got: int, total: int | None) -> None:
    """Check a reply of ``got`` bytes to a ranged GET of ``[start, end)`` of an object of ``total`` bytes (None: not said).

    A range past the end raises :class:`RangeReplyError`; so does a short
    reply without a size, which cannot tell a short object from a cut
    transfer (either way the bytes must not be used). A short reply of an
    object long enough is a cut transfer: :class:`TransientStorageError`.
    """
    if total is not None and end > total:
        raise RangeReplyError(f"{where}: range [{start}, {end}) past end of {total}-byte object")
    if got != end - start:
        if total is None:
            raise RangeReplyError(f"{where}: range [{start}, {end}) returned {got} bytes")
        raise TransientStorageError(f"{where}: short read of range [{start}, {end}): {got} bytes")


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

    def _check_parts(self, nparts: int, sizes) -> None:
        """Before :meth:`complete`: every part ``1..nparts`` was uploaded, and all but the last are ``part_size`` bytes.

        ``sizes`` maps each uploaded part's number to its size in bytes.
        """
        missing = [n for n in range(1, nparts + 1) if n not in sizes]
        if missing:
            raise ValueError(f"{self.key}: parts {missing[:5]} were never uploaded")
        for n in range(1, nparts):
            if sizes[n] != self.part_size:
                raise ValueError(f"{self.key}: part {n} is {sizes[n]} bytes, not {self.part_size}")

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
    #: Smallest multipart part (all but the last) the store accepts: S3's 5 MiB unless the
    #: store says more (S3's ``min_part_size`` storage option: CoreWeave's 15 MiB, say).
    min_part_size: int = MIN_PART_SIZE

    @property
    def identity(self) -> str:
        """What tells this store's location apart in the process: its URL, and for remote stores the
        endpoint too (two servers may hold buckets of one name)."""
        return self.url

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Return the whole object."""

    @abc.abstractmethod
    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Return the bytes ``[start, end)`` of each range, in order.

        A range reaching past the end of the object is an error, never a
        short read: callers rely on getting exactly what they asked for.
        """

    def read_range_into(self, key: str, start: int, out, progress: Callable[[int], None] | None = None) -> None:
        """Read bytes ``[start, start + len(out))`` of ``key`` into ``out``, a writable buffer.

        ``progress(n)``, when given, is called on the calling thread as the
        bytes arrive: the first ``n`` bytes of ``out`` then hold their final
        value. ``n`` grows from call to call and the last call has ``n ==
        len(out)``, so a caller may use a prefix before the rest is in (the
        loader decodes each chunk as soon as its bytes are there). Errors are
        those of :meth:`get_ranges`; after one, the bytes of ``out`` past the
        last ``n`` reported are undefined.

        This default reads the range whole through :meth:`get_ranges` and
        reports once; stores that can stream a body (S3, local files) read
        straight into ``out`` in pieces.
        """
        mv = memoryview(out).cast("B")
        (data,) = self.get_ranges(key, [(start, start + len(mv))])
        check_range_reply(f"{self.url}/{key}", start, start + len(mv), len(data), None)
        mv[:] = data
        if progress is not None:
            progress(len(mv))

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

    def delete_many(self, keys: Sequence[str]) -> None:
        """Delete objects; missing ones are not an error.

        Every key is checked before anything is deleted. On a failure it
        raises, naming a key that failed; keys other than that one may or
        may not have been deleted (deleting again is harmless). This one
        deletes one key at a time through :meth:`delete`; remote stores
        override it with batched or concurrent requests (S3's
        ``DeleteObjects``, 1000 keys a request).
        """
        for key in keys:
            check_key(key)
        for key in keys:
            self.delete(key)

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

    def set_throttle(self, policy) -> None:
        """How this store's requests slow down when the store throttles them: a
        :class:`~ckptstore.storage.throttle.ThrottlePolicy`, None (the default policy) or False
        (never). Remote stores share one adaptive rate per bucket of an endpoint in a process;
        the others have nothing to slow down."""

    def throttle_stats(self) -> dict | None:
        """The adaptive rate's state (:meth:`~ckptstore.storage.throttle.AdaptiveRate.stats`), or None."""
        return None

    def close(self) -> None:
        """Release connections and threads."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
