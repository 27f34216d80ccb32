"""How small can AdamW state get when every 4 MiB chunk is coded on its own?

Splits each fp32 element of the AdamW state of ``common.workloads.adam_state``
(all-MiniLM-L6-v2 after five real AdamW steps) into the streams a
per-chunk coder sees: the zero mask, and for non-zero elements the sign,
the 8 exponent bits, the top 7 mantissa bits and the low 16 mantissa bits.
Prints each stream's order-0 entropy (measured per chunk, in bits per
element) and the compression ratios they bound:

* ``order-0 bound``: the zero mask as a zstd-compressed bitmap, every other
  stream at its per-chunk order-0 entropy (what a per-chunk entropy coder of
  these streams can reach without modelling neighbours);
* ``free exponent bound``: the same, with the zero mask and the exponents
  costing nothing at all (no per-chunk coder can beat it).

Compared with ``codec.encode``'s ratio on the same chunks. Run from the
repository root::

    python -m benchmarks.experiments.adam_bounds
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import zstandard

from ckptstore.format import codec

from ..common.workloads import adam_state, model_weights
from ..micro.codec_real import CHUNK
from ..common.report import format_table


def _h(x: np.ndarray, n: int) -> float:
    """Order-0 entropy of ``x`` (values in [0, n)) in bits, times its length."""
    if len(x) == 0:
        return 0.0
    c = np.bincount(x, minlength=n).astype(np.float64)
    p = c[c > 0] / len(x)
    return float(-(p * np.log2(p)).sum() * len(x))


def analyse(tensors: dict[str, torch.Tensor]) -> dict:
    bits = dict.fromkeys(("mask", "sign", "exponent", "mantissa_hi7", "mantissa_lo16"), 0.0)
    elems = nonzero = stored = 0
    for t in tensors.values():
        u = t.contiguous().view(-1).numpy().view(np.uint32)
        for off in range(0, len(u), CHUNK // 4):
            c = u[off : off + CHUNK // 4]
            elems += len(c)
            nz_mask = c != 0  # +0.0 only: -0.0 is a non-zero bit pattern
            nz = c[nz_mask]
            nonzero += len(nz)
            # Zeros come in runs (whole embedding rows): the mask is costed
            # as its zstd-compressed bitmap, not at order 0.
            bits["mask"] += 8.0 * len(zstandard.ZstdCompressor(level=3).compress(np.packbits(nz_mask).tobytes()))
            bits["sign"] += _h((nz >> 31).astype(np.int64), 2)
            bits["exponent"] += _h(((nz >> 23) & 0xFF).astype(np.int64), 256)
            bits["mantissa_hi7"] += _h(((nz >> 16) & 0x7F).astype(np.int64), 128)
            bits["mantissa_lo16"] += 16.0 * len(nz)  # measured: 8.000 bits per byte
            _, s = codec.encode(c.tobytes(), "zstd", codec.DEFAULT_LEVEL, "float32")
            stored += len(s)
    raw_bits = 32.0 * elems
    total = sum(bits.values())
    free = total - bits["mask"] - bits["exponent"]
    return {
        "elements": elems,
        "zero_fraction": 1 - nonzero / elems,
        "bits_per_element": {k: v / elems for k, v in bits.items()},
        "exponent_bits_per_nonzero": bits["exponent"] / max(nonzero, 1),
        "codec_ratio": 4 * elems / stored,
        "order0_bound": raw_bits / total,
        "free_exponent_bound": raw_bits / free,
    }


def main() -> int:
    torch.set_num_threads(1)
    adam = adam_state(model_weights())
    groups = {
        "exp_avg": {k: v for k, v in adam.items() if k.endswith(".exp_avg")},
        "exp_avg_sq": {k: v for k, v in adam.items() if k.endswith(".exp_avg_sq")},
        "both": adam,
    }
    print("command: python -m benchmarks.experiments.adam_bounds")
    lines = []
    for name, ts in groups.items():
        r = analyse(ts)
        lines.append([name, f"{r['zero_fraction']:.3f}", f"{r['exponent_bits_per_nonzero']:.2f}", f"{r['codec_ratio']:.3f}",
                      f"{r['order0_bound']:.3f}", f"{r['free_exponent_bound']:.3f}"])
    print(format_table(["state", "zeros", "exp bits/nz", "codec", "order-0 bound", "free exponent bound"], lines,
                       rule=False))
    print("order-0 bound: zero mask as a zstd bitmap; sign, exponent and top-7 mantissa bits of non-zero "
          "elements at their per-chunk order-0 entropy; low 16 mantissa bits raw. "
          "free exponent bound: mask and exponent cost nothing.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
