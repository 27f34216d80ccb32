"""Bit-exact comparison of tensors, for tests and benchmarks.

torch is not imported here: a caller holding tensors has it loaded already,
and importing :mod:`ckptstore.testing` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (exact for NaN payloads and -0.0 too)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
    bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(ab, bb)
