"""What was loaded against what was saved, bit for bit."""

from __future__ import annotations

import torch

from ckptstore.testing import bits_equal


class VerificationError(AssertionError):
    """A load returned data that differs from what was saved."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def differing_elements(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two same-shaped tensors differ in their bytes."""
    n = a.element_size()
    return int((_bits(a).view(-1, n) != _bits(b).view(-1, n)).any(dim=1).sum())


def verify(expected: dict, got, what: str, exact_keys: bool = True) -> None:
    """Every tensor of ``expected`` in ``got`` with the same dtype, shape and bytes.

    With ``exact_keys`` (the default) ``got`` must hold no other key either.
    Raises :class:`VerificationError` naming ``what`` and the tensor.
    """
    if not isinstance(got, dict):
        raise VerificationError(f"{what}: returned {type(got).__name__}, not a dict")
    missing = [k for k in expected if k not in got]
    extra = [k for k in got if k not in expected] if exact_keys else []
    if missing or extra:
        raise VerificationError(f"{what}: missing keys {missing[:5]}, unexpected keys {extra[:5]}")
    for k, t in expected.items():
        u = got[k]
        if not isinstance(u, torch.Tensor):
            raise VerificationError(f"{what}: {k!r} is {type(u).__name__}, not a tensor")
        if u.dtype != t.dtype or u.shape != t.shape:
            raise VerificationError(f"{what}: {k!r} is {u.dtype}{list(u.shape)}, expected {t.dtype}{list(t.shape)}")
        if not bits_equal(u, t):
            raise VerificationError(f"{what}: {k!r} differs from the saved tensor in "
                                    f"{differing_elements(u, t)} of {t.numel()} elements")


def scrub(sd: dict) -> None:
    """Overwrite a load's destination (NaN, -1 for integers) so that stale data cannot pass."""
    for t in sd.values():
        if t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.fill_(-1)


def iter_tensors(sd):
    for v in sd.values():
        if isinstance(v, dict):
            yield from iter_tensors(v)
        elif isinstance(v, torch.Tensor):
            yield v


def nbytes(sd: dict) -> int:
    """Tensor bytes of a (nested) state dict."""
    return sum(t.numel() * t.element_size() for t in iter_tensors(sd))
