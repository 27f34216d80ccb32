"""One S3 client (issue 27 item 3): client CPU and wall time of PUTs and ranged GETs, side by side.

Run from the repository root::

    python -m benchmarks.micro.s3_clients [--server seaweedfs] [--mib 512] [--rounds 3] [--threads 8]

Puts ``--mib`` of random bytes as 64 MiB objects (single PUTs), then reads
them back as 8 MiB ranges, ``--threads`` requests at once, through:

- ``ckptstore S3Store``: the project's S3 store (botocore alone since issue
  27 item 3): ``S3Store.put``; ``read_range_into`` into one reused buffer per
  thread, the loader's path;
- ``S3Store multipart``: the save path of packs: each object as a multipart
  upload of 16 MiB parts (``create_multipart``/``upload_part``/``complete``),
  read back as above;
- ``botocore``: one boto3 client shared by the threads, configured as
  ckptstore configures its own (no SHA-256 of each body for the signature;
  the CRC32 header kept): ``put_object`` of the bytes; ``get_object`` with a
  ``Range``, the body read into a reused buffer;
- ``obstore`` (for comparison, when installed: ``pip install obstore``; not
  a dependency): ``put`` of the bytes and ``get_range``,
  ``unsigned_payload=True`` (Python bindings of the Rust ``object_store``
  crate; its own tokio threads, counted in this process's CPU time).

The server is pinned to CPU 1 and this process to CPU 0; clients alternate
within each round. Prints client CPU seconds (``process_time``, all threads)
and wall seconds per GiB, per round and the median; every object and range
is checked; the figures of two earlier stores (:data:`EARLIER`: s3fs with
a threaded botocore client for bodies, and obstore with botocore for
multipart uploads), measured by this script, are printed beside them.
Results: docs/performance.md, "One S3 client".
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import os

import numpy as np

from ckptstore.storage.s3 import S3Store

from ..common.clients import MultipartPut, ThreadBuffer, print_medians, probe, timed_rounds
from ..common.pinning import pin
from ..common.servers import SERVERS, start_server

OBJECT = 64 << 20
RANGE = 8 << 20
PART = 16 << 20
#: Earlier S3Stores: median client CPU-s/GiB of PUT and GET. s3fs + a threaded
#: botocore client for bodies: 512 MiB, 3 rounds, commit 088ca58; obstore (+
#: botocore multipart): 256 MiB, 3 rounds, commit bafeb17 (docs/data/s3_clients_obstore.txt).
EARLIER = {"s3fs (088ca58)": {"PUT": 0.78, "GET": 0.59}, "obstore (bafeb17)": {"PUT": 0.40, "GET": 0.91}}


class _Ckpt:
    name = "ckptstore S3Store"

    def __init__(self, srv, prefix):
        self.s = S3Store(f"bench/{prefix}", srv.storage_options())
        self._buffer = ThreadBuffer(RANGE)

    def put(self, key, data):
        self.s.put(key, data)

    def get(self, key, start):
        b = self._buffer()
        self.s.read_range_into(key, start, b, lambda n: None)
        return probe(b)

    def close(self):
        self.s.close()


class _CkptParts(MultipartPut, _Ckpt):
    name = "S3Store multipart"
    part_size = PART


class _Boto:
    name = "botocore"

    def __init__(self, srv, prefix):
        import boto3
        from botocore.config import Config

        self.prefix = prefix
        self.c = boto3.client("s3", endpoint_url=srv.endpoint, aws_access_key_id=srv.key,
                              aws_secret_access_key=srv.secret, region_name="us-east-1",
                              config=Config(max_pool_connections=64, proxies={},
                                            # as ckptstore configures it: the CRC32 header, no SHA-256 of
                                            # each body for the signature over plain HTTP
                                            s3={"payload_signing_enabled": False}))
        self._buffer = ThreadBuffer(RANGE)

    def put(self, key, data):
        self.c.put_object(Bucket="bench", Key=f"{self.prefix}/{key}", Body=data)

    def get(self, key, start):
        b = self._buffer()
        body = self.c.get_object(Bucket="bench", Key=f"{self.prefix}/{key}",
                                 Range=f"bytes={start}-{start + RANGE - 1}")["Body"]
        mv, got = memoryview(b), 0
        raw = body._raw_stream
        while got < RANGE:
            n = raw.readinto(mv[got:])
            if not n:
                break
            got += n
        body.close()
        assert got == RANGE
        return probe(b)

    def close(self):
        self.c.close()


class _Obstore:
    name = "obstore"

    def __init__(self, srv, prefix):
        from obstore.store import S3Store as ObS3

        self.prefix = prefix
        self.s = ObS3("bench", endpoint=srv.endpoint, access_key_id=srv.key, secret_access_key=srv.secret,
                      region="us-east-1", virtual_hosted_style_request=False, unsigned_payload=True,
                      client_options={"allow_http": True})

    def put(self, key, data):
        import obstore

        obstore.put(self.s, f"{self.prefix}/{key}", data)

    def get(self, key, start):
        import obstore

        got = obstore.get_range(self.s, f"{self.prefix}/{key}", start=start, end=start + RANGE)
        assert len(got) == RANGE
        return probe(memoryview(got))

    def close(self):
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="seaweedfs", choices=SERVERS)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8)
    a = ap.parse_args(argv)
    n = max(1, a.mib * (1 << 20) // OBJECT)
    gib = n * OBJECT / (1 << 30)
    kinds = [_Ckpt, _CkptParts, _Boto]
    if importlib.util.find_spec("obstore") is not None:
        kinds.append(_Obstore)
    else:
        print("obstore is not installed (pip install obstore): left out")
    data = np.random.default_rng(0).integers(0, 256, OBJECT, dtype=np.uint8).tobytes()
    work = [(f"o{i}", s) for i in range(n) for s in range(0, OBJECT, RANGE)]
    want = {w: probe(memoryview(data)[w[1] : w[1] + RANGE]) for w in work}
    with start_server(a.server, "bench") as srv:
        if srv.pid is not None:
            pin(srv.pid, {1})
            os.sched_setaffinity(0, {0})
        print(f"server {srv.name} (pid {srv.pid}, pinned to CPU 1; client on CPU 0), {n} objects of "
              f"{OBJECT >> 20} MiB (single PUTs), {RANGE >> 20} MiB ranges, {a.threads} threads")
        clients = [k(srv, k.__name__.strip("_").lower()) for k in kinds]
        with cf.ThreadPoolExecutor(a.threads) as pool:
            for c in clients:  # untimed warm-up: connections, clients, the server's volumes
                list(pool.map(lambda i: c.put(f"o{i}", data), range(n)))
                list(pool.map(lambda w: c.get(*w), work[: a.threads]))
            results = timed_rounds(pool, clients, a.rounds, data, n, work, want, gib)
        for c in clients:
            c.close()
    print()
    print_medians(results)
    for name, figures in EARLIER.items():
        for op, cpu in figures.items():
            print(f"{'S3Store ' + name:26s} {op:4s} {cpu:12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
