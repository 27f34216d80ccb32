"""In-process store: a dict guarded by a lock. Named stores are shared.

``memory://name`` opened twice in one process reaches the same objects, the
way fsspec's memory filesystem behaves, so tests can reopen a repository.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Iterator, Sequence

from ..errors import ObjectExistsError, ObjectNotFoundError
from .base import MultipartInfo, MultipartUpload, ObjectInfo, ObjectStore, check_key, check_ranges

_REGISTRY: dict[str, "_MemoryData"] = {}
_REGISTRY_LOCK = threading.Lock()


class _MemoryData:
    def __init__(self):
        self.lock = threading.Lock()
        self.objects: dict[str, tuple[bytes, float]] = {}
        self.uploads: dict[str, tuple[str, float, dict[int, bytes]]] = {}


class MemoryStore(ObjectStore):
    """Objects held in memory; ``name`` selects a process-wide namespace."""

    def __init__(self, name: str | None = None):
        if name is None:
            self._d = _MemoryData()
            name = f"anon-{id(self._d):x}"
        else:
            with _REGISTRY_LOCK:
                self._d = _REGISTRY.setdefault(name, _MemoryData())
        self.name = name
        self.url = f"memory://{name}"

    @staticmethod
    def clear(name: str) -> None:
        """Drop a named namespace (tests)."""
        with _REGISTRY_LOCK:
            _REGISTRY.pop(name, None)

    def _obj(self, key: str) -> bytes:
        try:
            return self._d.objects[check_key(key)][0]
        except KeyError:
            raise ObjectNotFoundError(f"{self.url}/{key}: no such object") from None

    def get(self, key: str) -> bytes:
        with self._d.lock:
            return self._obj(key)

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        ranges = check_ranges(ranges)
        with self._d.lock:
            data = self._obj(key)
        for s, e in ranges:
            if e > len(data):
                raise ValueError(f"{self.url}/{key}: range [{s}, {e}) past end of {len(data)}-byte object")
        return [data[s:e] for s, e in ranges]

    def put(self, key: str, data) -> None:
        data = bytes(data)
        with self._d.lock:
            self._d.objects[check_key(key)] = (data, time.time())

    def put_if_absent(self, key: str, data) -> None:
        data = bytes(data)
        with self._d.lock:
            if check_key(key) in self._d.objects:
                raise ObjectExistsError(f"{self.url}/{key}: object already exists")
            self._d.objects[key] = (data, time.time())

    def head(self, key: str) -> ObjectInfo:
        with self._d.lock:
            try:
                data, mtime = self._d.objects[check_key(key)]
            except KeyError:
                raise ObjectNotFoundError(f"{self.url}/{key}: no such object") from None
        return ObjectInfo(key, len(data), mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with self._d.lock:
            items = [(k, len(v[0]), v[1]) for k, v in self._d.objects.items() if k.startswith(prefix)]
        for k, size, mtime in sorted(items):
            yield ObjectInfo(k, size, mtime)

    def delete(self, key: str) -> None:
        with self._d.lock:
            self._d.objects.pop(check_key(key), None)

    def create_multipart(self, key: str, part_size: int) -> MultipartUpload:
        return _MemoryMultipart(self, check_key(key), part_size)

    def list_multipart(self, prefix: str = "") -> list[MultipartInfo]:
        with self._d.lock:
            return sorted(
                MultipartInfo(k, uid, t) for uid, (k, t, _) in self._d.uploads.items() if k.startswith(prefix)
            )

    def abort_multipart(self, key: str, upload_id: str) -> None:
        with self._d.lock:
            self._d.uploads.pop(upload_id, None)


class _MemoryMultipart(MultipartUpload):
    def __init__(self, store: MemoryStore, key: str, part_size: int):
        super().__init__(key, part_size)
        self.store = store
        self.upload_id = uuid.uuid4().hex
        with store._d.lock:
            store._d.uploads[self.upload_id] = (key, time.time(), {})

    def _parts(self) -> dict[int, bytes]:
        try:
            return self.store._d.uploads[self.upload_id][2]
        except KeyError:
            raise ObjectNotFoundError(f"{self.store.url}/{self.key}: multipart upload was aborted") from None

    def upload_part(self, number: int, data) -> None:
        self._check_part(number, data)
        data = bytes(data)
        with self.store._d.lock:
            self._parts()[number] = data

    def complete(self, nparts: int) -> None:
        with self.store._d.lock:
            parts = self._parts()
            self._check_parts(nparts, {n: len(b) for n, b in parts.items()})
            self.store._d.objects[self.key] = (b"".join(parts[n] for n in range(1, nparts + 1)), time.time())
            del self.store._d.uploads[self.upload_id]

    def abort(self) -> None:
        with self.store._d.lock:
            self.store._d.uploads.pop(self.upload_id, None)
