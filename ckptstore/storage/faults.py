"""Fault injection: a wrapper store that fails, delays, truncates or corrupts calls.

Used by the tests and benchmarks to prove what happens under faults::

    fs = FaultStore(store, seed=7)
    fs.add_fault(op="upload_part", key="packs/*", kind="error", error=transient("SlowDown"),
                 probability=0.2)
    fs.add_fault(op="put_if_absent", key="manifests/*", kind="lose_response", count=1)
    fs.add_fault(op="get_ranges", kind="corrupt", count=1)

Kinds:

``error``
    raise ``error(op, key)`` instead of calling the store.
``delay``
    sleep ``delay`` seconds, then call the store.
``lose_response``
    call the store (the write happens), then raise a transient error, as
    when a response is lost on the network.
``truncate`` / ``corrupt``
    reads (``get``, ``get_ranges``) return shortened / bit-flipped bytes;
    writes (``put``, ``put_if_absent``, ``upload_part``) store shortened /
    bit-flipped bytes and report success (a silently damaged write).

Selection is by operation name (or ``"*"``), key glob, seeded probability
and a maximum count. ``injected`` counts what fired, by kind.
"""

from __future__ import annotations

import collections
import fnmatch
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..errors import ObjectNotFoundError, StorageError, TransientStorageError
from .base import MultipartUpload, ObjectStore
from .wrappers import WrapperStore

KINDS = ("error", "delay", "lose_response", "truncate", "corrupt")


def transient(code: str = "SlowDown") -> Callable:
    """Factory of transient errors (503 SlowDown, 500 InternalError, connection reset...)."""
    return lambda op, key: TransientStorageError(f"{key}: injected transient failure on {op} ({code})")


def permanent(code: str = "AccessDenied") -> Callable:
    """Factory of permanent errors (403 AccessDenied...)."""
    return lambda op, key: StorageError(f"{key}: injected permanent failure on {op} ({code})")


def not_found() -> Callable:
    return lambda op, key: ObjectNotFoundError(f"{key}: injected 404 on {op}")


@dataclass
class Fault:
    op: str = "*"
    key: str = "*"
    kind: str = "error"
    error: Callable | None = None
    probability: float = 1.0
    count: int | None = None
    delay: float = 0.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "error" and self.error is None:
            self.error = transient()


class FaultStore(WrapperStore):
    """Wraps a store and injects :class:`Fault` s into chosen calls (thread-safe, seeded)."""

    def __init__(self, inner: ObjectStore, rules=(), seed: int | None = 0):
        super().__init__(inner)
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.faults: list[Fault] = []
        self.injected: collections.Counter = collections.Counter()
        self.triggered: list[tuple[str, str]] = []
        for op, glob, factory, count in rules:
            self.add_rule(op, glob, factory, count)

    # compatibility: tests written against the first wrapper use rules
    @property
    def rules(self):
        return self.faults

    def add_rule(self, op: str, key_glob: str, error_factory: Callable, count: int | None = None) -> None:
        """An ``error`` fault whose factory may also return None (then it acts as a hook)."""
        self.add_fault(op=op, key=key_glob, kind="error", error=error_factory, count=count)

    def add_fault(self, **kw) -> Fault:
        f = Fault(**kw)
        with self._lock:
            self.faults.append(f)
        return f

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()

    def _pick(self, op: str, key: str) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.op not in ("*", op) or not fnmatch.fnmatchcase(key, f.key):
                    continue
                if f.count is not None and f.count <= 0:
                    continue
                if f.probability < 1.0 and self._rng.random() >= f.probability:
                    continue
                if f.count is not None:
                    f.count -= 1
                self.injected[f.kind] += 1
                self.triggered.append((op, key))
                return f
        return None

    def _damage(self, f: Fault, data: bytes) -> bytes:
        if f.kind == "truncate":
            return bytes(data[: max(0, len(data) - 1 - len(data) // 3)])
        if f.kind == "corrupt" and len(data):
            b = bytearray(data)
            with self._lock:
                i = self._rng.randrange(len(b))
            b[i] ^= 0x40
            return bytes(b)
        return data

    def _call(self, op: str, key: str, fn: Callable, *, write_data=None):
        f = self._pick(op, key)
        if f is None:
            return fn(write_data) if write_data is not None else fn(None)
        if f.kind == "error":
            err = f.error(op, key)
            if err is not None:
                raise err
            return fn(write_data) if write_data is not None else fn(None)
        if f.kind == "delay":
            time.sleep(f.delay)
            return fn(write_data) if write_data is not None else fn(None)
        if f.kind == "lose_response":
            fn(write_data) if write_data is not None else fn(None)
            raise TransientStorageError(f"{key}: injected lost response after {op}")
        # truncate / corrupt
        if write_data is not None:
            return fn(self._damage(f, write_data))
        out = fn(None)
        if isinstance(out, list):
            return [self._damage(f, b) for b in out]
        if isinstance(out, (bytes, bytearray, memoryview)):
            return self._damage(f, out)
        return out

    # -- operations
    def get(self, key):
        return self._call("get", key, lambda _: self.inner.get(key))

    def get_ranges(self, key, ranges):
        return self._call("get_ranges", key, lambda _: self.inner.get_ranges(key, ranges))

    def read_range_into(self, key, start, out, progress=None):
        # Through get_ranges, so that its faults apply to streamed reads too.
        return ObjectStore.read_range_into(self, key, start, out, progress)

    def put(self, key, data):
        return self._call("put", key, lambda d: self.inner.put(key, d), write_data=bytes(data))

    def put_if_absent(self, key, data):
        return self._call("put_if_absent", key, lambda d: self.inner.put_if_absent(key, d), write_data=bytes(data))

    def head(self, key):
        return self._call("head", key, lambda _: self.inner.head(key))

    def list(self, prefix=""):
        return iter(self._call("list", prefix or "*", lambda _: list(self.inner.list(prefix))))

    def delete(self, key):
        return self._call("delete", key, lambda _: self.inner.delete(key))

    def create_multipart(self, key, part_size):
        mpu = self._call("create_multipart", key, lambda _: self.inner.create_multipart(key, part_size))
        return _FaultMultipart(self, mpu)

    def list_multipart(self, prefix=""):
        return self._call("list_multipart", prefix or "*", lambda _: self.inner.list_multipart(prefix))

    def abort_multipart(self, key, upload_id):
        return self._call("abort_multipart", key, lambda _: self.inner.abort_multipart(key, upload_id))


class _FaultMultipart(MultipartUpload):
    def __init__(self, owner: FaultStore, inner: MultipartUpload):
        self.owner, self.inner = owner, inner
        self.key, self.part_size = inner.key, inner.part_size
        self.upload_id = getattr(inner, "upload_id", None)

    def upload_part(self, number, data):
        return self.owner._call("upload_part", self.key, lambda d: self.inner.upload_part(number, d),
                                write_data=bytes(data))

    def complete(self, nparts):
        return self.owner._call("complete_multipart", self.key, lambda _: self.inner.complete(nparts))

    def abort(self):
        return self.inner.abort()
