"""Where a pinned S3 load spends its client CPU: per-stage thread CPU, summed over threads.

Run from the repository root::

    python -m benchmarks.experiments.load_stages [--workload a] [--rounds 3] [--timeline]

Starts SeaweedFS pinned to CPU 1 (this process on CPU 0, as in
``benchmarks.run``), saves the workload once, then loads it ``--rounds``
times into the same tensors with a fresh repository handle each time.
The stages are timed with ``time.thread_time`` around the functions that do
them, on whichever thread runs them, and summed:

- ``read``: ``S3Store.read_range_into`` (request, headers and receiving the
  body into the range buffer; the progress callbacks that hand chunks to
  the CPU pool included);
- ``decode``: ``codec.decode_verified_into`` (everything done per chunk),
  of which ``interleave`` (``_unplanes``/``_unlow3``: putting the bytes of
  each element back together), ``hash`` (BLAKE3 of the decoded chunk) and
  the rest (zstd of the compressed planes, checks).

``other`` is the process CPU outside both (planning, thread pools,
allocation, the main thread). With ``--timeline`` the last round also
prints, per 50 ms, the ranged GETs in flight and how many decodes run.
Every load is verified bit-exact.
"""

from __future__ import annotations

import argparse
import collections
import threading
import time

import ckptstore
from ckptstore.format import codec
from ckptstore.storage import s3 as s3mod

from ..common.measure import proc_cpu
from ..common.pinning import Pinning
from ..common.report import command_line, env_line, git_commit
from ..common.servers import start_server
from ..common.systems import BUCKET, S3_PACK_SIZE
from ..common.verify import verify
from ..common.workloads import build

_acc: collections.Counter = collections.Counter()
_events: list[tuple[str, float, float]] = []
_lock = threading.Lock()


def _timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            c, t1 = time.thread_time() - c0, time.perf_counter()
            with _lock:
                _acc[label] += c
                _events.append((label, t0, t1))

    setattr(owner, name, wrapper)


def _instrument() -> None:
    _timed(codec, "hash_bytes", "hash")
    _timed(codec, "_unplanes", "interleave")
    if hasattr(codec, "_unlow3"):
        _timed(codec, "_unlow3", "interleave")
    _timed(codec, "decode_verified_into", "decode")
    _timed(s3mod.S3Store, "read_range_into", "read")


def _timeline(t0: float, end: float) -> None:
    step = 0.05
    t = 0.0
    while t < end:
        gets = sum(1 for lb, a, b in _events if lb == "read" and a - t0 < t + step and b - t0 > t)
        busy = sum(min(b - t0, t + step) - max(a - t0, t) for lb, a, b in _events
                   if lb == "decode" and a - t0 < t + step and b - t0 > t) / step
        print(f"  {t:5.2f} s  GETs in flight {gets:2d}  decodes running {busy:4.2f}  " + "#" * gets)
        t += step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.experiments.load_stages", description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="a", choices=("a", "e", "b"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeline", action="store_true")
    a = ap.parse_args(argv)
    print(f"command: {command_line('benchmarks.experiments.load_stages', argv)}")
    print(env_line() + f", commit {git_commit()}")
    _instrument()
    sd = build(a.workload)
    import copy

    like = copy.deepcopy(sd)
    pinning = Pinning()
    print(pinning.describe())
    with start_server("seaweedfs", BUCKET) as srv:
        print(f"seaweedfs: {pinning.server(srv.pid)}")
        so, url = srv.storage_options(), f"s3://{BUCKET}/stages-{a.workload}"
        with pinning.client():
            with ckptstore.open(url, storage_options=so, pack_size=S3_PACK_SIZE) as repo:
                repo.save(sd, step=1)
            for rnd in range(a.rounds):
                with _lock:
                    _acc.clear()
                    _events.clear()
                s0 = proc_cpu(srv.pid)
                c0, t0 = time.process_time(), time.perf_counter()
                with ckptstore.open(url, storage_options=so) as repo:
                    repo.load(1, into=like)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                srv_cpu = proc_cpu(srv.pid) - s0
                verify(sd, like, f"{a.workload} load")
                st = dict(_acc)
                rest = st.get("decode", 0) - st.get("interleave", 0) - st.get("hash", 0)
                other = cpu - st.get("decode", 0) - st.get("read", 0)
                print(f"round {rnd}: wall {wall:.3f} s  client CPU {cpu:.3f} s  server CPU {srv_cpu:.3f} s | "
                      f"read {st.get('read', 0):.3f}  decode {st.get('decode', 0):.3f} (interleave "
                      f"{st.get('interleave', 0):.3f}, hash {st.get('hash', 0):.3f}, zstd and checks {rest:.3f})  "
                      f"other {other:.3f}", flush=True)
            if a.timeline:
                _timeline(t0, wall)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
