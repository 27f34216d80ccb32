"""Google Cloud Storage through gcsfs (JSON API).

Every request goes through ``GCSFileSystem._request`` / ``_call`` (gcsfs's
aiohttp session on fsspec's I/O loop; the sync bridge is safe from many
threads at once). gcsfs's high-level file API is not used: it caches
listings and infers directories, and its experimental "extended" file system
probes buckets over gRPC. We send the few JSON API requests we need.

Errors. gcsfs turns responses into built-in exceptions
(``gcsfs.retry.validate_response``): 404 -> ``FileNotFoundError``, 412 ->
``FileExistsError``, 403 -> ``OSError("Forbidden...")``, 502 ->
``requests.ProxyError``, a 400 mentioning "invalid" -> ``ValueError``, any
other status -> ``gcsfs.retry.HttpError`` with ``.code``. :func:`classify_error`
maps those to ckptstore's tree: 412 on a conditional create ->
:class:`ObjectExistsError`, 404 -> :class:`ObjectNotFoundError` (a 404 on an
object says nothing of the bucket: the first one asks, with a listing of
one object, and a missing bucket is a :class:`StorageError` saying so),
408/429/5xx and
connection failures -> :class:`TransientStorageError`, the rest ->
:class:`StorageError`. gcsfs itself retries 408/429/5xx and connection errors
up to 6 times with exponential backoff (about 30 s in all) before we see them.

Uploads. ``put`` is one "media" upload (the bytes as the body, no copy into
a multipart/related body; an empty object goes through gcsfs's
``simple_upload`` because the emulator drops an empty media upload).

Conditional create. ``put_if_absent`` is that same single upload with
``ifGenerationMatch=0``: GCS creates the object only if no live object
has the name and answers 412 otherwise, atomically.

Multipart: parallel composite upload. Each part is uploaded as its own
temporary object ``<prefix>/.uploads/<key>/<upload-id>/part-NNNNN`` (a marker
``.../upload`` is written when the upload starts, so an upload with no part
yet is still listed); ``complete`` composes them into the destination with
``compose`` (at most 32 sources a call, so more parts compose in a tree
through ``.../compose-L-NNNNN`` intermediates), checks the composed size, then
deletes the temporaries. Each source is pinned by the generation its upload
returned, so a part re-uploaded concurrently cannot slip in. ``abort``,
``list_multipart`` and ``abort_multipart`` work on that ``.uploads/``
directory, which GC reaches through them; ``list`` hides it and keys under
it are refused.

Why composite rather than gcsfs's resumable upload. A resumable upload takes
its bytes strictly in order, in chunks that are multiples of 256 KiB, one
request at a time: parts uploaded concurrently and out of order (what
:class:`~ckptstore.storage.base.ParallelUploader` does) would have to be held
in memory until their turn, or the pool threads would block on each other,
and one upload could only ever use one connection. Composite parts upload
concurrently like S3 parts.

Measured on this machine (2 shared cores, 64 MiB of random bytes) against
gcp-storage-emulator 2026.7.19 (in-process, serving one request at a time, so
concurrency cannot help there), best of 3:

* gcsfs resumable upload, 8 MiB chunks in sequence:        ~0.4 s
* one media upload of all 64 MiB:                          ~0.4 s
* composite: 8 x 8 MiB parts (1 or 4 threads):    parts    ~0.17 s
             compose + delete temporaries:                  ~1.3 s
             total                                          ~1.45 s

The parts themselves are the fastest path; the emulator's compose is slow
because it concatenates and checksums the 64 MiB in Python. On GCS, compose
is a server-side metadata operation that copies no data, while a single
upload stream is bounded well below a host's bandwidth, so several parts in
flight multiply throughput, which is what the save pipeline is built around:
composite is the choice, measured slower only where the emulator
reimplements compose by copying. Costs to know: temporary part objects
count as stored bytes until deleted and, where the bucket has a soft-delete
policy (the default is 7 days), for that long after; composite objects carry a CRC32C but no MD5; parts in
Nearline/Coldline buckets incur early-deletion charges. GCS now documents
an option to hard-delete the sources as part of a compose (sparing the
soft-delete charge); the emulator does not know it, so it is not used yet.
GCS's XML API
multipart upload (S3-style) avoids temporary objects but gcsfs does not
speak it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import threading
import uuid
from datetime import datetime, timezone
from typing import Callable, Iterator, Sequence

# gcsfs >= 2026 otherwise probes every bucket over gRPC first (and waits ~60 s
# against an emulator); must be set before gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from ..errors import (  # noqa: E402
    CkptStoreError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    TransientStorageError,
)
from ._classify import (  # noqa: E402
    MAX_MESSAGE,
    check_resolves,
    host_not_resolved,
    in_chain,
    is_network_error,
    optional_types,
    scrub,
)
from .base import (  # noqa: E402
    MultipartInfo,
    MultipartUpload,
    ObjectInfo,
    ObjectStore,
    RangeReplyError,
    check_key,
    check_range_reply,
    check_ranges,
    each_limited,
    gather_limited,
)

#: Reserved directory (under the store root) holding multipart temporaries.
UPLOADS = ".uploads"
#: Most sources GCS accepts in one compose request.
MAX_COMPOSE = 32
_MARKER = "upload"
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
_TIMESTAMP = re.compile(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)?$")
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


def parse_timestamp(text: str) -> float:
    """RFC 3339 time as GCS writes it (ms; the emulator writes µs) -> epoch seconds."""
    m = _TIMESTAMP.match(text or "")
    if m is None:
        raise StorageError(f"unparseable GCS timestamp {text!r}")
    y, mo, d, h, mi, s, frac, tz = m.groups()
    dt = datetime(int(y), int(mo), int(d), int(h), int(mi), int(s), tzinfo=timezone.utc)
    value = dt.timestamp() + (float("0." + frac) if frac else 0.0)
    if tz and tz != "Z":
        sign = 1 if tz[0] == "+" else -1
        value -= sign * (int(tz[1:3]) * 3600 + int(tz[4:6]) * 60)
    return value


def _status(exc: BaseException) -> int | None:
    """HTTP status behind a gcsfs exception, where gcsfs kept one."""
    def pick(e):
        for attr in ("code", "status"):  # gcsfs HttpError, aiohttp.ClientResponseError
            v = getattr(e, attr, None)
            if isinstance(v, int) and 100 <= v < 600:
                return v
        return None

    return in_chain(exc, pick)


def _is_connection_error(exc: BaseException) -> bool:
    # gcsfs raises requests' ProxyError for a 502 response; an aiohttp
    # response error carries a status and is classified by it.
    return is_network_error(
        exc,
        optional_types("aiohttp:ClientError", "requests.exceptions:ConnectionError", "requests.exceptions:Timeout"),
        not_these=optional_types("aiohttp:ClientResponseError"),
    )


def classify_error(exc: BaseException, where: str, op: str, exists_on_412: bool = False) -> Exception:
    """Turn an exception from gcsfs/aiohttp into a ckptstore exception.

    Parameters
    ----------
    exc:
        What the gcsfs call raised.
    where:
        ``gs://bucket/key`` (or the store URL), for the message.
    op:
        The GCS operation, for the message.
    exists_on_412:
        The call was a conditional create (``ifGenerationMatch=0``): a failed
        precondition means the object already exists.
    """
    if isinstance(exc, CkptStoreError):
        return exc
    dns = host_not_resolved(exc, where, f"GCS {op}")
    if dns is not None:
        return dns
    status = _status(exc)
    message = str(getattr(exc, "message", "") or exc)[:MAX_MESSAGE]
    if isinstance(exc, FileExistsError) or status == 412:
        if exists_on_412:
            return ObjectExistsError(f"{where}: object already exists (GCS {op}: 412 precondition failed)")
        return StorageError(f"{where}: GCS {op} failed (412 precondition failed)")
    if isinstance(exc, FileNotFoundError) or status == 404:
        return ObjectNotFoundError(f"{where}: no such object (GCS {op}: 404)")
    if status is not None:
        text = f"{where}: GCS {op} failed ({status}): {message}"
        if status in _TRANSIENT_STATUS or status >= 500:
            return TransientStorageError(text)
        return StorageError(text)
    if _is_connection_error(exc):
        return TransientStorageError(f"{where}: GCS {op} failed: {type(exc).__name__}: {message}")
    return StorageError(f"{where}: GCS {op} failed: {type(exc).__name__}: {message}")


def _errors_to_classify() -> tuple[type[BaseException], ...]:
    return (OSError, ValueError, asyncio.TimeoutError, *optional_types(
        "gcsfs.retry:HttpError", "aiohttp:ClientError", "google.auth.exceptions:GoogleAuthError"))


def _body(data) -> bytes:
    if isinstance(data, bytes):
        return data
    return memoryview(data).cast("B").tobytes()


_TOKEN_METHODS = frozenset({"anon", "google_default", "cache", "cloud", "browser"})


class GCSStore(ObjectStore):
    """Objects under ``gs://bucket/prefix``.

    Parameters
    ----------
    path:
        ``"bucket"`` or ``"bucket/prefix"`` (a ``gs://``/``gcs://`` scheme is accepted).
    storage_options:
        Passed to :class:`gcsfs.GCSFileSystem` (``token``, ``project``,
        ``endpoint_url``, ``requester_pays``, ``session_kwargs``...). The file
        system is created on first use, so opening a store makes no request.
    max_concurrency:
        Most requests of one :meth:`get_ranges` call, or of one compose
        round or cleanup, in flight at once.
    resolver:
        ``socket.getaddrinfo`` (the default) or a stand-in with its
        signature: the endpoint's host is resolved once, before the first
        request, and a name that does not resolve raises
        :class:`~ckptstore.errors.HostNotResolvedError` at once; gcsfs would
        otherwise retry it for about 30 s per call. Skipped when the session
        goes through a proxy (``session_kwargs`` with ``trust_env`` or a
        connector), where the proxy resolves names.
    """

    mtime_resolution = 0.001  # GCS "updated" has milliseconds (the emulator: µs)
    remote = True

    def __init__(self, path: str, storage_options: dict | None = None, max_concurrency: int = 16,
                 resolver: Callable | None = None):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        for scheme in ("gs://", "gcs://"):
            if path.startswith(scheme):
                path = path[len(scheme) :]
        bucket, _, prefix = path.strip("/").partition("/")
        prefix = prefix.strip("/")
        if "@" in bucket:
            raise ValueError("GCS path must not embed credentials; pass them in storage_options")
        if not bucket or ":" in bucket or "?" in path or "#" in path:
            raise ValueError(f"invalid GCS bucket name {bucket!r}")
        if prefix:
            check_key(prefix)
        self.bucket = bucket
        self.prefix = prefix
        self._root = f"{prefix}/" if prefix else ""
        self.url = f"gs://{bucket}/{prefix}" if prefix else f"gs://{bucket}"
        self.max_concurrency = max_concurrency
        opts = dict(storage_options or {})
        opts["skip_instance_cache"] = True
        opts["use_listings_cache"] = False
        self._opts = opts
        secrets = []
        token = opts.get("token")
        if isinstance(token, str) and token not in _TOKEN_METHODS:
            secrets.append(token)
        elif isinstance(token, dict):
            secrets += [str(v) for k, v in token.items() if "key" in k or "secret" in k or "token" in k]
        self._secrets = tuple(s for s in secrets if s)
        self._fs_obj = None
        self._fs_lock = threading.Lock()
        self._bucket_seen = False
        self._catch = _errors_to_classify()
        self._resolver = resolver or socket.getaddrinfo

    def __repr__(self) -> str:
        return f"GCSStore({self.url!r})"

    # ------------------------------------------------------------ plumbing
    @property
    def _fs(self):
        if self._fs_obj is None:
            with self._fs_lock:
                if self._fs_obj is None:
                    import gcsfs.core

                    # The core class: the "extended" one probes buckets over gRPC.
                    fs = gcsfs.core.GCSFileSystem(**self._gcsfs_options())
                    session = self._opts.get("session_kwargs") or {}
                    location = getattr(fs, "_location", None)
                    if isinstance(location, str) and not (session.get("trust_env") or "connector" in session):
                        check_resolves(location, self.url, "GCS", self._resolver)
                    self._fs_obj = fs
        return self._fs_obj

    def _gcsfs_options(self) -> dict:
        opts = self._opts
        # With STORAGE_EMULATOR_HOST set and no token, connect anonymously, as
        # google-cloud-storage does for an emulator: gcsfs would otherwise try
        # application-default credentials and the GCE metadata server first.
        if "token" not in opts and os.environ.get("STORAGE_EMULATOR_HOST", "") not in ("", "default"):
            opts = {**opts, "token": "anon"}
        return opts

    def _missing_bucket(self, op: str) -> StorageError | None:
        # An object call answered 404: the object, or the whole bucket? Asked
        # once (a bucket seen to exist is not asked about again), with a
        # listing of at most one object, which answers 404 only for a
        # missing bucket and needs no permission a repository does not.
        if self._bucket_seen:
            return None
        from fsspec.asyn import sync

        async def probe():
            await self._fs._call("GET", "b/{}/o", self.bucket, json_out=True, maxResults=1)

        try:
            sync(self._fs.loop, probe)
        except FileNotFoundError:
            return StorageError(f"gs://{self.bucket}: bucket does not exist (GCS {op}: 404)")
        except self._catch:
            return None  # the 404 stands as it is
        self._bucket_seen = True
        return None

    def _full(self, key: str) -> str:
        check_key(key)
        if key == UPLOADS or key.startswith(UPLOADS + "/"):
            raise ValueError(f"object key {key!r} is reserved for multipart uploads")
        return self._root + key

    def _where(self, key: str | None = None) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _error(self, exc: BaseException, key: str | None, op: str, exists_on_412: bool = False) -> Exception:
        return scrub(classify_error(exc, self._where(key), op, exists_on_412), exc, self._secrets)

    def _run(self, key: str | None, op: str, coro_fn, *args, exists_on_412: bool = False, **kwargs):
        from fsspec.asyn import sync

        fs = self._fs
        try:
            out = sync(fs.loop, coro_fn, *args, **kwargs)
        except RangeReplyError as e:
            raise ValueError(str(e)) from None
        except self._catch as e:
            err = self._error(e, key, op, exists_on_412)
            if isinstance(err, ObjectNotFoundError):
                err = self._missing_bucket(op) or err
            if err is e:
                raise
            raise err from e
        self._bucket_seen = True
        return out

    # async primitives: raw gcsfs exceptions, classified by _run
    async def _aget_meta(self, full: str) -> dict:
        return await self._fs._call("GET", "b/{}/o/{}", self.bucket, full, json_out=True)

    async def _aupload(self, full: str, data: bytes, create: bool = False) -> dict:
        # A single-request "media" upload: the body is the bytes as they are
        # (gcsfs's simple_upload builds a multipart/related copy of them).
        # ``ifGenerationMatch=0`` makes it an atomic exclusive create.
        from gcsfs.core import quote, simple_upload

        fs = self._fs
        if not data:
            # gcp-storage-emulator fails on an empty media upload (drops the
            # connection); GCS takes either. gcsfs's multipart/related upload
            # sends the same query (ifGenerationMatch included).
            return await simple_upload(fs, self.bucket, full, data, mode="create" if create else "overwrite")
        kw = {"ifGenerationMatch": "0"} if create else {}
        return await fs._call(
            "POST",
            f"{fs._location}/upload/storage/v1/b/{quote(self.bucket)}/o",
            uploadType="media",
            name=full,
            headers={"Content-Type": "application/octet-stream"},
            data=data,
            json_out=True,
            **kw,
        )

    async def _adelete(self, full: str, missing_ok: bool = True) -> None:
        try:
            await self._fs._call("DELETE", "b/{}/o/{}", self.bucket, full)
        except FileNotFoundError:
            if not missing_ok:
                raise

    async def _alist(self, full_prefix: str) -> list[dict]:
        items: list[dict] = []
        token = None
        while True:
            try:
                resp = await self._fs._call(
                    "GET", "b/{}/o", self.bucket, json_out=True, prefix=full_prefix or None, pageToken=token
                )
            except FileNotFoundError:
                # Listing answers 404 only for a missing bucket: a
                # configuration error, never an empty repository.
                raise StorageError(f"gs://{self.bucket}: bucket does not exist (GCS objects.list: 404)") from None
            items.extend(resp.get("items", ()))
            token = resp.get("nextPageToken")
            if not token:
                return items

    async def _gather(self, coros) -> list:
        return await gather_limited(coros, self.max_concurrency)

    # ------------------------------------------------------------ reads
    def get(self, key: str) -> bytes:
        full = self._full(key)

        async def run():
            status, headers, _, data = await self._fs._request("GET", self._fs.url(f"{self.bucket}/{full}"))
            return data

        return self._run(key, "objects.get", run)

    async def _aget_range(self, full: str, key: str, start: int, end: int) -> tuple[bytes, int | None]:
        from gcsfs.retry import HttpError

        try:
            status, headers, _, data = await self._fs._request(
                "GET", self._fs.url(f"{self.bucket}/{full}"), headers={"Range": f"bytes={start}-{end - 1}"}
            )
        except HttpError as e:
            if e.code == 416:
                raise RangeReplyError(f"{self._where(key)}: range [{start}, {end}) past end of object") from None
            raise
        m = _CONTENT_RANGE.match(headers.get("Content-Range", ""))
        total = int(m.group(3)) if m and m.group(3) != "*" else None
        if status == 200 and total is None:
            # The server ignored the Range header and sent the whole object.
            total = len(data)
            data = data[start:end]
        check_range_reply(self._where(key), start, end, len(data), total)
        return data, total

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        ranges = check_ranges(ranges)
        full = self._full(key)
        todo = [(i, s, e) for i, (s, e) in enumerate(ranges) if e > s]

        async def run():
            got = await self._gather(self._aget_range(full, key, s, e) for _, s, e in todo)
            out = [b""] * len(ranges)
            size = None
            for (i, _, _), (data, total) in zip(todo, got):
                out[i] = data
                size = total if total is not None else size
            return out, size

        out, size = self._run(key, "objects.get", run)
        if len(todo) < len(ranges) or not ranges:
            # Empty ranges need no bytes, but the object must exist and the
            # ranges lie inside it, as in every other store.
            if size is None:
                size = self.head(key).size
            for s, e in ranges:
                if e > size:
                    raise ValueError(f"{self._where(key)}: range [{s}, {e}) past end of {size}-byte object")
        return out

    def head(self, key: str) -> ObjectInfo:
        meta = self._run(key, "objects.get", self._aget_meta, self._full(key))
        return ObjectInfo(key, int(meta["size"]), parse_timestamp(meta["updated"]))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # GCS lists names in lexicographic (UTF-8 byte = code point) order.
        items = self._run(prefix or None, "objects.list", self._alist, self._root + prefix)
        for obj in items:
            rel = obj["name"][len(self._root) :]
            if rel.startswith(UPLOADS + "/"):
                continue
            try:
                check_key(rel)
            except ValueError:
                continue  # "dir/" placeholders made by other tools
            yield ObjectInfo(rel, int(obj["size"]), parse_timestamp(obj["updated"]))

    # ------------------------------------------------------------ writes
    def put(self, key: str, data) -> None:
        self._run(key, "objects.insert", self._aupload, self._full(key), _body(data))

    def put_if_absent(self, key: str, data) -> None:
        self._run(
            key, "objects.insert", self._aupload, self._full(key), _body(data), True, exists_on_412=True
        )

    def delete(self, key: str) -> None:
        self._run(key, "objects.delete", self._adelete, self._full(key))

    def delete_many(self, keys: Sequence[str]) -> None:
        """One ``objects.delete`` per key, ``max_concurrency`` at a time; the first failure names its key."""
        from fsspec.asyn import sync

        fulls = [self._full(k) for k in keys]
        failed: list[int] = []
        try:
            sync(self._fs.loop, each_limited, self._adelete, fulls, self.max_concurrency, failed)
        except self._catch as e:
            err = self._error(e, keys[failed[0]] if failed else None, "objects.delete", False)
            if err is e:
                raise
            raise err from e

    # ------------------------------------------------------------ multipart
    def _upload_dir(self, key: str, upload_id: str) -> str:
        return f"{self._root}{UPLOADS}/{key}/{upload_id}/"

    def create_multipart(self, key: str, part_size: int) -> MultipartUpload:
        self._full(key)
        return _GCSMultipart(self, key, part_size)

    def list_multipart(self, prefix: str = "") -> list[MultipartInfo]:
        base = f"{self._root}{UPLOADS}/"
        items = self._run(prefix or None, "objects.list", self._alist, base + prefix)
        found: dict[tuple[str, str], float] = {}
        for obj in items:
            rest = obj["name"][len(base) :]
            parts = rest.rsplit("/", 2)
            if len(parts) != 3 or not _UPLOAD_ID.fullmatch(parts[1]):
                continue
            key, upload_id = parts[0], parts[1]
            try:
                check_key(key)
            except ValueError:
                continue
            t = parse_timestamp(obj.get("timeCreated") or obj["updated"])
            found[(key, upload_id)] = min(t, found.get((key, upload_id), t))
        return sorted(MultipartInfo(k, u, t) for (k, u), t in found.items())

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self._full(key)
        if not isinstance(upload_id, str) or not _UPLOAD_ID.fullmatch(upload_id):
            raise ValueError(f"invalid GCS upload id {upload_id!r}")
        udir = self._upload_dir(key, upload_id)

        async def run():
            items = await self._alist(udir)
            # The marker last, so a half-done abort is still listed.
            names = sorted((o["name"] for o in items), key=lambda n: n.endswith("/" + _MARKER))
            await self._gather(self._adelete(n) for n in names if not n.endswith("/" + _MARKER))
            await self._gather(self._adelete(n) for n in names if n.endswith("/" + _MARKER))

        self._run(key, "objects.delete", run)

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the HTTP session; a later call opens a new one."""
        fs = self._fs_obj
        if fs is None or getattr(fs, "_session", None) is None:
            return
        from fsspec.asyn import sync

        try:
            sync(fs.loop, fs._session.close, timeout=10)
        except Exception:
            pass
        fs._session = None


class _GCSMultipart(MultipartUpload):
    """Parallel composite upload; see the module docstring."""

    def __init__(self, store: GCSStore, key: str, part_size: int):
        super().__init__(key, part_size)
        self.store = store
        self.upload_id = uuid.uuid4().hex
        self._dir = store._upload_dir(key, self.upload_id)
        self._lock = threading.Lock()
        self._parts: dict[int, tuple[int, str]] = {}  # number -> (size, generation)
        self._aborted = False
        marker = json.dumps({"key": key, "part_size": part_size}).encode()
        store._run(key, "objects.insert", store._aupload, self._dir + _MARKER, marker)

    def _part_name(self, number: int) -> str:
        return f"{self._dir}part-{number:05d}"

    def upload_part(self, number: int, data) -> None:
        self._check_part(number, data)
        if self._aborted:
            raise ObjectNotFoundError(f"{self.store._where(self.key)}: multipart upload was aborted")
        body = _body(data)
        meta = self.store._run(self.key, "objects.insert", self.store._aupload, self._part_name(number), body)
        with self._lock:
            self._parts[number] = (len(body), str(meta.get("generation") or ""))

    async def _acompose(self, dest: str, sources: list[tuple[str, str]]) -> dict:
        objs = []
        for name, generation in sources:
            src = {"name": name}
            if generation:
                src["objectPreconditions"] = {"ifGenerationMatch": generation}
            objs.append(src)
        return await self.store._fs._call(
            "POST",
            "b/{}/o/{}/compose",
            self.store.bucket,
            dest,
            json_out=True,
            headers={"Content-Type": "application/json"},
            json={
                "kind": "storage#composeRequest",
                "sourceObjects": objs,
                "destination": {"name": dest, "bucket": self.store.bucket, "contentType": "application/octet-stream"},
            },
        )

    def complete(self, nparts: int) -> None:
        if nparts < 1:
            raise ValueError(f"{self.key}: a multipart upload needs at least one part")
        with self._lock:
            missing = [n for n in range(1, nparts + 1) if n not in self._parts]
            if missing:
                raise ValueError(f"{self.key}: parts {missing[:5]} were never uploaded")
            for n in range(1, nparts):
                if self._parts[n][0] != self.part_size:
                    raise ValueError(f"{self.key}: part {n} is {self._parts[n][0]} bytes, not {self.part_size}")
            sources = [(self._part_name(n), self._parts[n][1]) for n in range(1, nparts + 1)]
            expected = sum(self._parts[n][0] for n in range(1, nparts + 1))
        if self._aborted:
            raise ObjectNotFoundError(f"{self.store._where(self.key)}: multipart upload was aborted")
        dest = self.store._full(self.key)

        async def run():
            level = 0
            srcs = sources
            while len(srcs) > MAX_COMPOSE:
                groups = [srcs[i : i + MAX_COMPOSE] for i in range(0, len(srcs), MAX_COMPOSE)]
                names = [f"{self._dir}compose-{level}-{i:05d}" for i in range(len(groups))]
                metas = await self.store._gather(self._acompose(n, g) for n, g in zip(names, groups))
                srcs = [(n, str(m.get("generation") or "")) for n, m in zip(names, metas)]
                level += 1
            return await self._acompose(dest, srcs)

        meta = self.store._run(self.key, "objects.compose", run)
        if int(meta.get("size", -1)) != expected:
            raise StorageError(
                f"{self.store._where(self.key)}: composed object has {meta.get('size')} bytes, expected {expected}"
            )
        try:
            self.store.abort_multipart(self.key, self.upload_id)
        except StorageError:
            pass  # leftovers stay listed by list_multipart; GC removes them

    def abort(self) -> None:
        self._aborted = True
        self.store.abort_multipart(self.key, self.upload_id)
