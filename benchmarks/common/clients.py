"""What the object-store client benchmarks (``micro/s3_clients``, ``micro/cloud_clients``) share:
the probe a range is checked by, the reused buffer per thread, a store's multipart put, the
timed rounds, and the table of medians.

A client is any object with a ``name``, ``put(key, data)`` and ``get(key, start)`` (returning
:func:`probe` of the range it read) and ``close()``.
"""

from __future__ import annotations

import statistics
import threading
import time

#: (client name, "PUT" or "GET") -> one (client CPU-s/GiB, wall s/GiB) per round
Results = dict[tuple[str, str], list[tuple[float, float]]]


def probe(b) -> bytes:
    """4 KiB from each end and the middle of a range (what a reused buffer is checked by)."""
    m = len(b) // 2
    return bytes(b[:4096]) + bytes(b[m : m + 4096]) + bytes(b[-4096:])


class ThreadBuffer:
    """One reused buffer of ``size`` bytes per thread (the loader keeps one per I/O thread): call it to get this thread's."""

    def __init__(self, size: int):
        self._size = size
        self._local = threading.local()

    def __call__(self) -> bytearray:
        b = getattr(self._local, "b", None)
        if b is None:
            b = self._local.b = bytearray(self._size)
        return b


class MultipartPut:
    """``put`` as the save path of packs sends an object: a multipart upload of ``part_size`` parts through ``self.s``."""

    part_size = 16 << 20

    def put(self, key, data):
        # Parts as bytearrays, cut once (the saver hands its part buffers over as they are).
        if getattr(self, "_of", None) is not data:
            step = self.part_size
            self._parts = [bytearray(data[i : i + step]) for i in range(0, len(data), step)]
            self._of = data
        mp = self.s.create_multipart(key, self.part_size)
        for n, part in enumerate(self._parts, 1):
            mp.upload_part(n, part)
        mp.complete(len(self._parts))


def timed_rounds(pool, clients, rounds: int, data: bytes, n: int, work, want, gib: float, width: int = 18) -> Results:
    """``rounds`` rounds, the clients alternating within each: every client PUTs the ``n``
    objects, then GETs every range of ``work``, checked against ``want``; one line a client
    and round, and the figures of each."""
    results: Results = {}
    for r in range(rounds):
        for c in clients:
            c0, t0 = time.process_time(), time.perf_counter()
            list(pool.map(lambda i: c.put(f"o{i}", data), range(n)))
            cpu, wall = time.process_time() - c0, time.perf_counter() - t0
            results.setdefault((c.name, "PUT"), []).append((cpu / gib, wall / gib))
            c0, t0 = time.process_time(), time.perf_counter()
            got = list(pool.map(lambda w: c.get(*w), work))
            cpu, wall = time.process_time() - c0, time.perf_counter() - t0
            assert all(g == want[w] for g, w in zip(got, work)), c.name
            results.setdefault((c.name, "GET"), []).append((cpu / gib, wall / gib))
            print(f"  round {r + 1}  {c.name:{width}s} PUT {results[(c.name, 'PUT')][-1][0]:5.2f} CPU-s/GiB "
                  f"{results[(c.name, 'PUT')][-1][1]:6.2f} s/GiB   GET {cpu / gib:5.2f} CPU-s/GiB "
                  f"{wall / gib:6.2f} s/GiB", flush=True)
    return results


def print_medians(results: Results, prefix: str = "", width: int = 18) -> None:
    """The medians over rounds, a line a client and operation."""
    print(f"{prefix}{'client':{width}s} {'op':4s} {'CPU-s/GiB (median)':>20s} {'s/GiB (median)':>16s}")
    for (name, op), rows in results.items():
        print(f"{prefix}{name:{width}s} {op:4s} {statistics.median(c for c, _ in rows):20.2f} "
              f"{statistics.median(w for _, w in rows):16.2f}")
