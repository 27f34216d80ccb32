"""Azure Blob Storage through adlfs (``az://container/prefix``, ``abfs://``).

adlfs resolves the account and credentials by the Azure conventions
(``connection_string``, ``account_name`` + ``account_key``, ``sas_token``,
a ``credential`` object, service-principal ``client_id``/``client_secret``/
``tenant_id``, else ``DefaultAzureCredential``; each also from its
``AZURE_STORAGE_*`` environment variable) and builds an async
``BlobServiceClient`` on fsspec's I/O loop. adlfs's file API is not used
(it caches listings, infers directories and has no conditional create);
the few blob operations we need go through that client directly, from any
thread, through ``fsspec.asyn.sync``.

Every request carries ``retry_total=0`` (the SDK's own policy otherwise
waits 15 s, 18 s, 24 s... between attempts, which against a dead server
made one call take over a minute; :class:`~ckptstore.storage.retry.RetryStore`
retries instead, with jitter and a bound) and connection / read timeouts
(``connection_timeout``, default 20 s; ``read_timeout``, default 60 s; both
storage options), so no request waits forever.

Conditional create. ``put_if_absent`` is ``upload_blob(overwrite=False)``,
which sends ``If-None-Match: *``; Azure and Azurite answer 409
``BlobAlreadyExists`` (real Azure may answer 412 ``ConditionNotMet``): both
become :class:`~ckptstore.errors.ObjectExistsError`.

Multipart: staged blocks. Each part is ``Put Block`` on the destination blob
with block id ``base64("<upload id>-<part number>")`` (all ids of one blob
have one length, as Azure requires); ``complete`` is one ``Put Block List``
naming exactly this upload's blocks in order, which makes the blob visible
at once and whole. Staged blocks are invisible to reads and listings.
Azure has no "upload id" of its own, so each upload writes a small marker
blob ``<prefix>/.uploads/<key>/<upload id>`` when it starts:
:meth:`AzureStore.list_multipart` lists those markers (GC aborts what it
finds there), ``complete`` refuses an upload whose marker is gone (aborted
behind its writer's back), then deletes the marker. ``list`` hides
``.uploads/`` and keys under it are refused. Aborting deletes the marker
and, when no committed blob has the key, the blob's uncommitted blocks
(``Delete Blob``); staged blocks that survive that (an upload to a key
that exists already) are discarded by Azure itself after seven days.
Limits to know: two uploads of one key in flight at once share the
blob's block set, so aborting one discards the other's blocks (ckptstore
never does this: pack names are unique); ``complete`` checks the marker
just before committing, so an abort racing that instant can lose.

Ranges. ``download_blob(offset, length)``; a range starting at or past the
end is a raw 416 that becomes ``ValueError`` like on every other store; a
range running past the end is caught by the object size in the answer's
``Content-Range``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import threading
import uuid
from typing import Iterator, Sequence

from ..errors import (
    CkptStoreError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    TransientStorageError,
)
from ._classify import MAX_MESSAGE, host_not_resolved, in_chain, is_network_error, optional_types
from .base import (
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

#: Reserved directory (under the store root) holding upload markers.
UPLOADS = ".uploads"
#: Default seconds to wait for a connection, and for the next bytes of an answer.
CONNECTION_TIMEOUT = 20.0
READ_TIMEOUT = 60.0
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_CODES = frozenset({"ServerBusy", "InternalError", "OperationTimedOut"})
_EXISTS_CODES = frozenset({"BlobAlreadyExists", "ConditionNotMet"})
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")
#: Query parameters of a SAS token that are secret (the signature), for scrubbing.
_SAS_SIG = re.compile(r"(sig=)[^&\s\"']+", re.IGNORECASE)
_CONN_SECRET = re.compile(r"((?:AccountKey|SharedAccessSignature)=)[^;\s\"']+", re.IGNORECASE)
#: storage options that are ours (the rest go to adlfs).
_OWN_OPTIONS = frozenset({"connection_timeout", "read_timeout", "retry_total"})


def _http(exc: BaseException) -> tuple[int | None, str, str]:
    """``(status, error_code, message)`` of the Azure HTTP error behind ``exc``."""
    from azure.core.exceptions import HttpResponseError

    e = in_chain(exc, lambda x: x if isinstance(x, HttpResponseError) else None)
    if e is None:
        return None, "", ""
    status = e.status_code
    if status is None and getattr(e, "response", None) is not None:
        status = getattr(e.response, "status_code", None)
    code = getattr(e, "error_code", None)
    code = str(getattr(code, "value", code) or "")
    message = str(getattr(e, "reason", None) or "")
    if not message:
        message = str(e.message or "").split("\n", 1)[0]
    return status, code, message


def _is_connection_error(exc: BaseException) -> bool:
    """Resets, refused connections, timeouts, bodies cut short or garbled in transit.

    ``IncompleteReadError`` and ``DecodeError`` are ``HttpResponseError``
    subclasses carrying the status of the answer that was cut (often 200 or
    206): they are network failures whatever that status says.
    """
    return is_network_error(exc, optional_types(
        "azure.core.exceptions:ServiceRequestError", "azure.core.exceptions:ServiceResponseError",
        "azure.core.exceptions:IncompleteReadError", "azure.core.exceptions:DecodeError", "aiohttp:ClientError"),
        not_these=optional_types("aiohttp:ClientResponseError"))


def classify_error(exc: BaseException, where: str, op: str, exists_on_conflict: bool = False) -> Exception:
    """Turn an exception from azure-storage-blob/adlfs into a ckptstore exception.

    Parameters
    ----------
    exc:
        What the blob call raised.
    where:
        ``az://container/key`` (or the store URL), for the message.
    op:
        The blob operation, for the message.
    exists_on_conflict:
        The call was a conditional create (``If-None-Match: *``): 409
        ``BlobAlreadyExists`` and 412 ``ConditionNotMet`` mean the object exists.
    """
    if isinstance(exc, CkptStoreError):
        return exc
    dns = host_not_resolved(exc, where, f"Azure {op}")
    if dns is not None:
        return dns
    status, code, message = _http(exc)
    message = message[:MAX_MESSAGE]
    if _is_connection_error(exc):
        return TransientStorageError(f"{where}: Azure {op} failed: {type(exc).__name__}: {str(exc)[:MAX_MESSAGE]}")
    if status is not None or code:
        label = f"{status} {code}".strip()
        text = f"{where}: Azure {op} failed ({label})" + (f": {message}" if message else "")
        if exists_on_conflict and (code in _EXISTS_CODES or status == 412):
            return ObjectExistsError(f"{where}: object already exists (Azure {op}: {label})")
        if code == "ContainerNotFound":
            # A configuration error, never an empty repository or a missing object.
            return StorageError(f"{where}: container does not exist (Azure {op}: {label})")
        if code == "BlobNotFound" or (status == 404 and not code):
            return ObjectNotFoundError(f"{where}: no such object (Azure {op}: {label})")
        if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS or (status is not None and status >= 500):
            return TransientStorageError(text)
        return StorageError(text)
    detail = f"{type(exc).__name__}: {str(exc)[:MAX_MESSAGE]}"
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFoundError(f"{where}: no such object (Azure {op})")
    return StorageError(f"{where}: Azure {op} failed: {detail}")


def _errors_to_classify() -> tuple[type[BaseException], ...]:
    return (OSError, ValueError, asyncio.TimeoutError, *optional_types(
        "azure.core.exceptions:AzureError", "aiohttp:ClientError"))


def _body(data):
    if isinstance(data, (bytes, bytearray)):
        return data
    return memoryview(data).cast("B").tobytes()


def _total_size(content_range: str | None) -> int | None:
    m = _CONTENT_RANGE.match(content_range or "")
    if m is None or m.group(3) == "*":
        return None
    return int(m.group(3))


def block_id(upload_id: str, number: int) -> str:
    """The block id of part ``number`` of an upload: one length for every part."""
    return base64.b64encode(f"{upload_id}-{number:05d}".encode()).decode()


#: Where adlfs finds each secret when ``storage_options`` does not name it.
_SECRET_ENV = {"account_key": "AZURE_STORAGE_ACCOUNT_KEY", "connection_string": "AZURE_STORAGE_CONNECTION_STRING",
               "sas_token": "AZURE_STORAGE_SAS_TOKEN", "client_secret": "AZURE_STORAGE_CLIENT_SECRET"}


def _secrets_of(opts: dict) -> tuple[str, ...]:
    """Every secret this store may send (from its options, else adlfs's environment variables)."""
    opts = dict(opts)
    for k, env in _SECRET_ENV.items():
        if not opts.get(k) and os.environ.get(env):
            opts[k] = os.environ[env]
    out = []
    for k in ("account_key", "connection_string", "sas_token", "client_secret", "credential"):
        v = opts.get(k)
        if isinstance(v, str) and v:
            out.append(v)
            out.append(v.lstrip("?"))
    conn = opts.get("connection_string")
    if isinstance(conn, str):
        for part in conn.split(";"):
            name, _, value = part.partition("=")
            if name.strip().lower() in ("accountkey", "sharedaccesssignature") and value:
                out.append(value)
    sas = opts.get("sas_token")
    if isinstance(sas, str):
        for part in sas.lstrip("?").split("&"):
            name, _, value = part.partition("=")
            if name == "sig" and value:
                out.append(value)
    return tuple(sorted({s for s in out if len(s) >= 4}, key=len, reverse=True))


def _scrub_text(text: str, secrets: tuple[str, ...]) -> str:
    for s in secrets:
        text = text.replace(s, "***")
    return _CONN_SECRET.sub(r"\1***", _SAS_SIG.sub(r"\1***", text))


class AzureStore(ObjectStore):
    """Objects under ``az://container/prefix``.

    Parameters
    ----------
    path:
        ``"container"`` or ``"container/prefix"`` (an ``az://``/``abfs://``/
        ``abfss://`` scheme is accepted).
    storage_options:
        Passed to :class:`adlfs.AzureBlobFileSystem` (``connection_string``,
        ``account_name``, ``account_key``, ``sas_token``, ``credential``,
        ``account_host``, ``anon``, ``client_id``/``client_secret``/``tenant_id``),
        except ``connection_timeout`` and ``read_timeout`` (seconds, every
        request) and ``retry_total`` (retries inside the Azure SDK, default 0:
        ckptstore's RetryStore retries). The client is created on first use,
        so opening a store makes no request.
    max_concurrency:
        Most range requests of one :meth:`get_ranges` call in flight at once.
    """

    mtime_resolution = 1.0  # Last-Modified has whole seconds
    remote = True

    def __init__(self, path: str, storage_options: dict | None = None, max_concurrency: int = 16):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        for scheme in ("az://", "abfs://", "abfss://"):
            if path.startswith(scheme):
                path = path[len(scheme) :]
        container, _, prefix = path.strip("/").partition("/")
        prefix = prefix.strip("/")
        if "@" in path:
            # container@account.dfs.core.windows.net: never echoed (the part
            # before "@" could be a secret in other URL forms); name the
            # account in storage_options instead.
            raise ValueError("Azure path must not carry an account or credentials (container@...); "
                             "pass account_name in storage_options or AZURE_STORAGE_ACCOUNT_NAME")
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]|\$root", container) or "--" in container:
            raise ValueError(f"invalid Azure container name {container!r} (3-63 lowercase letters, digits, '-')")
        if "?" in path or "#" in path:
            raise ValueError("Azure path must not carry a query or fragment")
        if prefix:
            check_key(prefix)
        self.container = container
        self.prefix = prefix
        self._root = f"{prefix}/" if prefix else ""
        self.url = f"az://{container}/{prefix}" if prefix else f"az://{container}"
        self.max_concurrency = max_concurrency
        opts = dict(storage_options or {})
        self._secrets = _secrets_of(opts)
        own = {k: opts.pop(k) for k in list(opts) if k in _OWN_OPTIONS}
        self._req = {
            "retry_total": int(own.get("retry_total", 0)),
            "connection_timeout": float(own.get("connection_timeout", CONNECTION_TIMEOUT)),
            "read_timeout": float(own.get("read_timeout", READ_TIMEOUT)),
        }
        self._opts = opts
        self._fs_obj = None
        self._cc = None
        self._fs_lock = threading.Lock()
        self._catch = _errors_to_classify()

    def __repr__(self) -> str:
        return f"AzureStore({self.url!r})"

    # ------------------------------------------------------------ plumbing
    def _container(self):
        if self._cc is None:
            with self._fs_lock:
                if self._cc is None:
                    import adlfs

                    try:
                        fs = adlfs.AzureBlobFileSystem(**self._opts, skip_instance_cache=True)
                    except ValueError as e:
                        # adlfs quotes the SDK's message, which may quote the
                        # connection string: scrubbed, and the cause dropped.
                        raise StorageError(
                            f"{self.url}: cannot open the Azure account: {_scrub_text(str(e), self._secrets)[:MAX_MESSAGE]}"
                        ) from None
                    self._fs_obj = fs
                    self._cc = fs.service_client.get_container_client(self.container)
        return self._cc

    @property
    def _loop(self):
        self._container()
        return self._fs_obj.loop

    def _full(self, key: str) -> str:
        check_key(key)
        if key == UPLOADS or key.startswith(UPLOADS + "/"):
            raise ValueError(f"object key {key!r} is reserved for multipart uploads")
        return self._root + key

    def _where(self, key: str | None = None) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _error(self, exc: BaseException, key: str | None, op: str, exists: bool = False) -> Exception:
        err = classify_error(exc, self._where(key), op, exists)
        if err is exc:
            return err
        text = str(err)
        clean = _scrub_text(text, self._secrets)
        return type(err)(clean) if clean != text else err

    def _run(self, key: str | None, op: str, coro_fn, *args, exists: bool = False):
        from fsspec.asyn import sync

        cc = self._container()
        try:
            return sync(self._fs_obj.loop, coro_fn, cc, *args)
        except RangeReplyError as e:
            raise ValueError(str(e)) from None
        except self._catch as e:
            err = self._error(e, key, op, exists)
            if err is e:
                raise
            if self._secrets:
                # The SDK's exception may quote a SAS URL or a connection
                # string; with secrets in play it is not kept as the cause.
                raise err from None
            raise err from e

    async def _gather(self, coros) -> list:
        return await gather_limited(coros, self.max_concurrency)

    # ------------------------------------------------------------ reads
    def get(self, key: str) -> bytes:
        full = self._full(key)

        async def run(cc):
            d = await cc.get_blob_client(full).download_blob(**self._req)
            data = await d.readall()
            if len(data) != d.size:
                raise TransientStorageError(f"{self._where(key)}: short read, got {len(data)} of {d.size} bytes")
            return data

        return self._run(key, "GetBlob", run)

    async def _aget_range(self, cc, full: str, key: str, start: int, end: int) -> tuple[bytes, int | None]:
        try:
            d = await cc.get_blob_client(full).download_blob(offset=start, length=end - start, **self._req)
        except self._catch as e:
            if _http(e)[0] == 416:
                raise RangeReplyError(f"{self._where(key)}: range [{start}, {end}) past end of object") from None
            raise
        data = await d.readall()
        total = _total_size(getattr(d.properties, "content_range", None))
        check_range_reply(self._where(key), start, end, len(data), total)
        return data, total

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        ranges = check_ranges(ranges)
        full = self._full(key)
        todo = [(i, s, e) for i, (s, e) in enumerate(ranges) if e > s]

        async def run(cc):
            got = await self._gather(self._aget_range(cc, full, key, s, e) for _, s, e in todo)
            out = [b""] * len(ranges)
            size = None
            for (i, _, _), (data, total) in zip(todo, got):
                out[i] = data
                size = total if total is not None else size
            return out, size

        out, size = self._run(key, "GetBlob", run)
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
        full = self._full(key)

        async def run(cc):
            return await cc.get_blob_client(full).get_blob_properties(**self._req)

        p = self._run(key, "GetBlobProperties", run)
        return ObjectInfo(key, int(p.size), p.last_modified.timestamp())

    async def _alist(self, cc, full_prefix: str) -> list:
        return [b async for b in cc.list_blobs(name_starts_with=full_prefix or None, **self._req)]

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        blobs = self._run(prefix or None, "ListBlobs", self._alist, self._root + prefix)
        out = []
        for b in blobs:
            rel = b.name[len(self._root) :]
            if rel.startswith(UPLOADS + "/"):
                continue
            try:
                check_key(rel)
            except ValueError:
                continue  # "dir/" placeholders made by other tools
            out.append(ObjectInfo(rel, int(b.size), b.last_modified.timestamp()))
        # Sorted here: the service's order is by name, but not promised in
        # code points for every character.
        out.sort(key=lambda o: o.key)
        return iter(out)

    # ------------------------------------------------------------ writes
    async def _aput(self, cc, full: str, data, create: bool = False):
        if not isinstance(data, bytes):
            data = bytes(data)  # upload_blob takes bytes, not bytearray (stage_block takes both)
        return await cc.get_blob_client(full).upload_blob(data, length=len(data), overwrite=not create, **self._req)

    def put(self, key: str, data) -> None:
        self._run(key, "PutBlob", self._aput, self._full(key), _body(data))

    def put_if_absent(self, key: str, data) -> None:
        # overwrite=False: the SDK sends If-None-Match: *.
        self._run(key, "PutBlob", self._aput, self._full(key), _body(data), True, exists=True)

    async def _adelete(self, cc, full: str) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        try:
            await cc.get_blob_client(full).delete_blob(delete_snapshots="include", **self._req)
        except ResourceNotFoundError as e:
            if _http(e)[1] == "ContainerNotFound":
                raise

    def delete(self, key: str) -> None:
        self._run(key, "DeleteBlob", self._adelete, self._full(key))

    def delete_many(self, keys: Sequence[str]) -> None:
        """One ``DeleteBlob`` per key, ``max_concurrency`` at a time; the first failure names its key."""
        from fsspec.asyn import sync

        fulls = [self._full(k) for k in keys]
        failed: list[int] = []
        if not fulls:
            return
        cc = self._container()
        try:
            sync(self._fs_obj.loop, each_limited, lambda full: self._adelete(cc, full), fulls, self.max_concurrency,
                 failed)
        except self._catch as e:
            err = self._error(e, keys[failed[0]] if failed else None, "DeleteBlob", False)
            if err is e:
                raise
            if self._secrets:
                raise err from None  # as _run: the SDK's exception may quote a secret
            raise err from e

    # ------------------------------------------------------------ multipart
    def _marker(self, key: str, upload_id: str) -> str:
        return f"{self._root}{UPLOADS}/{key}/{upload_id}"

    def create_multipart(self, key: str, part_size: int) -> MultipartUpload:
        self._full(key)
        return _AzureMultipart(self, key, part_size)

    def list_multipart(self, prefix: str = "") -> list[MultipartInfo]:
        base = f"{self._root}{UPLOADS}/"
        blobs = self._run(prefix or None, "ListBlobs", self._alist, base + prefix)
        out = []
        for b in blobs:
            key, _, upload_id = b.name[len(base) :].rpartition("/")
            if not _UPLOAD_ID.fullmatch(upload_id):
                continue
            try:
                check_key(key)
            except ValueError:
                continue
            t = b.creation_time or b.last_modified
            out.append(MultipartInfo(key, upload_id, t.timestamp()))
        return sorted(out)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        full = self._full(key)
        if not isinstance(upload_id, str) or not _UPLOAD_ID.fullmatch(upload_id):
            raise ValueError(f"invalid Azure upload id {upload_id!r}")
        marker = self._marker(key, upload_id)

        async def run(cc):
            from azure.core.exceptions import ResourceNotFoundError

            blob = cc.get_blob_client(full)
            try:
                await blob.get_blob_properties(**self._req)
            except ResourceNotFoundError as e:
                if _http(e)[1] == "ContainerNotFound":
                    raise
                # No committed blob: drop the staged blocks with it. (With a
                # committed blob of that key they stay until Azure expires them.)
                await self._adelete(cc, full)
            # The marker last, so a half-done abort is still listed.
            await self._adelete(cc, marker)

        self._run(key, "DeleteBlob", run)

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the HTTP session; a later call opens a new one."""
        fs = self._fs_obj
        if fs is None:
            return
        from fsspec.asyn import sync

        with self._fs_lock:
            self._fs_obj, self._cc = None, None
        try:
            sync(fs.loop, fs.service_client.close, timeout=10)
        except Exception:
            pass
        cred = getattr(fs, "credential", None)
        if cred is not None and hasattr(cred, "close"):
            try:
                sync(fs.loop, cred.close, timeout=10)
            except Exception:
                pass


class _AzureMultipart(MultipartUpload):
    """Staged blocks committed with one block list; see the module docstring."""

    def __init__(self, store: AzureStore, key: str, part_size: int):
        super().__init__(key, part_size)
        self.store = store
        self.upload_id = uuid.uuid4().hex
        self._full = store._full(key)
        self._marker = store._marker(key, self.upload_id)
        self._lock = threading.Lock()
        self._sizes: dict[int, int] = {}
        self._aborted = False
        marker = json.dumps({"key": key, "part_size": part_size}).encode()
        store._run(key, "PutBlob", store._aput, self._marker, marker)

    def upload_part(self, number: int, data) -> None:
        self._check_part(number, data)
        if self._aborted:
            raise ObjectNotFoundError(f"{self.store._where(self.key)}: multipart upload was aborted")
        body = _body(data)
        bid = block_id(self.upload_id, number)

        async def run(cc):
            await cc.get_blob_client(self._full).stage_block(bid, body, length=len(body), **self.store._req)

        self.store._run(self.key, "PutBlock", run)
        with self._lock:
            self._sizes[number] = len(body)

    def complete(self, nparts: int) -> None:
        if nparts < 1:
            raise ValueError(f"{self.key}: a multipart upload needs at least one part")
        with self._lock:
            missing = [n for n in range(1, nparts + 1) if n not in self._sizes]
            if missing:
                raise ValueError(f"{self.key}: parts {missing[:5]} were never uploaded")
            for n in range(1, nparts):
                if self._sizes[n] != self.part_size:
                    raise ValueError(f"{self.key}: part {n} is {self._sizes[n]} bytes, not {self.part_size}")
        if self._aborted:
            raise ObjectNotFoundError(f"{self.store._where(self.key)}: multipart upload was aborted")
        store = self.store

        async def run(cc):
            from azure.core.exceptions import ResourceNotFoundError
            from azure.storage.blob import BlobBlock

            try:
                await cc.get_blob_client(self._marker).get_blob_properties(**store._req)
            except ResourceNotFoundError as e:
                if _http(e)[1] == "ContainerNotFound":
                    raise
                raise ObjectNotFoundError(
                    f"{store._where(self.key)}: multipart upload {self.upload_id} was aborted (its marker is gone)"
                ) from None
            blocks = [BlobBlock(block_id(self.upload_id, n)) for n in range(1, nparts + 1)]
            try:
                await cc.get_blob_client(self._full).commit_block_list(blocks, **store._req)
            except self.store._catch as e:
                if _http(e)[1] == "InvalidBlockList":
                    # Our staged blocks are gone: aborted, expired, or
                    # committed already by an attempt whose answer was lost.
                    raise ObjectNotFoundError(
                        f"{store._where(self.key)}: blocks of upload {self.upload_id} are gone (InvalidBlockList)"
                    ) from None
                raise

        store._run(self.key, "PutBlockList", run)
        try:
            store._run(self.key, "DeleteBlob", store._adelete, self._marker)
        except StorageError:
            pass  # a leftover marker stays listed; GC aborts it (the object is not touched)

    def abort(self) -> None:
        self._aborted = True
        self.store.abort_multipart(self.key, self.upload_id)
