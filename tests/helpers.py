"""Shared test helpers (not fixtures)."""

from __future__ import annotations

import torch

from ckptstore.manifest import DTYPES

SMALL = dict(chunk_size=64 << 10, pack_size=1 << 20, part_size=5 << 20)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
    bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(ab, bb)


def random_tensor(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    """Random bits of any dtype (exotic ones made by viewing uint8 bytes)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    nbytes = n * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def all_dtypes() -> list[torch.dtype]:
    return [DTYPES[n] for n in sorted(DTYPES)]


def assert_tree_equal(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert bits_equal(a, b), f"tensor {path} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b and type(a) is type(b), f"{path}: {a!r} != {b!r}"


def flat_tensors(sd: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested dict, keyed by dotted path (``{"a": {"b": t}}`` -> ``{"a.b": t}``)."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(flat_tensors(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
    return out
