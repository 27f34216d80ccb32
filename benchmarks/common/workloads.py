"""The synthetic fp32 state dict of the save/load benchmarks."""

from __future__ import annotations

import torch

from .measure import GiB, MiB


def layout(size_gib: float) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a flat ``model.state_dict()``-like dict of about ``size_gib`` GiB.

    About 3/8 of the bytes are 4096x4096 matrices (64 MiB each); the rest are
    transformer-like layers at hidden size 1024 (four 1024x1024 attention
    projections, three 1024x4096 / 4096x1024 MLP matrices, norms and biases).
    """
    target = int(size_gib * GiB)
    big_bytes = 4096 * 4096 * 4
    n_big = max(1, round(0.375 * target / big_bytes))
    h, f = 1024, 4096
    layer_bytes = (4 * h * h + 3 * h * f) * 4
    n_layers = max(1, round((target - n_big * big_bytes) / layer_bytes))
    out = [("embed_tokens.weight", (4096, 4096))]
    for i in range(n_layers):
        p = f"layers.{i}."
        out.append((p + "input_norm.weight", (h,)))
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.append((p + f"attn.{name}.weight", (h, h)))
        out.append((p + "attn.o_proj.bias", (h,)))
        out.append((p + "post_norm.weight", (h,)))
        out.append((p + "mlp.gate_proj.weight", (f, h)))
        out.append((p + "mlp.up_proj.weight", (f, h)))
        out.append((p + "mlp.down_proj.weight", (h, f)))
        out.append((p + "mlp.down_proj.bias", (h,)))
    for i in range(n_big - 2):
        out.append((f"adapters.{i}.weight", (4096, 4096)))
    out.append(("final_norm.weight", (4096,)))
    if n_big >= 2:
        out.append(("lm_head.weight", (4096, 4096)))
    return out


def build_state_dict(size_gib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """:func:`layout` filled with ``torch.randn`` fp32 values from one seeded generator, in layout order."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=g, dtype=torch.float32) for name, shape in layout(size_gib)}


def build_small_state_dict(seed: int = 4) -> dict[str, torch.Tensor]:
    """256 MiB of fp32 ``randn`` in 12 tensors: four 4096x2048 (32 MiB) and eight 4096x1024 (16 MiB).

    The small checkpoint, where fixed costs (pools, first requests of fresh
    clients, per-object overheads) weigh as much as the bytes.
    """
    g = torch.Generator().manual_seed(seed)
    sd = {f"block.{i}.weight": torch.randn(4096, 2048, generator=g) for i in range(4)}
    sd.update({f"proj.{i}.weight": torch.randn(4096, 1024, generator=g) for i in range(8)})
    assert sum(t.numel() * 4 for t in sd.values()) == 256 * MiB
    return sd
