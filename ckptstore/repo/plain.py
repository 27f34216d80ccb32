"""Plain ``.safetensors`` objects in a bucket, read by parts without an import.

:class:`SafetensorsObject` reads the header with one ranged GET (after a
HEAD for the size: the header is checked against it,
:mod:`ckptstore.format.safetensors`), then each tensor, or a dim-0 slice of
it, from its own byte range only, through any :class:`~ckptstore.storage.ObjectStore`
(S3, GCS, Azure, local). Large ranges are cut into pieces read concurrently.

These reads are **not hash-checked**: a safetensors file carries no
digests. For checked reads (and dedup, slices along every dimension), import
the file into a repository (``ckptstore import``) and read that.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
from typing import Any, Callable

import torch

from ..errors import FormatError
from ..format import safetensors as _st
from ..pipeline import planner as _plan
from ..pipeline.staging import StagingBuffers
from ..pipeline.tensors import byte_view, castable, writable_in_place

MiB = 1 << 20
#: The first ranged read of an object: the 8-byte length and, mostly, the whole header (a
#: model's header is about 150 bytes a tensor: 64 KiB holds ~400 tensors; a longer one costs one more GET).
HEADER_PROBE = 64 << 10


#: The largest ``model.safetensors.index.json`` read.
MAX_INDEX_BYTES = 64 << 20
_SUFFIXES = (".safetensors", ".safetensors.index.json")


def is_safetensors_url(url) -> bool:
    """A URL or path naming one ``.safetensors`` object, or the index of a sharded model
    (``model.safetensors.index.json``)."""
    return isinstance(url, (str, os.PathLike)) and os.fspath(url).rstrip("/").endswith(_SUFFIXES)


class SafetensorsObject:
    """One plain safetensors object, its header read, its tensors read by parts.

    Parameters
    ----------
    store:
        The :class:`~ckptstore.storage.ObjectStore` holding it.
    key:
        Its key in ``store``.
    piece_bytes:
        Ranges longer than this are read as pieces of this size, ``workers`` at once.
    workers:
        Concurrent ranged reads (one pool per object).
    staging_bytes:
        Host buffers for destinations bytes cannot land in directly (another
        device or dtype, a slice across dim 1): at most this many bytes at
        once, pinned when a destination is on CUDA.
    owns_store:
        Close ``store`` in :meth:`close`.
    pool:
        A thread pool to read pieces on (not shut down by :meth:`close`); default one of ``workers`` threads.

    Attributes
    ----------
    header: the parsed :class:`~ckptstore.format.safetensors.Header`.
    url: the object's URL, for messages.
    """

    def __init__(self, store, key: str, *, piece_bytes: int = 8 * MiB, workers: int = 16,
                 staging_bytes: int = 64 * MiB, owns_store: bool = False, pool: cf.Executor | None = None):
        if piece_bytes < 1 or workers < 1 or staging_bytes < 1:
            raise ValueError("piece_bytes, workers and staging_bytes must be positive")
        self.store, self.key = store, key
        self.url = f"{store.url.rstrip('/')}/{key}"
        self.piece_bytes, self.workers, self.staging_bytes = piece_bytes, workers, staging_bytes
        self._owns = owns_store
        self._pool: cf.Executor | None = pool
        self._own_pool = pool is None
        try:
            self.header = self._read_header()
        except BaseException:
            self.close()
            raise

    # -- header
    def _read_header(self) -> _st.Header:
        size = self.store.head(self.key).size
        (first,) = self.store.get_ranges(self.key, [(0, min(size, HEADER_PROBE))])
        n = _st.header_length(first, size, self.url)
        if len(first) < 8 + n:
            (rest,) = self.store.get_ranges(self.key, [(len(first), 8 + n)])
            first = first + rest
        return _st.parse_header(memoryview(first)[8 : 8 + n], size, self.url)

    # -- what it holds
    def keys(self) -> list[str]:
        """Tensor names, in the order of their bytes."""
        return list(self.header.tensors)

    def __contains__(self, key) -> bool:
        return key in self.header.tensors

    def tensor(self, key: str) -> _st.PlainTensor:
        try:
            return self.header.tensors[key]
        except KeyError:
            raise KeyError(f"{self.url} has no tensor {key!r}") from None

    @property
    def metadata(self) -> dict[str, str]:
        return self.header.metadata

    def __repr__(self) -> str:
        return f"SafetensorsObject({self.url!r}, tensors={len(self.header.tensors)})"

    # -- reading
    def _fill(self, start: int, out: memoryview, on_bytes=None) -> None:
        """Read bytes ``[start, start + len(out))`` into ``out``, in concurrent pieces."""
        n = len(out)
        if n == 0:
            return
        if n <= self.piece_bytes:
            self.store.read_range_into(self.key, start, out)
            if on_bytes is not None:
                on_bytes(n)
            return
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="ckpt-plain")
        futures = []
        for a in range(0, n, self.piece_bytes):
            b = min(n, a + self.piece_bytes)
            futures.append(self._pool.submit(self.store.read_range_into, self.key, start + a, out[a:b]))
        try:
            for f, a in zip(futures, range(0, n, self.piece_bytes)):
                f.result()
                if on_bytes is not None:
                    on_bytes(min(n, a + self.piece_bytes) - a)
        except BaseException:
            for f in futures:
                f.cancel()
            cf.wait(futures)  # no piece may still write into ``out`` once this returns
            raise

    def read(self, key: str, index: Any = None, *, device=None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new tensor holding ``key`` (or its slice ``index``) on ``device`` (default CPU), as ``dtype``."""
        t = self.tensor(key)
        box, squeeze = _plan.normalize_index(index, t.shape)
        shape = [n for d, n in enumerate(_plan.box_shape(box)) if d not in squeeze]
        out = torch.empty(shape, dtype=dtype or t.dtype, device=device if device is not None else "cpu")
        return self.read_into(key, out, index)

    def read_into(self, key: str, dest: torch.Tensor, index: Any = None,
                  on_bytes: Callable[[int], None] | None = None, staging: StagingBuffers | None = None) -> torch.Tensor:
        """Fill ``dest`` with tensor ``key`` (or its slice ``index``), reading only the rows (dim-0
        indices) the slice covers.

        A contiguous CPU ``dest`` of the stored dtype whose slice is one run of
        the stored bytes (whole rows) receives them in its own memory; any
        other goes block by block through host buffers (``staging``, or a
        set made for this read). ``on_bytes(n)``: ``n`` more bytes of
        ``dest`` filled. Returns ``dest``.
        """
        t = self.tensor(key)
        box, squeeze = _plan.normalize_index(index, t.shape)
        want = tuple(n for d, n in enumerate(_plan.box_shape(box)) if d not in squeeze)
        if tuple(dest.shape) != want or not castable(t.dtype, dest.dtype):
            raise ValueError(f"{self.url}: tensor {key!r} is {str(t.dtype).removeprefix('torch.')}{list(t.shape)}; "
                             f"the destination of {list(want)} is "
                             f"{str(dest.dtype).removeprefix('torch.')}{list(dest.shape)}")
        target = dest.detach()
        for d in squeeze:
            target = target.unsqueeze(d)
        if target.numel() == 0:
            return dest
        rows = (box[0][0], box[0][0] + (_plan.box_len(box[0]) - 1) * box[0][2] + 1) if t.shape else (0, 1)
        whole_rows = all(b == (0, n, 1) for b, n in zip(box[1:], t.shape[1:])) and (not t.shape or box[0][2] == 1)
        if whole_rows and writable_in_place(target) and target.dtype == t.dtype:
            self._fill(t.start + rows[0] * t.row_bytes, memoryview(byte_view(target)), on_bytes)
            return dest
        own = staging is None
        if own:
            need = max(1, min(self.staging_bytes, t.row_bytes * (rows[1] - rows[0])))
            staging = StagingBuffers(max(need // 2, t.row_bytes, 1), 2,
                                     pin=target.device.type == "cuda" and torch.cuda.is_available())
        try:
            self._staged(t, box, rows, target, staging, on_bytes)
        finally:
            if own:
                staging.close()
        return dest

    def _staged(self, t: _st.PlainTensor, box, rows, target: torch.Tensor, staging: StagingBuffers, on_bytes) -> None:
        """Blocks of whole rows into a staging buffer, then the slice of each into ``target``."""
        per = max(1, staging.slot_bytes // max(1, t.row_bytes))
        step = box[0][2] if t.shape else 1
        per = max(step, per - per % step)  # a block starts on a row the slice takes
        r, out = rows[0], 0
        while r < rows[1]:
            r1 = min(rows[1], r + per)
            nrows = r1 - r
            if nrows * t.row_bytes > staging.slot_bytes:  # one row bigger than a buffer
                buf = torch.empty(nrows * t.row_bytes, dtype=torch.uint8)
                slot = None
            else:
                slot = staging.acquire()
                buf = slot.buf
            try:
                raw = buf[: nrows * t.row_bytes]
                self._fill(t.start + r * t.row_bytes, memoryview(raw.numpy()))
                block = raw.view(t.dtype).view((nrows,) + tuple(t.shape[1:])) if t.shape else raw.view(t.dtype)[0]
                if t.shape:
                    take = (slice(0, nrows, step),) + tuple(slice(a, b, s) for a, b, s in box[1:])
                    src = block[take]
                    dst = target[out : out + src.shape[0]]
                    out += src.shape[0]
                else:
                    src, dst = block, target
            except BaseException:
                if slot is not None:
                    staging.release(slot)
                raise
            if slot is None:
                dst.copy_(src)
            else:
                staging.copy_out(slot, src, dst)
            if on_bytes is not None:
                on_bytes(dst.numel() * dst.element_size())
            r = r1

    def close(self) -> None:
        if self._pool is not None and self._own_pool:
            self._pool.shutdown(wait=True)
        self._pool = None
        if self._owns:
            self._owns = False
            self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SafetensorsShards:
    """The safetensors objects a sharded model's ``model.safetensors.index.json`` names, read as one.

    The index (Hugging Face's: ``{"metadata": {...}, "weight_map": {tensor: file}}``, files
    beside it) is read whole (at most :data:`MAX_INDEX_BYTES`), then every file's header, as
    :class:`SafetensorsObject` reads one; each tensor is read from the file the map names, which
    must hold it. Same reading methods as :class:`SafetensorsObject`; not hash-checked either.
    The files share one pool of ``workers`` threads for their pieces.
    """

    def __init__(self, store, index_key: str, *, owns_store: bool = False, workers: int = 16, **options):
        self.store, self.key = store, index_key
        self.url = f"{store.url.rstrip('/')}/{index_key}"
        self._owns = owns_store
        self.objects: dict[str, SafetensorsObject] = {}
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="ckpt-plain")
        try:
            files = self._read_index()
            folder = index_key.rpartition("/")[0]
            for f in dict.fromkeys(files.values()):
                self.objects[f] = SafetensorsObject(store, f"{folder}/{f}" if folder else f, workers=workers,
                                                    pool=self._pool, **options)
            self.where = {}
            for name, f in files.items():
                if name not in self.objects[f]:
                    raise FormatError(f"{self.url}: weight_map puts tensor {name!r} in {f}, which has no such tensor")
                self.where[name] = self.objects[f]
        except BaseException:
            self.close()
            raise
        self.staging_bytes = next(iter(self.objects.values())).staging_bytes if self.objects else 64 * MiB

    def _read_index(self) -> dict[str, str]:
        size = self.store.head(self.key).size
        if size > MAX_INDEX_BYTES:
            raise FormatError(f"{self.url}: index of {size} bytes is over the {MAX_INDEX_BYTES}-byte limit")
        try:
            doc = json.loads(self.store.get(self.key).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise FormatError(f"{self.url}: not a safetensors index (not valid JSON: {e})") from None
        files = doc.get("weight_map") if type(doc) is dict else None
        if type(files) is not dict or not files or any(type(k) is not str or type(v) is not str
                                                       for k, v in files.items()):
            raise FormatError(f"{self.url}: not a safetensors index (no weight_map of tensor names to files)")
        for f in set(files.values()):
            parts = f.split("/")
            if not f.endswith(".safetensors") or f.startswith("/") or any(p in ("", ".", "..") for p in parts):
                raise FormatError(f"{self.url}: weight_map names {f!r}, not a .safetensors file beside the index")
        self.metadata = doc.get("metadata") if type(doc.get("metadata")) is dict else {}
        return files

    def keys(self) -> list[str]:
        """Tensor names, file by file in the index's order, each file's in the order of its bytes."""
        return [k for obj in self.objects.values() for k in obj.keys() if self.where.get(k) is obj]

    def __contains__(self, key) -> bool:
        return key in self.where

    def _obj(self, key: str) -> SafetensorsObject:
        try:
            return self.where[key]
        except KeyError:
            raise KeyError(f"{self.url} has no tensor {key!r}") from None

    def tensor(self, key: str) -> _st.PlainTensor:
        return self._obj(key).tensor(key)

    def read(self, key: str, index: Any = None, **kw) -> torch.Tensor:
        """As :meth:`SafetensorsObject.read`, from the file holding ``key``."""
        return self._obj(key).read(key, index, **kw)

    def read_into(self, key: str, dest: torch.Tensor, index: Any = None, **kw) -> torch.Tensor:
        """As :meth:`SafetensorsObject.read_into`, from the file holding ``key``."""
        return self._obj(key).read_into(key, dest, index, **kw)

    def __repr__(self) -> str:
        return f"SafetensorsShards({self.url!r}, files={len(self.objects)}, tensors={len(self.where)})"

    def close(self) -> None:
        for obj in self.objects.values():
            obj.close()
        self._pool.shutdown(wait=True)
        if self._owns:
            self._owns = False
            self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


#: What :func:`open_safetensors` returns.
PLAIN_SOURCES = (SafetensorsObject, SafetensorsShards)


def open_safetensors(url, storage_options: dict | None = None, **options) -> SafetensorsObject | SafetensorsShards:
    """Open the plain safetensors object ``url`` names (``s3://bucket/path/model.safetensors``,
    ``gs://``, ``az://``, ``file://`` or a path), or the files of a sharded model through its index
    (``.../model.safetensors.index.json``: a :class:`SafetensorsShards`), with the store's retries as
    :func:`ckptstore.open` has them. ``options``: as :class:`SafetensorsObject`."""
    from ..storage import open_store
    from ..storage.retry import RetryStore

    url = os.fspath(url).rstrip("/")
    if not is_safetensors_url(url):
        raise ValueError(f"{url!r} does not name a .safetensors object or a .safetensors.index.json")
    scheme, sep, rest = url.partition("://")
    if sep:
        folder, slash, key = rest.rpartition("/")
        if not slash or not folder.strip("/"):
            raise ValueError(f"{url!r} names no bucket or folder holding the object")
        root = f"{scheme}://{folder}"
    else:
        root, key = os.path.split(os.path.abspath(url))
    store = open_store(root, storage_options)
    if store.remote:
        store = RetryStore(store)
    if key.endswith(".index.json"):
        return SafetensorsShards(store, key, owns_store=True, **options)
    return SafetensorsObject(store, key, owns_store=True, **options)


__all__ = ["SafetensorsObject", "SafetensorsShards", "PLAIN_SOURCES", "open_safetensors", "is_safetensors_url",
           "HEADER_PROBE"]
