"""Chunk hashing and compression: bytes in, bytes out, no I/O.

Hash: BLAKE3-256 of the chunk's raw bytes, hex encoded. Measured on the
project's 2-core machine (``benchmarks/hash_codec.py``): blake3 4.2 GiB/s,
sha256 1.6 GiB/s on one core; both release the GIL.

Codecs (names are part of the on-store format):

``raw``
    the bytes as they are.
``zstd``
    one zstd frame holding the raw bytes.

A chunk is stored ``raw`` when zstd saves less than ``MIN_SAVING`` of it:
decoding raw bytes costs nothing and the difference on the wire is noise.
"""

from __future__ import annotations

import threading

import blake3
import zstandard

from .errors import IntegrityError

HASH_NAME = "blake3"
HASH_HEX_LEN = 64
CODECS = ("raw", "zstd")
MIN_SAVING = 0.03
DEFAULT_LEVEL = 1

_tls = threading.local()


def hash_bytes(data) -> str:
    """Hex BLAKE3-256 digest of ``data`` (any buffer)."""
    return blake3.blake3(data).hexdigest()


def is_hash(s: object) -> bool:
    return (
        isinstance(s, str)
        and len(s) == HASH_HEX_LEN
        and all(c in "0123456789abcdef" for c in s)
    )


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_tls, "c", None)
    if cache is None:
        cache = _tls.c = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "d", None)
    if d is None:
        d = _tls.d = zstandard.ZstdDecompressor()
    return d


def encode(data, codec: str = "zstd", level: int = DEFAULT_LEVEL) -> tuple[str, bytes | memoryview]:
    """Compress one chunk; returns ``(codec_used, stored_bytes)``.

    Falls back to ``raw`` (returning ``data`` itself, uncopied) when
    compression does not save at least ``MIN_SAVING``.
    """
    if codec == "raw" or len(data) == 0:
        return "raw", data
    if codec != "zstd":
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
    out = _compressor(level).compress(data)
    if len(out) > len(data) * (1.0 - MIN_SAVING):
        return "raw", data
    return "zstd", out


def decode(codec: str, stored, raw_len: int) -> bytes | memoryview:
    """Inverse of :func:`encode`; never returns more than ``raw_len`` bytes.

    Raises :class:`IntegrityError` when the bytes cannot be decoded to
    exactly ``raw_len`` bytes.
    """
    if codec == "raw":
        if len(stored) != raw_len:
            raise IntegrityError(f"raw chunk is {len(stored)} bytes, expected {raw_len}")
        return stored
    if codec == "zstd":
        try:
            # The frame header states its content size; check it before the
            # decompressor allocates that much (a crafted frame could claim TiBs).
            declared = zstandard.frame_content_size(stored)
            if declared not in (-1, raw_len):
                raise IntegrityError(f"zstd frame declares {declared} bytes, expected {raw_len}")
            out = _decompressor().decompress(stored, max_output_size=raw_len)
        except zstandard.ZstdError as e:
            raise IntegrityError(f"zstd frame does not decode: {e}") from None
        if len(out) != raw_len:
            raise IntegrityError(f"zstd chunk decodes to {len(out)} bytes, expected {raw_len}")
        return out
    raise IntegrityError(f"unknown codec {codec!r}")
