"""A GCS emulator (``gcp-storage-emulator``) on a free loopback port.

No pytest here: tests, demos and benchmarks use it alike. The server runs in
a thread of this process, in memory.

gcp-storage-emulator (2026.7.19) ignores the ``ifGenerationMatch``
precondition: a second exclusive create overwrites the object. Real GCS
answers ``412 Precondition Failed``. :class:`GCSEmulator` therefore wraps the
emulator's storage so that any write carrying ``ifGenerationMatch=N`` (uploads
of every kind, the last chunk of a resumable upload, compose, copy) fails with
a GCS-shaped 412 unless the live object's generation is ``N`` (``0``: no live
object). The check and the write run under the server's single request
thread, so they are atomic, as on GCS. Pass ``enforce_preconditions=False``
to see the emulator as it ships.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from functools import partial
from http import server as http_server
from urllib.parse import parse_qs, urlparse

from .ports import free_port


HOST = "127.0.0.1"
PROJECT = "test"


class _PreconditionFailed(Exception):
    pass


_REQUEST = threading.local()


def _make_classes(enforce: bool):
    from gcp_storage_emulator.server import RequestHandler
    from gcp_storage_emulator.storage import Storage

    class _Storage(Storage):
        """Storage that honours the request's ``ifGenerationMatch``."""

        def create_file(self, bucket_name, file_name, content, file_obj, file_id=None):
            want = getattr(_REQUEST, "if_generation_match", None)
            if enforce and want is not None:
                current = self.objects.get(bucket_name, {}).get(file_name)
                generation = int(current["generation"]) if current else 0
                if generation != int(want):
                    raise _PreconditionFailed(file_name)
            return super().create_file(bucket_name, file_name, content, file_obj, file_id)

    class _Handler(RequestHandler):
        protocol_version = "HTTP/1.0"

        def _route(self, method: str) -> None:
            query = parse_qs(urlparse(self.path).query)
            _REQUEST.if_generation_match = (query.get("ifGenerationMatch") or [None])[0]
            try:
                getattr(super(), f"do_{method}")()
            except _PreconditionFailed:
                body = json.dumps(
                    {
                        "error": {
                            "code": 412,
                            "message": "At least one of the pre-conditions you specified did not hold.",
                            "errors": [{"reason": "conditionNotMet", "domain": "global"}],
                        }
                    }
                ).encode()
                self.send_response(412, "Precondition Failed")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            finally:
                _REQUEST.if_generation_match = None

        def do_GET(self):
            self._route("GET")

        def do_POST(self):
            self._route("POST")

        def do_PUT(self):
            self._route("PUT")

        def do_DELETE(self):
            self._route("DELETE")

        def do_PATCH(self):
            self._route("PATCH")

        def log_message(self, format, *args):  # noqa: A002 - silence per-request lines
            pass

    return _Storage, _Handler


class GCSEmulator:
    """gcp-storage-emulator on ``127.0.0.1:<free port>``, in memory, in a thread.

    Use as a context manager, or call :meth:`start` and :meth:`stop`::

        with GCSEmulator() as gcs:
            gcs.create_bucket("ckpt")
            store = GCSStore("ckpt/run", gcs.storage_options())

    Requests are served one at a time (the emulator's storage is not
    thread-safe), so throughput measured here says nothing about GCS.
    """

    def __init__(self, port: int | None = None, enforce_preconditions: bool = True, quiet: bool = True):
        self.port = port or free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        self.enforce_preconditions = enforce_preconditions
        self._quiet = quiet
        self._httpd = None
        self._thread = None
        self._storage = None
        self._http = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # ------------------------------------------------------------ lifetime
    def start(self) -> "GCSEmulator":
        if self._httpd is not None:
            return self
        if self._quiet:
            for name in ("gcp_storage_emulator", "gcp_storage_emulator.server", "gcp_storage_emulator.storage"):
                lg = logging.getLogger(name)
                if lg.level == logging.NOTSET:
                    lg.setLevel(logging.CRITICAL)
        storage_cls, handler_cls = _make_classes(self.enforce_preconditions)
        self._storage = storage_cls(use_memory_fs=True)
        self._httpd = http_server.HTTPServer((HOST, self.port), partial(handler_cls, self._storage))
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="gcs-emulator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> "GCSEmulator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ helpers
    def storage_options(self) -> dict:
        """``storage_options`` of a GCSStore reaching this emulator anonymously."""
        return {"endpoint_url": self.endpoint, "token": "anon", "project": PROJECT}

    def _open(self, req) -> bytes:
        with self._http.open(req, timeout=30) as resp:
            return resp.read()

    def create_bucket(self, name: str) -> None:
        """Create a bucket (an existing one is fine)."""
        req = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project={PROJECT}",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            self._open(req)
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise

    def reset(self) -> None:
        """Drop every bucket and object."""
        self._open(urllib.request.Request(f"{self.endpoint}/wipe", method="GET"))

    def object_names(self, bucket: str) -> list[str]:
        """Every object name in ``bucket``, straight from the emulator's state."""
        return sorted(self._storage.objects.get(bucket, {}))


def main(argv=None) -> int:
    """``python -m ckptstore.testing.gcs_emulator --port 9023 --bucket my-bucket``: serve until Ctrl-C.

    gcp-storage-emulator as the tests run it: in memory, with ``ifGenerationMatch``
    enforced, so that ckptstore's check of conditional creates passes (the emulator as it
    ships accepts a second exclusive create, and ckptstore refuses to commit to it).
    """
    import argparse
    import time

    ap = argparse.ArgumentParser(description=main.__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=9023)
    ap.add_argument("--bucket", action="append", default=[], help="a bucket to create (repeatable)")
    a = ap.parse_args(argv)
    with GCSEmulator(port=a.port) as em:
        for b in a.bucket:
            em.create_bucket(b)
        print(f"GCS emulator on {em.endpoint} (ifGenerationMatch enforced); buckets: {', '.join(a.bucket) or 'none'}",
              flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
