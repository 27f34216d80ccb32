"""Client CPU of ranged S3 reads: ``get_ranges`` (a fresh ``bytes`` per range) against streamed reads.

Run from the repository root::

    python -m benchmarks.experiments.s3_reads [--server seaweedfs] [--mib 512] [--rounds 3] [--threads 16]

Puts ``--mib`` of random bytes as 16 MiB objects, then reads them back as 8
MiB ranges, ``--threads`` at once, two ways through one ``S3Store`` (botocore
alone since issue 27 item 3; before it, a third row read through s3fs's
aiohttp client): ``get_ranges`` (a fresh ``bytes`` per range) and
``read_range_into`` into one reused buffer per thread (the loader's path:
the body is streamed into the buffer). The
server is pinned to CPU 1 and this process to CPU 0, as in
``benchmarks.run``; rounds alternate. Prints the client's CPU seconds
(``process_time``) and wall seconds per GiB, each round and the median.
Results: docs/performance.md, "Loads: client CPU, and destinations of another dtype";
in full: docs/performance-history.md, "Streamed range reads and float32 transform 2".
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import time

import numpy as np

from ckptstore.storage.s3 import S3Store

from ..common.clients import ThreadBuffer, probe
from ..common.pinning import pin
from ..common.servers import SERVERS, start_server

OBJECT = 16 << 20
RANGE = 8 << 20
STREAMED = "read_range_into"


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
            "get_ranges": S3Store("bench/r", srv.storage_options()),
        }
        data = np.random.default_rng(0).integers(0, 256, OBJECT, dtype=np.uint8).tobytes()
        put = stores["get_ranges"]
        for i in range(n):
            put.put(f"o{i}", data)
        work = [(f"o{i}", s) for i in range(n) for s in range(0, OBJECT, RANGE)]
        modes = {name: "get_ranges" for name in stores}
        modes[STREAMED] = "read_range_into"
        stores[STREAMED] = put
        results: dict[str, list[tuple[float, float]]] = {k: [] for k in stores}
        buffer = ThreadBuffer(RANGE)  # one per thread, reused: the loader's pool

        def read(st, mode, w):
            if mode == "get_ranges":
                return st.get_ranges(w[0], [(w[1], w[1] + RANGE)])[0]
            buf = buffer()
            st.read_range_into(w[0], w[1], buf, lambda n: None)
            return probe(buf)  # the buffer is reused: keep a few bytes of each range to check

        want = {w: probe(data[w[1] : w[1] + RANGE]) for w in work}
        with cf.ThreadPoolExecutor(a.threads) as pool:
            for name, st in stores.items():  # untimed warm-up: connections, clients
                list(pool.map(lambda w: read(st, modes[name], w), work[: a.threads]))
            for r in range(a.rounds):
                for name, st in stores.items():
                    c0, t0 = time.process_time(), time.perf_counter()
                    got = list(pool.map(lambda w: read(st, modes[name], w), work))
                    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
                    if modes[name] == "get_ranges":
                        assert all(g == data[s : s + RANGE] for g, (_, s) in zip(got, work)), name
                    else:
                        assert all(g == want[w] for g, w in zip(got, work)), name
                    del got
                    results[name].append((cpu / gib, wall / gib))
                    print(f"  round {r + 1}  {name:30s} {cpu / gib:5.2f} CPU-s/GiB  {wall / gib:5.2f} s/GiB")
        for name, st in stores.items():
            if name != STREAMED:
                st.close()
    print()
    for name, rows in results.items():
        print(f"median {name:30s} {statistics.median(c for c, _ in rows):5.2f} CPU-s/GiB  "
              f"{statistics.median(w for _, w in rows):5.2f} s/GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
