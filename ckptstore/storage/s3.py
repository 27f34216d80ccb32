"""Amazon S3 (and S3-compatible services) through botocore alone.

Every request goes through one threaded botocore client per store (a
second, one-try client for conditional creates, below), built on first use
from s3fs-style ``storage_options``: get, ranged reads, head, list, put,
:meth:`S3Store.put_if_absent` (``If-None-Match: *``), delete,
``DeleteObjects``, multipart uploads and GC's list/abort of unfinished ones.
It was chosen by measurement over obstore (``benchmarks/micro/s3_clients.py``,
``docs/performance.md``, "One S3 client"): obstore cut client CPU only for
single PUTs, which carry manifests and segments (small); packs go through
multipart uploads, which obstore cannot do with explicit parts, and a load
through obstore cost more client CPU than botocore, whose ranged GETs are
read here straight from the socket into the loader's buffer
(:func:`~ckptstore.storage._blocking.stream_into`). Bodies carry a CRC32 the server checks and no
SHA-256 payload signature (botocore's default over HTTPS; over plain HTTP it
would hash every body at 1.8 GB/s); ``config_kwargs={"s3":
{"payload_signing_enabled": True}}`` signs them.

``storage_options`` keep s3fs's names (:data:`OPTIONS`): ``key``, ``secret``,
``token``, ``anon``, ``profile``, ``endpoint_url``, ``region_name``,
``client_kwargs``, ``config_kwargs``, ``connect_timeout``, ``read_timeout``,
``requester_pays``, ``s3_additional_kwargs`` (request parameters such as
``ServerSideEncryption``/``SSEKMSKeyId``, added to every request that takes
them) and a few more; any other key raises ``ValueError``
naming it (a typo never passes silently). Credentials: explicit ones, else
botocore's chain (environment, ``profile`` / ``AWS_PROFILE`` and
``~/.aws``, SSO, instance roles); the endpoint: the options, else
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``.

Retries and timeouts, so that no request waits forever and a dead server
fails in bounded time: every request has a connect timeout
(:data:`CONNECT_TIMEOUT`) and a read timeout (:data:`READ_TIMEOUT`, the
longest wait for the next bytes of an answer or for the server to take more
of a body); botocore tries a request at most :data:`TRIES` times (standard
mode: 5xx, throttling, connection errors and timeouts; backoff at most 1 s
then 2 s). Before these defaults botocore's legacy mode (5 attempts, backoff
up to 8 s) under s3fs made one call against a killed server take up to
~15 s, and a load then failed after 77-95 s. A conditional create goes
through a client that never retries: an attempt that landed with its answer
lost would otherwise come back as "already exists" from botocore's own
retry, where ckptstore's :class:`~ckptstore.storage.retry.RetryStore` (the
one layer with a bound on total time) knows to read the object back and
accept it if identical. What is left is classified as transient or
permanent (:func:`classify_error`, by the S3 error code and HTTP status of
the reply, or the kind of transport failure).

Clients hold urllib3 connection pools, which must not be shared across
``fork``: a store used in a process forked from the one that made its
clients (DataLoader workers, ``multiprocessing``'s fork start method) makes
its own there on first use and leaves the parent's alone.
"""

from __future__ import annotations

import datetime
import functools
import os
import re
import threading
from typing import Iterator, Sequence

from botocore.exceptions import BotoCoreError, ClientError

from ..errors import (
    CkptStoreError,
    CredentialsRefusedError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    TransientStorageError,
)
from ._classify import MAX_MESSAGE, host_not_resolved, in_chain, is_network_error, optional_types, scrub
from ._credentials import refused, s3_source, with_source
from ._blocking import get_ranges_threaded, stream_range
from .throttle import AdaptiveRate, ThrottlePolicy, parse_retry_after, rate_for
from ..units import parse_size
from .base import (
    MIN_PART_SIZE,
    MultipartInfo,
    MultipartUpload,
    ObjectInfo,
    ObjectStore,
    RangeReplyError,
    check_key,
    check_range_reply,
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

#: Codes (besides any 429 or 503 answer) that say the store was sent too many requests: they
#: lower the process's request rate to the bucket (:mod:`~ckptstore.storage.throttle`).
THROTTLE_CODES = frozenset(
    {
        "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "TooManyRequests",
        "TooManyRequestsException", "RequestLimitExceeded", "RequestThrottled", "RequestThrottledException",
        "BandwidthLimitExceeded",
    }
)

#: Codes meaning "this object (or upload) does not exist". ``404`` is what
#: HEAD requests report, having no body to carry a code (so a HEAD cannot
#: tell a missing bucket from a missing key). ``NoSuchBucket`` is deliberately
#: absent: a missing bucket is a configuration error, and reporting it as a
#: missing object would make an empty repository out of it.
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchUpload", "404", "NotFound"})
#: Codes (besides any 401 or 403) meaning the store refused the request's credentials.
AUTH_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                        "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "InvalidClientTokenId"})

#: Seconds to wait for a TCP connection.
CONNECT_TIMEOUT = 5.0
#: Seconds without a byte of an answer (or the server taking none of a body) before a request fails.
READ_TIMEOUT = 15.0
#: botocore's tries of one request, the first included (its ``max_attempts`` counts retries only).
TRIES = 3

#: The storage options understood, by where they go (s3fs's names).
OPTIONS = frozenset({"key", "secret", "token", "username", "password", "anon", "profile", "endpoint_url",
                     "region_name", "client_kwargs", "config_kwargs", "connect_timeout", "read_timeout",
                     "requester_pays", "use_ssl", "s3_additional_kwargs", "min_part_size"})
#: s3fs options about its own caches: accepted and ignored (this store has no cache).
IGNORED_OPTIONS = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
                             "default_block_size", "default_fill_cache", "default_cache_type", "cache_regions"})
CLIENT_KWARGS = frozenset({"endpoint_url", "region_name", "verify", "use_ssl", "aws_access_key_id",
                           "aws_secret_access_key", "aws_session_token"})
CONFIG_KWARGS = frozenset({"proxies", "retries", "connect_timeout", "read_timeout", "max_pool_connections", "s3",
                           "request_checksum_calculation", "user_agent_extra"})
S3_CONFIG = frozenset({"addressing_style", "payload_signing_enabled"})


# ------------------------------------------------------------------ errors
def _client_error(exc: BaseException):
    """The botocore ``ClientError`` behind ``exc`` (itself or a cause), or None."""
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


def _headers(exc: BaseException) -> dict:
    """The HTTP headers of the S3 error answer behind ``exc`` (lower-case names), or {}."""
    ce = _client_error(exc)
    resp = getattr(ce, "response", None) or {}
    return (resp.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}


def _on_answer(rate: AdaptiveRate, response=None, **kwargs) -> None:
    """botocore's ``needs-retry`` event, every attempt: tell the adaptive rate how it went."""
    if response is None:
        return None  # no answer (a connection failure): says nothing about the request rate
    http, parsed = response
    status = getattr(http, "status_code", None)
    code = str(((parsed or {}).get("Error") or {}).get("Code") or "")
    throttled = code in THROTTLE_CODES or status in (429, 503)
    rate.after(throttled, parse_retry_after(http.headers.get("Retry-After")) if throttled else None)
    return None  # botocore's own retry handler decides on retrying


def _before_send(rate: AdaptiveRate, **kwargs) -> None:
    rate.before()
    return None


def _is_connection_error(exc: BaseException) -> bool:
    """Network-level failures (resets, timeouts, truncated bodies): retryable."""
    return is_network_error(exc, optional_types(
        "botocore.exceptions:ConnectionError", "botocore.exceptions:HTTPClientError",
        "botocore.exceptions:IncompleteReadError", "botocore.exceptions:ReadTimeoutError",
        "botocore.exceptions:ResponseStreamingError"))


def classify_error(exc: BaseException, where: str, op: str, exists_on_412: bool = False) -> Exception:
    """Turn an exception from botocore into a ckptstore exception.

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
    if isinstance(exc, ValueError) and not type(exc).__module__.startswith("botocore"):
        if _garbled_reply(exc):
            # A reply cut short inside its headers (a connection closed mid-header ends the header
            # block without an error) leaves a header botocore cannot parse: as transient as the cut
            return TransientStorageError(f"{where}: S3 {op} failed: the reply was garbled ({_detail(exc)})")
        return exc  # not botocore's parsing: ours (RangeReplyError...), raised as it is
    dns = host_not_resolved(exc, where, f"S3 {op}")
    if dns is not None:
        return dns
    code, status, message = error_code(exc)
    message = message[:MAX_MESSAGE]
    if code or status:
        label = code or str(status)
        text = f"{where}: S3 {op} failed ({label})" + (f": {message}" if message else "")
        # 304: MinIO (minio #19442) refuses a conditional create of an existing key so
        if exists_on_412 and (code in ("PreconditionFailed", "NotModified", "304") or status in (412, 304)):
            return ObjectExistsError(f"{where}: object already exists (S3 {op}: {label})")
        if code in AUTH_CODES or status in (401, 403):  # the store adds where its credentials came from
            return refused(where, f"S3 {op}", label, message)
        if code in NOT_FOUND_CODES or (not code and status == 404):
            which = " (the bucket exists)" if code == "NoSuchKey" else ""
            return ObjectNotFoundError(f"{where}: no such object{which} (S3 {op}: {label})")
        if code == "NoSuchBucket":
            return StorageError(f"{where}: bucket does not exist (S3 {op}: {label}); create it first: "
                                "ckptstore never creates buckets")
        if code == "EntityTooSmall":
            return StorageError(f"{text}. The store refused a multipart part as too small: its minimum part "
                                "is above this repository's part_size. Open the repository with a larger "
                                "part_size=, or give the store's minimum as the storage option min_part_size "
                                "(CoreWeave: '15MiB')")
        if code in TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429)):
            err = TransientStorageError(text)
            if code in THROTTLE_CODES or status in (429, 503):
                err.throttled = True
                err.retry_after = parse_retry_after(_headers(exc).get("retry-after"))
            return err
        return StorageError(text)
    detail = _detail(exc)
    if exists_on_412 and isinstance(exc, FileExistsError):
        return ObjectExistsError(f"{where}: object already exists (S3 {op})")
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFoundError(f"{where}: no such object (S3 {op})")
    if isinstance(exc, optional_types("botocore.exceptions:NoCredentialsError")):
        return CredentialsRefusedError(f"{where}: S3 {op} failed: no credentials to sign it with")
    if _is_connection_error(exc):
        return TransientStorageError(f"{where}: S3 {op} failed: {detail}")
    return StorageError(f"{where}: S3 {op} failed: {detail}")


def _detail(exc: BaseException) -> str:
    """``Type: message`` of an exception with no error code, its message cut to MAX_MESSAGE."""
    return f"{type(exc).__name__}: {str(exc)[:MAX_MESSAGE]}"


def _garbled_reply(exc: BaseException) -> bool:
    """``exc`` was raised while botocore parsed a reply (a header or body it could not read)."""
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename.replace(os.sep, "/")
        if "/botocore/parsers.py" in name:
            return True
        tb = tb.tb_next
    return False


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
    """``storage_options`` (s3fs's names) checked and translated for botocore.

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
        # The environment's endpoint too, so that path-style addressing follows it.
        self.endpoint = opts.get("endpoint_url") or ck.get("endpoint_url") or next(
            (os.environ[k] for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if os.environ.get(k)), None)
        self.region = opts.get("region_name") or ck.get("region_name")
        self.verify = ck.get("verify")  # None: botocore's default; False; or a CA bundle path
        self.connect = _seconds(opts.get("connect_timeout") or cfg.get("connect_timeout") or CONNECT_TIMEOUT)
        self.read = _seconds(opts.get("read_timeout") or cfg.get("read_timeout") or READ_TIMEOUT)
        self.tries = _tries(cfg.get("retries"))
        self.proxies = dict(cfg.get("proxies") or {})
        self.pool = max(int(cfg.get("max_pool_connections") or 10), max_concurrency)
        self.path_style = s3cfg.get("addressing_style", "path" if self.endpoint else "auto") == "path"
        self.checksums = str(cfg.get("request_checksum_calculation") or os.environ.get(
            "AWS_REQUEST_CHECKSUM_CALCULATION") or "when_supported").lower()
        # Without a CRC32 the server checks, the SHA-256 payload signature is the body's only check.
        self.sign_payload = bool(s3cfg.get("payload_signing_enabled")) or self.checksums == "when_required"
        self.user_agent_extra = cfg.get("user_agent_extra")
        self.requester_pays = bool(opts.get("requester_pays"))
        # Not every S3-compatible store takes S3's 5 MiB parts (CoreWeave: 15 MiB).
        self.min_part_size = parse_size(opts.get("min_part_size") or MIN_PART_SIZE)
        if self.min_part_size < MIN_PART_SIZE:
            raise ValueError(f"S3 storage option min_part_size must be at least {MIN_PART_SIZE} bytes (S3's own "
                             f"minimum), got {opts.get('min_part_size')!r}")
        self.extra = _extra_params(opts.get("s3_additional_kwargs"))
        if self.endpoint and opts.get("use_ssl", ck.get("use_ssl", True)) is False:
            self.endpoint = self.endpoint.replace("https://", "http://", 1)
        #: Kept only to scrub them from error messages, never printed.
        self.secrets = tuple(str(s) for s in (self.secret, self.token) if s)

    def client(self, retries: bool = True):
        """A botocore S3 client (thread-safe) with these options; ``retries=False``: one try per request."""
        import botocore.session
        from botocore import UNSIGNED
        from botocore.config import Config

        config = {"connect_timeout": self.connect, "read_timeout": self.read,
                  "retries": {"mode": "standard", "total_max_attempts": self.tries if retries else 1},
                  "max_pool_connections": self.pool, "proxies": self.proxies,
                  "request_checksum_calculation": self.checksums,
                  "s3": {"addressing_style": "path" if self.path_style else "auto",
                         "payload_signing_enabled": self.sign_payload}}
        if self.user_agent_extra:
            config["user_agent_extra"] = self.user_agent_extra
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
            client = session.create_client("s3", config=Config(**config), **kwargs)
        if self.requester_pays:
            client.meta.events.register("before-parameter-build.s3", _request_payer)
        if self.extra:
            client.meta.events.register("before-parameter-build.s3", functools.partial(_add_params, self.extra))
        return client


#: Operations whose parameters ``s3_additional_kwargs`` may name (server-side encryption, storage class, ACL...).
_EXTRA_OPERATIONS = ("PutObject", "CreateMultipartUpload", "UploadPart", "GetObject", "HeadObject")


def _extra_params(extra) -> dict:
    """``s3_additional_kwargs`` checked: each key a parameter of a request this store sends (as s3fs
    took them: ``{"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": ...}``); a typo is refused by name."""
    if not extra:
        return {}
    if not isinstance(extra, dict):
        raise ValueError("S3 storage option s3_additional_kwargs must be a dict of request parameters")
    import botocore.session

    model = botocore.session.get_session().get_service_model("s3")
    known = set().union(*(model.operation_model(op).input_shape.members for op in _EXTRA_OPERATIONS))
    known -= {"Bucket", "Key", "Body", "Range", "UploadId", "PartNumber", "IfNoneMatch", "ContentLength"}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(f"S3 storage option s3_additional_kwargs: {unknown} not a parameter of "
                         f"{', '.join(_EXTRA_OPERATIONS)} (e.g. ServerSideEncryption, SSEKMSKeyId, StorageClass)")
    return dict(extra)


def _add_params(extra: dict, params: dict, model, **kwargs) -> None:
    """``s3_additional_kwargs`` on every request whose operation takes them."""
    members = model.input_shape.members if model.input_shape is not None else {}
    for k, v in extra.items():
        if k in members:
            params.setdefault(k, v)


def _request_payer(params: dict, model, **kwargs) -> None:
    """``RequestPayer=requester`` on every request whose operation takes it."""
    if "RequestPayer" in model.input_shape.members:
        params.setdefault("RequestPayer", "requester")


_SESSION_LOCK = threading.Lock()
_SESSION: dict[str, object] = {}


def _after_fork_in_child() -> None:
    global _SESSION_LOCK
    _SESSION_LOCK = threading.Lock()  # another thread of the parent may have held it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# ------------------------------------------------------------------ bodies
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


def _total_size(content_range: str | None) -> int | None:
    m = _CONTENT_RANGE.match(content_range or "")
    if m is None or m.group(3) == "*":
        return None
    return int(m.group(3))


def _body(data):
    # botocore sends bytes and bytearray as they are; anything else
    # (memoryview, numpy buffers) is copied once into bytes.
    if isinstance(data, (bytes, bytearray)):
        return data
    return memoryview(data).cast("B").tobytes()


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
        # (pid that made them, lock, {retries: client}): see _client.
        self._clients: tuple[int, threading.Lock, dict] = (os.getpid(), threading.Lock(), {})
        # ValueError: botocore's reply parsing raises it for a garbled header (classify_error)
        self._catch = (OSError, BotoCoreError, ClientError, ValueError)
        self._rate: AdaptiveRate | None = None
        self.set_throttle(None)
        self.min_part_size = self._opts.min_part_size

    def set_throttle(self, policy: ThrottlePolicy | None | bool) -> None:
        """The adaptive request rate this store's clients wait on (see :class:`ObjectStore`): one
        per bucket and endpoint in the process. Takes effect for clients made after the call."""
        if policy is False:
            self._rate = None
            return
        self._rate = rate_for(f"s3|{self._endpoint}|{self.bucket}", policy if isinstance(policy, ThrottlePolicy) else None)

    @property
    def _endpoint(self) -> str:
        return self._opts.endpoint or f"aws:{self._opts.region or 'default'}"

    @property
    def identity(self) -> str:
        return f"s3|{self._endpoint}|{self.url}"

    def throttle_stats(self) -> dict | None:
        return self._rate.stats() if self._rate is not None else None

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    # ------------------------------------------------------------ plumbing
    def _full(self, key: str) -> str:
        return self._root + check_key(key)

    def _where(self, key: str | None = None) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _raise(self, exc: BaseException, key: str | None, op: str, exists_on_412: bool = False):
        err = classify_error(exc, self._where(key), op, exists_on_412)
        if isinstance(err, CredentialsRefusedError):
            err = with_source(err, s3_source(self._opts, self._clients[2]))
        err = scrub(err, exc, self._secrets)
        if err is exc:
            raise exc
        raise err from exc

    def _client(self, retries: bool = True):
        """The botocore client (``retries=False``: the one-try one of creates), made on first use.

        In a process forked from the one that made them, new ones (and a new
        lock: the parent's may have been held at the fork), made there.
        """
        pid, lock, clients = self._clients
        if pid != os.getpid():
            pid, lock, clients = self._clients = (os.getpid(), threading.Lock(), {})
        client = clients.get(retries)
        if client is None:
            with lock:
                client = clients.get(retries)
                if client is None:
                    client = self._opts.client(retries)
                    if self._rate is not None:
                        # first: botocore's retry handler answers needs-retry, ending the event
                        client.meta.events.register_first("before-send.s3", functools.partial(_before_send, self._rate))
                        client.meta.events.register_first("needs-retry.s3", functools.partial(_on_answer, self._rate))
                    clients[retries] = client
        return client

    def _call(self, op: str, key: str | None, retries: bool = True, exists_on_412: bool = False, **kwargs):
        """``client.<op>(Bucket=..., **kwargs)``; errors classified, named by the S3 operation."""
        client = self._client(retries)
        try:
            return getattr(client, op)(Bucket=self.bucket, **kwargs)
        except self._catch as e:
            self._raise(e, key, client.meta.method_to_api_mapping.get(op, op), exists_on_412)

    # ------------------------------------------------------------ reads
    def get(self, key: str) -> bytes:
        body = self._call("get_object", key, Key=self._full(key))["Body"]
        try:
            return body.read()  # botocore checks the length against Content-Length
        except self._catch as e:
            self._raise(e, key, "GetObject")
        finally:
            body.close()

    def _ranged_get(self, key: str, start: int, end: int) -> dict:
        """One ranged GetObject; a range past the end raises :class:`RangeReplyError`."""
        try:
            return self._client().get_object(Bucket=self.bucket, Key=self._full(key),
                                             Range=f"bytes={start}-{end - 1}")
        except self._catch as e:
            if error_code(e)[0] == "InvalidRange":
                raise RangeReplyError(f"{self._where(key)}: range [{start}, {end}) past end of object") from None
            raise

    def _range_bytes(self, key: str, start: int, end: int) -> tuple[bytes, int | None]:
        resp = self._ranged_get(key, start, end)
        body = resp["Body"]
        try:
            data = body.read()  # botocore checks the length against Content-Length
        finally:
            body.close()
        size = _total_size(resp.get("ContentRange"))
        check_range_reply(self._where(key), start, end, len(data), size)
        return data, size

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Each range by its own GET, at most ``max_concurrency`` at once on a pool of this call."""
        try:
            return get_ranges_threaded(lambda s, e: self._range_bytes(key, s, e), ranges, self.max_concurrency,
                                       lambda: self.head(key).size, self._where(key), "ckptstore-s3-get")
        except self._catch as e:
            self._raise(e, key, "GetObject")

    def read_range_into(self, key: str, start: int, out, progress=None) -> None:
        """Stream one ranged GET straight into ``out`` (:func:`~._blocking.stream_range`), reporting progress."""
        mv = memoryview(out).cast("B")
        n = len(mv)
        if n == 0 or start < 0:
            return super().read_range_into(key, start, out, progress)
        end, body = start + n, None
        try:
            resp = self._ranged_get(key, start, end)
            body = resp["Body"]
            if stream_range(self._where(key), start, mv, resp.get("ContentLength"),
                            _total_size(resp.get("ContentRange")), getattr(body, "_raw_stream", None), progress,
                            body.read):
                body = None  # its connection went back to the pool
        except self._catch as e:
            self._raise(e, key, "GetObject")
        finally:
            if body is not None:
                body.close()  # not read to its end: drop the connection

    def head(self, key: str) -> ObjectInfo:
        resp = self._call("head_object", key, Key=self._full(key))
        return ObjectInfo(key, int(resp["ContentLength"]), resp["LastModified"].timestamp())

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Pages as they come (S3 lists keys in code point order, that of sorted str keys)."""
        try:
            pages = self._client().get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._root + prefix)
            for page in pages:
                for obj in page.get("Contents", ()):
                    rel = obj["Key"][len(self._root) :]
                    try:
                        check_key(rel)
                    except ValueError:
                        # "dir/" markers and the like, made by other tools: not
                        # addressable through this API, so not listed.
                        continue
                    yield ObjectInfo(rel, int(obj["Size"]), obj["LastModified"].timestamp())
        except self._catch as e:
            self._raise(e, prefix or None, "ListObjectsV2")

    # ------------------------------------------------------------ writes
    def put(self, key: str, data) -> None:
        self._call("put_object", key, Key=self._full(key), Body=_body(data))

    def put_if_absent(self, key: str, data) -> None:
        """``If-None-Match: *``, one try (module docstring); the server's 412 raises ObjectExistsError."""
        self._call("put_object", key, retries=False, exists_on_412=True, Key=self._full(key), Body=_body(data),
                   IfNoneMatch="*")

    def delete(self, key: str) -> None:
        try:
            self._call("delete_object", key, Key=self._full(key))
        except ObjectNotFoundError:
            pass

    def delete_many(self, keys: Sequence[str]) -> None:
        """``DeleteObjects`` of up to :data:`DELETE_BATCH` keys a request.

        Keys the reply lists as failed raise (transient when every code is
        one S3 asks to retry), naming the first of them.
        """
        keys = list(keys)
        for i in range(0, len(keys), DELETE_BATCH):
            batch = keys[i : i + DELETE_BATCH]
            resp = self._call("delete_objects", batch[0], Delete={
                "Objects": [{"Key": self._full(k)} for k in batch], "Quiet": True})
            failed = [e for e in resp.get("Errors") or () if e.get("Code") != "NoSuchKey"]
            if failed:
                first = str(failed[0].get("Key") or "")
                code = str(failed[0].get("Code") or "")
                text = (f"{self._where(first[len(self._root) :])}: S3 DeleteObjects failed for {len(failed)} of "
                        f"{len(batch)} object(s); this one: {code}: {str(failed[0].get('Message'))[:MAX_MESSAGE]}")
                transient = all(e.get("Code") in TRANSIENT_CODES for e in failed)
                raise (TransientStorageError if transient else StorageError)(text)

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
        """Close the clients (their connections); a later call makes new ones."""
        pid, lock, clients = self._clients
        if pid != os.getpid():  # the parent's: not this process's to close
            self._clients = (os.getpid(), threading.Lock(), {})
            return
        with lock:
            old = list(clients.values())
            clients.clear()
        for client in old:
            try:
                client.close()
            except Exception:
                pass


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
        resp = self.store._call("upload_part", self.key, Key=self._full, UploadId=self.upload_id,
                                PartNumber=number, Body=_body(data))
        with self._lock:
            self._etags[number] = resp["ETag"]
            self._sizes[number] = size

    def complete(self, nparts: int) -> None:
        if nparts < 1:
            raise ValueError(f"{self.key}: a multipart upload needs at least one part")
        with self._lock:
            self._check_parts(nparts, self._sizes)
            parts = [{"PartNumber": n, "ETag": self._etags[n]} for n in range(1, nparts + 1)]
        self.store._call("complete_multipart_upload", self.key, Key=self._full, UploadId=self.upload_id,
                         MultipartUpload={"Parts": parts})

    def abort(self) -> None:
        self._aborted = True
        self.store.abort_multipart(self.key, self.upload_id)
