"""The header of a plain ``.safetensors`` file, parsed strictly and bounded (pure, no I/O).

A safetensors file is an 8-byte little-endian header length ``N``, ``N``
bytes of UTF-8 JSON (``{name: {"dtype", "shape", "data_offsets"}, ...}``
plus an optional ``"__metadata__"`` of strings, padded with spaces), then
the tensors' bytes, row-major and little-endian, at ``data_offsets``
relative to the end of the header. This module checks all of it against
the object's size before a reader allocates or reads anything more: the
length is bounded (:data:`MAX_HEADER_BYTES`, safetensors' own limit), the
JSON is an object with exactly those fields, every tensor's byte length is
its shape times its dtype's size, and the tensors tile the data area with
no gap or overlap, ending at the object's end.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch

from ..errors import FormatError

#: The largest header accepted (safetensors' own ``MAX_HEADER_SIZE``).
MAX_HEADER_BYTES = 100_000_000
#: At most this many dims per tensor (as ckptstore's format).
MAX_DIMS = 64

#: safetensors dtype names -> torch dtypes (those torch has).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        DTYPES[_code] = getattr(torch, _name)
del _name, _code


@dataclass(frozen=True)
class PlainTensor:
    """One tensor of a safetensors object.

    Attributes
    ----------
    name: its key in the header.
    dtype: the torch dtype.
    shape: its shape.
    start, end: its bytes ``[start, end)`` in the object (absolute offsets).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along dim 0 (the whole tensor for a 0-d one)."""
        return self.dtype.itemsize * math.prod(self.shape[1:]) if self.shape else self.nbytes


@dataclass(frozen=True)
class Header:
    """A parsed header: ``tensors`` in the order of their bytes, ``metadata`` (str -> str)."""

    tensors: dict[str, PlainTensor]
    metadata: dict[str, str]
    data_start: int


def _fail(where: str, msg: str):
    raise FormatError(f"{where}: not a valid safetensors file: {msg}")


def header_length(first: bytes, size: int, where: str) -> int:
    """The header length ``N`` from the object's first 8 bytes, checked against ``size``."""
    if size < 8 or len(first) < 8:
        _fail(where, f"the object is {size} bytes, too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", first[:8])
    if n > MAX_HEADER_BYTES:
        _fail(where, f"header length {n} is over the {MAX_HEADER_BYTES}-byte limit (truncated or not safetensors?)")
    if n < 2 or 8 + n > size:
        _fail(where, f"header length {n} does not fit in the {size}-byte object (truncated?)")
    return n


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _reject_constant(c):
    raise ValueError(f"non-standard JSON constant {c}")


def _tensor(name: str, t, where: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    if type(t) is not dict or set(t) != {"dtype", "shape", "data_offsets"}:
        _fail(where, f"tensor {name!r}: expected an object with exactly 'dtype', 'shape' and 'data_offsets'")
    dtype = DTYPES.get(t["dtype"]) if type(t["dtype"]) is str else None
    if dtype is None:
        _fail(where, f"tensor {name!r}: unsupported dtype {t['dtype']!r:.40} (known: {', '.join(DTYPES)})")
    shape, offs = t["shape"], t["data_offsets"]
    if type(shape) is not list or len(shape) > MAX_DIMS or any(type(n) is not int or n < 0 for n in shape):
        _fail(where, f"tensor {name!r}: shape must be a list of at most {MAX_DIMS} non-negative ints")
    if type(offs) is not list or len(offs) != 2 or any(type(o) is not int or o < 0 for o in offs) \
            or offs[1] < offs[0]:
        _fail(where, f"tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end")
    if math.prod(shape) * dtype.itemsize != offs[1] - offs[0]:
        _fail(where, f"tensor {name!r}: {t['dtype']}{shape} is {math.prod(shape) * dtype.itemsize} bytes, "
                 f"data_offsets {offs} hold {offs[1] - offs[0]}")
    return dtype, tuple(shape), offs[0], offs[1]


def parse_header(raw: bytes, size: int, where: str) -> Header:
    """Parse the ``N`` header bytes (after the 8-byte length) of a ``size``-byte object."""
    try:
        doc = json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=_no_duplicates,
                         parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        _fail(where, f"the header is not valid JSON (truncated or garbled?): {e}")
    if type(doc) is not dict:
        _fail(where, "the header is not a JSON object")
    meta = doc.pop("__metadata__", {})
    if type(meta) is not dict or any(type(k) is not str or type(v) is not str for k, v in meta.items()):
        _fail(where, "__metadata__ must be an object of strings")
    data_start = 8 + len(raw)
    parsed = sorted(((_tensor(k, v, where), k) for k, v in doc.items()), key=lambda x: (x[0][2], x[0][3]))
    at = 0
    tensors = {}
    for (dtype, shape, begin, end), name in parsed:
        if begin != at:
            _fail(where, f"tensor {name!r} starts at data offset {begin}, expected {at} "
                         "(tensors must tile the data area with no gap or overlap)")
        at = end
        tensors[name] = PlainTensor(name, dtype, shape, data_start + begin, data_start + end)
    if data_start + at != size:
        _fail(where, f"the tensors end at byte {data_start + at}, the object has {size} bytes (truncated?)")
    return Header(tensors, dict(meta), data_start)
