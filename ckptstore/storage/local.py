"""A directory on a local (or mounted) file system.

Durable writes go to a temporary file in ``.tmp/`` that is fsynced and then
renamed into place (``put``) or hard-linked into place (``put_if_absent``:
``link`` fails if the target exists, which makes it an atomic exclusive
create even on file systems where ``O_EXCL`` on the final name would expose a
half-written file). Multipart uploads write parts with ``pwrite`` at their
final offsets into one temporary file; they also take positional writes
(:meth:`_LocalMultipart.write_at`, ``pwritev`` of a chunk's pieces straight
from the caller's buffers, no part buffer in between: what
:class:`~ckptstore.storage.upload.ParallelUploader` uses for local packs).
Write-out of an upload's data is started every :data:`WRITEBACK_BYTES`
(``sync_file_range``, Linux), so that the ``fsync`` of :meth:`complete`
finds little left to write instead of the whole object. A directory
created for an object is made durable in its parent too.

Opening a store and reading from it create nothing: the directory and its
``.tmp/`` appear with the first write, so a mistyped path leaves no trace.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import uuid
from typing import Iterator, Sequence

from ..errors import ObjectExistsError, ObjectNotFoundError
from .base import READ_PIECE, MultipartInfo, MultipartUpload, ObjectInfo, ObjectStore, check_key, check_ranges

_TMP = ".tmp"
MiB = 1 << 20
#: Bytes written to an upload after which their write-out to disk is started.
WRITEBACK_BYTES = 8 * MiB
_SYNC_FILE_RANGE_WRITE = 2
_IOV_MAX = 1024


def _find_sync_file_range():
    """libc's ``sync_file_range`` (GIL released while it runs), or None off Linux."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _find_sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``[offset, offset + length)`` of ``fd`` to disk; returns at once.

    A hint only (no durability: the ``fsync`` that follows is what makes the
    data durable, and reports errors); a no-op where it is unavailable.
    """
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


class LocalStore(ObjectStore):
    mtime_resolution = 0.01  # coarse-timestamp file systems
    #: Its uploads take ``write_at(offset, buffers)`` and ``complete_written(size)``.
    positional_multipart = True
    """Objects as files under ``root``.

    Parameters
    ----------
    root:
        Directory holding the store; created by the first write (opening
        and reading never create it).
    fsync:
        Flush file data and directory entries to disk before a write returns
        (default True: a committed step survives a power cut).
    """

    def __init__(self, root: str, fsync: bool = True):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.fsync = fsync
        self.url = f"file://{self.root}"
        self._tmp_root = os.path.join(self.root, _TMP)
        self._tmp_made = False

    def _path(self, key: str) -> str:
        check_key(key)
        if key.split("/", 1)[0] == _TMP:
            raise ValueError(f"key {key!r} is reserved")
        return os.path.join(self.root, *key.split("/"))

    def tmp_dir(self) -> str:
        """``.tmp/`` (with the store's directory), created on the first write."""
        if not self._tmp_made:
            os.makedirs(self._tmp_root, exist_ok=True)
            self._tmp_made = True
        return self._tmp_root

    def _tmp_path(self, tag: str = "") -> str:
        return os.path.join(self.tmp_dir(), f"{uuid.uuid4().hex}{tag}")

    def _missing(self, key: str) -> ObjectNotFoundError:
        return ObjectNotFoundError(f"{self.url}/{key}: no such object")

    def get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise self._missing(key) from None

    @contextlib.contextmanager
    def _reading(self, key: str):
        """An open descriptor of ``key`` and the object's size."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise self._missing(key) from None
        try:
            yield fd, os.fstat(fd).st_size
        finally:
            os.close(fd)

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        ranges = check_ranges(ranges)
        with self._reading(key) as (fd, size):
            out = []
            for s, e in ranges:
                if e > size:
                    raise ValueError(f"{self.url}/{key}: range [{s}, {e}) past end of {size}-byte object")
                out.append(os.pread(fd, e - s, s) if e > s else b"")
            return out

    def read_range_into(self, key: str, start: int, out, progress=None) -> None:
        mv = memoryview(out).cast("B")
        n = len(mv)
        with self._reading(key) as (fd, size):
            if start < 0 or start + n > size:
                raise ValueError(f"{self.url}/{key}: range [{start}, {start + n}) past end of {size}-byte object")
            got = 0
            while got < n:
                k = os.preadv(fd, [mv[got : min(n, got + READ_PIECE)]], start + got)
                if k <= 0:  # the file shrank under us: packs never do
                    raise ValueError(f"{self.url}/{key}: object ended at {start + got}, inside range "
                                     f"[{start}, {start + n})")
                got += k
                if progress is not None:
                    progress(got)
            if n == 0 and progress is not None:
                progress(0)

    def _write_tmp(self, data) -> str:
        tmp = self._tmp_path()
        with open(tmp, "wb") as f:
            f.write(data)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        return tmp

    def _sync_dir(self, path: str) -> None:
        if self.fsync:
            fd = os.open(os.path.dirname(path), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _make_parent(self, path: str) -> None:
        """Create ``path``'s directory; each directory created is made durable in its parent."""
        d = os.path.dirname(path)
        if os.path.isdir(d):
            return
        created = []
        p = d
        while p != self.root and not os.path.isdir(p):
            created.append(p)
            p = os.path.dirname(p)
        os.makedirs(d, exist_ok=True)
        # Parents first: a name is durable once the directory holding it is.
        for c in reversed(created):
            self._sync_dir(c)

    def put(self, key: str, data) -> None:
        path = self._path(key)
        self._make_parent(path)
        tmp = self._write_tmp(data)
        os.replace(tmp, path)
        self._sync_dir(path)

    def put_if_absent(self, key: str, data) -> None:
        path = self._path(key)
        self._make_parent(path)
        if os.path.exists(path):
            raise ObjectExistsError(f"{self.url}/{key}: object already exists")
        tmp = self._write_tmp(data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise ObjectExistsError(f"{self.url}/{key}: object already exists") from None
        finally:
            os.unlink(tmp)
        self._sync_dir(path)

    def head(self, key: str) -> ObjectInfo:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            raise self._missing(key) from None
        if not os.path.isfile(self._path(key)):
            raise self._missing(key)
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Walk only the directory that can hold the prefix.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = os.path.join(self.root, *base.split("/")) if base else self.root
        found = []
        for dirpath, dirnames, filenames in os.walk(start):
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            if rel == "":
                dirnames[:] = [d for d in dirnames if d != _TMP]
            for name in filenames:
                key = rel + name
                if key.startswith(prefix):
                    try:
                        st = os.stat(os.path.join(dirpath, name))
                    except FileNotFoundError:
                        continue
                    found.append(ObjectInfo(key, st.st_size, st.st_mtime))
        found.sort(key=lambda o: o.key)
        yield from found

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def create_multipart(self, key: str, part_size: int) -> MultipartUpload:
        return _LocalMultipart(self, check_key(key), part_size)

    def list_multipart(self, prefix: str = "") -> list[MultipartInfo]:
        out = []
        tmpdir = self._tmp_root
        try:
            names = os.listdir(tmpdir)
        except (FileNotFoundError, NotADirectoryError):
            return []  # nothing was ever written here
        for name in names:
            if not name.endswith(".mpu"):
                continue
            try:
                with open(os.path.join(tmpdir, name), encoding="utf-8") as f:
                    key = f.read()
                st = os.stat(os.path.join(tmpdir, name))
            except FileNotFoundError:
                continue
            if key.startswith(prefix):
                out.append(MultipartInfo(key, name[: -len(".mpu")], st.st_mtime))
        return sorted(out)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        tmpdir = self._tmp_root
        if not all(c in "0123456789abcdef" for c in upload_id):
            raise ValueError(f"invalid upload id {upload_id!r}")
        for suffix in (".mpu", ".part"):
            try:
                os.unlink(os.path.join(tmpdir, upload_id + suffix))
            except FileNotFoundError:
                pass


class _LocalMultipart(MultipartUpload):
    """An upload into one temporary file: parts (``upload_part``) or positional writes (``write_at``)."""

    def __init__(self, store: LocalStore, key: str, part_size: int):
        super().__init__(key, part_size)
        self.store = store
        self.upload_id = uuid.uuid4().hex
        tmpdir = store.tmp_dir()
        self._marker = os.path.join(tmpdir, self.upload_id + ".mpu")
        self._data = os.path.join(tmpdir, self.upload_id + ".part")
        # Written to a temporary name and renamed, so a kill never leaves an
        # empty marker naming no key.
        with open(self._marker + ".new", "w", encoding="utf-8") as f:
            f.write(key)
        os.replace(self._marker + ".new", self._marker)
        self._fd = os.open(self._data, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()
        self._written = 0  # bytes written by write_at
        self._wb_from = 0  # write_at's data before this offset has had its write-out started

    def _open_fd(self) -> int:
        if self._fd < 0:
            raise ObjectNotFoundError(f"{self.store.url}/{self.key}: multipart upload was aborted")
        return self._fd

    def upload_part(self, number: int, data) -> None:
        self._check_part(number, data)
        fd = self._open_fd()
        mv = memoryview(data).cast("B")
        off = start = (number - 1) * self.part_size
        while len(mv):
            n = os.pwrite(fd, mv, off)
            mv, off = mv[n:], off + n
        if self.store.fsync:
            start_writeback(fd, start, off - start)
        self._sizes[number] = len(data)

    def write_at(self, offset: int, buffers) -> int:
        """Write ``buffers`` back to back at ``offset`` (one ``pwritev``, no copy); returns the bytes written.

        Positional writes never overlap; the object is what
        :meth:`complete_written` finds once every byte of it was written.
        """
        fd = self._open_fd()
        views = [m for m in (memoryview(b).cast("B") for b in buffers) if len(m)]
        total = sum(len(m) for m in views)
        off = offset
        while views:
            n = os.pwritev(fd, views[:_IOV_MAX], off)
            off += n
            # A short write (rare on files): drop what went out, go on with the rest.
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]
        wb = None
        with self._lock:
            self._written += total
            if self.store.fsync and off - self._wb_from >= WRITEBACK_BYTES:
                wb = (self._wb_from, off - self._wb_from)
                self._wb_from = off
        if wb is not None:
            start_writeback(fd, *wb)
        return total

    def complete(self, nparts: int) -> None:
        if self._written:
            raise ValueError(f"{self.store.url}/{self.key}: bytes were written at offsets; use complete_written")
        self._check_parts(nparts, self._sizes)
        self._finish((nparts - 1) * self.part_size + self._sizes[nparts])

    def complete_written(self, size: int) -> None:
        """Make the ``size`` bytes written by :meth:`write_at` the object (fsynced, then renamed into place)."""
        self._open_fd()
        if self._sizes or self._written != size:
            raise ValueError(f"{self.store.url}/{self.key}: {self._written} bytes written at offsets, "
                             f"completing {size}" + (" (parts were uploaded too)" if self._sizes else ""))
        self._finish(size)

    def _finish(self, size: int) -> None:
        os.ftruncate(self._fd, size)
        if self.store.fsync:
            os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        path = self.store._path(self.key)
        self.store._make_parent(path)
        os.replace(self._data, path)
        self.store._sync_dir(path)
        os.unlink(self._marker)

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        for p in (self._data, self._marker):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
