"""An HTTP proxy for tests that logs every request and answers some of them itself.

:class:`RequestProxy` sits between the clients and an S3-compatible test
server (moto, SeaweedFS) on loopback. Where :mod:`.faultproxy` breaks TCP
connections, this one understands HTTP/1.1 requests: it counts them by
kind and by client, and it plays a store that pushes back or differs from
S3:

* every request is logged (:class:`Request`: the client's label, method,
  kind, key, status, bytes each way); :meth:`RequestProxy.counts` sums them;
* :meth:`RequestProxy.fail`: the next ``count`` matching requests (or every
  one, until removed) are answered with an error (``503 SlowDown`` by
  default, optionally with ``Retry-After``) without reaching the server;
* :meth:`RequestProxy.rate_limit`: a token bucket over matching requests;
  those above the rate are answered ``503 SlowDown``, as S3 answers above
  its per-prefix request rates;
* ``drop_if_none_match``: the ``If-None-Match`` header is removed before
  forwarding, as by a store that ignores conditional creates;
* :meth:`RequestProxy.part_rules`: ``CompleteMultipartUpload`` is refused
  when the parts (all but the last) differ in size (Cloudflare R2) or are
  smaller than a minimum (CoreWeave: 15 MiB);
* :meth:`RequestProxy.expire_keys`: requests signed with an access key whose
  issue time (in the key) lies more than a lifetime back are refused with
  ``400 ExpiredToken`` (keys from :func:`issue_key`);
* :meth:`RequestProxy.stall`: matching requests are held before their body is
  read, until released or the proxy stops.

Clients are told apart by the endpoint they use: :meth:`RequestProxy.endpoint`
opens one listening port per label ("rank0", "rank1", ...), so the ranks of
a job each get their own. Time (token buckets, key lifetimes) is read from
``clock`` (``time.monotonic`` / ``time.time`` by default), so tests can
drive it. No pytest here. Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import http.client
import socketserver
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Callable

HOST = "127.0.0.1"
_BLOCK = 256 << 10
#: Hop-by-hop headers, never forwarded either way.
_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
                  "expect"})

#: Request kinds, as :func:`s3_kind` names them.
KINDS = ("LIST", "LIST_UPLOADS", "GET", "HEAD", "PUT", "PART", "MPU_CREATE", "MPU_COMPLETE", "MPU_ABORT",
         "DELETE", "DELETE_BATCH", "OTHER")


def s3_kind(method: str, key: str, query: dict[str, list[str]]) -> str:
    """What an S3 request (path style: ``/bucket/key?query``) does; one of :data:`KINDS`."""
    if method == "HEAD":
        return "HEAD"
    if method == "GET":
        if "uploads" in query:
            return "LIST_UPLOADS"
        if not key or "list-type" in query:
            return "LIST"
        return "GET"
    if method == "PUT":
        return "PART" if "partNumber" in query and "uploadId" in query else "PUT"
    if method == "POST":
        if "uploads" in query:
            return "MPU_CREATE"
        if "uploadId" in query:
            return "MPU_COMPLETE"
        if "delete" in query:
            return "DELETE_BATCH"
        return "OTHER"
    if method == "DELETE":
        return "MPU_ABORT" if "uploadId" in query else "DELETE"
    return "OTHER"


@dataclass
class Request:
    """One request the proxy saw, and what became of it.

    ``status`` is the answer's HTTP status (the server's, or the proxy's own
    when ``injected``); 0 if the client went away first. ``sent`` is the
    request body's length, ``received`` the answer body's.
    """

    label: str
    method: str
    kind: str
    key: str
    query: str
    conditional: bool  # carried If-None-Match or If-Match
    at: float
    status: int = 0
    injected: str = ""  # the proxy's own error code, or ""
    access_key: str = ""  # the key id the request was signed with
    sent: int = 0
    received: int = 0


@dataclass
class Rule:
    """Requests a :meth:`RequestProxy.fail` rule answers, and how many it has answered.

    ``count``: how many more to answer (None: every match, until removed).
    """

    match: Callable[[Request], bool]
    status: int
    code: str
    message: str
    count: int | None
    retry_after: float | None = None
    fired: int = 0
    removed: bool = False


@dataclass
class _Bucket:
    match: Callable[[Request], bool]
    rate: float
    burst: float
    retry_after: float | None
    tokens: float
    last: float
    fired: int = 0
    passed: int = 0


@dataclass
class _PartRules:
    equal: bool
    min_size: int
    sizes: dict = field(default_factory=dict)  # upload id -> {part number: bytes}
    refused: int = 0


def issue_key(prefix: str = "ckpt", now: float | None = None) -> str:
    """An access key id carrying its issue time, for :meth:`RequestProxy.expire_keys`."""
    t = time.time() if now is None else now
    return f"{prefix}{int(t * 1000)}"


def _issued(key_id: str) -> float | None:
    digits = ""
    for c in reversed(key_id):
        if not c.isdigit():
            break
        digits = c + digits
    return int(digits) / 1000 if digits else None


def _access_key(headers) -> str:
    auth = headers.get("Authorization") or ""
    _, sep, rest = auth.partition("Credential=")
    return rest.split("/", 1)[0] if sep else ""


def error_body(code: str, message: str) -> bytes:
    rid = uuid.uuid4().hex[:16].upper()
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>{rid}</RequestId></Error>").encode()


def match(kind: str | tuple | None = None, label: str | None = None, key_prefix: str | None = None,
          method: str | None = None) -> Callable[[Request], bool]:
    """A request predicate: every given condition holds (``kind`` may be a tuple of kinds)."""
    kinds = (kind,) if isinstance(kind, str) else kind

    def pred(r: Request) -> bool:
        return ((kinds is None or r.kind in kinds) and (label is None or r.label == label)
                and (key_prefix is None or r.key.startswith(key_prefix)) and (method is None or r.method == method))

    return pred


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Listener"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _upstream(self) -> http.client.HTTPConnection:
        conn = getattr(self, "_conn", None)
        if conn is None:
            host, port = self.server.proxy.upstream
            conn = self._conn = http.client.HTTPConnection(host, port, timeout=self.server.proxy.timeout)
        return conn

    def _drop_upstream(self) -> None:
        conn = getattr(self, "_conn", None)
        self._conn = None
        if conn is not None:
            conn.close()

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self._drop_upstream()

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _answer(self, req: Request, status: int, code: str, message: str, retry_after: float | None) -> None:
        body = b"" if self.command == "HEAD" else error_body(code, message)
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        if retry_after is not None:
            self.send_header("Retry-After", f"{retry_after:g}")
        self.end_headers()
        if body:
            self.wfile.write(body)
        req.status, req.injected, req.received = status, code, len(body)

    def _forward(self, req: Request, body: bytes) -> None:
        proxy = self.server.proxy
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _HOP]
        if proxy.drop_if_none_match:
            headers = [(k, v) for k, v in headers if k.lower() != "if-none-match"]
        headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
        if body or self.command in ("PUT", "POST"):
            headers.append(("Content-Length", str(len(body))))
        for attempt in (0, 1):
            conn = self._upstream()
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in headers:
                    conn.putheader(k, v)
                conn.endheaders(body if body else None)
                resp = conn.getresponse()
                break
            except (ConnectionError, http.client.HTTPException, OSError):
                self._drop_upstream()  # a pooled connection the server closed: once more on a new one
                if attempt:
                    raise
        self.send_response_only(resp.status, resp.reason)
        length = resp.getheader("Content-Length")
        data = None
        if length is None and self.command != "HEAD" and resp.status not in (204, 304):
            data = resp.read()
            length = str(len(data))
        for k, v in resp.getheaders():
            if k.lower() not in _HOP and k.lower() != "content-length":
                self.send_header(k, v)
        if length is not None:
            self.send_header("Content-Length", length)
        self.end_headers()
        req.status = resp.status
        if self.command == "HEAD" or resp.status in (204, 304):
            resp.read()
            return
        if data is not None:
            self.wfile.write(data)
            req.received = len(data)
            return
        left = int(length)
        while left:
            block = resp.read(min(_BLOCK, left))
            if not block:
                raise ConnectionError("upstream answer cut short")
            self.wfile.write(block)
            left -= len(block)
            req.received += len(block)

    def _handle(self) -> None:
        proxy = self.server.proxy
        parsed = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
        path = urllib.parse.unquote(parsed.path).lstrip("/")
        _, _, key = path.partition("/")
        req = Request(
            label=self.server.label, method=self.command, kind=proxy.classify(self.command, key, query), key=key,
            query=parsed.query, conditional=bool(self.headers.get("If-None-Match") or self.headers.get("If-Match")),
            at=proxy.clock(), access_key=_access_key(self.headers),
        )
        proxy._log(req)
        proxy._hold(req)
        body = self._body()
        req.sent = len(body)
        verdict = proxy._verdict(req, self.headers, body, query)
        if verdict is not None:
            self._answer(req, *verdict)
            return
        self._forward(req, body)
        proxy._after(req, query)

    def do_GET(self):
        self._handle()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET


class _Listener(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def __init__(self, proxy: "RequestProxy", label: str):
        self.proxy, self.label = proxy, label
        super().__init__((HOST, 0), _Handler)

    def handle_error(self, request, client_address) -> None:
        # A client that gave up (a timeout, a reset) or a proxy stopped under a held request:
        # part of the faults this proxy plays, not worth a traceback on stderr.
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError, OSError)):
            super().handle_error(request, client_address)


class RequestProxy:
    """A logging, fault-injecting HTTP proxy in front of ``upstream`` (see the module docstring).

    Parameters
    ----------
    upstream:
        The server's endpoint, ``http://127.0.0.1:PORT``.
    clock:
        Seconds for token buckets (monotonic); ``wall`` the wall time key
        lifetimes are measured against.
    classify:
        ``(method, key, query) -> kind``; :func:`s3_kind` by default.
    timeout:
        Seconds the proxy waits on the server.
    """

    def __init__(self, upstream: str, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, classify=s3_kind, timeout: float = 60.0):
        u = urllib.parse.urlsplit(upstream)
        if u.hostname not in (HOST, "localhost"):
            raise ValueError(f"RequestProxy forwards to loopback servers only, not {upstream!r}")
        self.upstream = (HOST, u.port or 80)
        self.clock, self.wall, self.classify, self.timeout = clock, wall, classify, timeout
        self.drop_if_none_match = False
        self.log: list[Request] = []
        self._lock = threading.Lock()
        self._listeners: dict[str, tuple[_Listener, threading.Thread]] = {}
        self._rules: list[Rule] = []
        self._buckets: list[_Bucket] = []
        self._parts: _PartRules | None = None
        self._key_life: float | None = None
        self.expired = 0
        self._stalls: list[tuple[Callable[[Request], bool], threading.Event]] = []
        self._stopped = threading.Event()

    # ------------------------------------------------------------ lifetime
    def endpoint(self, label: str = "") -> str:
        """The URL clients labelled ``label`` talk to (a port of its own, opened on first use)."""
        with self._lock:
            if self._stopped.is_set():
                raise RuntimeError("the proxy is stopped")
            got = self._listeners.get(label)
            if got is None:
                srv = _Listener(self, label)
                t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                                     name=f"reqproxy-{label or 'default'}")
                t.start()
                got = self._listeners[label] = (srv, t)
        return f"http://{HOST}:{got[0].server_address[1]}"

    def stop(self) -> None:
        self._stopped.set()
        for _, ev in list(self._stalls):
            ev.set()
        with self._lock:
            listeners, self._listeners = list(self._listeners.values()), {}
        for srv, t in listeners:
            srv.shutdown()
            srv.server_close()
            t.join(timeout=5)

    def __enter__(self) -> "RequestProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ the log
    def _log(self, req: Request) -> None:
        with self._lock:
            self.log.append(req)

    def requests(self, pred: Callable[[Request], bool] | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.log if pred is None or pred(r)]

    def counts(self, by: str = "kind", pred: Callable[[Request], bool] | None = None) -> Counter:
        """Requests per value of ``by`` (a :class:`Request` field, or ``"label,kind"`` for pairs)."""
        names = by.split(",")
        return Counter(tuple(getattr(r, n) for n in names) if len(names) > 1 else getattr(r, names[0])
                       for r in self.requests(pred))

    def clear(self) -> None:
        with self._lock:
            self.log.clear()

    # ------------------------------------------------------------ faults
    def fail(self, pred: Callable[[Request], bool] | None = None, count: int | None = 1, status: int = 503,
             code: str = "SlowDown", message: str = "Please reduce your request rate.",
             retry_after: float | None = None) -> Rule:
        """Answer the next ``count`` requests matching ``pred`` (None: all) with an error; returns the rule."""
        rule = Rule(pred or (lambda r: True), status, code, message, count, retry_after)
        with self._lock:
            self._rules.append(rule)
        return rule

    def remove(self, rule: Rule) -> None:
        with self._lock:
            rule.removed = True

    def rate_limit(self, rate: float, burst: float | None = None, pred: Callable[[Request], bool] | None = None,
                   retry_after: float | None = None) -> _Bucket:
        """At most ``rate`` matching requests a second (bursts of ``burst``); the rest get 503 SlowDown."""
        b = _Bucket(pred or (lambda r: True), float(rate), float(burst if burst is not None else rate), retry_after,
                    float(burst if burst is not None else rate), self.clock())
        with self._lock:
            self._buckets.append(b)
        return b

    def part_rules(self, equal: bool = True, min_size: int = 0) -> _PartRules:
        """Refuse completions whose parts (all but the last) differ in size or are under ``min_size``."""
        self._parts = _PartRules(equal, int(min_size))
        return self._parts

    def expire_keys(self, lifetime: float | None) -> None:
        """Refuse requests signed with a key issued (:func:`issue_key`) over ``lifetime`` seconds ago."""
        self._key_life = lifetime

    def stall(self, pred: Callable[[Request], bool], count: int | None = None) -> threading.Event:
        """Hold matching requests (the first ``count`` of them; None: all) before their body is read,
        until the returned event is set or the proxy stops: the client sees a server that never reads."""
        ev = threading.Event()
        left = [count]

        def take(r: Request) -> bool:
            if not pred(r) or left[0] == 0:
                return False
            if left[0] is not None:
                left[0] -= 1
            return True

        with self._lock:
            self._stalls.append((take, ev))
        return ev

    # ------------------------------------------------------------ decisions (handler threads)
    def _hold(self, req: Request) -> None:
        with self._lock:
            holds = [ev for pred, ev in self._stalls if not ev.is_set() and pred(req)]
        for ev in holds:
            ev.wait()
            if self._stopped.is_set():
                raise ConnectionError("proxy stopped")

    def _verdict(self, req: Request, headers, body: bytes, query: dict):
        """``(status, code, message, retry_after)`` to answer instead of the server, or None."""
        if self._key_life is not None:
            issued = _issued(_access_key(headers))
            if issued is not None and self.wall() - issued > self._key_life:
                with self._lock:
                    self.expired += 1
                return 400, "ExpiredToken", "The provided token has expired.", None
        with self._lock:
            for rule in self._rules:
                if rule.removed or (rule.count is not None and rule.fired >= rule.count) or not rule.match(req):
                    continue
                rule.fired += 1
                return rule.status, rule.code, rule.message, rule.retry_after
            now = self.clock()
            for b in self._buckets:
                if not b.match(req):
                    continue
                b.tokens = min(b.burst, b.tokens + (now - b.last) * b.rate)
                b.last = now
                if b.tokens < 1:
                    b.fired += 1
                    return 503, "SlowDown", "Please reduce your request rate.", b.retry_after
                b.tokens -= 1
                b.passed += 1
        rules = self._parts
        if rules is not None:
            upload = (query.get("uploadId") or [""])[0]
            if req.kind == "PART":
                size = int(headers.get("x-amz-decoded-content-length") or len(body))
                with self._lock:
                    rules.sizes.setdefault(upload, {})[int(query["partNumber"][0])] = size
            elif req.kind == "MPU_COMPLETE":
                with self._lock:
                    sizes = rules.sizes.get(upload, {})
                    ordered = [sizes[n] for n in sorted(sizes)]
                    head = ordered[:-1]
                    problem = None
                    if rules.min_size and any(s < rules.min_size for s in head):
                        problem = ("EntityTooSmall", "Your proposed upload is smaller than the minimum allowed object size.")
                    elif rules.equal and (len(set(head)) > 1 or (head and ordered[-1] > head[0])):
                        problem = ("InvalidPart", "All non-trailing parts must have the same length.")
                    if problem is not None:
                        rules.refused += 1
                        return (400, *problem, None)
        return None

    def _after(self, req: Request, query: dict) -> None:
        if self._parts is not None and req.kind in ("MPU_COMPLETE", "MPU_ABORT") and 200 <= req.status < 300:
            with self._lock:
                self._parts.sizes.pop((query.get("uploadId") or [""])[0], None)


def credential_process_script(path, prefix: str = "ckpt", refresh_after: float = 2.0) -> str:
    """Write an executable ``credential_process`` that hands out a fresh :func:`issue_key` key each call.

    Its ``Expiration`` lies ten minutes and ``refresh_after`` seconds ahead:
    botocore refreshes credentials that expire within ten minutes before
    each request, so the key changes about every ``refresh_after`` seconds.
    Returns the command line for an AWS config's ``credential_process``.
    """
    import os
    import sys

    script = f'''#!{sys.executable}
import datetime, json, time
now = time.time()
exp = datetime.datetime.fromtimestamp(now + 600 + {refresh_after!r}, datetime.timezone.utc)
print(json.dumps({{"Version": 1, "AccessKeyId": "{prefix}%d" % int(now * 1000), "SecretAccessKey": "testing",
                  "Expiration": exp.strftime("%Y-%m-%dT%H:%M:%SZ")}}))
'''
    with open(path, "w") as f:
        f.write(script)
    os.chmod(path, 0o755)
    return str(path)
