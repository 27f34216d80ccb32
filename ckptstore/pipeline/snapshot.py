"""Snapshots for ``save(blocking=False)``: host copies in reused buffers, unchanged chunks found by comparison.

An async save copies the state dict to host memory so that the caller may
go on changing it; the copy is the only part of the save the training loop
waits for. :class:`Snapshots` keeps one host buffer per tensor across saves
and, for each chunk-sized block of a tensor, compares the tensor's bytes
with the buffer's (``memcmp``) before copying: a block whose bytes equal
the previous snapshot's is not copied, and is reported *unchanged*, so the
save can reuse the previous step's chunk reference without hashing it.

Why the comparison is safe where a ``data_ptr`` or version counter is not:
the buffer is this object's own memory, written only here, and it holds
exactly the bytes the previous save hashed (the next snapshot waits for
that save to finish); a block that compares equal byte for byte has the
same BLAKE3 hash, whatever the caller did to the tensor in between (an
in-place edit, a new tensor of the same shape and dtype, an edit undone).
Comparing costs two reads per unchanged byte and one read-and-compare plus
one copy per changed byte; ``memcmp`` stops at the first difference, so a
changed block is mostly copied, not compared.

The comparisons and copies run on the handle's CPU pool in blocks of
``chunk_size`` (``ctypes`` calls release the GIL). CUDA tensors are copied
into pinned buffers with ``non_blocking`` copies, one wait per device, and
are not compared (every chunk of theirs is hashed); other devices go through
:func:`~ckptstore.pipeline.tensors.stage`.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import ctypes.util
from dataclasses import dataclass, field

import torch

from .tensors import stage

#: Tensors smaller than this are compared and copied on the calling thread (a pool hand-off costs more).
INLINE_BYTES = 1 << 20

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=False)
_memcmp = _libc.memcmp
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcmp.restype = ctypes.c_int
_memcpy = _libc.memcpy
_memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcpy.restype = ctypes.c_void_p


def compare_copy(dst: int, src: int, n: int, compare: bool) -> bool:
    """Make ``n`` bytes at address ``dst`` equal those at ``src``; True if they already were (and
    ``compare``). Without ``compare`` (``dst`` holds nothing to keep), a plain copy: False."""
    if compare and _memcmp(dst, src, n) == 0:
        return True
    _memcpy(dst, src, n)
    return False


@dataclass
class Snapshot:
    """One save's host copy: ``tensors`` (the buffers, the caller's shapes and dtypes) and, per key,
    which ``chunk_size`` blocks equal the previous snapshot's (``unchanged[key][j]``), or None for a
    tensor that was not compared (new, reshaped, retyped, on a device)."""

    tensors: dict[str, torch.Tensor]
    chunk_size: int
    unchanged: dict[str, list[bool] | None] = field(default_factory=dict)
    copied_bytes: int = 0
    unchanged_bytes: int = 0


class Snapshots:
    """Host buffers kept across async saves, refreshed block by block; see the module docstring.

    Parameters
    ----------
    chunk_size:
        The repository's chunk size: a block compared is a chunk of the save.
    pool:
        Threads to compare and copy on (the handle's CPU pool).
    """

    def __init__(self, chunk_size: int, pool: cf.Executor):
        self.chunk_size = chunk_size
        self.pool = pool
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, tensors: dict[str, torch.Tensor]) -> Snapshot:
        """Copy ``tensors`` into this object's buffers (the previous snapshot must no longer be read)."""
        staged: dict[str, torch.Tensor] = {}
        snap = Snapshot(staged, self.chunk_size)
        jobs: list[tuple[str, int, int, int, int, bool]] = []  # key, block, dst, src, n, compare
        keep: list[torch.Tensor] = []  # the sources read by address, alive until copied
        waits: set[torch.device] = set()
        try:
            for k, t in tensors.items():
                src = t.detach()
                kind = src.device.type
                if kind not in ("cpu", "cuda"):
                    staged[k] = stage(t)
                    snap.unchanged[k] = None
                    snap.copied_bytes += staged[k].numel() * staged[k].element_size()
                    continue
                buf = self.buffers.get(k)
                fresh = not _fits(buf, src)
                if fresh:
                    buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=kind == "cuda")
                staged[k] = buf
                nbytes = buf.numel() * buf.element_size()
                if kind == "cuda":
                    buf.copy_(src, non_blocking=True)  # conj/neg bits resolve in the copy
                    waits.add(src.device)
                    snap.unchanged[k] = None
                    snap.copied_bytes += nbytes
                    continue
                src = src.resolve_conj().resolve_neg().contiguous()
                keep.append(src)  # a copy made here (conj, neg, strided) must outlive the copies by address
                blocks = -(-nbytes // self.chunk_size) if nbytes else 0
                snap.unchanged[k] = None if fresh else [False] * blocks
                if not nbytes:
                    continue
                d, s = buf.data_ptr(), src.data_ptr()
                for j in range(blocks):
                    off = j * self.chunk_size
                    jobs.append((k, j, d + off, s + off, min(self.chunk_size, nbytes - off), not fresh))
            self._run(jobs, snap)
        except BaseException:
            # Some buffers now hold part of this snapshot: none may be compared against again.
            self.buffers = {}
            raise
        finally:
            for dev in waits:  # also on failure: no copy may still be writing a buffer we keep
                torch.cuda.synchronize(dev)
            del keep
        # Keys the state dict no longer has are dropped; copies made by stage() are not kept.
        self.buffers = {k: v for k, v in staged.items() if tensors[k].device.type in ("cpu", "cuda")}
        return snap

    def _run(self, jobs, snap: Snapshot) -> None:
        big = [j for j in jobs if j[4] >= INLINE_BYTES]
        futures = [self.pool.submit(compare_copy, d, s, n, c) for _, _, d, s, n, c in big]
        results = [(j, compare_copy(j[2], j[3], j[4], j[5])) for j in jobs if j[4] < INLINE_BYTES]
        try:
            results += [(j, f.result()) for j, f in zip(big, futures)]
        finally:
            cf.wait(futures)
        for (k, block, _, _, n, _), same in results:
            if same:
                snap.unchanged[k][block] = True
                snap.unchanged_bytes += n
            else:
                snap.copied_bytes += n


def _fits(buf: torch.Tensor | None, src: torch.Tensor) -> bool:
    """A buffer from the last snapshot that can take ``src``: same shape and dtype, pinned for CUDA."""
    return (buf is not None and buf.shape == src.shape and buf.dtype == src.dtype
            and (src.device.type != "cuda" or buf.is_pinned()))


__all__ = ["Snapshot", "Snapshots", "compare_copy", "INLINE_BYTES"]
