"""gpu: save from and load into CUDA tensors, next to DCP on the same host (issue 16, item 5).

A state dict of ``--gib`` of fp32 (tensors of 256 MiB, seeded ``randn``
made on the device) is saved and loaded by, interleaved over ``--rounds``:

``dcp-fs``
    ``dcp.save`` with ``FileSystemWriter`` (fsyncs its files), then
    ``dcp.load`` with ``FileSystemReader`` into a state dict of device
    tensors.
``dcp-fs-async``
    ``dcp.async_save`` with ``FileSystemWriter``: the time until it
    returns (the blocking part), then until its future resolves.
``ckptstore-local``
    ``repo.save(sd, step)`` into a local repository, then
    ``repo.load(step, into=like)`` into device tensors.
``ckptstore-local-async``
    ``ASYNC_SAVES`` saves with ``blocking=False`` through one handle, each
    waited for before the next; one element changes between saves. The
    first stages into fresh pinned host buffers, the later ones reuse
    them. Reported: the time until ``save`` returns, and until the future
    resolves.

Device timings end with ``torch.cuda.synchronize()``. Every load is checked
bit for bit against the source tensors (after its timing). Reported: the
medians, and the ratios the issue names: ckptstore's save and load over
DCP's, and the blocking part of an async save over a blocking save (target
at most 0.1).

    python -m benchmarks.micro.gpu [--gib 4] [--device cuda:0] [--rounds 2] [--dir DIR] [--json PATH]

Without a CUDA device, ``--device cuda...`` prints ``skipped: no CUDA
device`` and exits 0. ``--device cpu`` runs the same steps on CPU tensors
(how the script itself is checked on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import ckptstore

from ..common.report import git_commit, write_results
from ..common.verify import scrub, verify
from ..common.systems import quiet_dcp

MiB = 1 << 20
GiB = 1 << 30
TENSOR_BYTES = 256 * MiB
ASYNC_SAVES = 3


def make_state(gib: float, device: torch.device) -> dict[str, torch.Tensor]:
    n = max(1, round(gib * GiB / TENSOR_BYTES))
    per = min(TENSOR_BYTES, int(gib * GiB)) // 4
    g = torch.Generator(device=device).manual_seed(16)
    return {f"layer{i}.weight": torch.randn(per, generator=g, device=device) for i in range(n)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def dcp_round(sd, like, tmp, device, out: dict) -> None:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    dcp = quiet_dcp()
    path = os.path.join(tmp, "dcp")
    try:
        out.setdefault("dcp-fs save", []).append(timed(lambda: dcp.save(sd, storage_writer=FileSystemWriter(path)),
                                                       device))
        scrub(like)
        out.setdefault("dcp-fs load", []).append(
            timed(lambda: dcp.load(like, storage_reader=FileSystemReader(path)), device))
        verify(sd, like, "dcp-fs load")
    finally:
        shutil.rmtree(path, ignore_errors=True)
    path = os.path.join(tmp, "dcp-async")
    try:
        sync(device)
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, storage_writer=FileSystemWriter(path))
        blocked = time.perf_counter() - t0
        fut.result()
        out.setdefault("dcp-fs-async returns", []).append(blocked)
        out.setdefault("dcp-fs-async total", []).append(time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - a peer's failure is a result, not a crash of the run
        out.setdefault("errors", []).append(f"dcp.async_save: {type(e).__name__}: {e}")
    finally:
        shutil.rmtree(path, ignore_errors=True)


def ckpt_round(sd, like, tmp, device, out: dict) -> None:
    url = os.path.join(tmp, "ckpt")
    try:
        with ckptstore.open(url) as repo:
            out.setdefault("ckptstore-local save", []).append(timed(lambda: repo.save(sd, step=1), device))
        scrub(like)
        with ckptstore.open(url) as repo:
            out.setdefault("ckptstore-local load", []).append(timed(lambda: repo.load(1, into=like), device))
        verify(sd, like, "ckptstore-local load")
    finally:
        shutil.rmtree(url, ignore_errors=True)
    url = os.path.join(tmp, "ckpt-async")
    first = next(iter(sd.values()))
    keep = first.view(-1)[0].item()
    try:
        with ckptstore.open(url) as repo:
            for step in range(1, ASYNC_SAVES + 1):
                first.view(-1)[0] = keep + step
                sync(device)
                t0 = time.perf_counter()
                fut = repo.save(sd, step=step, blocking=False)
                blocked = time.perf_counter() - t0
                first.view(-1)[0] = keep  # the caller's next step: the save has its own copy
                fut.result()
                total = time.perf_counter() - t0
                which = "first" if step == 1 else "later"
                out.setdefault(f"ckptstore-local-async returns ({which})", []).append(blocked)
                out.setdefault(f"ckptstore-local-async total ({which})", []).append(total)
            got = repo.load(ASYNC_SAVES)
        first.view(-1)[0] = keep + ASYNC_SAVES
        try:
            verify(sd, {k: v.to(device) for k, v in got.items()}, "ckptstore-local-async load")
        finally:
            first.view(-1)[0] = keep
    finally:
        first.view(-1)[0] = keep
        shutil.rmtree(url, ignore_errors=True)


def ratios(med: dict) -> dict:
    def r(a, b):
        return round(med[a] / med[b], 3) if a in med and b in med and med[b] > 0 else None

    return {
        "ckptstore save / dcp-fs save": r("ckptstore-local save", "dcp-fs save"),
        "ckptstore load / dcp-fs load": r("ckptstore-local load", "dcp-fs load"),
        "ckptstore async returns (later) / ckptstore save (target <= 0.1)":
            r("ckptstore-local-async returns (later)", "ckptstore-local save"),
        "ckptstore async returns (first) / ckptstore save":
            r("ckptstore-local-async returns (first)", "ckptstore-local save"),
        "dcp async returns / dcp save": r("dcp-fs-async returns", "dcp-fs save"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device (run with --device cpu to check the script itself)")
        return 0
    if device.type not in ("cpu", "cuda"):
        ap.error(f"--device {args.device}: only cpu and cuda are measured")
    tmp = tempfile.mkdtemp(prefix="ckpt-gpu-", dir=args.dir)
    try:
        sd = make_state(args.gib, device)
        like = {k: torch.empty_like(v) for k, v in sd.items()}
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"# benchmarks.micro.gpu: {len(sd)} tensors, {nbytes / GiB:.2f} GiB fp32 on {args.device} ({name}), "
              f"{os.cpu_count()} CPUs, {args.rounds} rounds, into {tmp} (commit {git_commit()})", flush=True)
        out: dict[str, list] = {}
        for rnd in range(args.rounds):
            for fn in ((dcp_round, ckpt_round) if rnd % 2 == 0 else (ckpt_round, dcp_round)):
                fn(sd, like, tmp, device, out)
            print(f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in out.items() if k != "errors"),
                  flush=True)
        med = {k: statistics.median(v) for k, v in out.items() if k != "errors"}
        print()
        for k, v in med.items():
            print(f"{k:45s} {v:8.3f} s  {nbytes / GiB / v:6.2f} GiB/s   rounds: {', '.join(f'{x:.3f}' for x in out[k])}")
        print()
        rat = ratios(med)
        for k, v in rat.items():
            print(f"{k:68s} {v}")
        for e in out.get("errors", []):
            print("error:", e)
        if args.json:
            write_results(args.json, "python -m benchmarks.micro.gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
                          {"device": args.device, "device_name": name, "bytes": nbytes, "rounds": out,
                           "medians": med, "ratios": rat})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
