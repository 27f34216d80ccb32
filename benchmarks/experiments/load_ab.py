"""Loads only, side by side: ckptstore variants against s3torchconnector on one pinned server.

Run from the repository root::

    python -m benchmarks.experiments.load_ab [--workload a] [--rounds 5] [--variant NAME:opt=val,...]

Starts SeaweedFS pinned to CPU 1 (this process on CPU 0 while it talks to
the server, as in ``benchmarks.run``), saves the workload once with
ckptstore and once with s3torchconnector's DCP writer, then loads each
``--rounds`` times, interleaved, into the same destination tensors, and
prints wall seconds, client CPU seconds and server CPU seconds per round
and the medians, and each variant's median over s3torchconnector's.

``--variant`` adds a ckptstore load with other repository options (for
example ``--variant io8:io_workers=8``); the default variant uses the
defaults. Every load is verified bit-exact.

This is the quick loop for the load rows of ``benchmarks.run`` (which
also saves each round); its figures are the same measurement.
"""

from __future__ import annotations

import argparse
import statistics

import ckptstore

from ..common.measure import Timer
from ..common.pinning import Pinning
from ..common.report import command_line, env_line, git_commit
from ..common.servers import start_server
from ..common.systems import BUCKET, CkptSystem, S3tcSystem, optional_peers
from ..common.verify import scrub, verify
from ..common.workloads import build


def _parse_variant(text: str) -> tuple[str, dict]:
    name, _, opts = text.partition(":")
    out: dict = {}
    for kv in filter(None, opts.split(",")):
        k, _, v = kv.partition("=")
        out[k] = int(v) if v.isdigit() else v
    return name, out


class Variant(CkptSystem):
    def __init__(self, server, name: str, options: dict):
        super().__init__(server=server)
        self.vname = name
        self.load_options = options

    def load(self, wl, step, like):
        with ckptstore.open(self.url(wl), storage_options=self.so, **self.options, **self.load_options) as repo:
            repo.load(step, into=like)
        return like


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.experiments.load_ab", description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="a", choices=("a", "e", "b"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:opt=val,...")
    ap.add_argument("--no-peer", action="store_true", help="skip s3torchconnector")
    a = ap.parse_args(argv)
    print(f"command: {command_line('benchmarks.experiments.load_ab', argv)}")
    print(env_line() + f", commit {git_commit()}")
    sd = build(a.workload)
    like = {k: v.clone() for k, v in sd.items()} if a.workload != "b" else None
    if like is None:
        import copy

        like = copy.deepcopy(sd)
    pinning = Pinning()
    print(pinning.describe())
    with start_server("seaweedfs", BUCKET) as srv:
        print(f"seaweedfs: {pinning.server(srv.pid)}")
        systems = [Variant(srv, "ckptstore", {})] + [Variant(srv, *_parse_variant(v)) for v in a.variant]
        peers = [] if a.no_peer else [c for c in optional_peers()[0] if c is S3tcSystem]
        peer = peers[0](srv) if peers else None
        with pinning.client():
            systems[0].save(sd, a.workload, 1)
            systems[0].end_saves()
            if peer is not None:
                peer.save(sd, a.workload, 1)
        rows: dict[str, list] = {}
        order = systems + ([peer] if peer is not None else [])
        for rnd in range(a.rounds):
            for s in order:
                name = getattr(s, "vname", "s3torchconnector")
                scrub(like)  # outside the timing, as in benchmarks.run
                with pinning.client():
                    with Timer(srv.pid) as tm:
                        got = s.load(a.workload, 1, like)
                verify(sd, got, f"{name} load")
                rows.setdefault(name, []).append(tm)
                print(f"  round {rnd} {name:<18} {tm.seconds:6.3f} s  cpu {tm.cpu:5.2f}  srv {tm.server_cpu:5.2f}",
                      flush=True)
    med = {n: statistics.median(t.seconds for t in ts) for n, ts in rows.items()}
    print(f"\nworkload {a.workload}, medians of {a.rounds} rounds:")
    for n, ts in rows.items():
        cpu = statistics.median(t.cpu for t in ts)
        srvc = statistics.median(t.server_cpu for t in ts)
        rel = f"  {med[n] / med['s3torchconnector']:.3f}x s3torchconnector" if "s3torchconnector" in med else ""
        print(f"  {n:<18} {med[n]:6.3f} s  cpu {cpu:5.2f}  srv {srvc:5.2f}{rel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
