"""Wrapper stores adding cross-cutting behaviour around any backend.

:class:`WrapperStore` forwards every call to an inner store;
:class:`CountingStore` counts calls and bytes (tests assert on what a read
fetched; the demo and benchmarks report it). Fault injection builds on
these in :mod:`ckptstore.storage.faults`.
"""

from __future__ import annotations

import collections
import threading

from .base import MultipartUpload, ObjectStore


class WrapperStore(ObjectStore):
    """Forwards every call to ``inner``; subclasses override what they need.

    ``delete_many`` is the exception: the base class's deletes key by key
    through this wrapper's ``delete``, so a subclass that overrides
    ``delete`` sees every key. Wrappers that only observe or retry forward
    it (``CountingStore``, ``RetryStore``), keeping the backend's batches.
    """

    def __init__(self, inner: ObjectStore):
        self.inner = inner
        self.url = inner.url
        self.mtime_resolution = inner.mtime_resolution
        self.remote = inner.remote
        self.min_part_size = inner.min_part_size

    def get(self, key):
        return self.inner.get(key)

    def get_ranges(self, key, ranges):
        return self.inner.get_ranges(key, ranges)

    def read_range_into(self, key, start, out, progress=None):
        return self.inner.read_range_into(key, start, out, progress)

    def put(self, key, data):
        return self.inner.put(key, data)

    def put_if_absent(self, key, data):
        return self.inner.put_if_absent(key, data)

    def head(self, key):
        return self.inner.head(key)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def delete(self, key):
        return self.inner.delete(key)

    def create_multipart(self, key, part_size):
        return self.inner.create_multipart(key, part_size)

    def list_multipart(self, prefix=""):
        return self.inner.list_multipart(prefix)

    def abort_multipart(self, key, upload_id):
        return self.inner.abort_multipart(key, upload_id)

    @property
    def identity(self) -> str:
        return self.inner.identity

    def set_throttle(self, policy):
        return self.inner.set_throttle(policy)

    def throttle_stats(self):
        return self.inner.throttle_stats()

    def close(self):
        self.inner.close()


class CountingStore(WrapperStore):
    """Counts calls and bytes moved, per operation (thread-safe).

    ``bytes_read``/``bytes_written`` total the payloads; ``calls`` counts
    operations by name; ``reads`` lists ``(key, start, end)`` of every
    ranged read; ``read_by_prefix`` totals bytes read per top-level key
    prefix (``"packs"`` data, ``"segments"`` and ``"manifests"`` metadata).
    """

    def __init__(self, inner: ObjectStore):
        super().__init__(inner)
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.bytes_read = 0
            self.bytes_written = 0
            self.calls: collections.Counter = collections.Counter()
            self.reads: list[tuple[str, int, int]] = []
            #: bytes read per top-level key prefix ("packs", "segments", "manifests", ...)
            self.read_by_prefix: collections.Counter = collections.Counter()

    def _count(self, op, read=0, written=0):
        with self._lock:
            self.calls[op] += 1
            self.bytes_read += read
            self.bytes_written += written

    def get(self, key):
        data = self.inner.get(key)
        self._count("get", read=len(data))
        with self._lock:
            self.read_by_prefix[key.split("/", 1)[0]] += len(data)
        return data

    def get_ranges(self, key, ranges):
        out = self.inner.get_ranges(key, ranges)
        with self._lock:
            self.reads.extend((key, int(s), int(e)) for s, e in ranges)
            self.read_by_prefix[key.split("/", 1)[0]] += sum(len(b) for b in out)
        self._count("get_ranges", read=sum(len(b) for b in out))
        return out

    def read_range_into(self, key, start, out, progress=None):
        n = memoryview(out).nbytes
        self.inner.read_range_into(key, start, out, progress)
        with self._lock:
            self.reads.append((key, int(start), int(start) + n))
            self.read_by_prefix[key.split("/", 1)[0]] += n
        self._count("read_range_into", read=n)

    def put(self, key, data):
        self.inner.put(key, data)
        self._count("put", written=len(data))

    def put_if_absent(self, key, data):
        self.inner.put_if_absent(key, data)
        self._count("put_if_absent", written=len(data))

    def head(self, key):
        self._count("head")
        return self.inner.head(key)

    def list(self, prefix=""):
        self._count("list")
        return self.inner.list(prefix)

    def delete(self, key):
        self._count("delete")
        return self.inner.delete(key)

    def delete_many(self, keys):
        self._count("delete_many")
        return self.inner.delete_many(keys)

    def create_multipart(self, key, part_size):
        self._count("create_multipart")
        return _CountingMultipart(self, self.inner.create_multipart(key, part_size))


class _CountingMultipart(MultipartUpload):
    def __init__(self, owner: CountingStore, inner: MultipartUpload):
        self.owner, self.inner = owner, inner
        self.key, self.part_size = inner.key, inner.part_size

    def upload_part(self, number, data):
        self.inner.upload_part(number, data)
        self.owner._count("upload_part", written=len(data))

    def complete(self, nparts):
        self.inner.complete(nparts)
        self.owner._count("complete_multipart")

    def abort(self):
        self.inner.abort()
        self.owner._count("abort_multipart")

