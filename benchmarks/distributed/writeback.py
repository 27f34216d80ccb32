"""Write-back saves against direct saves, a local-directory save and raw PUTs, side by side.

Run from the repository root::

    python -m benchmarks.distributed.writeback [--size-gib 1.0] [--rounds 3] [--no-pin] [--json OUT.json]

One process builds workload a (``--size-gib`` of fp32 ``randn``, as
``benchmarks.run``), starts SeaweedFS (pinned to the upper half of the CPUs,
the client to the lower half while it talks to it, as ``benchmarks.run``
does) and, in interleaved rounds (each save into a fresh repository, so
nothing is deduplicated), times:

``local``        ``repo.save`` to a local-directory repository (``file://``), the fsynced baseline,
                 on the same CPUs as the client of the other rows
``direct``       ``repo.save`` to SeaweedFS (no tier)
``write-back``   ``repo.save`` to SeaweedFS with ``cache_dir=`` (a local directory) and
                 ``write_back=True``: the time the save blocks, then the time until
                 ``repo.flush()`` returns (the packs uploaded and the step committed)
``raw-put``      boto3 PUTs of the write-back step's stored bytes as 16 MiB objects
                 (``common.systems.raw_put``, 8 threads): the upload yardstick

Issue 26's targets: the write-back save blocks at most 1.1x the local save;
its commit follows within 1.1x the raw PUT time of the stored bytes. Every
step is loaded back from a fresh handle without the tier and compared bit
for bit. Medians of ``--rounds``; ``--json`` writes every round.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time

from ..common.measure import Timer, loadavg, median
from ..common.pinning import Pinning
from ..common.report import env_info, format_table, human, write_results
from ..common.servers import seaweedfs
from ..common.systems import raw_put
from ..common.verify import VerificationError, verify
from ..common.workloads import data_a

BUCKET = "ckptbench"


def _open(url: str, server=None, **kw):
    import ckptstore

    so = server.storage_options() if server is not None else None
    return ckptstore.open(url, storage_options=so, **kw)


def _warm(repo) -> None:
    """A training job's handle is open across saves: its client is connected before a save (untimed)."""
    repo.latest()


def _settle() -> None:
    """Write out every dirty page first (untimed): the server's volume files share this disk, and a
    save's fsync must not pay for the previous operation's write-back."""
    os.sync()


def one_round(sd: dict, srv, pinning: Pinning, tmp: str, r: int) -> dict:
    out: dict = {}
    # Every row runs on the client's CPUs (the lower half; the server has
    # the rest): the local save is the baseline of the write-back save's
    # blocking time, which does the same local work.
    with pinning.client():
        local = os.path.join(tmp, f"local-{r}")
        with _open(local) as repo:
            _settle()
            with Timer() as tm:
                info = repo.save(sd, step=1)
            out["local"] = tm.seconds
            out["stored_bytes"] = info.uploaded_bytes
        shutil.rmtree(local, ignore_errors=True)
        # direct to SeaweedFS
        url = f"s3://{BUCKET}/direct-{r}"
        with _open(url, srv) as repo:
            _warm(repo)
            _settle()
            with Timer(srv.pid) as tm:
                repo.save(sd, step=1)
        out["direct"] = tm.seconds
        # write-back to SeaweedFS through a tier on local disk
        url = f"s3://{BUCKET}/wb-{r}"
        cache = os.path.join(tmp, f"tier-{r}")
        repo = _open(url, srv, cache_dir=cache, write_back=True)
        try:
            _warm(repo)
            _settle()
            with Timer(srv.pid) as tm:
                info = repo.save(sd, step=1)
                blocked = time.perf_counter() - tm.t0
                repo.flush()
            out["wb_block"] = blocked
            out["wb_commit_after"] = tm.seconds - blocked
            out["wb_stored"] = info.uploaded_bytes
        finally:
            repo.close()
        shutil.rmtree(cache, ignore_errors=True)
        _settle()
        tm = raw_put(srv, out["wb_stored"], 8)
        out["raw_put"] = tm.seconds
    # every step reads back bit for bit, from the store alone
    with _open(f"s3://{BUCKET}/wb-{r}", srv) as repo:
        verify(sd, repo.load(1), "write-back step")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    command = "python -m benchmarks.distributed.writeback " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"load average at start: {loadavg()}", flush=True)
    pinning = Pinning(enabled=not args.no_pin)
    print(pinning.describe(), flush=True)
    sd = data_a(args.size_gib)
    logical = sum(t.numel() * t.element_size() for t in sd.values())
    rounds = []
    tmp = tempfile.mkdtemp(prefix="ckpt-wb-bench-")
    try:
        with seaweedfs(BUCKET) as srv:
            print(f"server: {srv.info.get('server')}, {pinning.server(srv.pid)}", flush=True)
            for r in range(args.rounds):
                res = one_round(sd, srv, pinning, tmp, r)
                rounds.append(res)
                print(f"round {r}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in res.items()), flush=True)
    except VerificationError as e:
        print(f"VERIFICATION FAILED: {e}")
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: median([r[k] for r in rounds]) for k in rounds[0]}
    rows = [
        ["local-directory save (file://)", f"{med['local']:.2f}", ""],
        ["direct save to SeaweedFS", f"{med['direct']:.2f}", ""],
        ["write-back save: blocks", f"{med['wb_block']:.2f}", f"{med['wb_block'] / med['local']:.3f} of the local save (target <= 1.1)"],
        ["write-back: commit done after the save returned", f"{med['wb_commit_after']:.2f}",
         f"{med['wb_commit_after'] / med['raw_put']:.3f} of raw PUTs (target <= 1.1)"],
        [f"raw PUTs of the stored {human(med['wb_stored'])}", f"{med['raw_put']:.2f}", ""],
    ]
    print(f"\nworkload a: {human(logical)} fp32 randn; medians of {args.rounds} interleaved rounds")
    print(format_table(["operation", "seconds", "ratio"], rows, left=1, rule=False))
    for name, ratio, target in (("block", med["wb_block"] / med["local"], 1.1),
                                ("commit", med["wb_commit_after"] / med["raw_put"], 1.1)):
        if ratio > target:
            print(f"MISSED: write-back {name} ratio {ratio:.3f} > {target}")
    print(f"command: {command}")
    print(f"load average at end: {loadavg()}; env: {env_info()}")
    if args.json:
        write_results(args.json, command, {"rounds": rounds, "median": med, "logical_bytes": logical})
    return 0


if __name__ == "__main__":
    sys.exit(main())
