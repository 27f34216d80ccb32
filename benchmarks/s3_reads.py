"""Client CPU of ranged S3 reads: s3fs's aiohttp client against the threaded botocore one.

Run from the repository root::

    python -m benchmarks.s3_reads [--server seaweedfs] [--mib 512] [--rounds 3]

Puts ``--mib`` of random bytes as 16 MiB objects, then reads them back as 8
MiB ranges the way the loader does (16 threads, one range per
``get_ranges`` call) through two ``S3Store`` s: ``upload_client=False``
(every request through s3fs's aiobotocore client on fsspec's loop) and the
default (ranged reads through the threaded botocore client). The server
is pinned to CPU 1 and this process to CPU 0, as in ``benchmarks.run``;
rounds alternate. Prints the client's CPU seconds (``process_time``) and
wall seconds per GiB, each round and the median.

Measured on 2026-12-01 (2 cores, SeaweedFS 4.48, 512 MiB, medians of 3-5
rounds): with 4 threads 0.95 against 0.65 CPU-s/GiB at the same wall time
(1.06 and 1.07 s/GiB), with 8 threads 0.99 against 0.57 (1.12 and 1.11
s/GiB); with 16 threads 1.00 against 0.67 CPU-s/GiB, but 1.35 against 1.87
s/GiB of wall time: at 16 concurrent requests the one-core server slows
both clients down, the threaded one more (not explained yet).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import time

import numpy as np

from ckptstore.storage.s3 import S3Store

from .common.pinning import pin
from .common.servers import SERVERS, start_server

OBJECT = 16 << 20
RANGE = 8 << 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="seaweedfs", choices=SERVERS)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=16)
    a = ap.parse_args(argv)
    n = max(1, a.mib * (1 << 20) // OBJECT)
    gib = n * OBJECT / (1 << 30)
    with start_server(a.server, "bench") as srv:
        if srv.pid is not None:
            pin(srv.pid, {1})
            os.sched_setaffinity(0, {0})
        print(f"server {srv.name} (pid {srv.pid}, pinned to CPU 1; client on CPU 0), "
              f"{n} objects of {OBJECT >> 20} MiB, {RANGE >> 20} MiB ranges, {a.threads} threads")
        stores = {
            "s3fs (upload_client=False)": S3Store("bench/r", srv.storage_options(), upload_client=False),
            "threaded botocore (default)": S3Store("bench/r", srv.storage_options()),
        }
        data = np.random.default_rng(0).integers(0, 256, OBJECT, dtype=np.uint8).tobytes()
        put = stores["threaded botocore (default)"]
        for i in range(n):
            put.put(f"o{i}", data)
        work = [(f"o{i}", s) for i in range(n) for s in range(0, OBJECT, RANGE)]
        results: dict[str, list[tuple[float, float]]] = {k: [] for k in stores}
        with cf.ThreadPoolExecutor(a.threads) as pool:
            for name, st in stores.items():  # untimed warm-up: connections, clients
                list(pool.map(lambda w: st.get_ranges(w[0], [(w[1], w[1] + RANGE)]), work[: a.threads]))
            for r in range(a.rounds):
                for name, st in stores.items():
                    c0, t0 = time.process_time(), time.perf_counter()
                    got = list(pool.map(lambda w: st.get_ranges(w[0], [(w[1], w[1] + RANGE)])[0], work))
                    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
                    assert all(g == data[s : s + RANGE] for g, (_, s) in zip(got, work)), name
                    del got
                    results[name].append((cpu / gib, wall / gib))
                    print(f"  round {r + 1}  {name:28s} {cpu / gib:5.2f} CPU-s/GiB  {wall / gib:5.2f} s/GiB")
        for st in stores.values():
            st.close()
    print()
    for name, rows in results.items():
        print(f"median {name:28s} {statistics.median(c for c, _ in rows):5.2f} CPU-s/GiB  "
              f"{statistics.median(w for _, w in rows):5.2f} s/GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
