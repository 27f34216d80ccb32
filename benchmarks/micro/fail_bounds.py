"""How long a load takes to fail when the S3 server dies or stalls (default settings).

Run from the repository root::

    python -m benchmarks.micro.fail_bounds [--mib 24]

SeaweedFS (``ckptstore.testing.seaweedfs``) holds one saved step; a
:class:`~ckptstore.testing.faultproxy.FaultProxy` sits in front. Two cases,
each with ckptstore's default ``RetryPolicy`` and S3 settings (5 s connect /
15 s read timeouts, 3 botocore tries, ``RetryStore`` 8 attempts / 120 s):

* ``dead``: the server is SIGKILLed a few MiB into the load (connections
  are then refused or reset);
* ``stalled``: every connection stops answering after 0 bytes (the server
  takes the request and never replies), from the first request on.

Prints the seconds from the fault to the error, and the error. The stated
bound is ``max_total + 3 * (connect + read) + 3`` = 183 s; ``dead`` is far
below it, ``stalled`` near ``max_total`` plus part of one attempt.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

import ckptstore
from ckptstore.errors import StorageError
from ckptstore.testing.faultproxy import Fault, FaultProxy
from ckptstore.testing.seaweedfs import SeaweedFS

from ..common.measure import Timer

BUCKET = "failbounds"


def _load(url, so) -> tuple[float, str]:
    """Seconds until ``load(1)`` returned or raised, and what it did."""
    repo = ckptstore.open(url, storage_options=so)
    try:
        with Timer() as tm:
            try:
                repo.load(1)
                what = "loaded (no fault hit)"
            except StorageError as e:
                what = f"{type(e).__name__}: {str(e)[:240]}"
        return tm.seconds, what
    finally:
        repo.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=24, help="size of the saved step")
    args = ap.parse_args()
    with SeaweedFS() as weed:
        weed.create_bucket(BUCKET)
        url = f"s3://{BUCKET}/r"
        ckptstore.open(url, storage_options=weed.storage_options()).save(
            {"w": torch.randn(args.mib << 18)}, step=1)
        # stalled: every connection is held from its first byte on
        with FaultProxy(("127.0.0.1", weed.port), rate=1.0, stall_seconds=900) as p:
            p.plan = lambda i: Fault("stall", "down", 0, 900.0)
            took, err = _load(url, weed.storage_options(p.endpoint))
        print(f"stalled: failed after {took:.1f} s: {err}", flush=True)
        # dead: SIGKILL after 4 MiB of the load went through (responses slowed a little)
        with FaultProxy(("127.0.0.1", weed.port), rate=1.0, kinds=("latency",), directions=("down",),
                        max_after=1, latency_seconds=0.001) as p:
            t_kill = [0.0]

            def killer():
                while p.bytes_down < (4 << 20):
                    time.sleep(0.002)
                t_kill[0] = time.perf_counter()
                weed.kill()
                p.drop_all()

            threading.Thread(target=killer, daemon=True).start()
            t0 = time.perf_counter()
            took, err = _load(url, weed.storage_options(p.endpoint))
            after = took - (t_kill[0] - t0) if t_kill[0] else float("nan")
        print(f"dead: failed {after:.1f} s after the kill: {err}", flush=True)


if __name__ == "__main__":
    main()
