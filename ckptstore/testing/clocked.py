"""A store whose object times follow a :class:`~ckptstore.clock.ManualClock`.

Object stores date objects by their own clock, so advancing a test's clock
alone would make objects written *after* the advance look old as well.
:class:`ClockedStore` records the clock's offset when each object (and
each multipart upload) is created through it and adds it to the times it
reports: an object written after ``clock.advance(60)`` is dated 60 s later,
as if the minute had really passed. Several handles on one repository
share the record by sharing ``offsets``. Objects written by anyone else
(another process) carry no offset: they are dated by the store alone.
"""

from __future__ import annotations

import dataclasses
import threading

from ..clock import ManualClock
from ..storage.base import MultipartInfo, MultipartUpload, ObjectInfo, ObjectStore
from ..storage.wrappers import WrapperStore


class ClockOffsets:
    """The clock offset each object was written at, shared by stores on one repository."""

    def __init__(self):
        self._by_key: dict[str, float] = {}
        self._by_upload: dict[str, float] = {}
        self._lock = threading.Lock()

    def wrote(self, key: str, offset: float) -> None:
        with self._lock:
            self._by_key[key] = offset

    def started(self, upload_id: str, offset: float) -> None:
        with self._lock:
            self._by_upload[upload_id] = offset

    def of_key(self, key: str) -> float:
        return self._by_key.get(key, 0.0)

    def of_upload(self, upload_id: str) -> float:
        return self._by_upload.get(upload_id, 0.0)


class ClockedStore(WrapperStore):
    """See the module docstring."""

    def __init__(self, inner: ObjectStore, clock: ManualClock, offsets: ClockOffsets | None = None):
        super().__init__(inner)
        self.clock = clock
        self.offsets = offsets if offsets is not None else ClockOffsets()

    def _dated(self, info: ObjectInfo) -> ObjectInfo:
        return dataclasses.replace(info, mtime=info.mtime + self.offsets.of_key(info.key))

    def put(self, key, data):
        self.offsets.wrote(key, self.clock.offset)
        return self.inner.put(key, data)

    def put_if_absent(self, key, data):
        offset = self.clock.offset
        self.inner.put_if_absent(key, data)
        self.offsets.wrote(key, offset)

    def head(self, key):
        return self._dated(self.inner.head(key))

    def list(self, prefix=""):
        for info in self.inner.list(prefix):
            yield self._dated(info)

    def create_multipart(self, key, part_size):
        mpu = self.inner.create_multipart(key, part_size)
        upload_id = getattr(mpu, "upload_id", None)
        if upload_id is not None:
            self.offsets.started(upload_id, self.clock.offset)
        return _DatedUpload(mpu, self, key)

    def list_multipart(self, prefix=""):
        return [
            dataclasses.replace(u, initiated=u.initiated + self.offsets.of_upload(u.upload_id))
            for u in self.inner.list_multipart(prefix)
        ]


class _DatedUpload(MultipartUpload):
    def __init__(self, inner: MultipartUpload, owner: ClockedStore, key: str):
        self.inner = inner
        self.owner = owner
        self.key = key
        self.part_size = inner.part_size

    def upload_part(self, number, data):
        return self.inner.upload_part(number, data)

    def complete(self, nparts):
        offset = self.owner.clock.offset
        self.inner.complete(nparts)
        self.owner.offsets.wrote(self.key, offset)

    def abort(self):
        return self.inner.abort()


__all__ = ["ClockedStore", "ClockOffsets", "MultipartInfo"]
