"""load_module: host memory and time, next to torch.load(mmap=True) + load_state_dict(assign=True).

A stack of ``nn.Linear(hidden, hidden)`` layers (about ``--size-gib`` of fp32
weights, values from a seeded ``torch.randn`` per layer) is saved once as
step 1 of a local ckptstore repository and as a ``torch.save`` file. Then,
each in a fresh process (``--phase``), the same model is built on ``meta``
and filled, while a thread samples the process's RSS every 5 ms:

``ckpt``
    ``ckptstore.load_module(model, url, device_map={"": DEVICE})``: decodes
    straight into the new CPU parameters (``--device cpu``).
``ckpt-cast``
    the same into a bf16 model (fp32 stored): every tensor goes through the
    staging buffers, the path CUDA destinations take.
``torch-mmap``
    ``torch.load(path, mmap=True, weights_only=True)`` then
    ``model.load_state_dict(sd, assign=True)``; pages are read when first
    touched, so the timing includes touching every parameter (a sum),
    which the other phases do too.

Reported per phase: wall seconds (load, then load + touch), peak RSS above
the level before the load minus the module's own CPU-resident bytes, next
to the repository's read budget (half of ``max_inflight_bytes``); for
ckptstore also the read budget's high-water mark. Every phase checks its
parameters bit for bit against regenerated weights (after the timing).

    nice -n 10 python -m benchmarks.micro.load_module [--size-gib 2] [--budget-mib 512]
        [--device cpu] [--dir DIR] [--json docs/data/load_module_2gib.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

import ckptstore

from ..common.measure import RssSampler as Sampler
from ..common.measure import rss_now as rss
from ..common.report import write_results

MiB = 1 << 20
GiB = 1 << 30


class Stack(nn.Module):
    def __init__(self, layers: int, hidden: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))


def layer_weights(i: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(hidden, hidden, generator=g), torch.randn(hidden, generator=g)


def shape_of(size_gib: float, hidden: int) -> int:
    return max(1, round(size_gib * GiB / (hidden * hidden * 4)))


def prepare(args) -> dict:
    layers = shape_of(args.size_gib, args.hidden)
    url = os.path.join(args.dir, "repo")
    pt = os.path.join(args.dir, "weights.pt")
    with torch.device("meta"):
        model = Stack(layers, args.hidden)
    sd = {}
    for i in range(layers):
        w, b = layer_weights(i, args.hidden)
        sd[f"layers.{i}.weight"], sd[f"layers.{i}.bias"] = w, b
    assert set(sd) == set(model.state_dict())
    t0 = time.perf_counter()
    with ckptstore.open(url, max_inflight_bytes=args.budget_mib * MiB) as repo:
        info = repo.save(sd, step=1)
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    torch.save(sd, pt)
    torch_save_s = time.perf_counter() - t0
    return {"layers": layers, "logical_bytes": info.logical_bytes, "stored_bytes": info.uploaded_bytes,
            "ckpt_save_seconds": save_s, "torch_save_seconds": torch_save_s}


def touch(model: nn.Module) -> float:
    s = 0.0
    with torch.no_grad():
        for p in model.parameters():
            s += float(p.float().sum()) if p.dtype != torch.float32 else float(p.sum())
    return s


def check(model: nn.Module, layers: int, hidden: int, dtype: torch.dtype) -> bool:
    for i in range(layers):
        w, b = layer_weights(i, hidden)
        lin = model.layers[i]
        if not (torch.equal(lin.weight.cpu(), w.to(dtype)) and torch.equal(lin.bias.cpu(), b.to(dtype))):
            return False
    return True


def measure(args, layers: int) -> dict:
    dtype = torch.bfloat16 if args.phase == "ckpt-cast" else torch.float32
    with torch.device("meta"):
        model = Stack(layers, args.hidden).to(dtype)
    module_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cpu_resident = module_bytes if args.device == "cpu" else 0
    out = {"phase": args.phase, "module_bytes": module_bytes, "module_cpu_bytes": cpu_resident,
           "module_dtype": str(dtype).removeprefix("torch.")}
    url = os.path.join(args.dir, "repo")
    base = rss()
    t0 = time.perf_counter()
    with Sampler() as s:
        if args.phase == "torch-mmap":
            sd = torch.load(os.path.join(args.dir, "weights.pt"), mmap=True, weights_only=True)
            model.load_state_dict(sd, assign=True)
            load_s = time.perf_counter() - t0
            touch(model)
        else:
            repo = ckptstore.open(url, max_inflight_bytes=args.budget_mib * MiB)
            budget = repo.runtime.read_budget()
            ckptstore.load_module(model, repo, device_map={"": args.device})
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            load_s = time.perf_counter() - t0
            touch(model)
            out["read_budget_bytes"] = budget.limit
            out["read_budget_peak_bytes"] = budget.peak
    total_s = time.perf_counter() - t0
    if args.phase != "torch-mmap":
        repo.close()
    out.update(load_seconds=load_s, load_touch_seconds=total_s, peak_rss_above_base=s.peak - base,
               peak_rss_over_module=s.peak - base - cpu_resident, equal=check(model, layers, args.hidden, dtype))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--budget-mib", type=int, default=512, help="max_inflight_bytes; the read budget is half")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", help="working directory (default: a temporary one, removed after)")
    ap.add_argument("--json")
    ap.add_argument("--phase", choices=["ckpt", "ckpt-cast", "torch-mmap"], help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:  # a child process: one measurement, JSON on stdout's last line
        print(json.dumps(measure(args, args.layers)))
        return 0
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "benchmarks.micro.load_module",
                                                *(argv if argv is not None else sys.argv[1:])])
    print("command:", command)
    tmp = None
    if args.dir is None:
        tmp = args.dir = tempfile.mkdtemp(prefix="ckpt-loadmod-")
    try:
        prep = prepare(args)
        print(f"model: {prep['layers']} x nn.Linear({args.hidden}, {args.hidden}), "
              f"{prep['logical_bytes'] / GiB:.2f} GiB fp32; stored {prep['stored_bytes'] / GiB:.2f} GiB; "
              f"saved in {prep['ckpt_save_seconds']:.1f} s (torch.save {prep['torch_save_seconds']:.1f} s)")
        budget = max(args.budget_mib * MiB // 2, 8 * MiB)
        print(f"read budget: {budget / MiB:.0f} MiB (max_inflight_bytes {args.budget_mib} MiB); device {args.device}")
        rows = []
        for phase in ("ckpt", "ckpt-cast", "torch-mmap"):
            cmd = [sys.executable, "-m", "benchmarks.micro.load_module", "--phase", phase, "--layers", str(prep["layers"]),
                   "--hidden", str(args.hidden), "--budget-mib", str(args.budget_mib), "--device", args.device,
                   "--dir", args.dir]
            res = subprocess.run(cmd, check=True, capture_output=True, text=True)
            row = json.loads(res.stdout.strip().splitlines()[-1])
            rows.append(row)
            extra = row["peak_rss_over_module"]
            line = (f"{phase:11s} load {row['load_seconds']:6.2f} s, +touch {row['load_touch_seconds']:6.2f} s; "
                    f"module {row['module_dtype']} {row['module_cpu_bytes'] / GiB:.2f} GiB on CPU; "
                    f"peak RSS over it {extra / MiB:7.1f} MiB")
            if "read_budget_bytes" in row:
                ok = extra <= 1.1 * row["read_budget_bytes"]
                line += (f" = {extra / row['read_budget_bytes']:.2f} x read budget "
                         f"({'within' if ok else 'OVER'} budget + 10%); budget high-water "
                         f"{row['read_budget_peak_bytes'] / MiB:.0f} MiB")
            line += f"; bit-exact: {row['equal']}"
            print(line)
        if args.json:
            write_results(args.json, command, {"prepare": prep, "read_budget_bytes": budget, "phases": rows})
        return 0 if all(r["equal"] for r in rows) else 1
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
