"""GC's deletions on a real S3 server: one DeleteObject per key (before) against ``delete_many``.

Run from the repository root::

    python -m benchmarks.experiments.gc_deletes [--server seaweedfs|moto] [--objects 8000] [--rounds 2]

Starts the server (pinned to CPU 1, this process on CPU 0, as in
``benchmarks.run``), writes ``--objects`` 1 KiB objects under a prefix
(16 PUTs in flight), then deletes them, rounds interleaved:

- ``single``: ``S3Store.delete`` per key, one after the other: what
  ``GCPlan.execute`` did before ``delete_many``;
- ``delete_many``: ``S3Store.delete_many`` called with 1000 keys at a
  time, one call after another: one ``DeleteObjects`` request each (GC's
  batches before they were 4000 keys);
- ``delete_many x4000``: called with 4000 keys at a time (GC's batch):
  four ``DeleteObjects`` requests of 1000 keys in flight.

Prints seconds per 1000 keys for each and what that makes of the 975,000
packs and 990,000 segments the ``benchmarks.distributed.scale --gc-steps 1000`` plan
deletes. Every delete is checked by listing the prefix afterwards.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import time

from ckptstore.storage import open_store

from ..common.measure import median
from ..common.pinning import Pinning
from ..common.report import env_line, git_commit
from ..common.servers import start_server

BUCKET = "ckptgcdel"
SCALE_DELETES = 975_000 + 990_000


def fill(store, prefix: str, n: int) -> list[str]:
    keys = [f"{prefix}/{i:07d}" for i in range(n)]
    body = b"x" * 1024
    with cf.ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda k: store.put(k, body), keys))
    return keys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", default="seaweedfs", choices=("seaweedfs", "moto"))
    ap.add_argument("--objects", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    print(env_line())
    print(f"commit {git_commit()}; {args.objects} objects of 1 KiB per round, {args.rounds} rounds")
    pinning = Pinning(True)
    times: dict[str, list[float]] = {"single": [], "delete_many": [], "delete_many x4000": []}
    with start_server(args.server, BUCKET) as srv:
        print(f"{srv.info['server']}: {pinning.server(srv.pid)}")
        store = open_store(f"s3://{BUCKET}/gcdel", srv.storage_options())
        try:
            for r in range(args.rounds):
                for how in times:
                    prefix = f"{how.replace(' ', '-')}-{r}"
                    keys = fill(store, prefix, args.objects)
                    with pinning.client():
                        t0 = time.perf_counter()
                        if how == "single":
                            for k in keys:
                                store.delete(k)
                        else:
                            step = 4000 if how.endswith("x4000") else 1000
                            for i in range(0, len(keys), step):
                                store.delete_many(keys[i : i + step])
                        took = time.perf_counter() - t0
                    left = sum(1 for _ in store.list(prefix + "/"))
                    if left:
                        raise AssertionError(f"{how}: {left} of {len(keys)} objects still listed after deleting")
                    times[how].append(took)
                    print(f"  round {r + 1} {how}: {took:.2f} s for {len(keys)} keys "
                          f"({took / len(keys) * 1000:.3f} s per 1000)")
        finally:
            store.close()
    print()
    base = median(times["single"]) / args.objects
    for how, ts in times.items():
        per = median(ts) / args.objects
        print(f"{how:<18} {per * 1000:8.3f} s per 1000 keys (median); {per * SCALE_DELETES / 60:8.1f} min for the "
              f"{SCALE_DELETES:,} deletions of the 1000-step GC plan; {base / per:5.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
