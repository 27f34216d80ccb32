"""One GCS client and one Azure client (issue 27 item 3): client CPU and wall time of PUTs and ranged GETs.

Run from the repository root::

    python -m benchmarks.micro.cloud_clients [--cloud gcs azure] [--mib 512] [--rounds 3] [--threads 8]

The GCS and Azure half of ``benchmarks/micro/s3_clients.py``, measured the
same way: puts ``--mib`` of random bytes as 64 MiB objects (single PUTs),
then reads them back as 8 MiB ranges, ``--threads`` requests at once, each
client in turn within each round; every range read is checked (probes of
its start, middle and end); prints client CPU seconds (``process_time``, all
threads of this process) and wall seconds per GiB, per round and the median.

GCS, against gcp-storage-emulator (:mod:`ckptstore.testing.gcs_emulator`)
started in a child process of its own (in this process its CPU would count
as the client's), pinned to CPU 1, this process to CPU 0:

- ``ckptstore GCSStore``: the project's store (google-auth's
  ``AuthorizedSession`` on the JSON API since issue 27; gcsfs's aiohttp
  session before): ``put`` (one ``uploadType=media`` POST);
  ``read_range_into`` into one reused buffer per thread (one ranged GET of
  ``/download/storage/v1/b/../o/..?alt=media``, its body read from the
  socket into the buffer);
- ``GCSStore multipart``: the save path of packs: each object as a
  multipart upload of 16 MiB parts (``create_multipart``/``upload_part``/
  ``complete``: parallel composite upload, each part a media upload, then
  ``compose`` and the parts deleted), read back as above;
- ``google-cloud-storage``: one ``storage.Client`` (anonymous credentials,
  ``api_endpoint`` the emulator) shared by the threads;
  ``Blob.upload_from_string(checksum=None)`` (above 8 MiB the library makes
  it a resumable upload: one POST to open the session, the 64 MiB in one PUT);
  ``Blob.download_to_file(start, end, raw_download=True, checksum=None)``
  into a sink writing into a reused buffer;
- ``google-auth session``: the prototype the store was rebuilt on, the
  same JSON API requests with nothing around them: one ``AuthorizedSession``
  (google-auth's ``requests`` session, the HTTP layer google-cloud-storage
  uses) shared by the threads: a media upload POST; a ranged GET whose
  body is read from the socket straight into the reused buffer (as
  ``s3_clients``' botocore row does);
- ``obstore`` (``obstore.store.GCSStore``, ``base_url`` the emulator, a
  static bearer token): ``put(use_multipart=False)`` (one PUT; obstore's
  default above 5 MiB, a multipart upload, is an XML API call the emulator
  does not serve: 501) and ``get_range``, which speak GCS's XML API
  (``PUT``/``GET /<bucket>/<object>``). gcp-storage-emulator serves those
  two paths but answers them without ``ETag`` and ``Last-Modified``, which
  object_store requires of every PUT and GET reply ("ETag Header missing
  from response"): the emulator process started here adds both headers to
  that route only (:func:`_serve_gcs`), and nothing else about it changes.
  Without that shim obstore cannot be measured against this emulator.

Azure, against Azurite (:mod:`ckptstore.testing.azurite`, a Node.js process,
pinned to CPU 1):

- ``ckptstore AzureStore``: the project's store (azure-storage-blob's
  synchronous ``BlobServiceClient``, requests, one per process shared by
  the threads): ``put`` (``upload_blob``, one Put Blob up to 64 MiB);
  ``read_range_into`` (one ranged Get Blob through the operation under
  ``download_blob``, its body read from the socket straight into the
  reused buffer);
- ``AzureStore multipart``: the save path of packs: 16 MiB parts as
  ``stage_block`` calls, then one ``commit_block_list``, read back as above;
- ``azure-storage-blob sync``: one synchronous ``BlobServiceClient``
  (``retry_total=0``, as ckptstore's) shared by the threads (requests):
  ``upload_blob(overwrite=True)``; ``download_blob(offset, length).readinto``
  a sink writing into a reused buffer;
- ``obstore`` (``obstore.store.AzureStore``, account key, ``endpoint`` the
  emulator): ``put(use_multipart=False)`` (one Put Blob) and ``get_range``.

An emulator is not the cloud: gcp-storage-emulator is single-threaded
Python (one request at a time, HTTP/1.0, a connection per request) and
Azurite is a Node.js process on one core, so wall times here are the
emulator's; what compares the clients is their CPU. Clients that cannot be
built or cannot talk to an emulator are left out with the reason printed.
Results: docs/performance.md, "One GCS client, one Azure client".
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import os
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np

from ..common.clients import MultipartPut, Results, ThreadBuffer, print_medians, probe, timed_rounds
from ..common.pinning import pin

OBJECT = 64 << 20
RANGE = 8 << 20
PART = 16 << 20
BUCKET = "bench"


class _Sink:
    """A writable stream over a buffer: the SDKs' ``readinto``/``download_to_file`` write here, no copy kept."""

    def __init__(self, buf):
        self.mv = memoryview(buf).cast("B")
        self.n = 0

    def write(self, b) -> int:
        k = len(b)
        self.mv[self.n : self.n + k] = b
        self.n += k
        return k

    def seekable(self) -> bool:
        return False


class _Client:
    """One client: ``put(key, data)``, ``get(key, start)`` -> probes of the range read."""

    name = "?"

    def __init__(self, srv, prefix):
        self.prefix = prefix
        self._buffer = ThreadBuffer(RANGE)

    def close(self):
        pass


# ------------------------------------------------------------------ GCS
class _GCSServer:
    """gcp-storage-emulator in a child process (``--serve-gcs``), so that its CPU is not counted as ours."""

    name = "gcp-storage-emulator"

    def __init__(self):
        from ckptstore.testing.ports import free_port

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.micro.cloud_clients", "--serve-gcs",
                                      str(self.port)], stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + 60
        while True:
            try:
                opener.open(f"{self.endpoint}/", timeout=5).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("gcp-storage-emulator did not start")
                time.sleep(0.2)
        from ckptstore.testing.gcs_emulator import GCSEmulator

        GCSEmulator(port=self.port).create_bucket(BUCKET)  # an unstarted one: only its HTTP helpers

    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "test"}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _serve_gcs(port: int) -> None:
    """The emulator process: :class:`GCSEmulator` in this process's main thread's care, until terminated.

    The XML API route (``PUT``/``GET /<bucket>/<object>``) gets the
    ``ETag`` and ``Last-Modified`` headers real GCS sends (obstore refuses
    replies without them); the JSON API routes are left as they ship.
    """
    import email.utils
    import signal

    from gcp_storage_emulator import server as gserver
    from gcp_storage_emulator.handlers import objects

    from ckptstore.storage.gcs import parse_timestamp
    from ckptstore.testing.gcs_emulator import GCSEmulator

    def with_etag(fn):
        def handler(request, response, storage, *args, **kwargs):
            fn(request, response, storage, *args, **kwargs)
            try:
                obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            except Exception:
                return
            response["ETag"] = f'"{obj.get("md5Hash")}-{obj.get("generation")}"'
            response["Last-Modified"] = email.utils.formatdate(parse_timestamp(obj["updated"]), usegmt=True)

        return handler

    for _, handlers in gserver.HANDLERS:
        if handlers.get("PUT") is objects.xml_upload:
            handlers["PUT"] = with_etag(objects.xml_upload)
            handlers["GET"] = with_etag(handlers["GET"])
    em = GCSEmulator(port=port, enforce_preconditions=False).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    stop.wait()
    em.stop()


class _GCSStore(_Client):
    name = "ckptstore GCSStore"

    def __init__(self, srv, prefix):
        super().__init__(srv, prefix)
        from ckptstore.storage.gcs import GCSStore

        self.s = GCSStore(f"{BUCKET}/{prefix}", srv.storage_options())

    def put(self, key, data):
        self.s.put(key, data)

    def get(self, key, start):
        b = self._buffer()
        self.s.read_range_into(key, start, b, lambda n: None)
        return probe(b)

    def close(self):
        self.s.close()


class _Parts(MultipartPut):
    """The save path of packs: each object as a multipart upload of ``PART`` parts through the store."""

    part_size = PART


class _GCSStoreParts(_Parts, _GCSStore):
    name = "GCSStore multipart"


class _GoogleCloudStorage(_Client):
    name = "google-cloud-storage"

    def __init__(self, srv, prefix):
        super().__init__(srv, prefix)
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        self.c = storage.Client(project="test", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": srv.endpoint})
        self.bucket = self.c.bucket(BUCKET)

    def put(self, key, data):
        self.bucket.blob(f"{self.prefix}/{key}").upload_from_string(data, checksum=None)

    def get(self, key, start):
        sink = _Sink(self._buffer())
        self.bucket.blob(f"{self.prefix}/{key}").download_to_file(
            sink, start=start, end=start + RANGE - 1, raw_download=True, checksum=None)
        assert sink.n == RANGE
        return probe(sink.mv)

    def close(self):
        self.c.close()


class _GoogleSession(_Client):
    name = "google-auth session"

    def __init__(self, srv, prefix):
        super().__init__(srv, prefix)
        from google.auth.credentials import AnonymousCredentials
        from google.auth.transport.requests import AuthorizedSession

        self.ep = srv.endpoint
        self.http = AuthorizedSession(AnonymousCredentials())
        self.http.trust_env = False

    def put(self, key, data):
        r = self.http.post(f"{self.ep}/upload/storage/v1/b/{BUCKET}/o",
                           params={"uploadType": "media", "name": f"{self.prefix}/{key}"}, data=data,
                           headers={"Content-Type": "application/octet-stream"})
        r.raise_for_status()

    def get(self, key, start):
        from urllib.parse import quote

        b = self._buffer()
        r = self.http.get(f"{self.ep}/download/storage/v1/b/{BUCKET}/o/{quote(f'{self.prefix}/{key}', safe='')}",
                          params={"alt": "media"}, headers={"Range": f"bytes={start}-{start + RANGE - 1}"},
                          stream=True)
        r.raise_for_status()
        mv, got = memoryview(b), 0
        while got < RANGE:  # the body straight from the socket into the buffer, as s3_clients' botocore row
            n = r.raw.readinto(mv[got:])
            if not n:
                break
            got += n
        r.close()
        assert got == RANGE
        return probe(b)

    def close(self):
        self.http.close()


class _ObstoreGCS(_Client):
    name = "obstore"

    def __init__(self, srv, prefix):
        super().__init__(srv, prefix)
        from obstore.store import GCSStore as ObGCS

        # A static token: the emulator checks none, and obstore would
        # otherwise ask the GCE metadata server for one.
        self.s = ObGCS(BUCKET, base_url=srv.endpoint, bearer_token="emulator",
                       client_options={"allow_http": True})

    def put(self, key, data):
        import obstore

        # One PUT (obstore's default above 5 MiB is a multipart upload of 5 MiB parts).
        obstore.put(self.s, f"{self.prefix}/{key}", data, use_multipart=False)

    def get(self, key, start):
        import obstore

        got = obstore.get_range(self.s, f"{self.prefix}/{key}", start=start, end=start + RANGE)
        assert len(got) == RANGE
        return probe(memoryview(got))


# ------------------------------------------------------------------ Azure
class _AzureServer:
    name = "Azurite"

    def __init__(self):
        from ckptstore.testing.azurite import Azurite

        self.az = Azurite().start()
        self.pid = self.az._proc.pid
        self.endpoint = self.az.endpoint
        self.az.create_container(BUCKET)

    def stop(self):
        self.az.stop()


class _AzureStore(_Client):
    name = "ckptstore AzureStore"

    def __init__(self, srv, prefix):
        super().__init__(srv, prefix)
        from ckptstore.storage.azure import AzureStore

        self.s = AzureStore(f"{BUCKET}/{prefix}", srv.az.storage_options())

    put = _GCSStore.put
    get = _GCSStore.get
    close = _GCSStore.close


class _AzureStoreParts(_Parts, _AzureStore):
    name = "AzureStore multipart"


class _AzureSync(_Client):
    name = "azure-storage-blob sync"

    def __init__(self, srv, prefix):
        super().__init__(srv, prefix)
        from azure.storage.blob import BlobServiceClient

        self.c = BlobServiceClient.from_connection_string(srv.az.connection_string, retry_total=0)
        self.cc = self.c.get_container_client(BUCKET)

    def put(self, key, data):
        self.cc.get_blob_client(f"{self.prefix}/{key}").upload_blob(data, length=len(data), overwrite=True)

    def get(self, key, start):
        sink = _Sink(self._buffer())
        n = self.cc.get_blob_client(f"{self.prefix}/{key}").download_blob(offset=start, length=RANGE).readinto(sink)
        assert n == RANGE == sink.n
        return probe(sink.mv)

    def close(self):
        self.c.close()


class _ObstoreAzure(_ObstoreGCS):
    name = "obstore"

    def __init__(self, srv, prefix):
        _Client.__init__(self, srv, prefix)
        from obstore.store import AzureStore as ObAzure

        from ckptstore.testing.azurite import ACCOUNT, ACCOUNT_KEY

        self.s = ObAzure(BUCKET, account_name=ACCOUNT, account_key=ACCOUNT_KEY, endpoint=srv.endpoint,
                         client_options={"allow_http": True})


CLOUDS = {
    "gcs": (_GCSServer, [(_GCSStore, None), (_GCSStoreParts, None), (_GoogleCloudStorage, "google.cloud.storage"),
            (_GoogleSession, "google.auth"), (_ObstoreGCS, "obstore")]),
    "azure": (_AzureServer, [(_AzureStore, None), (_AzureStoreParts, None), (_AzureSync, "azure.storage.blob"), (_ObstoreAzure, "obstore")]),
}


def _bench(cloud: str, a, data: bytes, n: int) -> Results:
    gib = n * OBJECT / (1 << 30)
    server_cls, kinds = CLOUDS[cloud]
    work = [(f"o{i}", s) for i in range(n) for s in range(0, OBJECT, RANGE)]
    want = {w: probe(memoryview(data)[w[1] : w[1] + RANGE]) for w in work}
    results: Results = {}
    srv = server_cls()
    try:
        pin(srv.pid, {1})
        os.sched_setaffinity(0, {0})
        print(f"{cloud}: server {srv.name} (pid {srv.pid}, pinned to CPU 1; client on CPU 0), {n} objects of "
              f"{OBJECT >> 20} MiB (single PUTs), {RANGE >> 20} MiB ranges, {a.threads} threads", flush=True)
        clients = []
        with cf.ThreadPoolExecutor(a.threads) as pool:
            for kind, module in kinds:
                if module is not None and importlib.util.find_spec(module.split(".")[0]) is None:
                    print(f"  {kind.name}: left out: {module} is not installed")
                    continue
                try:  # untimed warm-up: connections, clients; also proves the client can talk to the emulator
                    c = kind(srv, kind.__name__.strip("_").lower())
                    list(pool.map(lambda i: c.put(f"o{i}", data), range(n)))
                    got = list(pool.map(lambda w: c.get(*w), work[: a.threads]))
                    assert all(g == want[w] for g, w in zip(got, work)), "wrong bytes"
                except Exception as e:  # noqa: BLE001 - reported, and the row left out
                    print(f"  {kind.name}: left out: cannot use it against {srv.name}: "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", flush=True)
                    continue
                clients.append(c)
            results = timed_rounds(pool, clients, a.rounds, data, n, work, want, gib, width=24)
        for c in clients:
            c.close()
    finally:
        srv.stop()
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cloud", nargs="+", default=list(CLOUDS), choices=list(CLOUDS))
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--serve-gcs", type=int, metavar="PORT", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve_gcs:
        _serve_gcs(a.serve_gcs)
        return 0
    n = max(1, a.mib * (1 << 20) // OBJECT)
    data = np.random.default_rng(0).integers(0, 256, OBJECT, dtype=np.uint8).tobytes()
    for cloud in a.cloud:
        results = _bench(cloud, a, data, n)
        print()
        print_medians(results, prefix=f"{cloud:5s} ", width=24)
        print(flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
