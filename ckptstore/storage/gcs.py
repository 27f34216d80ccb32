"""Google Cloud Storage through its JSON API, on google-auth's ``requests`` session.

Every request goes through one :class:`google.auth.transport.requests.AuthorizedSession`
per store (the HTTP layer google-cloud-storage itself uses), shared by the
calling threads: the loader's I/O threads, the uploader's part threads, and
the pools :meth:`GCSStore.get_ranges` and :meth:`GCSStore.delete_many` start.
It was chosen by measurement over gcsfs's aiohttp client, which this store
used before, and over obstore, whose GCS client speaks the XML API (no
``compose``; ``benchmarks/micro/cloud_clients.py``, ``docs/performance.md``,
"One GCS client, one Azure client"). A ranged read streams its body from the
socket straight into the loader's buffer
(:func:`~ckptstore.storage._blocking.stream_into`).

Storage options (:data:`OPTIONS`, gcsfs's names where gcsfs had the option;
any other key raises ``ValueError`` naming it; docs/quickstart.md lists
them): ``token`` (:func:`credentials`), ``project``, ``access`` (the OAuth
scope), ``endpoint_url`` (else ``STORAGE_EMULATOR_HOST``, else Google's),
``requester_pays`` (``userProject`` on every request), ``connect_timeout``,
``read_timeout``, ``tries``, ``trust_env`` (default False: proxy variables
are ignored, as gcsfs's aiohttp session ignored them) and ``proxies``.

Retries and timeouts. Every request has a connect and a read timeout. A
request answered 408, 429 or 5xx, or failing at the connection (reset,
refused, timed out, a body cut short), is tried again, at most
:data:`TRIES` times in all, after 0.5 s then 1 s (jittered); a conditional
create is tried once: an attempt that landed with its answer lost would
come back as "already exists", where ckptstore's
:class:`~ckptstore.storage.retry.RetryStore` knows to read the object back
and accept it if identical. The endpoint's host is resolved once before the
first request: a name that does not resolve raises
:class:`~ckptstore.errors.HostNotResolvedError` at once (skipped through a
proxy, which resolves names).

Errors. :func:`classify_error` maps an answer's status: 412 on a
conditional create -> :class:`ObjectExistsError`; 404 ->
:class:`ObjectNotFoundError` (a 404 on an object says nothing of the
bucket: the first one asks, with a listing of one object, and a missing
bucket is a :class:`StorageError` saying so); 408/429/5xx and connection
failures -> :class:`TransientStorageError`; the rest -> :class:`StorageError`.

Uploads. ``put`` is one "media" upload (the bytes as the body, sent as they
are; an empty object is a "multipart" upload of metadata and no bytes,
because the emulator drops an empty media upload). ``put_if_absent`` is that
same upload with ``ifGenerationMatch=0``: GCS creates the object only if no
live object has the name and answers 412 otherwise, atomically.

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

Why composite rather than a resumable upload: a resumable upload takes its
bytes strictly in order, in multiples of 256 KiB, one request at a time, so
parts uploaded concurrently and out of order (what
:class:`~ckptstore.storage.upload.ParallelUploader` does) would wait in
memory for their turn, and one upload could use one connection only.
Composite parts upload concurrently like S3 parts; on GCS ``compose`` is a
metadata operation that copies no data. Costs to know: temporary parts
count as stored bytes until deleted and, where the bucket has a soft-delete
policy (the default is 7 days), for that long after; composite objects carry
a CRC32C but no MD5; parts in Nearline/Coldline buckets incur early-deletion
charges. The emulator's compose copies and checksums the bytes in Python,
so it is slower there than on GCS (figures: docs/performance.md).

Sessions hold urllib3 connection pools, which must not be shared across
``fork``: a store used in a process forked from the one that made its
session makes its own there on first use and leaves the parent's alone.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import re
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Callable, Iterator, Sequence
from urllib.parse import quote

from ..errors import (
    CkptStoreError,
    CredentialsRefusedError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    TransientStorageError,
)
from .throttle import AdaptiveRate, ThrottlePolicy, parse_retry_after, rate_for
from ._blocking import each_threaded, get_ranges_threaded, stream_range
from ._classify import MAX_MESSAGE, check_resolves, host_not_resolved, in_chain, is_network_error, optional_types, scrub
from ._credentials import gcs_source, refused, with_source
from .base import (
    MultipartInfo,
    MultipartUpload,
    ObjectInfo,
    ObjectStore,
    RangeReplyError,
    check_key,
    check_range_reply,
)

#: Reserved directory (under the store root) holding multipart temporaries.
UPLOADS = ".uploads"
#: Most sources GCS accepts in one compose request.
MAX_COMPOSE = 32
#: Where requests go without ``endpoint_url`` or ``STORAGE_EMULATOR_HOST``.
GOOGLE_ENDPOINT = "https://storage.googleapis.com"
#: Seconds to wait for a TCP connection.
CONNECT_TIMEOUT = 5.0
#: Seconds without a byte of an answer (or the server taking none of a body) before a request fails.
READ_TIMEOUT = 30.0
#: Tries of one request, the first included (a conditional create: one).
TRIES = 3
#: The storage options understood (module docstring).
OPTIONS = frozenset({"token", "project", "access", "endpoint_url", "requester_pays", "connect_timeout",
                     "read_timeout", "tries", "trust_env", "proxies"})
#: gcsfs options about its own caches and file objects: accepted and ignored (this store has none).
IGNORED_OPTIONS = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "cache_timeout",
                             "consistency", "block_size", "default_location", "version_aware"})
_ACCESS = ("read_only", "read_write", "full_control")
_MARKER = "upload"
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: Statuses by which GCS says it was sent too many requests (429 rateLimitExceeded, 503
#: when a bucket's rate ramps up): they lower the process's request rate (:mod:`.throttle`).
THROTTLE_STATUS = frozenset({429, 503})
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
_TIMESTAMP = re.compile(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)?$")
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")
_LIST_FIELDS = "items(name,size,updated,timeCreated),nextPageToken"


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


# ------------------------------------------------------------------ errors
class GCSHTTPError(Exception):
    """An answer with an error status: ``status``, GCS's ``reason`` (``"conditionNotMet"``...) and message;
    ``retry_after``: its ``Retry-After`` in seconds, if any."""

    def __init__(self, status: int, message: str = "", reason: str = "", retry_after: float | None = None):
        super().__init__(f"{status} {reason}: {message}".strip() if reason else f"{status}: {message}")
        self.status, self.message, self.reason, self.retry_after = status, message, reason, retry_after

    @classmethod
    def from_response(cls, resp) -> "GCSHTTPError":
        """From a ``requests`` response: the JSON API's ``{"error": {"message", "errors": [{"reason"}]}}`` body."""
        text = ""
        try:
            text = resp.text or ""
            err = json.loads(text).get("error") or {}
            message = str(err.get("message") or "")
            reason = str(((err.get("errors") or [{}])[0] or {}).get("reason") or "")
        except (ValueError, AttributeError, TypeError, IndexError):
            message, reason = text.strip().split("\n", 1)[0], ""
        retry_after = parse_retry_after((getattr(resp, "headers", None) or {}).get("Retry-After"))
        return cls(int(resp.status_code), message[:MAX_MESSAGE], reason, retry_after)


def _status(exc: BaseException) -> int | None:
    """The HTTP status behind ``exc``, where it kept one."""
    return in_chain(exc, lambda e: e.status if isinstance(e, GCSHTTPError) else None)


def _is_connection_error(exc: BaseException) -> bool:
    """Resets, refused connections, timeouts, bodies cut short: worth another try."""
    return is_network_error(exc, optional_types(
        "requests.exceptions:ConnectionError", "requests.exceptions:Timeout",
        "requests.exceptions:ChunkedEncodingError", "urllib3.exceptions:ProtocolError",
        "urllib3.exceptions:TimeoutError", "http.client:IncompleteRead", "google.auth.exceptions:TransportError"))


def classify_error(exc: BaseException, where: str, op: str, exists_on_412: bool = False) -> Exception:
    """Turn what a request raised into a ckptstore exception.

    Parameters
    ----------
    exc:
        A :class:`GCSHTTPError`, or what ``requests``/urllib3/google-auth raised.
    where:
        ``gs://bucket/key`` (or the store URL), for the message.
    op:
        The GCS operation (``objects.get``...), for the message.
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
    if status == 412:
        if exists_on_412:
            return ObjectExistsError(f"{where}: object already exists (GCS {op}: 412 precondition failed)")
        return StorageError(f"{where}: GCS {op} failed (412 precondition failed)")
    if status == 404:
        return ObjectNotFoundError(f"{where}: no such object (GCS {op}: 404)")
    if status in (401, 403):  # the store adds where its credentials came from
        return refused(where, f"GCS {op}", str(status), getattr(in_chain(exc, lambda e: e if isinstance(
            e, GCSHTTPError) else None), "message", ""))
    if status is not None:
        text = f"{where}: GCS {op} failed ({exc})"
        if status in _TRANSIENT_STATUS or status >= 500:
            err = TransientStorageError(text)
            if status in THROTTLE_STATUS:
                err.throttled = True
                err.retry_after = in_chain(exc, lambda e: e.retry_after if isinstance(e, GCSHTTPError) else None)
            return err
        return StorageError(text)
    message = str(exc)[:MAX_MESSAGE]
    if _is_connection_error(exc):
        return TransientStorageError(f"{where}: GCS {op} failed: {type(exc).__name__}: {message}")
    if isinstance(exc, optional_types("google.auth.exceptions:RefreshError", "google.auth.exceptions:DefaultCredentialsError")):
        return CredentialsRefusedError(f"{where}: GCS {op} failed: the credentials were refused or could not "
                                       f"be obtained ({type(exc).__name__}: {message})")
    return StorageError(f"{where}: GCS {op} failed: {type(exc).__name__}: {message}")


def _errors_to_classify() -> tuple[type[BaseException], ...]:
    return (GCSHTTPError, OSError, *optional_types(
        "requests.exceptions:RequestException", "urllib3.exceptions:HTTPError", "http.client:HTTPException",
        "google.auth.exceptions:GoogleAuthError"))


# ------------------------------------------------------------------ options and credentials
def _emulator_host() -> str | None:
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if host in ("", "default"):
        return None
    return host if host.startswith(("http://", "https://")) else f"http://{host}"


def credentials(token, access: str = "full_control"):
    """The ``google.auth`` credentials a ``token`` storage option names.

    ``None``: anonymous when ``STORAGE_EMULATOR_HOST`` names an emulator,
    else application-default credentials (``gcloud auth
    application-default login``, ``GOOGLE_APPLICATION_CREDENTIALS``, the GCE
    metadata server); none found is an error, never a silent anonymous
    fallback. Else ``"google_default"``, ``"cloud"`` (the metadata server),
    ``"anon"``, the path of a service-account or authorized-user JSON file,
    its content as a dict, a raw access token, or ``Credentials``; gcsfs's
    interactive ``"browser"`` and ``"cache"`` are refused.
    """
    import google.auth
    import google.auth.credentials
    import google.auth.exceptions

    scopes = [f"https://www.googleapis.com/auth/devstorage.{access}"]
    if isinstance(token, google.auth.credentials.Credentials):
        return token
    if token == "anon" or (token is None and _emulator_host()):
        return google.auth.credentials.AnonymousCredentials()
    if token is None or token == "google_default":
        try:
            return google.auth.default(scopes=scopes)[0]
        except google.auth.exceptions.DefaultCredentialsError as e:
            raise StorageError(f"no Google credentials found ({e}); run `gcloud auth application-default login`, "
                               "set GOOGLE_APPLICATION_CREDENTIALS, or pass storage_options={'token': ...} "
                               "('anon' for public buckets)") from None
    if token == "cloud":
        from google.auth import compute_engine

        return compute_engine.Credentials(scopes=scopes)
    if token in ("browser", "cache"):
        raise ValueError(f"GCS token {token!r} (gcsfs's interactive login) is not supported: run "
                         "`gcloud auth application-default login` and leave token unset")
    if isinstance(token, str) and os.path.exists(token):
        try:
            with open(token) as f:
                token = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"GCS token file {token!r} is not a JSON credentials file: {e}") from None
    if isinstance(token, dict):
        return _from_info(token, scopes)
    if isinstance(token, str) and token:
        if token.endswith(".json") or os.sep in token:
            raise ValueError(f"GCS token file {token!r} does not exist")
        from google.oauth2.credentials import Credentials

        return Credentials(token)  # a raw access token: used until it expires, never refreshed
    raise ValueError(f"GCS token must be None, a method name, a file path, a dict or Credentials, "
                     f"got {type(token).__name__}")


def _from_info(info: dict, scopes: list[str]):
    """Credentials from a service-account key or an authorized-user JSON (what ``gcloud`` writes)."""
    kind = info.get("type")
    if kind == "service_account":
        from google.oauth2 import service_account

        return service_account.Credentials.from_service_account_info(info, scopes=scopes)
    if kind == "authorized_user":
        from google.oauth2.credentials import Credentials

        return Credentials.from_authorized_user_info(info, scopes=scopes)
    raise ValueError(f"GCS token of type {kind!r}: pass a service_account or authorized_user JSON, or build the "
                     "google.auth Credentials yourself and pass them as the token")


def _secrets_of(token) -> tuple[str, ...]:
    if isinstance(token, str) and token not in ("anon", "google_default", "cloud") and not os.path.exists(token):
        return (token,)
    if isinstance(token, dict):
        return tuple(str(v) for k, v in token.items() if v and ("key" in k or "secret" in k or "token" in k))
    return ()


def _flag(value, name: str, project_ok: bool = False):
    """A boolean option, given as a bool or as the CLI's text (``-o trust_env=true``); or a project id."""
    if value is None or isinstance(value, bool):
        return bool(value)
    text = str(value).strip()
    if text.lower() in ("true", "1", "yes", "on"):
        return True
    if text.lower() in ("false", "0", "no", "off", ""):
        return False
    if project_ok:
        return text
    raise ValueError(f"GCS {name} must be true or false, got {value!r}")


class _Options:
    """``storage_options`` checked once: every key known, every value of its type."""

    def __init__(self, opts: dict, max_concurrency: int):
        unknown = sorted(set(opts) - OPTIONS - IGNORED_OPTIONS)
        if unknown:
            raise ValueError(f"unknown GCS storage option(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(sorted(OPTIONS))}")
        self.token = opts.get("token")
        self.project = opts.get("project")
        self.access = opts.get("access") or "full_control"
        if self.access not in _ACCESS:
            raise ValueError(f"GCS access must be one of {', '.join(_ACCESS)}, got {self.access!r}")
        endpoint = opts.get("endpoint_url") or _emulator_host() or GOOGLE_ENDPOINT
        if not str(endpoint).startswith(("http://", "https://")):
            raise ValueError(f"GCS endpoint_url must start with http:// or https://, got {endpoint!r}")
        self.endpoint = str(endpoint).rstrip("/")
        payer = _flag(opts.get("requester_pays"), "requester_pays", project_ok=True)
        if payer is True and not self.project:
            raise ValueError("GCS requester_pays=True needs the project to bill: pass project=...")
        self.params = {"userProject": self.project if payer is True else payer} if payer else {}
        self.connect = float(opts.get("connect_timeout") or CONNECT_TIMEOUT)
        self.read = float(opts.get("read_timeout") or READ_TIMEOUT)
        self.tries = int(opts.get("tries") or TRIES)
        if self.tries < 1:
            raise ValueError(f"GCS tries must be >= 1, got {self.tries}")
        self.trust_env = _flag(opts.get("trust_env"), "trust_env")
        self.proxies = dict(opts.get("proxies") or {})
        self.pool = max(10, max_concurrency)
        self.secrets = tuple(s for s in _secrets_of(self.token) if len(s) >= 4)

    def session(self):
        """A new ``AuthorizedSession``: our timeouts and pool, urllib3 retrying nothing (we retry)."""
        import requests.adapters
        from google.auth.transport.requests import AuthorizedSession

        session = AuthorizedSession(credentials(self.token, self.access))
        session.trust_env = self.trust_env
        session.proxies.update(self.proxies)
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=self.pool, max_retries=0)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
        return session


def _body(data):
    # requests/urllib3 send bytes, bytearray and byte memoryviews as they are.
    if isinstance(data, (bytes, bytearray)):
        return data
    return memoryview(data).cast("B")


# ------------------------------------------------------------------ the store
class GCSStore(ObjectStore):
    """Objects under ``gs://bucket/prefix``.

    Parameters
    ----------
    path:
        ``"bucket"`` or ``"bucket/prefix"`` (a ``gs://``/``gcs://`` scheme is accepted).
    storage_options:
        :data:`OPTIONS` (module docstring): ``token``, ``project``,
        ``endpoint_url``, ``requester_pays``, timeouts... An unknown key
        raises ``ValueError``. The session is made on first use, so
        opening a store makes no request.
    max_concurrency:
        Most requests of one :meth:`get_ranges` call, or of one compose
        round or cleanup, in flight at once; also the floor of the HTTP
        connection pool size.
    resolver:
        ``socket.getaddrinfo`` (the default) or a stand-in with its signature,
        for the endpoint check before the first request.
    sleep:
        ``time.sleep`` or a stand-in, for the waits between tries.
    """

    mtime_resolution = 0.001  # GCS "updated" has milliseconds (the emulator: µs)
    remote = True

    def __init__(self, path: str, storage_options: dict | None = None, max_concurrency: int = 16,
                 resolver: Callable | None = None, sleep: Callable[[float], None] = time.sleep):
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
        self._opts = _Options(dict(storage_options or {}), max_concurrency)
        self._secrets = self._opts.secrets
        # (pid that made it, lock, [session]): see _session.
        self._sessions: tuple[int, threading.Lock, list] = (os.getpid(), threading.Lock(), [])
        self._bucket_seen = False
        self._catch = _errors_to_classify()
        self._resolver = resolver or socket.getaddrinfo
        self._sleep = sleep
        ep, b = self._opts.endpoint, quote(bucket, safe="")
        self._rate: AdaptiveRate | None = None
        self.set_throttle(None)
        self._api = f"{ep}/storage/v1/b/{b}/o"
        self._upload_url = f"{ep}/upload/storage/v1/b/{b}/o"
        self._download = f"{ep}/download/storage/v1/b/{b}/o"

    def __repr__(self) -> str:
        return f"GCSStore({self.url!r})"

    def set_throttle(self, policy: ThrottlePolicy | None | bool) -> None:
        """The adaptive request rate every request waits on (one per bucket and endpoint in the process)."""
        self._rate = None if policy is False else rate_for(
            f"gcs|{self._opts.endpoint}|{self.bucket}", policy if isinstance(policy, ThrottlePolicy) else None)

    @property
    def identity(self) -> str:
        return f"gcs|{self._opts.endpoint}|{self.url}"

    def throttle_stats(self) -> dict | None:
        return self._rate.stats() if self._rate is not None else None

    # ------------------------------------------------------------ plumbing
    def _session(self):
        """The session, made on first use (after the endpoint's host resolved); a forked child makes its own."""
        pid, lock, box = self._sessions
        if pid != os.getpid():
            pid, lock, box = self._sessions = (os.getpid(), threading.Lock(), [])
        if not box:
            with lock:
                if not box:
                    if not (self._opts.trust_env or self._opts.proxies):
                        check_resolves(self._opts.endpoint, self.url, "GCS", self._resolver)
                    box.append(self._opts.session())
        return box[0]

    def _send(self, method: str, url: str, *, params: dict | None = None, retry: bool = True,
              stream: bool = False, **kwargs):
        """One request, tried again on 408/429/5xx and connection failures (module docstring).

        Returns the response of a 2xx answer; raises :class:`GCSHTTPError`
        for any other status, or what the transport raised.
        """
        session = self._session()
        params = {**self._opts.params, **(params or {})}
        tries = self._opts.tries if retry else 1
        rate = self._rate
        for attempt in range(1, tries + 1):
            if rate is not None:
                rate.before()
            try:
                resp = session.request(method, url, params=params, stream=stream,
                                       timeout=(self._opts.connect, self._opts.read), **kwargs)
            except self._catch as e:
                if attempt == tries or not _is_connection_error(e) or host_not_resolved(e, "", ""):
                    raise
            else:
                throttled = resp.status_code in THROTTLE_STATUS
                if rate is not None:
                    rate.after(throttled, parse_retry_after(resp.headers.get("Retry-After")) if throttled else None)
                if resp.status_code < 400:
                    return resp
                err = GCSHTTPError.from_response(resp)
                resp.close()
                if attempt == tries or err.status not in _TRANSIENT_STATUS:
                    raise err
            self._sleep(0.5 * 2 ** (attempt - 1) * (0.5 + random.random()))
        raise AssertionError("unreachable")  # pragma: no cover

    def _json(self, method: str, url: str, **kwargs) -> dict:
        resp = self._send(method, url, **kwargs)
        try:
            return resp.json() if resp.content else {}
        except ValueError as e:
            raise StorageError(f"{self.url}: GCS answered with something other than JSON: {e}") from None

    def _missing_bucket(self, op: str) -> StorageError | None:
        # An object call answered 404: the object, or the whole bucket? Asked
        # once (a bucket seen to exist is not asked about again), with a
        # listing of at most one object, which answers 404 only for a
        # missing bucket and needs no permission a repository does not.
        if self._bucket_seen:
            return None
        try:
            self._json("GET", self._api, params={"maxResults": 1, "fields": "nextPageToken"})
        except GCSHTTPError as e:
            if e.status == 404:
                return StorageError(f"gs://{self.bucket}: bucket does not exist (GCS {op}: 404)")
            return None
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
        err = classify_error(exc, self._where(key), op, exists_on_412)
        if isinstance(err, CredentialsRefusedError):
            err = with_source(err, gcs_source(self._opts.token))
        return scrub(err, exc, self._secrets)

    def _run(self, key: str | None, op: str, fn, *args, exists_on_412: bool = False, **kwargs):
        """``fn(*args, **kwargs)``, its errors classified (a 404 checked for a missing bucket)."""
        try:
            out = fn(*args, **kwargs)
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

    def _object_url(self, full: str) -> str:
        return f"{self._api}/{quote(full, safe='')}"

    def _media_url(self, full: str) -> str:
        return f"{self._download}/{quote(full, safe='')}"

    # raw primitives: transport exceptions, classified by _run
    def _upload(self, full: str, data, create: bool = False) -> dict:
        # A single-request "media" upload of the bytes as they are.
        # ``ifGenerationMatch=0`` makes it an atomic exclusive create, tried once.
        params = {"name": full, **({"ifGenerationMatch": "0"} if create else {})}
        if not len(data):
            # The emulator drops an empty media upload; GCS takes either.
            boundary = uuid.uuid4().hex
            body = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                    f"{json.dumps({'name': full})}\r\n--{boundary}\r\n"
                    f"Content-Type: application/octet-stream\r\n\r\n\r\n--{boundary}--\r\n").encode()
            return self._json("POST", self._upload_url, params={**params, "uploadType": "multipart"}, data=body,
                              retry=not create, headers={"Content-Type": f"multipart/related; boundary={boundary}"})
        return self._json("POST", self._upload_url, params={**params, "uploadType": "media"}, data=_body(data),
                          retry=not create, headers={"Content-Type": "application/octet-stream"})

    def _delete_raw(self, full: str) -> None:
        try:
            self._send("DELETE", self._object_url(full)).close()
        except GCSHTTPError as e:
            if e.status != 404:
                raise

    def _list_raw(self, full_prefix: str) -> Iterator[dict]:
        token = None
        while True:
            params = {"fields": _LIST_FIELDS, **({"prefix": full_prefix} if full_prefix else {}),
                      **({"pageToken": token} if token else {})}
            try:
                page = self._json("GET", self._api, params=params)
            except GCSHTTPError as e:
                if e.status == 404:
                    # Listing answers 404 only for a missing bucket: a
                    # configuration error, never an empty repository.
                    raise StorageError(f"gs://{self.bucket}: bucket does not exist (GCS objects.list: 404)") from None
                raise
            yield from page.get("items", ())
            token = page.get("nextPageToken")
            if not token:
                return

    # ------------------------------------------------------------ reads
    def get(self, key: str) -> bytes:
        full = self._full(key)
        return self._run(key, "objects.get", lambda: self._send("GET", self._media_url(full),
                                                               params={"alt": "media"}).content)

    def _ranged(self, key: str, start: int, end: int, stream: bool):
        try:
            return self._send("GET", self._media_url(self._full(key)), params={"alt": "media"}, stream=stream,
                              headers={"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"})
        except GCSHTTPError as e:
            if e.status == 416:
                raise RangeReplyError(f"{self._where(key)}: range [{start}, {end}) past end of object") from None
            raise

    def _range_bytes(self, key: str, start: int, end: int) -> tuple[bytes, int | None]:
        resp = self._ranged(key, start, end, stream=False)
        data = resp.content
        m = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
        total = int(m.group(3)) if m and m.group(3) != "*" else None
        if resp.status_code == 200 and total is None:
            # The server ignored the Range header and sent the whole object.
            total = len(data)
            data = data[start:end]
        check_range_reply(self._where(key), start, end, len(data), total)
        return data, total

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Each range by its own GET, at most ``max_concurrency`` at once on a pool of this call."""
        self._full(key)
        return self._run(key, "objects.get", get_ranges_threaded, lambda s, e: self._range_bytes(key, s, e), ranges,
                         self.max_concurrency, lambda: self.head(key).size, self._where(key), "ckptstore-gcs-get")

    def read_range_into(self, key: str, start: int, out, progress=None) -> None:
        """Stream one ranged GET straight into ``out`` (:func:`~._blocking.stream_range`), reporting progress."""
        mv = memoryview(out).cast("B")
        n = len(mv)
        if n == 0 or start < 0:
            return super().read_range_into(key, start, out, progress)
        self._full(key)
        self._run(key, "objects.get", self._stream_range, key, start, mv, progress)

    def _stream_range(self, key: str, start: int, mv: memoryview, progress) -> None:
        n = len(mv)
        end = start + n
        resp = self._ranged(key, start, end, stream=True)
        try:
            m = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
            if resp.status_code != 206 or m is None:
                # The server ignored the Range header: the body is the whole object.
                data = resp.content
                check_range_reply(self._where(key), start, end, len(data[start:end]), len(data))
                mv[:] = data[start:end]
                if progress is not None:
                    progress(n)
                return
            total = None if m.group(3) == "*" else int(m.group(3))
            if stream_range(self._where(key), start, mv, resp.headers.get("Content-Length"), total, resp.raw,
                            progress):
                resp = None  # its connection went back to the pool
        finally:
            if resp is not None:
                resp.close()

    def head(self, key: str) -> ObjectInfo:
        meta = self._run(key, "objects.get", self._json, "GET", self._object_url(self._full(key)),
                         params={"fields": "size,updated"})
        return ObjectInfo(key, int(meta["size"]), parse_timestamp(meta["updated"]))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # GCS lists names in lexicographic (UTF-8 byte = code point) order.
        items = self._run(prefix or None, "objects.list", lambda: list(self._list_raw(self._root + prefix)))
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
        self._run(key, "objects.insert", self._upload, self._full(key), data)

    def put_if_absent(self, key: str, data) -> None:
        self._run(key, "objects.insert", self._upload, self._full(key), data, True, exists_on_412=True)

    def delete(self, key: str) -> None:
        self._run(key, "objects.delete", self._delete_raw, self._full(key))

    def delete_many(self, keys: Sequence[str]) -> None:
        """One ``objects.delete`` per key, ``max_concurrency`` at a time; the first failure names its key."""
        fulls = [self._full(k) for k in keys]
        failed = each_threaded(self._delete_raw, fulls, self.max_concurrency, "ckptstore-gcs-delete")
        if failed is not None:
            i, e = failed
            err = self._error(e, keys[i], "objects.delete")
            if err is e:
                raise e
            raise err from e

    # ------------------------------------------------------------ multipart
    def _upload_dir(self, key: str, upload_id: str) -> str:
        return f"{self._root}{UPLOADS}/{key}/{upload_id}/"

    def create_multipart(self, key: str, part_size: int) -> MultipartUpload:
        self._full(key)
        return _GCSMultipart(self, key, part_size)

    def list_multipart(self, prefix: str = "") -> list[MultipartInfo]:
        base = f"{self._root}{UPLOADS}/"
        items = self._run(prefix or None, "objects.list", lambda: list(self._list_raw(base + prefix)))
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

        def run():
            names = [o["name"] for o in self._list_raw(udir)]
            # The marker last, so a half-done abort is still listed.
            for batch in ([n for n in names if not n.endswith("/" + _MARKER)],
                          [n for n in names if n.endswith("/" + _MARKER)]):
                failed = each_threaded(self._delete_raw, batch, self.max_concurrency, "ckptstore-gcs-delete")
                if failed is not None:
                    raise failed[1]

        self._run(key, "objects.delete", run)

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the session (its connections); a later call makes a new one."""
        pid, lock, box = self._sessions
        if pid != os.getpid():  # the parent's: not this process's to close
            self._sessions = (os.getpid(), threading.Lock(), [])
            return
        with lock:
            old = list(box)
            box.clear()
        for session in old:
            try:
                session.close()
            except Exception:
                pass


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
        store._run(key, "objects.insert", store._upload, self._dir + _MARKER, marker)

    def _part_name(self, number: int) -> str:
        return f"{self._dir}part-{number:05d}"

    def upload_part(self, number: int, data) -> None:
        self._check_part(number, data)
        if self._aborted:
            raise ObjectNotFoundError(f"{self.store._where(self.key)}: multipart upload was aborted")
        meta = self.store._run(self.key, "objects.insert", self.store._upload, self._part_name(number), data)
        with self._lock:
            self._parts[number] = (len(data), str(meta.get("generation") or ""))

    def _compose(self, dest: str, sources: list[tuple[str, str]]) -> dict:
        objs = []
        for name, generation in sources:
            src = {"name": name}
            if generation:
                src["objectPreconditions"] = {"ifGenerationMatch": generation}
            objs.append(src)
        body = {"kind": "storage#composeRequest", "sourceObjects": objs,
                "destination": {"name": dest, "bucket": self.store.bucket, "contentType": "application/octet-stream"}}
        return self.store._json("POST", f"{self.store._object_url(dest)}/compose", json=body)

    def _compose_tree(self, dest: str, sources: list[tuple[str, str]]) -> dict:
        """Compose ``sources`` into ``dest``, through intermediates when there are over :data:`MAX_COMPOSE`."""
        level = 0
        while len(sources) > MAX_COMPOSE:
            groups = [sources[i : i + MAX_COMPOSE] for i in range(0, len(sources), MAX_COMPOSE)]
            names = [f"{self._dir}compose-{level}-{i:05d}" for i in range(len(groups))]
            with cf.ThreadPoolExecutor(min(self.store.max_concurrency, len(groups)),
                                       thread_name_prefix="ckptstore-gcs-compose") as ex:
                metas = list(ex.map(self._compose, names, groups))
            sources = [(n, str(m.get("generation") or "")) for n, m in zip(names, metas)]
            level += 1
        return self._compose(dest, sources)

    def complete(self, nparts: int) -> None:
        if nparts < 1:
            raise ValueError(f"{self.key}: a multipart upload needs at least one part")
        with self._lock:
            self._check_parts(nparts, {n: size for n, (size, _) in self._parts.items()})
            sources = [(self._part_name(n), self._parts[n][1]) for n in range(1, nparts + 1)]
            expected = sum(self._parts[n][0] for n in range(1, nparts + 1))
        if self._aborted:
            raise ObjectNotFoundError(f"{self.store._where(self.key)}: multipart upload was aborted")
        meta = self.store._run(self.key, "objects.compose", self._compose_tree, self.store._full(self.key), sources)
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
