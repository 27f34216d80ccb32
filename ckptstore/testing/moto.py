"""A moto S3 server on a free loopback port, for tests, demos and benchmarks.

No pytest here: the CLI demo and the benchmarks use it too. Credentials are
passed explicitly in :meth:`MotoServer.storage_options`; the process
environment is never changed.
"""

from __future__ import annotations

import http.client
import logging
import threading
import urllib.error
import urllib.request

from .ports import free_port

HOST = "127.0.0.1"
REGION = "us-east-1"
#: moto accepts any credentials; these are only what the clients sign with.
KEY = SECRET = "testing"


class _Middleware:
    """WSGI fixes that make moto behave like S3 towards our clients.

    * Conditional requests (``If-None-Match``/``If-Match``) run one at a
      time: moto checks the precondition and stores the object in two steps
      without a lock, so two concurrent exclusive creates could both succeed
      on its threaded server. S3 makes them atomic.
    * moto sets ``server: amazon.com`` and werkzeug adds its own ``Server``
      header; strict HTTP parsers (aiohttp's pure-Python parser, used under
      ``python -X dev``) reject the duplicate with a 400. moto's copy is
      dropped.
    """

    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ, start_response):
        def start(status, headers, exc_info=None):
            headers = [(k, v) for k, v in headers if k.lower() != "server"]
            return start_response(status, headers, exc_info)

        if environ.get("HTTP_IF_NONE_MATCH") or environ.get("HTTP_IF_MATCH"):
            with self.lock:
                # Flask has produced the whole response (and moto has applied
                # the write) by the time the app returns.
                return self.app(environ, start)
        return self.app(environ, start)


class MotoServer:
    """A ``moto.server.ThreadedMotoServer`` on ``127.0.0.1:<free port>``.

    Use as a context manager, or call :meth:`start` and :meth:`stop`::

        with MotoServer() as moto:
            moto.create_bucket("ckpt")
            store = S3Store("ckpt/run", moto.storage_options())
    """

    def __init__(self, port: int | None = None, quiet: bool = True):
        self.port = port or free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        self._quiet = quiet
        self._server = None
        self._client = None
        # Talk to the loopback server directly, whatever proxy the
        # environment names.
        self._http = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # ------------------------------------------------------------ lifetime
    def start(self) -> "MotoServer":
        if self._server is not None:
            return self
        from moto.server import ThreadedMotoServer

        if self._quiet:
            wz = logging.getLogger("werkzeug")
            if wz.level == logging.NOTSET:
                # One log line per request otherwise.
                wz.setLevel(logging.ERROR)
        server = ThreadedMotoServer(ip_address=HOST, port=self.port, verbose=False)
        server.start()
        wsgi = getattr(server, "_server", None)
        if wsgi is not None and hasattr(wsgi, "app"):
            wsgi.app = _Middleware(wsgi.app)
        self._server = server
        return self

    def stop(self) -> None:
        """Stop the server thread and close the bucket client."""
        server, self._server = self._server, None
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass
        if server is not None:
            server.stop()
            wsgi = getattr(server, "_server", None)
            if wsgi is not None:
                wsgi.server_close()

    def __enter__(self) -> "MotoServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ helpers
    def storage_options(self, bucket: str | None = None) -> dict:
        """S3 ``storage_options`` (s3fs's names) reaching this server.

        ``bucket`` is accepted for symmetry with other emulators and unused:
        the options do not depend on the bucket. ``config_kwargs.proxies`` is
        empty so that no environment proxy sees the traffic; botocore retries
        a failed request at most once (``max_attempts`` counts retries after
        the first try in botocore's legacy mode): moto does not throttle, and
        more retries of its internal errors only slow tests down by seconds.
        """
        return {
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION},
            "config_kwargs": {"proxies": {}, "retries": {"max_attempts": 1}},
        }

    def client(self):
        """A boto3 S3 client for this server (created once)."""
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.client(
                "s3",
                endpoint_url=self.endpoint,
                region_name=REGION,
                aws_access_key_id=KEY,
                aws_secret_access_key=SECRET,
                config=Config(proxies={}),
            )
        return self._client

    def create_bucket(self, name: str) -> None:
        """Create a bucket (an existing one of ours is fine)."""
        try:
            self.client().create_bucket(Bucket=name)
        except self.client().exceptions.BucketAlreadyOwnedByYou:
            pass

    def reset(self) -> None:
        """Drop every bucket and object (moto's ``/moto-api/reset``)."""
        # Idempotent: retried when the server drops the connection (seen once on a loaded machine:
        # RemoteDisconnected with no response).
        for attempt in range(3):
            req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", data=b"", method="POST")
            try:
                with self._http.open(req, timeout=30) as resp:
                    resp.read()
                return
            except (ConnectionError, http.client.HTTPException, urllib.error.URLError):
                if attempt == 2:
                    raise
