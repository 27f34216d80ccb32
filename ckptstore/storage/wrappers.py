"""Wrapper stores adding cross-cutting behaviour around any backend.

:class:`CountingStore` counts calls and bytes (tests assert on what a read
fetched; the demo and benchmarks report it). :class:`FaultStore` makes chosen
calls fail (tests of commit and crash behaviour).
"""

from __future__ import annotations

import collections
import fnmatch
import threading
from typing import Callable, Iterator, Sequence

from .base import MultipartInfo, MultipartUpload, ObjectInfo, ObjectStore


class WrapperStore(ObjectStore):
    """Forwards every call to ``inner``; subclasses override what they need."""

    def __init__(self, inner: ObjectStore):
        self.inner = inner
        self.url = inner.url
        self.mtime_resolution = inner.mtime_resolution

    def get(self, key):
        return self.inner.get(key)

    def get_ranges(self, key, ranges):
        return self.inner.get_ranges(key, ranges)

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

    def close(self):
        self.inner.close()


class CountingStore(WrapperStore):
    """Counts calls and bytes moved, per operation (thread-safe).

    ``bytes_read``/``bytes_written`` total the payloads; ``calls`` counts
    operations by name; ``reads`` lists ``(key, start, end)`` of every
    ranged read.
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

    def _count(self, op, read=0, written=0):
        with self._lock:
            self.calls[op] += 1
            self.bytes_read += read
            self.bytes_written += written

    def get(self, key):
        data = self.inner.get(key)
        self._count("get", read=len(data))
        return data

    def get_ranges(self, key, ranges):
        out = self.inner.get_ranges(key, ranges)
        with self._lock:
            self.reads.extend((key, int(s), int(e)) for s, e in ranges)
        self._count("get_ranges", read=sum(len(b) for b in out))
        return out

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


class FaultStore(WrapperStore):
    """Raises ``error`` on calls matching ``op`` and a key glob.

    Parameters
    ----------
    inner: the store to wrap.
    rules: list of ``(op, key_glob, error_factory, count)``; ``op`` is a
        method name (``"put_if_absent"``, ``"get_ranges"``, ``"upload_part"``
        ...) or ``"*"``; ``count`` is how many matching calls fail (None:
        all). ``error_factory(op, key)`` returns the exception to raise, or
        None to let the call through (a factory that sleeps is a delay).
    """

    def __init__(self, inner: ObjectStore, rules: Sequence[tuple[str, str, Callable, int | None]] = ()):
        super().__init__(inner)
        self._lock = threading.Lock()
        self.rules = [list(r) for r in rules]
        self.triggered: list[tuple[str, str]] = []

    def add_rule(self, op: str, key_glob: str, error_factory: Callable, count: int | None = None) -> None:
        with self._lock:
            self.rules.append([op, key_glob, error_factory, count])

    def _check(self, op: str, key: str) -> None:
        with self._lock:
            for rule in self.rules:
                rop, glob, factory, count = rule
                if (rop == "*" or rop == op) and fnmatch.fnmatchcase(key, glob) and (count is None or count > 0):
                    if count is not None:
                        rule[3] = count - 1
                    self.triggered.append((op, key))
                    break
            else:
                return
        err = factory(op, key)  # outside the lock: a factory may sleep (a delay rule)
        if err is not None:
            raise err

    def get(self, key):
        self._check("get", key)
        return self.inner.get(key)

    def get_ranges(self, key, ranges):
        self._check("get_ranges", key)
        return self.inner.get_ranges(key, ranges)

    def put(self, key, data):
        self._check("put", key)
        return self.inner.put(key, data)

    def put_if_absent(self, key, data):
        self._check("put_if_absent", key)
        return self.inner.put_if_absent(key, data)

    def head(self, key):
        self._check("head", key)
        return self.inner.head(key)

    def delete(self, key):
        self._check("delete", key)
        return self.inner.delete(key)

    def create_multipart(self, key, part_size):
        self._check("create_multipart", key)
        return _FaultMultipart(self, self.inner.create_multipart(key, part_size))


class _FaultMultipart(MultipartUpload):
    def __init__(self, owner: FaultStore, inner: MultipartUpload):
        self.owner, self.inner = owner, inner
        self.key, self.part_size = inner.key, inner.part_size

    def upload_part(self, number, data):
        self.owner._check("upload_part", self.key)
        self.inner.upload_part(number, data)

    def complete(self, nparts):
        self.owner._check("complete_multipart", self.key)
        self.inner.complete(nparts)

    def abort(self):
        self.inner.abort()
