"""Azure Blob Storage through azure-storage-blob's synchronous client (``az://container/prefix``, ``abfs://``).

Every request goes through one ``BlobServiceClient`` per store and process
(azure-core's ``requests`` transport), shared by the calling threads and
made on first use, so opening a store makes no request. It was chosen by
measurement over the SDK's asynchronous client on an event loop
(``benchmarks/micro/cloud_clients.py``; ``docs/performance.md``, "One GCS
client, one Azure client"). A process forked from the one that made the
client (DataLoader workers, ``multiprocessing``'s fork start method) makes
its own there on first use and leaves the parent's alone: connection pools
must not cross ``fork``.

Account, credentials, connections: :mod:`ckptstore.storage._azure_client`
(``storage_options`` and ``AZURE_STORAGE_*`` variables by the Azure
conventions; any other option raises ``ValueError`` naming it; secrets
never appear in messages; proxies from the environment, as before).

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

Reads. One ``Get Blob`` each, through the operation under ``download_blob``
(the SDK's pipeline: signing, timeouts, no retries), its body read from the
socket by the store (``read_range_into``: into the caller's buffer, with
progress). ``download_blob`` itself reads an answer whole before handing a
byte over, sends a request more per 4 MiB past 32 MiB, and resends a body
cut short up to three times whatever ``retry_total`` says. A range at or
past the end is a 416, a ``ValueError`` as on every store; one running past
the end is caught by the object size in ``Content-Range``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import threading
import uuid
from typing import Iterator, Sequence

from ..errors import (CkptStoreError, CredentialsRefusedError, ObjectExistsError, ObjectNotFoundError, StorageError,
                      TransientStorageError)
from ._azure_client import ACCOUNT_OPTIONS, ENVIRONMENT, POOL_CONNECTIONS, Client, connect, resolve_account
from ._azure_client import scrub_text as _scrub_text
from ._azure_client import secrets_of as _secrets_of
from ._blocking import each_threaded, get_ranges_threaded, stream_range
from ._classify import MAX_MESSAGE, host_not_resolved, in_chain, is_network_error, optional_types
from ._credentials import azure_source, refused, with_source
from .throttle import AdaptiveRate, ThrottlePolicy, parse_retry_after, rate_for
from .base import (MultipartInfo, MultipartUpload, ObjectInfo, ObjectStore, RangeReplyError, check_key,
                   check_range_reply)

#: Reserved directory (under the store root) holding upload markers.
UPLOADS = ".uploads"
#: Default seconds to wait for a connection, and for the next bytes of an answer.
CONNECTION_TIMEOUT = 20.0
READ_TIMEOUT = 60.0
#: The storage options understood: the account's (:mod:`._azure_client`), then the requests'.
OPTIONS = ACCOUNT_OPTIONS | {"connection_timeout", "read_timeout", "retry_total"}
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_CODES = frozenset({"ServerBusy", "InternalError", "OperationTimedOut"})
_EXISTS_CODES = frozenset({"BlobAlreadyExists", "ConditionNotMet"})
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


# ------------------------------------------------------------------ errors
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
    if not code and getattr(e, "response", None) is not None:  # raised below download_blob: not parsed yet
        code = (getattr(e.response, "headers", None) or {}).get("x-ms-error-code")
    code = str(getattr(code, "value", code) or "")
    message = str(getattr(e, "reason", None) or "")
    if not message:
        message = str(e.message or "").split("\n", 1)[0]
    return status, code, message


def _retry_after(exc: BaseException) -> float | None:
    """The ``Retry-After`` of the Azure HTTP error behind ``exc``, in seconds."""
    from azure.core.exceptions import HttpResponseError

    e = in_chain(exc, lambda x: x if isinstance(x, HttpResponseError) else None)
    resp = getattr(e, "response", None)
    return parse_retry_after((getattr(resp, "headers", None) or {}).get("Retry-After"))


def _is_connection_error(exc: BaseException) -> bool:
    """Resets, refused connections, timeouts, bodies cut short or garbled in transit.

    ``IncompleteReadError`` and ``DecodeError`` are ``HttpResponseError``
    subclasses carrying the status of the answer that was cut (often 200 or
    206): they are network failures whatever that status says. Below the
    SDK (a body read by ckptstore): requests' and urllib3's own.
    """
    return is_network_error(exc, optional_types(
        "azure.core.exceptions:ServiceRequestError", "azure.core.exceptions:ServiceResponseError",
        "azure.core.exceptions:IncompleteReadError", "azure.core.exceptions:DecodeError",
        "requests.exceptions:ConnectionError", "requests.exceptions:Timeout",
        "requests.exceptions:ChunkedEncodingError", "urllib3.exceptions:ProtocolError",
        "urllib3.exceptions:TimeoutError", "http.client:IncompleteRead"))


#: Error codes (besides any 401 or 403) meaning the account refused the request's credentials.
_AUTH_CODES = frozenset({"AuthenticationFailed", "AuthorizationFailure", "AuthorizationPermissionMismatch",
                         "InvalidAuthenticationInfo", "NoAuthenticationInformation"})


def classify_error(exc: BaseException, where: str, op: str, exists_on_conflict: bool = False) -> Exception:
    """Turn an exception from azure-storage-blob (or the transport under it) into a ckptstore exception.

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
    # azure-core keeps the transport's exception as inner_exception, not as the cause.
    inner = getattr(exc, "inner_exception", None)
    dns = host_not_resolved(exc, where, f"Azure {op}")
    if dns is None and isinstance(inner, BaseException):
        dns = host_not_resolved(inner, where, f"Azure {op}")
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
        if status in (401, 403) or code in _AUTH_CODES:  # the store adds where its credentials came from
            return refused(where, f"Azure {op}", label, message)
        if code == "BlobNotFound" or (status == 404 and not code):
            return ObjectNotFoundError(f"{where}: no such object (Azure {op}: {label})")
        if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS or (status is not None and status >= 500):
            err = TransientStorageError(text)
            if status in (429, 503) or code == "ServerBusy":
                err.throttled = True
                err.retry_after = _retry_after(exc)
            return err
        return StorageError(text)
    detail = f"{type(exc).__name__}: {str(exc)[:MAX_MESSAGE]}"
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFoundError(f"{where}: no such object (Azure {op})")
    return StorageError(f"{where}: Azure {op} failed: {detail}")


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


# ------------------------------------------------------------------ the store
class AzureStore(ObjectStore):
    """Objects under ``az://container/prefix``.

    Parameters
    ----------
    path:
        ``"container"`` or ``"container/prefix"`` (an ``az://``/``abfs://``/
        ``abfss://`` scheme is accepted).
    storage_options:
        :data:`OPTIONS`: the account and credentials (``connection_string``,
        ``account_name``, ``account_key``, ``sas_token``, ``credential``...:
        :mod:`~ckptstore.storage._azure_client`); ``connection_timeout`` and
        ``read_timeout`` (seconds, every request); ``retry_total`` (retries
        inside the SDK, default 0: RetryStore retries). Any other key raises
        ``ValueError``. The client is made on first use, not here.
    max_concurrency:
        Most requests of one :meth:`get_ranges` or :meth:`delete_many` call
        in flight at once; also the floor of the connection pool's size.
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
        opts = dict(storage_options or {})
        unknown = sorted(set(opts) - OPTIONS)
        if unknown:
            raise ValueError(f"Azure storage option(s) {unknown} not supported; supported: {sorted(OPTIONS)}")
        self.container = container
        self.prefix = prefix
        self._root = f"{prefix}/" if prefix else ""
        self.url = f"az://{container}/{prefix}" if prefix else f"az://{container}"
        self.max_concurrency = max_concurrency
        self._secrets = _secrets_of(opts)
        # which account (options and environment, hashed: they may hold secrets), for identity
        self._account_id = hashlib.sha256(repr(sorted((k, repr(v)) for k, v in opts.items())).encode() + repr(
            sorted((k, os.environ.get(k, "")) for k in ENVIRONMENT.values())).encode()).hexdigest()[:16]
        self._req = {
            "retry_total": int(opts.pop("retry_total", 0)),
            "connection_timeout": float(opts.pop("connection_timeout", CONNECTION_TIMEOUT)),
            "read_timeout": float(opts.pop("read_timeout", READ_TIMEOUT)),
        }
        self._opts = opts
        # (pid that made it, lock, [its Client] or []): see _client.
        self._clients: tuple[int, threading.Lock, list] = (os.getpid(), threading.Lock(), [])
        self._throttle: ThrottlePolicy | None | bool = None
        self._rate: AdaptiveRate | None = None
        # requests' exceptions are OSErrors; urllib3's and http.client's come from bodies the store reads.
        self._catch = (OSError, *optional_types("azure.core.exceptions:AzureError", "urllib3.exceptions:HTTPError",
                                                "http.client:HTTPException"))

    def __repr__(self) -> str:
        return f"AzureStore({self.url!r})"

    def set_throttle(self, policy: ThrottlePolicy | None | bool) -> None:
        """The adaptive request rate every request waits on (one per container of an account host in the
        process; the account is known once the client is made)."""
        self._throttle = policy
        self._rate = None
        made = self._clients[2]
        if made:
            self._take_rate(made[0])

    def _take_rate(self, client: Client) -> None:
        policy = self._throttle
        if policy is not False:
            host = getattr(client.service, "primary_hostname", "") or ""
            self._rate = rate_for(f"azure|{host}|{self.container}",
                                  policy if isinstance(policy, ThrottlePolicy) else None)

    @property
    def identity(self) -> str:
        return f"azure|{self._account_id}|{self.url}"

    def throttle_stats(self) -> dict | None:
        return self._rate.stats() if self._rate is not None else None

    def _before_request(self, request) -> None:
        if self._rate is not None:
            self._rate.before()

    def _on_answer(self, response) -> None:
        rate = self._rate
        if rate is None:
            return
        http = response.http_response
        headers = http.headers or {}
        throttled = http.status_code in (429, 503) or headers.get("x-ms-error-code") == "ServerBusy"
        rate.after(throttled, parse_retry_after(headers.get("Retry-After")) if throttled else None)

    # ------------------------------------------------------------ plumbing
    def _client(self) -> Client:
        """This process's client, made on first use.

        In a process forked from the one that made it, a new one (and a new
        lock: the parent's may have been held at the fork), made there.
        """
        pid, lock, made = self._clients
        if pid != os.getpid():
            pid, lock, made = self._clients = (os.getpid(), threading.Lock(), [])
        if not made:
            with lock:
                if not made:
                    client = self._connect()
                    self._take_rate(client)  # before the first request
                    made.append(client)
        return made[0]

    def _connect(self) -> Client:
        try:
            account = resolve_account(self._opts)
            return connect(account, self.container, max(POOL_CONNECTIONS, self.max_concurrency), self._req,
                           {"raw_request_hook": self._before_request, "raw_response_hook": self._on_answer})
        except (ValueError, TypeError) as e:
            # The SDK's message may quote the connection string: scrubbed, and the cause dropped.
            raise StorageError(
                f"{self.url}: cannot open the Azure account: {_scrub_text(str(e), self._secrets)[:MAX_MESSAGE]}"
            ) from None

    def _blob(self, full: str):
        return self._client().container.get_blob_client(full)

    def _full(self, key: str) -> str:
        check_key(key)
        if key == UPLOADS or key.startswith(UPLOADS + "/"):
            raise ValueError(f"object key {key!r} is reserved for multipart uploads")
        return self._root + key

    def _where(self, key: str | None = None) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _raise(self, exc: BaseException, key: str | None, op: str, exists: bool = False):
        err = classify_error(exc, self._where(key), op, exists)
        if isinstance(err, CredentialsRefusedError):
            err = with_source(err, azure_source(self._opts))
        if err is exc:
            raise exc
        text = str(err)
        clean = _scrub_text(text, self._secrets)
        if clean != text:
            scrubbed = type(err)(clean)
            scrubbed.__dict__.update(err.__dict__)  # e.g. HostNotResolvedError.temporary
            err = scrubbed
        if self._secrets:
            # The SDK's exception may quote a SAS URL or a connection
            # string; with secrets in play it is not kept as the cause.
            raise err from None
        raise err from exc

    def _call(self, key: str | None, op: str, fn, exists: bool = False):
        """``fn()``, its errors classified and named by the blob operation ``op``."""
        try:
            return fn()
        except RangeReplyError as e:
            raise ValueError(str(e)) from None
        except self._catch as e:
            self._raise(e, key, op, exists)

    # ------------------------------------------------------------ reads
    def _download(self, full: str, start: int | None = None, end: int | None = None):
        """One ``Get Blob`` (of bytes ``[start, end)`` if given), its body left unread: the ``requests`` response.

        Through the operation under ``download_blob`` (module docstring).
        """
        try:
            op = self._blob(full)._client.blob
            op.download  # noqa: B018 - checked here, so that a changed SDK says so
        except AttributeError:
            from azure.storage.blob import __version__

            raise StorageError(f"{self.url}: azure-storage-blob {__version__} has no Get Blob operation where "
                               "12.x keeps it; install 'azure-storage-blob>=12.31,<13'") from None
        rng = None if start is None else f"bytes={start}-{end - 1}"
        got = op.download(range=rng, cls=lambda pipeline_response, *_: pipeline_response, **self._req)
        return got.http_response.internal_response

    def get(self, key: str) -> bytes:
        full = self._full(key)

        def run():
            resp = self._download(full)
            try:
                return resp.raw.read()  # a body short of its Content-Length raises (urllib3)
            finally:
                resp.close()

        return self._call(key, "GetBlob", run)

    def _ranged(self, full: str, key: str, start: int, end: int):
        """The unread answer to a ranged GET, its headers checked; a range past the end raises RangeReplyError."""
        try:
            resp = self._download(full, start, end)
        except self._catch as e:
            if _http(e)[0] == 416:
                raise RangeReplyError(f"{self._where(key)}: range [{start}, {end}) past end of object") from None
            raise
        length = resp.headers.get("Content-Length")
        try:
            # Before any byte is read: the size and length the headers state.
            check_range_reply(self._where(key), start, end, end - start if length is None else int(length),
                              _total_size(resp.headers.get("Content-Range")))
        except BaseException:
            resp.close()
            raise
        return resp

    def _range_bytes(self, full: str, key: str, start: int, end: int) -> tuple[bytes, int | None]:
        resp = self._ranged(full, key, start, end)
        try:
            data = resp.raw.read()
        finally:
            resp.close()
        total = _total_size(resp.headers.get("Content-Range"))
        check_range_reply(self._where(key), start, end, len(data), total)
        return data, total

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Each range by its own GET, at most ``max_concurrency`` at once on a pool of this call."""
        full = self._full(key)
        return self._call(key, "GetBlob", lambda: get_ranges_threaded(
            lambda s, e: self._range_bytes(full, key, s, e), ranges, self.max_concurrency,
            lambda: self.head(key).size, self._where(key), "ckptstore-az-get"))

    def read_range_into(self, key: str, start: int, out, progress=None) -> None:
        """Stream one ranged GET straight into ``out`` (:func:`~._blocking.stream_range`), reporting progress."""
        mv = memoryview(out).cast("B")
        n = len(mv)
        if n == 0 or start < 0:
            return super().read_range_into(key, start, out, progress)
        full, end = self._full(key), start + n

        def run():
            resp = self._ranged(full, key, start, end)
            at_end = False
            try:
                at_end = stream_range(self._where(key), start, mv, resp.headers.get("Content-Length"),
                                      _total_size(resp.headers.get("Content-Range")), resp.raw, progress)
            finally:
                if not at_end:
                    resp.close()  # not read to its end: drop the connection

        self._call(key, "GetBlob", run)

    def head(self, key: str) -> ObjectInfo:
        full = self._full(key)
        p = self._call(key, "GetBlobProperties", lambda: self._blob(full).get_blob_properties(**self._req))
        return ObjectInfo(key, int(p.size), p.last_modified.timestamp())

    def _list_blobs(self, key: str | None, full_prefix: str) -> list:
        cc = self._client().container
        return self._call(key, "ListBlobs", lambda: list(cc.list_blobs(name_starts_with=full_prefix or None,
                                                                       **self._req)))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        out = []
        for b in self._list_blobs(prefix or None, self._root + prefix):
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
    def _upload(self, full: str, data, key: str | None, create: bool = False) -> None:
        if not isinstance(data, bytes):
            data = bytes(data)  # upload_blob takes bytes, not bytearray (stage_block takes both)
        self._call(key, "PutBlob", lambda: self._blob(full).upload_blob(
            data, length=len(data), overwrite=not create, **self._req), exists=create)

    def put(self, key: str, data) -> None:
        self._upload(self._full(key), _body(data), key)

    def put_if_absent(self, key: str, data) -> None:
        # overwrite=False: the SDK sends If-None-Match: *.
        self._upload(self._full(key), _body(data), key, create=True)

    def _delete_blob(self, full: str) -> None:
        """Delete Blob; a missing blob is fine, a missing container raises (unclassified)."""
        from azure.core.exceptions import ResourceNotFoundError

        try:
            self._blob(full).delete_blob(delete_snapshots="include", **self._req)
        except ResourceNotFoundError as e:
            if _http(e)[1] == "ContainerNotFound":
                raise

    def delete(self, key: str) -> None:
        full = self._full(key)
        self._call(key, "DeleteBlob", lambda: self._delete_blob(full))

    def delete_many(self, keys: Sequence[str]) -> None:
        """One ``DeleteBlob`` per key, ``max_concurrency`` at a time; the first failure names its key."""
        fulls = [self._full(k) for k in keys]
        failed = each_threaded(self._delete_blob, fulls, self.max_concurrency, "ckptstore-az-delete")
        if failed is not None:
            i, exc = failed
            if not isinstance(exc, self._catch):
                raise exc
            self._raise(exc, keys[i], "DeleteBlob")

    # ------------------------------------------------------------ multipart
    def _marker(self, key: str, upload_id: str) -> str:
        return f"{self._root}{UPLOADS}/{key}/{upload_id}"

    def create_multipart(self, key: str, part_size: int) -> MultipartUpload:
        self._full(key)
        return _AzureMultipart(self, key, part_size)

    def list_multipart(self, prefix: str = "") -> list[MultipartInfo]:
        base = f"{self._root}{UPLOADS}/"
        out = []
        for b in self._list_blobs(prefix or None, base + prefix):
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

        def run():
            from azure.core.exceptions import ResourceNotFoundError

            try:
                self._blob(full).get_blob_properties(**self._req)
            except ResourceNotFoundError as e:
                if _http(e)[1] == "ContainerNotFound":
                    raise
                # No committed blob: drop the staged blocks with it. (With a
                # committed blob of that key they stay until Azure expires them.)
                self._delete_blob(full)
            # The marker last, so a half-done abort is still listed.
            self._delete_blob(marker)

        self._call(key, "DeleteBlob", run)

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the client (its connections) and any credential made for it; a later call makes new ones.

        A ``credential`` passed in storage options stays open: it is the caller's.
        """
        pid, lock, made = self._clients
        if pid != os.getpid():  # the parent's: not this process's to close
            self._clients = (os.getpid(), threading.Lock(), [])
            return
        with lock:
            old = list(made)
            made.clear()
        for client in old:
            for closer in (client.service.close, getattr(client.credential, "close", None)):
                if closer is not None:
                    try:
                        closer()
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
        store._upload(self._marker, json.dumps({"key": key, "part_size": part_size}).encode(), key)

    def upload_part(self, number: int, data) -> None:
        self._check_part(number, data)
        if self._aborted:
            raise ObjectNotFoundError(f"{self.store._where(self.key)}: multipart upload was aborted")
        store, body, bid = self.store, _body(data), block_id(self.upload_id, number)
        store._call(self.key, "PutBlock", lambda: store._blob(self._full).stage_block(
            bid, body, length=len(body), **store._req))
        with self._lock:
            self._sizes[number] = len(body)

    def complete(self, nparts: int) -> None:
        if nparts < 1:
            raise ValueError(f"{self.key}: a multipart upload needs at least one part")
        with self._lock:
            self._check_parts(nparts, self._sizes)
        if self._aborted:
            raise ObjectNotFoundError(f"{self.store._where(self.key)}: multipart upload was aborted")
        store = self.store

        def run():
            from azure.core.exceptions import ResourceNotFoundError
            from azure.storage.blob import BlobBlock

            try:
                store._blob(self._marker).get_blob_properties(**store._req)
            except ResourceNotFoundError as e:
                if _http(e)[1] == "ContainerNotFound":
                    raise
                raise ObjectNotFoundError(
                    f"{store._where(self.key)}: multipart upload {self.upload_id} was aborted (its marker is gone)"
                ) from None
            blocks = [BlobBlock(block_id(self.upload_id, n)) for n in range(1, nparts + 1)]
            try:
                store._blob(self._full).commit_block_list(blocks, **store._req)
            except store._catch as e:
                if _http(e)[1] == "InvalidBlockList":
                    # Our staged blocks are gone: aborted, expired, or
                    # committed already by an attempt whose answer was lost.
                    raise ObjectNotFoundError(
                        f"{store._where(self.key)}: blocks of upload {self.upload_id} are gone (InvalidBlockList)"
                    ) from None
                raise

        store._call(self.key, "PutBlockList", run)
        try:
            store._call(self.key, "DeleteBlob", lambda: store._delete_blob(self._marker))
        except StorageError:
            pass  # a leftover marker stays listed; GC aborts it (the object is not touched)

    def abort(self) -> None:
        self._aborted = True
        self.store.abort_multipart(self.key, self.upload_id)
