"""Tensor memory as bytes: views for saving, host copies, destinations for loading."""

from __future__ import annotations

import math

import numpy as np
import torch

MiB = 1 << 20


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a tensor's data, copying only when it must."""
    t = host_tensor(t)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


_SAME_SIZE_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(t: torch.Tensor) -> np.ndarray | None:
    """A NumPy view of a CPU tensor's elements as integers of the same size (any strides), for
    strided copies: NumPy copies rows with ``memcpy`` on the calling thread, where ``Tensor.copy_``
    of a strided box ran 100x slower here while other threads were busy (its intra-op threads).
    None for elements of 16 bytes (complex128) or a tensor NumPy cannot view."""
    isz = t.element_size()
    if t.device.type != "cpu" or isz not in _TORCH_INT or t.is_conj() or t.is_neg():
        return None
    try:
        return t.detach().view(_TORCH_INT[isz]).numpy()
    except (RuntimeError, TypeError):
        return None


def frombuffer_as(buf, itemsize: int, shape) -> np.ndarray | None:
    """``buf``'s bytes as a C-order array of ``shape`` of same-size integers (None: 16-byte elements)."""
    dt = _SAME_SIZE_INT.get(itemsize)
    if dt is None:
        return None
    shape = tuple(shape)
    return np.frombuffer(buf, dtype=dt, count=math.prod(shape)).reshape(shape)  # math.prod: no array made


def tile_bytes(t: torch.Tensor, offsets, sizes) -> memoryview:
    """The C-order bytes of the box of a host tensor (from :func:`host_tensor`) at ``offsets`` of
    ``sizes``: a view where the box is contiguous in ``t``, else one strided copy."""
    index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
    if any(n == 0 for n in sizes):
        return memoryview(b"")
    a = int_view(t)
    if a is not None:
        return memoryview(np.ascontiguousarray(a[index]).reshape(-1).view(np.uint8))
    return memoryview(t[index].contiguous().reshape(-1).view(torch.uint8).numpy())


def host_tensor(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with ``t``'s values (conj/neg bits resolved), copying only when it must."""
    t = t.detach()
    if t.device.type != "cpu":
        t = to_host(t)
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


def to_host(t: torch.Tensor, slice_bytes: int = 64 * MiB) -> torch.Tensor:
    """Copy a device tensor to host memory through a pinned buffer in slices."""
    t = t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    if t.numel() == 0:
        return out
    src = t.reshape(-1).view(torch.uint8)
    dst = out.reshape(-1).view(torch.uint8)
    n = src.numel()
    pinned = torch.empty(min(n, slice_bytes), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    for off in range(0, n, slice_bytes):
        m = min(slice_bytes, n - off)
        pinned[:m].copy_(src[off : off + m], non_blocking=False)
        dst[off : off + m].copy_(pinned[:m])
    return out


def stage(t: torch.Tensor) -> torch.Tensor:
    """Host copy of a tensor for async save (the caller may mutate the original)."""
    t = t.detach()
    if t.device.type != "cpu":
        return to_host(t)
    return t.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)


def byte_view(t: torch.Tensor) -> np.ndarray:
    """Writable uint8 NumPy view of a contiguous CPU tensor."""
    if t.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def writable_in_place(t: torch.Tensor) -> bool:
    """Chunks can be copied straight into ``t``'s memory."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def castable(stored: torch.dtype, dest: torch.dtype) -> bool:
    """Whether values stored as ``stored`` may be loaded into a ``dest`` tensor.

    The same dtype always; otherwise floating to floating (fp8, bf16, fp16,
    fp32, fp64 in any direction) and complex to complex, cast as
    ``Tensor.copy_`` casts, like DCP's ``FileSystemReader``. Casts across
    kinds (float to int, int to bool) are refused: they lose values silently.
    """
    if stored == dest:
        return True
    return (stored.is_floating_point and dest.is_floating_point) or (stored.is_complex and dest.is_complex)
