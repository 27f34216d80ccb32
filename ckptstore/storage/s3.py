"""Amazon S3 (and S3-compatible services) through obstore; multipart uploads through botocore.

Every request but those of multipart uploads goes through obstore (the
Python bindings of the Rust ``object_store`` crate): get, ranged reads
(streamed into the caller's buffer), head, list, put, the conditional create
of :meth:`S3Store.put_if_absent` (``If-None-Match: *``), delete and
``DeleteObjects``. It was chosen by measurement (``benchmarks/s3_clients.py``,
``docs/performance.md``, "One S3 client"): about half botocore's client CPU
per GiB on PUTs and ranged GETs; the loader's streamed reads, which botocore
read straight from the socket into the buffer, cost more (the figures are
there). obstore exposes no explicit multipart
parts (only its own streamed uploads) and cannot list or abort unfinished
uploads, which GC must do for crashed savers; so :meth:`S3Store.create_multipart`,
:meth:`S3Store.list_multipart` and :meth:`S3Store.abort_multipart` use a
botocore client built lazily from the same options, and nothing else does.
Part bodies carry a CRC32 the server checks and no SHA-256 payload signature
(botocore's default over HTTPS; over plain HTTP it would hash every body);
obstore PUTs are sent with ``UNSIGNED-PAYLOAD`` likewise (the loader checks
every chunk's hash). ``config_kwargs={"s3": {"payload_signing_enabled":
True}}`` signs both.

``storage_options`` keep s3fs's names (:data:`OPTIONS`): ``key``, ``secret``,
``token``, ``anon``, ``profile``, ``endpoint_url``, ``region_name``,
``client_kwargs``, ``config_kwargs``, ``connect_timeout``, ``read_timeout``,
``requester_pays`` and a few more; any other key raises ``ValueError``
naming it (a typo never passes silently). Credentials: explicit ones, else
botocore's chain (environment, ``profile`` / ``AWS_PROFILE`` and
``~/.aws``, SSO, instance roles) through obstore's ``credential_provider``,
else obstore's own environment chain.

Retries and timeouts, so that no request waits forever and a dead server
fails in bounded time: every request has a connect timeout
(:data:`CONNECT_TIMEOUT`), a read timeout (:data:`READ_TIMEOUT`: the
longest wait for the next bytes of an answer) and an overall limit
(:data:`REQUEST_TIMEOUT`, for a body the server stops taking); obstore tries
a request at most :data:`TRIES` times (5xx, connection errors, timeouts of
safe requests; backoff at most 2 s) within :data:`RETRY_TIMEOUT`, botocore
likewise (standard mode). A conditional create goes through a second
obstore client that never retries: an attempt that landed with its answer
lost would otherwise come back as "already exists" from obstore's own
retry, where ckptstore's :class:`~ckptstore.storage.retry.RetryStore` (the
one layer with a bound on total time) knows to read the object back and
accept it if identical. What is left is classified as transient or
permanent (:func:`classify_error`, by the S3 error code and HTTP status in
the reply, or the kind of transport failure).

obstore runs one tokio runtime per process, which does not survive
``fork``: a process forked from one that used this module (DataLoader
workers, ``multiprocessing``'s fork start method) gets a
:class:`~ckptstore.errors.CkptStoreError` on first use instead of a hang.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import os
import re
import socket
import threading
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
)

#: Keys per ``DeleteObjects`` request (S3's limit).
DELETE_BATCH = 1000

#: S3 error codes that are worth retrying: throttling, server-side failures,
#: and conflicting concurrent conditional writes (S3 answers those with 409
#: ConditionalRequestConflict and asks the client to retry).
TRANSIENT_CODES = frozenset(
    {
        "SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "RequestTimeoutException",
        "Throttling", "ThrottlingException", "ThrottledException", "TooManyRequests", "TooManyRequestsException",
        "RequestLimitExceeded", "RequestThrottled", "BandwidthLimitExceeded", "OperationAborted",
        "ConditionalRequestConflict", "InternalServerError", "BadGateway", "GatewayTimeout",
        # The body arrived damaged (its checksum did not match): send again.
        "BadDigest", "XAmzContentSHA256Mismatch",
    }
)

#: Codes meaning "this object (or upload) does not exist". ``404`` is what
#: HEAD requests report, having no body to carry a code (so a HEAD cannot
#: tell a missing bucket from a missing key). ``NoSuchBucket`` is deliberately
#: absent: a missing bucket is a configuration error, and reporting it as a
#: missing object would make an empty repository out of it.
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchUpload", "404", "NotFound"})

#: Seconds to wait for a TCP connection.
CONNECT_TIMEOUT = 5.0
#: Seconds without a byte of an answer before a request fails.
READ_TIMEOUT = 15.0
#: Seconds one request may take in all (obstore), for a body the server stops taking.
REQUEST_TIMEOUT = 300.0
#: Tries of one request, the first included (obstore and botocore).
TRIES = 3
#: Seconds after a request's first try past which obstore starts no other.
RETRY_TIMEOUT = 60.0

#: The storage options understood, by where they go (s3fs's names).
OPTIONS = frozenset({"key", "secret", "token", "username", "password", "anon", "profile", "endpoint_url",
                     "region_name", "client_kwargs", "config_kwargs", "connect_timeout", "read_timeout",
                     "request_timeout", "requester_pays", "use_ssl"})
#: s3fs options about its own caches: accepted and ignored (this store has no cache).
IGNORED_OPTIONS = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
                             "default_block_size", "default_fill_cache", "default_cache_type", "cache_regions"})
CLIENT_KWARGS = frozenset({"endpoint_url", "region_name", "verify", "use_ssl", "aws_access_key_id",
                           "aws_secret_access_key", "aws_session_token"})
CONFIG_KWARGS = frozenset({"proxies", "retries", "connect_timeout", "read_timeout", "max_pool_connections", "s3",
                           "request_checksum_calculation", "user_agent_extra"})
S3_CONFIG = frozenset({"addressing_style", "payload_signing_enabled"})


# ------------------------------------------------------------------ fork guard
_PID: int | None = None  # the process that first used obstore through this module


def _check_fork(where: str) -> None:
    """Raise in a process forked from one whose obstore runtime is running (it would hang)."""
    global _PID
    pid = os.getpid()
    if _PID is None:
        _PID = pid
    elif _PID != pid:
        raise CkptStoreError(
            f"{where}: S3 used in a process forked from one that already used S3 (pid {_PID}); obstore's "
            "runtime does not survive fork. Open the repository in a spawn-started process "
            "(multiprocessing.get_context('spawn'), DataLoader(multiprocessing_context='spawn')), or only "
            "in the children")


# ------------------------------------------------------------------ errors
_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]{1,80})</Code>")
_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
_NETWORK_KIND = re.compile(r"kind: (Connect|Request|Timeout|Interrupted|Decode|Body)\b|HTTP error|error decoding")
_DNS = re.compile(r"dns error.*?failed to lookup address information: ([^\"\n]*)", re.S)
_URL_HOST = re.compile(r"https?://([^/:\s]+)")


def _client_error(exc: BaseException):
    """The botocore ``ClientError`` behind ``exc`` (itself or a cause), or None."""
    types = optional_types("botocore.exceptions:ClientError")
    return in_chain(exc, lambda e: e if types and isinstance(e, types) else None)


def _obstore_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("obstore") or "Error performing" in str(exc)


def error_code(exc: BaseException) -> tuple[str, int | None, str]:
    """``(code, http_status, message)`` of the S3 error behind ``exc``; ``("", None, "")`` if none."""
    ce = _client_error(exc)
    if ce is not None:
        resp = getattr(ce, "response", None) or {}
        err = resp.get("Error") or {}
        status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return str(err.get("Code") or ""), status, str(err.get("Message") or "")
    if not _obstore_error(exc):
        return "", None, ""
    text = str(exc)
    status = _STATUS.search(text)
    code = _CODE.search(text)
    message = _MESSAGE.search(text)
    return (code.group(1) if code else "", int(status.group(1)) if status else None,
            message.group(1) if message else "")


def _is_connection_error(exc: BaseException) -> bool:
    """Network-level failures (resets, timeouts, truncated bodies): retryable."""
    if _obstore_error(exc) and _NETWORK_KIND.search(str(exc)):
        return True
    return is_network_error(exc, optional_types(
        "botocore.exceptions:ConnectionError", "botocore.exceptions:HTTPClientError",
        "botocore.exceptions:IncompleteReadError", "botocore.exceptions:ReadTimeoutError",
        "botocore.exceptions:ResponseStreamingError"))


def _unresolved(exc: BaseException, where: str, op: str):
    found = host_not_resolved(exc, where, f"S3 {op}")
    if found is not None or not _obstore_error(exc):
        return found
    m = _DNS.search(str(exc))
    if m is None:
        return None
    reason = m.group(1).strip()
    host = _URL_HOST.search(str(exc))
    errno = socket.EAI_AGAIN if "emporar" in reason else socket.EAI_NONAME
    return host_not_resolved(socket.gaierror(errno, reason), where, f"S3 {op}", host=host and host.group(1))


def classify_error(exc: BaseException, where: str, op: str, exists_on_412: bool = False) -> Exception:
    """Turn an exception from obstore or botocore into a ckptstore exception.

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
    dns = _unresolved(exc, where, op)
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
    # No S3 reply: the first line of obstore's message (the rest is its debug dump).
    detail = f"{type(exc).__name__}: {str(exc).splitlines()[0][:MAX_MESSAGE] if str(exc) else ''}"
    if exists_on_412 and (isinstance(exc, FileExistsError) or type(exc).__name__ == "AlreadyExistsError"):
        return ObjectExistsError(f"{where}: object already exists (S3 {op})")
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFoundError(f"{where}: no such object (S3 {op})")
    if _is_connection_error(exc):
        return TransientStorageError(f"{where}: S3 {op} failed: {detail}")
    return StorageError(f"{where}: S3 {op} failed: {detail}")


# ------------------------------------------------------------------ options
def _seconds(value) -> float:
    return float(value.total_seconds() if isinstance(value, datetime.timedelta) else value)


def _tries(retries: dict | None) -> int:
    """Tries of a request from botocore's ``retries`` option (``max_attempts`` counts retries only)."""
    retries = retries or {}
    if "total_max_attempts" in retries:
        return max(1, int(retries["total_max_attempts"]))
    if "max_attempts" in retries:
        return max(1, int(retries["max_attempts"]) + 1)
    return TRIES


class _Options:
    """``storage_options`` (s3fs's names) checked and translated for obstore and botocore.

    Raises ``ValueError`` naming any key not understood.
    """

    def __init__(self, opts: dict, max_concurrency: int):
        def refuse(unknown, where, known):
            if unknown:
                raise ValueError(f"S3 storage option(s) {sorted(unknown)}{where} not supported; "
                                 f"supported: {sorted(known)}")

        refuse(set(opts) - OPTIONS - IGNORED_OPTIONS, "", OPTIONS)
        ck = dict(opts.get("client_kwargs") or {})
        refuse(set(ck) - CLIENT_KWARGS, " in client_kwargs", CLIENT_KWARGS)
        cfg = dict(opts.get("config_kwargs") or {})
        refuse(set(cfg) - CONFIG_KWARGS, " in config_kwargs", CONFIG_KWARGS)
        s3cfg = dict(cfg.get("s3") or {})
        refuse(set(s3cfg) - S3_CONFIG, " in config_kwargs['s3']", S3_CONFIG)
        self.key = opts.get("key") or opts.get("username") or ck.get("aws_access_key_id")
        self.secret = opts.get("secret") or opts.get("password") or ck.get("aws_secret_access_key")
        self.token = opts.get("token") or ck.get("aws_session_token")
        self.anon = bool(opts.get("anon"))
        self.profile = opts.get("profile")
        # The environment's endpoint too (botocore reads it as well): obstore needs allow_http for it.
        self.endpoint = opts.get("endpoint_url") or ck.get("endpoint_url") or next(
            (os.environ[k] for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if os.environ.get(k)), None)
        self.region = opts.get("region_name") or ck.get("region_name")
        self.verify = ck.get("verify", True)
        if not isinstance(self.verify, bool):
            raise ValueError("S3 option client_kwargs['verify'] takes True or False here (a CA bundle path is "
                             "not supported: add the CA to the system's trust store)")
        self.connect = _seconds(opts.get("connect_timeout") or cfg.get("connect_timeout") or CONNECT_TIMEOUT)
        self.read = _seconds(opts.get("read_timeout") or cfg.get("read_timeout") or READ_TIMEOUT)
        self.total = _seconds(opts.get("request_timeout") or REQUEST_TIMEOUT)
        self.tries = _tries(cfg.get("retries"))
        self.proxies = dict(cfg.get("proxies") or {})
        self.pool = int(cfg.get("max_pool_connections") or max(10, max_concurrency))
        self.path_style = s3cfg.get("addressing_style", "path" if self.endpoint else "auto") == "path"
        self.sign_payload = bool(s3cfg.get("payload_signing_enabled")) or str(
            cfg.get("request_checksum_calculation", "when_supported")).lower() == "when_required"
        self.requester_pays = bool(opts.get("requester_pays"))
        if self.endpoint and opts.get("use_ssl", ck.get("use_ssl", True)) is False:
            self.endpoint = self.endpoint.replace("https://", "http://", 1)
        #: Kept only to scrub them from error messages, never printed.
        self.secrets = tuple(str(s) for s in (self.secret, self.token) if s)

    def obstore_store(self, bucket: str, retries: bool = True):
        """An ``obstore.store.S3Store`` for ``bucket`` (``retries=False``: one try per call)."""
        from obstore.store import S3Store as ObS3

        config: dict = {"unsigned_payload": not self.sign_payload}
        if self.endpoint:
            config["endpoint"] = self.endpoint
        if self.region:
            config["region"] = self.region
        if self.path_style:
            config["virtual_hosted_style_request"] = False
        if self.requester_pays:
            config["request_payer"] = True
        provider = None
        if self.anon:
            config["skip_signature"] = True
        elif self.key and self.secret:
            config.update(access_key_id=self.key, secret_access_key=self.secret)
            if self.token:
                config["session_token"] = self.token
        else:
            provider = _botocore_credentials(self.profile)
            if provider is not None and not self.region and provider.region:
                config["region"] = provider.region
        client = {"connect_timeout": datetime.timedelta(seconds=self.connect),
                  "read_timeout": datetime.timedelta(seconds=self.read),
                  "timeout": datetime.timedelta(seconds=self.total),
                  "pool_max_idle_per_host": str(self.pool),
                  "allow_http": bool(self.endpoint and self.endpoint.startswith("http://"))}
        if self.verify is False:
            client["allow_invalid_certificates"] = True
        proxy = self.proxies.get("https" if not client["allow_http"] else "http")
        if proxy:
            client["proxy_url"] = proxy
        retry = {"max_retries": self.tries - 1 if retries else 0,
                 "retry_timeout": datetime.timedelta(seconds=RETRY_TIMEOUT),
                 "backoff": {"init_backoff": datetime.timedelta(seconds=0.5),
                             "max_backoff": datetime.timedelta(seconds=2), "base": 2}}
        return ObS3(bucket, config=config, client_options=client, retry_config=retry,
                    credential_provider=provider)

    def botocore_client(self):
        """A threaded botocore client with the same options (multipart uploads only)."""
        import botocore.session
        from botocore import UNSIGNED
        from botocore.config import Config

        config = {"connect_timeout": self.connect, "read_timeout": self.read,
                  "retries": {"mode": "standard", "total_max_attempts": self.tries},
                  "max_pool_connections": self.pool, "proxies": self.proxies,
                  "s3": {"addressing_style": "path" if self.path_style else "auto",
                         "payload_signing_enabled": self.sign_payload}}
        if self.anon:
            config["signature_version"] = UNSIGNED
        kwargs = {"endpoint_url": self.endpoint, "region_name": self.region, "verify": self.verify}
        if self.key and self.secret:
            kwargs.update(aws_access_key_id=self.key, aws_secret_access_key=self.secret,
                          aws_session_token=self.token)
        with _SESSION_LOCK:  # create_client is not thread-safe on one session
            if self.anon or (self.key and self.secret and not self.profile):
                # Loading the S3 service model costs ~0.1 s: stores that bring
                # their own credentials share one session (a session caches
                # credentials found through the chain: the others never share).
                session = _SESSION.get("shared") or _SESSION.setdefault("shared", botocore.session.Session())
            else:
                session = botocore.session.Session(profile=self.profile)
            return session.create_client("s3", config=Config(**config), **kwargs)


_SESSION_LOCK = threading.Lock()
_SESSION: dict[str, object] = {}


class _BotocoreCredentials:
    """obstore's ``credential_provider`` over botocore's chain (``~/.aws``, profiles, SSO, roles)."""

    def __init__(self, creds, region: str | None):
        self.creds = creds
        self.region = region

    def __call__(self) -> dict:
        frozen = self.creds.get_frozen_credentials()  # refreshes temporary credentials when due
        expires = None
        if hasattr(self.creds, "refresh_needed"):
            expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=5)
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                "token": frozen.token, "expires_at": expires}


def _botocore_credentials(profile: str | None) -> _BotocoreCredentials | None:
    """botocore's credentials for ``profile`` (None: the default chain), or None where there are none."""
    try:
        import botocore.session
    except ImportError:
        if profile:
            raise ImportError("the S3 option 'profile' needs botocore: pip install 'ckptstore[s3]'") from None
        return None
    session = botocore.session.Session(profile=profile)
    creds = session.get_credentials()
    if creds is None:
        return None
    return _BotocoreCredentials(creds, session.get_config_variable("region"))


# ------------------------------------------------------------------ the store
class S3Store(ObjectStore):
    """Objects under ``s3://bucket/prefix``.

    Parameters
    ----------
    path:
        ``"bucket"`` or ``"bucket/prefix"`` (an ``s3://`` scheme is accepted).
    storage_options:
        s3fs's names (module docstring, :data:`OPTIONS`): ``key``,
        ``secret``, ``token``, ``anon``, ``profile``, ``endpoint_url``,
        ``client_kwargs`` (``endpoint_url``, ``region_name``...),
        ``config_kwargs`` (``retries``, ``proxies``...), ``connect_timeout``,
        ``read_timeout``. An unknown key raises ``ValueError``.
    max_concurrency:
        Most range requests of one :meth:`get_ranges` call in flight at once;
        also the floor of the HTTP connection pool size.
    """

    mtime_resolution = 1.0  # Last-Modified has whole seconds
    remote = True

    def __init__(self, path: str, storage_options: dict | None = None, max_concurrency: int = 16):
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
        self._opts = _Options(dict(storage_options or {}), max_concurrency)
        self._secrets = self._opts.secrets
        self._lock = threading.Lock()
        self._stores: dict[bool, object] = {}  # obstore stores: retrying, and one-try (creates)
        self._mp = None  # the botocore client of multipart uploads
        self._catch = (OSError, *optional_types("obstore.exceptions:BaseError", "botocore.exceptions:BotoCoreError",
                                                "botocore.exceptions:ClientError"))

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    # ------------------------------------------------------------ plumbing
    def _full(self, key: str) -> str:
        return self._root + check_key(key)

    def _where(self, key: str | None = None) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _raise(self, exc: BaseException, key: str | None, op: str, exists_on_412: bool = False):
        err = scrub(classify_error(exc, self._where(key), op, exists_on_412), exc, self._secrets)
        if err is exc:
            raise exc
        raise err from exc

    def _store(self, retries: bool = True):
        """obstore's store (the one-try one for creates), made on first use; checks for a fork first."""
        _check_fork(self.url)
        store = self._stores.get(retries)
        if store is None:
            with self._lock:
                store = self._stores.get(retries)
                if store is None:
                    store = self._stores[retries] = self._opts.obstore_store(self.bucket, retries)
        return store

    def _client(self):
        """The botocore client of multipart uploads (made on first use)."""
        if self._mp is None:
            with self._lock:
                if self._mp is None:
                    self._mp = self._opts.botocore_client()
        return self._mp

    def _call(self, op: str, key: str | None, **kwargs):
        """A botocore request (multipart uploads)."""
        try:
            return getattr(self._client(), op)(Bucket=self.bucket, **kwargs)
        except self._catch as e:
            self._raise(e, key, op)

    # ------------------------------------------------------------ reads
    def get(self, key: str) -> bytes:
        import obstore

        full = self._full(key)
        try:
            res = obstore.get(self._store(), full)
            data = res.bytes()
        except self._catch as e:
            self._raise(e, key, "GetObject")
        if len(data) != res.meta["size"]:
            raise TransientStorageError(f"{self._where(key)}: short read, got {len(data)} of {res.meta['size']} bytes")
        return bytes(data)

    def _get_range(self, key: str, start: int, end: int):
        """One ranged GET: obstore's result and the object's size.

        A range past the end raises :class:`RangeReplyError`.
        """
        import obstore

        try:
            res = obstore.get(self._store(), self._full(key), options={"range": (start, end)})
        except self._catch as e:
            if error_code(e)[0] == "InvalidRange":
                raise RangeReplyError(f"{self._where(key)}: range [{start}, {end}) past end of object") from None
            raise
        size = int(res.meta["size"])
        r0, r1 = res.range
        check_range_reply(self._where(key), start, end, r1 - r0, size)
        return res, size

    def _range_bytes(self, key: str, start: int, end: int) -> tuple[bytes, int]:
        res, size = self._get_range(key, start, end)
        data = res.bytes()
        check_range_reply(self._where(key), start, end, len(data), size)
        return bytes(data), size

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Each range by its own GET (obstore's ``get_ranges`` merges neighbours and caps
        its requests at 10); at most ``max_concurrency`` at once on a pool of this call."""
        ranges = check_ranges(ranges)
        todo = [(i, s, e) for i, (s, e) in enumerate(ranges) if e > s]
        out: list[bytes] = [b""] * len(ranges)
        size = None
        try:
            if len(todo) <= 1 or self.max_concurrency == 1:
                # The loader asks for one range per call from its own I/O threads.
                for i, s, e in todo:
                    out[i], size = self._range_bytes(key, s, e)
            else:
                with cf.ThreadPoolExecutor(min(self.max_concurrency, len(todo)),
                                           thread_name_prefix="ckptstore-s3-get") as ex:
                    futs = [(i, ex.submit(self._range_bytes, key, s, e)) for i, s, e in todo]
                    try:
                        for i, f in futs:
                            out[i], size = f.result()
                    finally:
                        for _, f in futs:
                            f.cancel()
        except RangeReplyError as e:
            raise ValueError(str(e)) from None
        except self._catch as e:
            self._raise(e, key, "GetObject")
        if len(todo) < len(ranges) or not ranges:
            # Empty ranges need no bytes, but they must exist and lie inside
            # the object, like in every other store.
            if size is None:
                size = self.head(key).size
            for s, e in ranges:
                if e > size:
                    raise ValueError(f"{self._where(key)}: range [{s}, {e}) past end of {size}-byte object")
        return out

    def read_range_into(self, key: str, start: int, out, progress=None) -> None:
        """Stream one ranged GET into ``out``, reporting every :data:`READ_PIECE` bytes or so."""
        mv = memoryview(out).cast("B")
        n = len(mv)
        if n == 0 or start < 0:
            return super().read_range_into(key, start, out, progress)
        end, got = start + n, 0
        try:
            res, size = self._get_range(key, start, end)
            for piece in res.stream(min_chunk_size=READ_PIECE):
                k = len(piece)
                if got + k > n:
                    raise RangeReplyError(f"{self._where(key)}: range [{start}, {end}) returned more than {n} bytes")
                mv[got : got + k] = piece
                got += k
                if progress is not None:
                    progress(got)
            check_range_reply(self._where(key), start, end, got, size)  # a body cut short: raises
        except self._catch as e:
            self._raise(e, key, "GetObject")

    def head(self, key: str) -> ObjectInfo:
        import obstore

        try:
            meta = obstore.head(self._store(), self._full(key))
        except self._catch as e:
            self._raise(e, key, "HeadObject")
        return ObjectInfo(key, int(meta["size"]), meta["last_modified"].timestamp())

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Pages as they come (S3 lists keys in code point order, that of sorted str keys).

        obstore lists "directories": a prefix not ending in ``/`` lists its
        parent directory from just before it and stops past the prefix.
        """
        import obstore

        want = self._root + prefix
        parent = want[: want.rfind("/") + 1] if not want.endswith("/") else want
        start_after = None
        if want != parent:
            start_after = want[:-1] + chr(ord(want[-1]) - 1) if ord(want[-1]) > 1 else parent
        try:
            pages = obstore.list(self._store(), prefix=parent.rstrip("/") or None, offset=start_after,
                                 chunk_size=1000)
            for page in pages:
                for meta in page:
                    path = meta["path"]
                    if not path.startswith(want):
                        if path[: len(want)] > want:
                            return
                        continue
                    rel = path[len(self._root) :]
                    try:
                        check_key(rel)
                    except ValueError:
                        # "dir/" markers and the like, made by other tools: not
                        # addressable through this API, so not listed.
                        continue
                    yield ObjectInfo(rel, int(meta["size"]), meta["last_modified"].timestamp())
        except self._catch as e:
            self._raise(e, prefix or None, "ListObjectsV2")

    # ------------------------------------------------------------ writes
    def _put(self, key: str, data, create: bool) -> None:
        import obstore

        full = self._full(key)
        body = data if isinstance(data, (bytes, bytearray)) else memoryview(data).cast("B")
        try:
            obstore.put(self._store(not create), full, body, mode="create" if create else "overwrite",
                        use_multipart=False)
        except self._catch as e:
            self._raise(e, key, "PutObject", exists_on_412=create)

    def put(self, key: str, data) -> None:
        self._put(key, data, create=False)

    def put_if_absent(self, key: str, data) -> None:
        """``If-None-Match: *``, one try (module docstring); the server's 412 raises ObjectExistsError."""
        self._put(key, data, create=True)

    def delete(self, key: str) -> None:
        import obstore

        try:
            obstore.delete(self._store(), self._full(key))
        except FileNotFoundError:
            pass
        except self._catch as e:
            self._raise(e, key, "DeleteObject")

    def delete_many(self, keys: Sequence[str]) -> None:
        """``DeleteObjects`` of up to :data:`DELETE_BATCH` keys a request (obstore's bulk delete).

        A failure names the first key of the batch it happened in.
        """
        import obstore

        fulls = [self._full(k) for k in keys]
        for i in range(0, len(fulls), DELETE_BATCH):
            try:
                obstore.delete(self._store(), fulls[i : i + DELETE_BATCH])
            except self._catch as e:
                self._raise(e, keys[i], "DeleteObjects")

    # ------------------------------------------------------------ multipart (botocore)
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
        """Drop the clients (their connections close); a later call makes new ones."""
        with self._lock:
            mp, self._mp = self._mp, None
            self._stores = {}
        if mp is not None:
            try:
                mp.close()
            except Exception:
                pass


class _S3Multipart(MultipartUpload):
    def __init__(self, store: S3Store, key: str, part_size: int):
        super().__init__(key, part_size)
        self.store = store
        self._full = store._full(key)
        extra = {"RequestPayer": "requester"} if store._opts.requester_pays else {}
        self._extra = extra
        resp = store._call("create_multipart_upload", key, Key=self._full, **extra)
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
        # botocore sends bytes and bytearray as they are; anything else is copied once.
        body = data if isinstance(data, (bytes, bytearray)) else memoryview(data).cast("B").tobytes()
        resp = self.store._call("upload_part", self.key, Key=self._full, UploadId=self.upload_id,
                                PartNumber=number, Body=body, **self._extra)
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
        self.store._call("complete_multipart_upload", self.key, Key=self._full, UploadId=self.upload_id,
                         MultipartUpload={"Parts": parts}, **self._extra)

    def abort(self) -> None:
        self._aborted = True
        self.store.abort_multipart(self.key, self.upload_id)
