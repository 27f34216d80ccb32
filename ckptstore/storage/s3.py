"""Amazon S3 (and S3-compatible services) through s3fs.

Requests go through ``S3FileSystem._call_s3`` / ``call_s3``, s3fs's wrapper
around one aiobotocore client running on fsspec's I/O loop (safe to call
from many threads at once), except those carrying a body (``PutObject``,
``UploadPart``) and ranged reads of data (:meth:`S3Store.get_ranges`): they
go through a threaded botocore client built from the same options
(``_upload_client_spec``), because aiohttp on Python < 3.12.9 copies every
body into fresh memory two or three times, which made the S3 transport the
largest client CPU cost of a save after the codec, and of a load after
decoding (8 MiB ranged GETs from SeaweedFS, ``benchmarks/experiments/s3_reads.py``:
0.95-1.0 client CPU-s per GiB through s3fs, 0.57-0.68 through the threaded
client). Uploads
send a CRC32 of the body that the server checks, and skip botocore's
SHA-256 payload signature (see ``S3Store.__init__``).

s3fs translates ``ClientError`` into built-in exceptions and keeps the
original as ``__cause__``; :func:`classify_error` looks at that S3 error code
(not at the built-in type, which depends on the s3fs version and on whether
the server sent a ``Condition`` field) to pick the ckptstore exception.

Retries and timeouts, so that no request waits forever and a dead server
fails in bounded time: every request has a connect timeout
(:data:`CONNECT_TIMEOUT`) and a read timeout (:data:`READ_TIMEOUT`, the
longest wait for the next bytes of an answer or for the server to take more
of a body), the threaded upload client included; botocore tries a request
at most 3 times (:data:`BOTOCORE_RETRIES`, standard mode: 5xx, throttling,
connection errors and timeouts, backoff at most 1 s then 2 s); s3fs's own retry loop around
botocore's (``S3FileSystem.retries``, 5 by default, multiplying botocore's)
is set to one attempt. Each of these is a storage option
(``connect_timeout``, ``read_timeout``, ``config_kwargs={"retries": {...}}``).
The errors left over are classified as transient or permanent for
ckptstore's retry wrapper (:class:`~ckptstore.storage.retry.RetryStore`),
the one layer with a bound on total time. Before these defaults botocore's
legacy mode (5 attempts, backoff up to 8 s) under s3fs made one call against
a killed server take up to ~15 s, and a load then failed after 77-95 s.

Stores that bring explicit credentials share one process-wide botocore
session, so opening a store does not reload the S3 service model each time,
and stores with exactly the same options (credentials, endpoint, every
client setting) share their clients too (:class:`_SharedClients`): a fresh
repository handle on the same bucket reuses the warm connections of the
previous one instead of paying a new client and new TCP connections on its
first requests. Stores whose credentials come from the environment chain
never share (the same rule as for the session).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import collections
import hashlib
import json
import os
import re
import threading
import weakref
from typing import Iterator, Sequence

from ..errors import (
    CkptStoreError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    TransientStorageError,
)
from ._classify import MAX_MESSAGE, host_not_resolved, in_chain, is_network_error, optional_types, scrub
from .base import (
    READ_PIECE,
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

#: Keys per ``DeleteObjects`` request (S3's limit) and such requests in flight at once.
DELETE_BATCH = 1000
DELETE_REQUESTS = 4

#: S3 error codes that are worth retrying: throttling, server-side failures,
#: and conflicting concurrent conditional writes (S3 answers those with 409
#: ConditionalRequestConflict and asks the client to retry).
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "RequestTimeoutException",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "RequestThrottled",
        "BandwidthLimitExceeded",
        "OperationAborted",
        "ConditionalRequestConflict",
        "InternalServerError",
        "BadGateway",
        "GatewayTimeout",
        # The body arrived damaged (its checksum did not match): send again.
        "BadDigest",
        "XAmzContentSHA256Mismatch",
    }
)

#: Codes meaning "this object (or upload) does not exist". ``404`` is what
#: HEAD requests report, having no body to carry a code (so a HEAD cannot
#: tell a missing bucket from a missing key). ``NoSuchBucket`` is deliberately
#: absent: a missing bucket is a configuration error, and reporting it as a
#: missing object would make an empty repository out of it.
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchUpload", "404", "NotFound"})

#: Seconds to wait for a TCP connection (s3fs's default, applied to uploads too).
CONNECT_TIMEOUT = 5.0
#: Seconds without progress on a request before it fails (s3fs's default,
#: applied to uploads too; botocore's own default is 60).
READ_TIMEOUT = 15.0
#: botocore's tries of one request, the first included (botocore's
#: ``max_attempts`` counts retries only: ``{"max_attempts": 2}`` is 3 tries).
BOTOCORE_RETRIES = {"mode": "standard", "total_max_attempts": 3}
#: s3fs's attempts around each botocore call.
S3FS_ATTEMPTS = 1


def _client_error(exc: BaseException):
    """The botocore ``ClientError`` behind ``exc`` (itself or a cause), or None."""
    from botocore.exceptions import ClientError

    return in_chain(exc, lambda e: e if isinstance(e, ClientError) else None)


def error_code(exc: BaseException) -> tuple[str, int | None, str]:
    """``(code, http_status, message)`` of the S3 error behind ``exc``; ``("", None, "")`` if none."""
    ce = _client_error(exc)
    if ce is None:
        return "", None, ""
    resp = getattr(ce, "response", None) or {}
    err = resp.get("Error") or {}
    status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return str(err.get("Code") or ""), status, str(err.get("Message") or "")


def _is_connection_error(exc: BaseException) -> bool:
    """Network-level failures (resets, timeouts, truncated bodies): retryable."""
    return is_network_error(exc, optional_types(
        "botocore.exceptions:ConnectionError", "botocore.exceptions:HTTPClientError",
        "botocore.exceptions:IncompleteReadError", "botocore.exceptions:ReadTimeoutError",
        "botocore.exceptions:ResponseStreamingError", "aiohttp:ClientError"))


def classify_error(exc: BaseException, where: str, op: str, exists_on_412: bool = False) -> Exception:
    """Turn an exception from s3fs/botocore into a ckptstore exception.

    Parameters
    ----------
    exc:
        What the S3 call raised.
    where:
        ``s3://bucket/key`` (or the store URL), for the message.
    op:
        The S3 operation, for the message.
    exists_on_412:
        The call was a conditional create: a failed precondition means the
        object already exists.

    Returns
    -------
    An exception to raise (``raise classify_error(e, ...) from e``):
    :class:`ObjectNotFoundError`, :class:`ObjectExistsError`,
    :class:`TransientStorageError` (throttling, 5xx, connection failures),
    :class:`HostNotResolvedError` (the endpoint's host name does not resolve:
    retried only briefly) or :class:`StorageError` (everything else; fail fast).
    """
    if isinstance(exc, CkptStoreError):
        return exc
    dns = host_not_resolved(exc, where, f"S3 {op}")
    if dns is not None:
        return dns
    code, status, message = error_code(exc)
    message = message[:MAX_MESSAGE]
    if code or status:
        label = code or str(status)
        text = f"{where}: S3 {op} failed ({label})" + (f": {message}" if message else "")
        if exists_on_412 and (code == "PreconditionFailed" or status == 412):
            return ObjectExistsError(f"{where}: object already exists (S3 {op}: {label})")
        if code in NOT_FOUND_CODES or (not code and status == 404):
            return ObjectNotFoundError(f"{where}: no such object (S3 {op}: {label})")
        if code == "NoSuchBucket":
            return StorageError(f"{where}: bucket does not exist (S3 {op}: {label})")
        if code in TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429)):
            return TransientStorageError(text)
        return StorageError(text)
    # No S3 response: s3fs's own translation or a network failure.
    detail = f"{type(exc).__name__}: {str(exc)[:MAX_MESSAGE]}"
    if exists_on_412 and isinstance(exc, FileExistsError):
        return ObjectExistsError(f"{where}: object already exists (S3 {op})")
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFoundError(f"{where}: no such object (S3 {op})")
    if _is_connection_error(exc):
        return TransientStorageError(f"{where}: S3 {op} failed: {detail}")
    return StorageError(f"{where}: S3 {op} failed: {detail}")


def _errors_to_classify() -> tuple[type[BaseException], ...]:
    return (OSError, asyncio.TimeoutError, *optional_types(
        "botocore.exceptions:BotoCoreError", "botocore.exceptions:ClientError", "aiohttp:ClientError"))


_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


def _total_size(content_range: str | None) -> int | None:
    m = _CONTENT_RANGE.match(content_range or "")
    if m is None or m.group(3) == "*":
        return None
    return int(m.group(3))


def _copy_dicts(obj):
    """``obj`` with every nested dict and list copied (other values as they are)."""
    if isinstance(obj, dict):
        return {k: _copy_dicts(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_dicts(v) for v in obj]
    return obj


def _body(data):
    # aiobotocore sends bytes and bytearray as they are; anything else
    # (memoryview, numpy buffers) is copied once into bytes.
    if isinstance(data, (bytes, bytearray)):
        return data
    return memoryview(data).cast("B").tobytes()


_SESSIONS: dict[str, object] = {}
_SESSION_LOCK = threading.Lock()
#: S3FileSystem arguments that do not reach the botocore session; any other
#: key is forwarded to ``AioSession`` (``profile``...) and needs its own.
_FS_ARGS = frozenset(
    {
        "anon", "key", "secret", "token", "use_ssl", "client_kwargs", "requester_pays",
        "default_block_size", "default_fill_cache", "default_cache_type", "version_aware",
        "config_kwargs", "s3_additional_kwargs", "endpoint_url", "use_listings_cache",
        "listings_expiry_time", "max_paths", "skip_instance_cache", "cache_regions",
        "max_concurrency", "fixed_upload_size", "username",
        "password", "connect_timeout", "read_timeout",
    }
)


def _can_share_session(opts: dict) -> bool:
    """Whether this store may use the process-wide botocore session.

    A botocore session loads the S3 service model (tens of thousands of
    objects, ~0.1 s) and caches credentials found through the environment
    chain. Sharing it is safe only when the store brings its own credentials
    (or none, anonymous) and no session-level option such as ``profile``.
    """
    if "session" in opts or set(opts) - _FS_ARGS:
        return False
    explicit = (opts.get("key") or opts.get("username")) and (opts.get("secret") or opts.get("password"))
    return bool(explicit or opts.get("anon"))


def _shared_session(kind: str = "aio"):
    """The process-wide session: ``"aio"`` (aiobotocore, for s3fs) or ``"sync"`` (botocore, uploads)."""
    with _SESSION_LOCK:
        session = _SESSIONS.get(kind)
        if session is None:
            if kind == "aio":
                import aiobotocore.session

                session = aiobotocore.session.AioSession()
            else:
                import botocore.session

                session = botocore.session.Session()
            _SESSIONS[kind] = session
        return session


#: Idle shared clients kept open (least recently used ones beyond it are closed).
SHARED_CLIENTS_IDLE = 8


def _client_key(opts: dict, upload_client: bool = False) -> str | None:
    """A digest of the exact client options when stores with them may share clients, else None.

    Only options that are plain values (so that equal options mean equal
    clients) and only stores allowed the shared session (explicit
    credentials or anonymous): two stores share only when every option,
    the credentials included, is the same (and whether uploads go through
    a separate client, ``upload_client``).
    """
    if not _can_share_session(opts):
        return None
    try:
        canon = json.dumps([opts, upload_client], sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(canon.encode()).hexdigest()


class _SharedClients:
    """Process-wide S3 clients (s3fs's file system object and the upload client), by :func:`_client_key`.

    A store holds its entry while open (a count of users); entries nobody
    holds stay open for the next store with the same options, at most
    :data:`SHARED_CLIENTS_IDLE` of them (older idle ones are closed).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[str, dict] = collections.OrderedDict()

    def forget(self) -> None:
        """Drop every entry without closing it (in a forked child: the parent's
        connections and event loop are not the child's to use or close)."""
        self._lock = threading.Lock()
        self._entries = collections.OrderedDict()

    def acquire(self, key: str, make_fs) -> dict:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = {"fs": make_fs(), "upload": None, "users": 0,
                                              "lock": threading.Lock()}
            self._entries.move_to_end(key)
            entry["users"] += 1
            idle = [k for k, e in self._entries.items() if e["users"] == 0]
            evict = [self._entries.pop(k) for k in idle[: max(0, len(idle) - SHARED_CLIENTS_IDLE)]]
        for e in evict:
            _close_clients(e["fs"], e["upload"])
        return entry

    def release(self, key: str) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry["users"] > 0:
                entry["users"] -= 1

    def clear(self) -> None:
        """Close every idle shared client (tests; the next store opens new ones)."""
        with self._lock:
            idle = [k for k, e in self._entries.items() if e["users"] == 0]
            evict = [self._entries.pop(k) for k in idle]
        for e in evict:
            _close_clients(e["fs"], e["upload"])

    def __len__(self) -> int:
        return len(self._entries)


_SHARED = _SharedClients()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_SHARED.forget)


def _close_clients(fs, upload) -> None:
    """Close an s3fs file system's client and an upload client (either may be None)."""
    from fsspec.asyn import sync

    if upload is not None:
        try:
            upload.close()
        except Exception:
            pass
    creator = getattr(fs, "_s3creator", None) if fs is not None else None
    if fs is None or getattr(fs, "_s3", None) is None or creator is None:
        return
    try:
        sync(fs.loop, creator.__aexit__, None, None, None, timeout=10)
    except Exception:
        pass
    fs._s3 = None


#: ``client_kwargs`` keys botocore's ``create_client`` takes as they are.
_CLIENT_ARGS = frozenset({"region_name", "endpoint_url", "verify", "use_ssl", "api_version",
                          "aws_access_key_id", "aws_secret_access_key", "aws_session_token"})
#: storage options that only steer s3fs's caches and file objects.
_CACHE_ARGS = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
                         "default_block_size", "default_fill_cache", "default_cache_type", "version_aware",
                         "fixed_upload_size", "cache_regions", "max_concurrency"})


def _upload_client_spec(opts: dict) -> dict | None:
    """How to build a plain (threaded) botocore client equivalent to s3fs's, or None.

    Uploads go through it: aiohttp on Python < 3.12.9 copies every request
    body two or three times into fresh memory (header join, ``data[n:]``,
    transport buffer), where botocore's urllib3 connection hands the part
    buffer to ``sendall`` as it is (the client CPU of both, measured:
    ``docs/performance.md``, "Two figures the code's docstrings used to carry"). Options this
    cannot reproduce exactly (a caller's own session, unknown keys) keep
    uploads on s3fs.
    """
    if "session" in opts or set(opts) - (_FS_ARGS | _CACHE_ARGS | {"profile"}):
        return None
    ck = dict(opts.get("client_kwargs") or {})
    if set(ck) - _CLIENT_ARGS:
        return None
    key = opts.get("key") or opts.get("username")
    secret = opts.get("secret") or opts.get("password")
    if key:
        ck["aws_access_key_id"] = key
    if secret:
        ck["aws_secret_access_key"] = secret
    if opts.get("token"):
        ck["aws_session_token"] = opts["token"]
    if opts.get("endpoint_url"):
        ck["endpoint_url"] = opts["endpoint_url"]
    if "use_ssl" in opts:
        ck["use_ssl"] = opts["use_ssl"]
    config = dict(opts.get("config_kwargs") or {})
    for k in ("connect_timeout", "read_timeout"):
        if opts.get(k) is not None:
            config.setdefault(k, opts[k])
    extra = dict(opts.get("s3_additional_kwargs") or {})
    if opts.get("requester_pays"):
        extra["RequestPayer"] = "requester"
    return {"client": ck, "config": config, "anon": bool(opts.get("anon")), "profile": opts.get("profile"),
            "share": _can_share_session(opts), "extra": extra}


def _make_upload_client(spec: dict):
    import botocore.session
    from botocore import UNSIGNED
    from botocore.config import Config

    config = dict(spec["config"])
    if spec["anon"]:
        config["signature_version"] = UNSIGNED
    # The same sharing rule as s3fs's session: a session caches credentials
    # found through the environment chain, so only stores that bring their
    # own (or none) share one.
    if spec["share"]:
        session = _shared_session("sync")
    else:
        session = botocore.session.Session(profile=spec["profile"])
    with _SESSION_LOCK:  # botocore's create_client is not thread-safe on one session
        return session.create_client("s3", config=Config(**config), **spec["client"])


def _stream_body(body, mv: memoryview, progress) -> tuple[int, bool]:
    """Read a botocore ``StreamingBody`` into ``mv`` piece by piece.

    Straight into ``mv`` through the ``http.client`` response under urllib3's
    (one copy, from the socket), when the body is a plain length-delimited
    one; otherwise through ``body.read`` (a copy more). Returns ``(bytes
    read, at end)``: at end, the body held exactly ``len(mv)`` bytes and its
    connection went back to the pool; otherwise the caller closes it. (A
    botocore response-checksum wrapper would be bypassed too; S3 sends no
    checksum for ranged GETs, and the loader checks every chunk's BLAKE3.)
    """
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    direct = (fp is not None and hasattr(fp, "readinto") and hasattr(fp, "isclosed")
              and hasattr(raw, "release_conn") and not getattr(fp, "chunked", False)
              and not (raw.headers or {}).get("content-encoding"))
    n, got = len(mv), 0
    while got < n:
        piece = mv[got : min(n, got + READ_PIECE)]
        if direct:
            k = fp.readinto(piece)
        else:
            data = body.read(len(piece))
            k = len(data)
            piece[:k] = data
        if not k:
            return got, False
        got += k
        if progress is not None:
            progress(got)
    if direct:
        if not fp.isclosed():  # more than Content-Length said, or no length
            return got, False
        raw.release_conn()
        return got, True
    return got, not body.read(1)


class S3Store(ObjectStore):
    mtime_resolution = 1.0  # Last-Modified has whole seconds
    remote = True

    """Objects under ``s3://bucket/prefix``.

    Parameters
    ----------
    path:
        ``"bucket"`` or ``"bucket/prefix"`` (an ``s3://`` scheme is accepted).
    storage_options:
        Passed to :class:`s3fs.S3FileSystem` (``key``, ``secret``, ``token``,
        ``endpoint_url``, ``client_kwargs``, ``config_kwargs``, ``profile``...).
        Instance and listing caches are always disabled so that no stale
        cache hides an object.
    max_concurrency:
        Most range requests of one :meth:`get_ranges` call in flight at once;
        also the floor of the HTTP connection pool size.
    upload_client:
        Send object and part bodies, and fetch the ranges of
        :meth:`get_ranges`, through a threaded botocore client built from
        the same options (default), instead of s3fs's aiohttp one, which
        copies each body several times; everything else, and stores whose
        options it cannot reproduce, go through s3fs.
    """

    def __init__(self, path: str, storage_options: dict | None = None, max_concurrency: int = 16,
                 upload_client: bool = True):
        import s3fs

        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if path.startswith("s3://"):
            path = path[len("s3://") :]
        bucket, _, prefix = path.strip("/").partition("/")
        prefix = prefix.strip("/")
        if "@" in bucket:
            # Never echo it: the part before "@" would be a secret.
            raise ValueError("S3 path must not embed credentials; pass them in storage_options")
        if not bucket or ":" in bucket:
            raise ValueError(f"invalid S3 bucket name {bucket!r}")
        if prefix:
            check_key(prefix)
        self.bucket = bucket
        self.prefix = prefix
        self._root = f"{prefix}/" if prefix else ""
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.max_concurrency = max_concurrency

        # Nested option dicts copied too: botocore rewrites a ``retries`` dict
        # in place, which changed the caller's options (and this store's
        # client key) after the first client was made.
        opts = _copy_dicts(dict(storage_options or {}))
        opts["skip_instance_cache"] = True
        opts["use_listings_cache"] = False
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("max_pool_connections", max(10, max_concurrency))
        # Every request has timeouts and a small retry budget (module docstring).
        config.setdefault("connect_timeout", opts.pop("connect_timeout", None) or CONNECT_TIMEOUT)
        config.setdefault("read_timeout", opts.pop("read_timeout", None) or READ_TIMEOUT)
        config.setdefault("retries", dict(BOTOCORE_RETRIES))
        if _checksums_on(config):
            # Over plain HTTP botocore otherwise SHA-256-hashes every body to
            # sign it (1.8 GB/s: the largest client CPU cost of a save to a
            # loopback or on-premises endpoint), on top of the CRC32 it sends
            # in x-amz-checksum-crc32 (4 GB/s), which the server checks
            # against the body. One check suffices; the CRC header is itself
            # signed. Over HTTPS this is botocore's default already.
            s3cfg = dict(config.get("s3") or {})
            s3cfg.setdefault("payload_signing_enabled", False)
            config["s3"] = s3cfg
        opts["config_kwargs"] = config
        # Kept only to scrub them from error messages, never printed.
        self._secrets = tuple(
            str(opts[k]) for k in ("secret", "password", "token", "session_token") if opts.get(k)
        )
        self._upload_spec = _upload_client_spec(opts) if upload_client else None
        self._upload = None
        self._upload_kwargs: dict[str, dict] = {}
        self._upload_lock = threading.Lock()
        key = _client_key(opts, self._upload_spec is not None)
        if _can_share_session(opts):
            opts["session"] = _shared_session()

        def make_fs():
            fs = s3fs.S3FileSystem(**opts)
            fs.retries = S3FS_ATTEMPTS
            return fs

        self._make_fs = make_fs
        self._key = key
        self._own_fs = make_fs() if key is None else None
        self._shared: dict | None = None  # the entry of _SHARED this store holds
        self._release = None
        self._catch = _errors_to_classify()

    @property
    def _fs(self):
        """s3fs's file system: this store's own, or the shared one of its options
        (held from the first use until :meth:`close`; a use after it holds it again)."""
        if self._key is None:
            return self._own_fs
        return self._entry()["fs"]

    def _entry(self) -> dict:
        """The shared entry this store holds (taken again after :meth:`close`)."""
        entry = self._shared
        if entry is None:
            with self._upload_lock:
                if self._shared is None:
                    self._shared = _SHARED.acquire(self._key, self._make_fs)
                    # Released on close, or when the store is collected unclosed.
                    self._release = weakref.finalize(self, _SHARED.release, self._key)
                entry = self._shared
        return entry

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    # ------------------------------------------------------------ plumbing
    def _full(self, key: str) -> str:
        return self._root + check_key(key)

    def _where(self, key: str | None = None) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _error(self, exc: BaseException, key: str | None, op: str, exists_on_412: bool = False) -> Exception:
        return scrub(classify_error(exc, self._where(key), op, exists_on_412), exc, self._secrets)

    def _raise(self, exc: BaseException, key: str | None, op: str, exists_on_412: bool = False):
        err = self._error(exc, key, op, exists_on_412)
        if err is exc:
            raise exc
        raise err from exc

    def _call(self, op: str, key: str | None, exists_on_412: bool = False, **kwargs):
        try:
            return self._fs.call_s3(op, Bucket=self.bucket, **kwargs)
        except self._catch as e:
            self._raise(e, key, op, exists_on_412)

    def _run(self, coro_fn, *args):
        from fsspec.asyn import sync

        return sync(self._fs.loop, coro_fn, *args)

    # ------------------------------------------------------------ reads
    async def _aget(self, full: str, key: str) -> bytes:
        resp = await self._fs._call_s3("get_object", Bucket=self.bucket, Key=full)
        try:
            data = await resp["Body"].read()
        finally:
            resp["Body"].close()
        expected = resp.get("ContentLength")
        if expected is not None and len(data) != expected:
            raise TransientStorageError(
                f"{self._where(key)}: short read, got {len(data)} of {expected} bytes"
            )
        return data

    def get(self, key: str) -> bytes:
        full = self._full(key)
        try:
            return self._run(self._aget, full, key)
        except self._catch as e:
            self._raise(e, key, "GetObject")

    async def _aget_ranges(self, full: str, key: str, ranges: list[tuple[int, int]]):
        sem = asyncio.Semaphore(self.max_concurrency)
        out: list[bytes] = [b""] * len(ranges)
        sizes: list[int] = []

        async def one(i: int, start: int, end: int) -> None:
            async with sem:
                try:
                    resp = await self._fs._call_s3(
                        "get_object", Bucket=self.bucket, Key=full, Range=f"bytes={start}-{end - 1}"
                    )
                except self._catch as e:
                    code, _, _ = error_code(e)
                    if code == "InvalidRange":
                        # S3 refuses a range starting at or past the end.
                        raise RangeReplyError(
                            f"{self._where(key)}: range [{start}, {end}) past end of object"
                        ) from None
                    raise
                try:
                    data = await resp["Body"].read()
                finally:
                    resp["Body"].close()
            total = _total_size(resp.get("ContentRange"))
            if total is not None:
                sizes.append(total)
            check_range_reply(self._where(key), start, end, len(data), total)
            out[i] = data

        tasks = [asyncio.ensure_future(one(i, s, e)) for i, (s, e) in enumerate(ranges) if e > s]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return out, (sizes[0] if sizes else None)

    def _ranged_get(self, client, full: str, key: str, start: int, end: int) -> dict:
        """One ranged GetObject through the threaded client; a range past the end raises :class:`RangeReplyError`."""
        try:
            return client.get_object(Bucket=self.bucket, Key=full, Range=f"bytes={start}-{end - 1}",
                                     **self._op_kwargs(client, "get_object"))
        except self._catch as e:
            if error_code(e)[0] == "InvalidRange":
                raise RangeReplyError(f"{self._where(key)}: range [{start}, {end}) past end of object") from None
            raise

    def _get_range(self, client, full: str, key: str, start: int, end: int, sizes: list[int]) -> bytes:
        """One ranged GET through the threaded client (the checks of :meth:`_aget_ranges`)."""
        resp = self._ranged_get(client, full, key, start, end)
        body = resp["Body"]
        try:
            data = body.read()  # botocore checks the length against Content-Length
        finally:
            body.close()
        total = _total_size(resp.get("ContentRange"))
        if total is not None:
            sizes.append(total)
        check_range_reply(self._where(key), start, end, len(data), total)
        return data

    def _get_ranges_threaded(self, full: str, key: str, ranges: list[tuple[int, int]]):
        client = self._upload_client()
        sizes: list[int] = []
        todo = [(i, s, e) for i, (s, e) in enumerate(ranges) if e > s]
        out: list[bytes] = [b""] * len(ranges)
        if len(todo) <= 1 or self.max_concurrency == 1:
            # The loader's fetcher asks for one range per call from its own
            # I/O threads: no pool needed.
            for i, s, e in todo:
                out[i] = self._get_range(client, full, key, s, e, sizes)
        else:
            with cf.ThreadPoolExecutor(min(self.max_concurrency, len(todo)),
                                       thread_name_prefix="ckptstore-s3-get") as ex:
                futs = [(i, ex.submit(self._get_range, client, full, key, s, e, sizes)) for i, s, e in todo]
                try:
                    for i, f in futs:
                        out[i] = f.result()
                finally:
                    for _, f in futs:
                        f.cancel()
        return out, (sizes[0] if sizes else None)

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        ranges = check_ranges(ranges)
        full = self._full(key)
        try:
            if self._upload_spec is not None:
                out, size = self._get_ranges_threaded(full, key, ranges)
            else:
                out, size = self._run(self._aget_ranges, full, key, ranges)
        except RangeReplyError as e:
            raise ValueError(str(e)) from None
        except self._catch as e:
            self._raise(e, key, "GetObject")
        if any(e == s for s, e in ranges) or not ranges:
            # Empty ranges need no bytes, but they must exist and lie inside
            # the object, like in every other store.
            if size is None:
                size = self.head(key).size
            for s, e in ranges:
                if e > size:
                    raise ValueError(f"{self._where(key)}: range [{s}, {e}) past end of {size}-byte object")
        return out

    def read_range_into(self, key: str, start: int, out, progress=None) -> None:
        """Stream one ranged GET into ``out`` (threaded client; s3fs's reads whole, as the default)."""
        mv = memoryview(out).cast("B")
        n = len(mv)
        if self._upload_spec is None or n == 0 or start < 0:
            return super().read_range_into(key, start, out, progress)
        full, end = self._full(key), start + n
        body = None
        try:
            resp = self._ranged_get(self._upload_client(), full, key, start, end)
            body = resp["Body"]
            total = _total_size(resp.get("ContentRange"))
            length = resp.get("ContentLength")
            # Before any byte is read: the size and length the headers state.
            check_range_reply(self._where(key), start, end, n if length is None else length, total)
            got, at_end = _stream_body(body, mv, progress)
            if at_end:
                body = None  # its connection went back to the pool
            elif got == n:
                raise RangeReplyError(f"{self._where(key)}: range [{start}, {end}) returned more than {n} bytes")
            else:
                check_range_reply(self._where(key), start, end, got, total)  # a body cut short: raises
        except self._catch as e:
            self._raise(e, key, "GetObject")
        finally:
            if body is not None:
                body.close()  # not read to its end: drop the connection

    def head(self, key: str) -> ObjectInfo:
        resp = self._call("head_object", key, Key=self._full(key))
        return ObjectInfo(key, int(resp["ContentLength"]), resp["LastModified"].timestamp())

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # S3 lists keys in UTF-8 byte order, which is code point order: the
        # same order as sorting the str keys, so pages are yielded as they come.
        kwargs = {"Prefix": self._root + prefix}
        while True:
            resp = self._call("list_objects_v2", prefix or None, **kwargs)
            for obj in resp.get("Contents", ()):
                rel = obj["Key"][len(self._root) :]
                try:
                    check_key(rel)
                except ValueError:
                    # "dir/" markers and the like, made by other tools: not
                    # addressable through this API, so not listed.
                    continue
                yield ObjectInfo(rel, int(obj["Size"]), obj["LastModified"].timestamp())
            token = resp.get("NextContinuationToken")
            if not resp.get("IsTruncated") or not token:
                return
            kwargs["ContinuationToken"] = token

    # ------------------------------------------------------------ writes
    def put(self, key: str, data) -> None:
        self._send("put_object", key, Key=self._full(key), Body=_body(data))

    def put_if_absent(self, key: str, data) -> None:
        self._send("put_object", key, exists_on_412=True, Key=self._full(key), Body=_body(data), IfNoneMatch="*")

    def _upload_client(self):
        up = self._upload
        if up is not None:
            return up
        if self._key is not None:
            shared = self._entry()
            with shared["lock"]:
                if shared["upload"] is None:
                    shared["upload"] = _make_upload_client(self._upload_spec)
                up = shared["upload"]
            with self._upload_lock:
                if self._shared is shared:  # not closed meanwhile
                    self._upload = up
            return up
        with self._upload_lock:
            if self._upload is None:
                self._upload = _make_upload_client(self._upload_spec)
            return self._upload

    def _op_kwargs(self, client, op: str) -> dict:
        """``s3_additional_kwargs`` (and requester pays) that ``op`` takes, as s3fs applies them."""
        extra = self._upload_kwargs.get(op)
        if extra is None:
            model = client.meta.service_model.operation_model(client.meta.method_to_api_mapping[op])
            members = model.input_shape.members
            extra = self._upload_kwargs[op] = {
                k: v for k, v in self._upload_spec["extra"].items() if k in members}
        return extra

    def _send(self, op: str, key: str, exists_on_412: bool = False, **kwargs):
        """A request carrying a body: through the upload client when there is one."""
        if self._upload_spec is None:
            return self._call(op, key, exists_on_412, **kwargs)
        try:
            client = self._upload_client()
            return getattr(client, op)(Bucket=self.bucket, **self._op_kwargs(client, op), **kwargs)
        except self._catch as e:
            self._raise(e, key, op, exists_on_412)

    def delete(self, key: str) -> None:
        try:
            self._call("delete_object", key, Key=self._full(key))
        except ObjectNotFoundError:
            pass

    def delete_many(self, keys: Sequence[str]) -> None:
        """``DeleteObjects`` of up to :data:`DELETE_BATCH` keys a request, a few requests at a time.

        A server without ``DeleteObjects`` (``NotImplemented``) gets one
        ``DeleteObject`` per key instead, ``max_concurrency`` at a time.
        Keys the reply lists as failed raise (transient when every code is
        one S3 asks to retry), naming the first of them.
        """
        fulls = [self._full(k) for k in keys]
        if not fulls:
            return
        batches = [fulls[i : i + DELETE_BATCH] for i in range(0, len(fulls), DELETE_BATCH)]
        try:
            failed = self._run(self._adelete_batches, batches)
        except self._catch as e:
            if error_code(e)[0] != "NotImplemented":
                self._raise(e, keys[0], "DeleteObjects")
            failed, failed_at = [], []
            try:
                self._run(each_limited, self._adelete_one, fulls, self.max_concurrency, failed_at)
            except self._catch as e2:
                self._raise(e2, keys[failed_at[0]] if failed_at else None, "DeleteObject")
        if failed:
            full, code, message = failed[0]
            key = full[len(self._root) :] if full.startswith(self._root) else full
            text = (f"{self._where(key)}: S3 DeleteObjects failed for {len(failed)} of {len(fulls)} object(s); "
                    f"this one: {code}: {message[:MAX_MESSAGE]}")
            transient = all(c in TRANSIENT_CODES for _, c, _ in failed)
            raise (TransientStorageError if transient else StorageError)(text)

    async def _adelete_batches(self, batches: list[list[str]]) -> list[tuple[str, str, str]]:
        async def one(batch):
            resp = await self._fs._call_s3("delete_objects", Bucket=self.bucket,
                                           Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            return [(str(e.get("Key") or ""), str(e.get("Code") or ""), str(e.get("Message") or ""))
                    for e in resp.get("Errors") or () if e.get("Code") != "NoSuchKey"]

        got = await gather_limited([one(b) for b in batches], min(self.max_concurrency, DELETE_REQUESTS))
        return [f for fs in got for f in fs]

    async def _adelete_one(self, full: str) -> None:
        try:
            await self._fs._call_s3("delete_object", Bucket=self.bucket, Key=full)
        except self._catch as e:
            if error_code(e)[0] != "NoSuchKey" and not isinstance(e, FileNotFoundError):
                raise

    # ------------------------------------------------------------ multipart
    def create_multipart(self, key: str, part_size: int) -> MultipartUpload:
        return _S3Multipart(self, check_key(key), part_size)

    def list_multipart(self, prefix: str = "") -> list[MultipartInfo]:
        out = []
        kwargs = {"Prefix": self._root + prefix}
        while True:
            resp = self._call("list_multipart_uploads", prefix or None, **kwargs)
            for up in resp.get("Uploads", ()):
                rel = up["Key"][len(self._root) :]
                try:
                    check_key(rel)
                except ValueError:
                    continue
                out.append(MultipartInfo(rel, up["UploadId"], up["Initiated"].timestamp()))
            if not resp.get("IsTruncated"):
                break
            kwargs["KeyMarker"] = resp.get("NextKeyMarker", "")
            kwargs["UploadIdMarker"] = resp.get("NextUploadIdMarker", "")
        return sorted(out, key=lambda m: (m.key, m.upload_id))

    def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            self._call("abort_multipart_upload", key, Key=self._full(key), UploadId=upload_id)
        except ObjectNotFoundError:
            pass

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the HTTP clients; a later call opens new ones.

        Shared clients (:class:`_SharedClients`) go back to the process-wide
        cache instead, open for the next store with the same options; a
        later call on this store takes them again.
        """
        with self._upload_lock:
            up, self._upload = self._upload, None
            release, self._release, self._shared = self._release, None, None
        if self._key is not None:
            if release is not None:
                release()
            return
        _close_clients(self._own_fs, up)


def _checksums_on(config: dict) -> bool:
    """Whether botocore will send a body checksum with uploads."""
    setting = config.get("request_checksum_calculation") or os.environ.get(
        "AWS_REQUEST_CHECKSUM_CALCULATION", "when_supported")
    return str(setting).lower() == "when_supported"


class _S3Multipart(MultipartUpload):
    def __init__(self, store: S3Store, key: str, part_size: int):
        super().__init__(key, part_size)
        self.store = store
        self._full = store._full(key)
        resp = store._call("create_multipart_upload", key, Key=self._full)
        self.upload_id: str = resp["UploadId"]
        self._lock = threading.Lock()
        self._etags: dict[int, str] = {}
        self._sizes: dict[int, int] = {}
        self._aborted = False

    def upload_part(self, number: int, data) -> None:
        self._check_part(number, data)
        if self._aborted:
            raise ObjectNotFoundError(f"{self.store._where(self.key)}: multipart upload was aborted")
        size = len(data)
        resp = self.store._send(
            "upload_part",
            self.key,
            Key=self._full,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=_body(data),
        )
        with self._lock:
            self._etags[number] = resp["ETag"]
            self._sizes[number] = size

    def complete(self, nparts: int) -> None:
        if nparts < 1:
            raise ValueError(f"{self.key}: a multipart upload needs at least one part")
        with self._lock:
            missing = [n for n in range(1, nparts + 1) if n not in self._etags]
            if missing:
                raise ValueError(f"{self.key}: parts {missing[:5]} were never uploaded")
            for n in range(1, nparts):
                if self._sizes[n] != self.part_size:
                    raise ValueError(f"{self.key}: part {n} is {self._sizes[n]} bytes, not {self.part_size}")
            parts = [{"PartNumber": n, "ETag": self._etags[n]} for n in range(1, nparts + 1)]
        self.store._call(
            "complete_multipart_upload",
            self.key,
            Key=self._full,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": parts},
        )

    def abort(self) -> None:
        self._aborted = True
        self.store.abort_multipart(self.key, self.upload_id)
