"""Chunk hashing and compression: bytes in, bytes out, no I/O.

Hash: BLAKE3-256 of the chunk's raw bytes, hex encoded; it releases the
GIL (why BLAKE3, measured against SHA-256: ``docs/performance.md``, "Hashing").

Codecs (names are part of the on-store format):

``raw``
    the bytes as they are.
``zstd``
    one zstd frame holding the raw bytes.
``bgz``
    byte-grouped zstd for floating-point data: the chunk's elements are
    split into planes (byte ``i`` of every element; for bfloat16 the 8
    exponent bits and the sign+7 mantissa bits), and each plane is stored
    zstd-compressed or raw, whichever is smaller. Exponent planes of trained
    weights and optimizer states compress well, mantissa planes barely;
    compressing them together (plain zstd) wastes both. Layout: u8 version
    (1), u8 element size, u8 transform (0 byte planes, 1 bfloat16 bit
    split, 2 top byte apart from the low 3 bytes of 4-byte elements), u8
    number of planes, then per plane u8 mode (0 raw, 1 zstd) and u32 stored
    length (little-endian), then the plane payloads in order. Transform 2
    has two "planes": the top byte of every element, then the low 3 bytes of
    every element kept together (always raw); writers use it for float32
    chunks whose low bytes do not compress (it stores the same bytes as
    transform 0 and decodes in one gather and one scatter instead of four
    plane passes).

A chunk is stored ``raw`` when zstd saves less than ``MIN_SAVING`` of it:
decoding raw bytes costs nothing and the difference on the wire is noise.
"""

from __future__ import annotations

import struct
import threading

import blake3
import numpy as np
import zstandard

from ..errors import IntegrityError

HASH_NAME = "blake3"
HASH_HEX_LEN = 64
CODECS = ("raw", "zstd", "bgz")
#: dtypes whose chunks are byte-grouped (element size, transform).
BYTEGROUP_DTYPES = {
    "float16": (2, 0),
    "bfloat16": (2, 1),
    "float32": (4, 0),
    "float64": (8, 0),
    "complex64": (4, 0),
    "complex128": (8, 0),
}
#: A plane whose first 64 KiB compress by less than this is stored raw
#: without compressing the rest (random mantissa bytes).
PLANE_SAMPLE = 64 << 10
#: The probe of a plane that did not compress in the tensor's earlier chunks (see encode_pieces).
PLANE_PROBE = 4 << 10
#: Slots of a tensor's shared plane judgements (one per byte plane of the widest grouped element).
JUDGED_SLOTS = 8
PLANE_MIN_RATIO = 1.05
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


def encode(data, codec: str = "zstd", level: int = DEFAULT_LEVEL, dtype: str | None = None) -> tuple[str, bytes | memoryview]:
    """Compress one chunk; returns ``(codec_used, stored_bytes)``.

    ``codec="zstd"`` byte-groups floating-point chunks (``dtype`` given, see
    ``BYTEGROUP_DTYPES``) and zstd-compresses the rest. Falls back to ``raw``
    (returning ``data`` itself, uncopied) when compression does not save at
    least ``MIN_SAVING``.
    """
    name, pieces = encode_pieces(data, codec, level, dtype)
    return name, pieces[0] if len(pieces) == 1 else b"".join(pieces)


def encode_pieces(data, codec: str = "zstd", level: int = DEFAULT_LEVEL,
                  dtype: str | None = None, scratch=None, judged: list | None = None) -> tuple[str, list]:
    """:func:`encode` without joining: ``(codec_used, buffers)``.

    The stored chunk is the concatenation of ``buffers``; a writer that
    copies them into its part buffers anyway saves one copy of the chunk.
    ``scratch``, a writable buffer at least ``len(data)`` long, receives the
    byte planes instead of a fresh allocation (whose page faults cost more
    than the transposition itself); ``buffers`` may then point into it, so
    it must not be reused before they are consumed.

    ``judged``, a list shared by the chunks of one tensor (start it as
    ``[None] * JUDGED_SLOTS``), keeps what byte planes of its earlier chunks did on their
    samples: a plane that did not compress there is judged here on a
    :data:`PLANE_PROBE`-byte probe instead of a :data:`PLANE_SAMPLE` sample
    (a tensor of many small chunks, tiles, otherwise compresses a sample of
    its random mantissa bytes per chunk); a plane that did compress there is
    compressed without a sample (and stored raw if that does not make it
    smaller). A probe that compresses sends the plane to the full
    judgement, so a chunk unlike the tensor's first (zeros in random
    weights) is still compressed.
    """
    if codec == "raw" or len(data) == 0:
        return "raw", [data]
    if codec not in ("zstd", "bgz"):
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
    limit = len(data) * (1.0 - MIN_SAVING)
    bg = BYTEGROUP_DTYPES.get(dtype or "")
    if bg is not None and len(data) % bg[0] == 0:
        pieces = _bytegroup_encode(data, bg[0], bg[1], level, scratch, judged)
        if sum(len(p) for p in pieces) > limit:
            return "raw", [data]
        return "bgz", pieces
    out = _compressor(level).compress(data)
    if len(out) > limit:
        return "raw", [data]
    return "zstd", [out]


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
        return _unzstd(stored, raw_len, "zstd chunk")
    if codec == "bgz":
        return _bytegroup_decode(stored, raw_len)
    raise IntegrityError(f"unknown codec {codec!r}")


def decode_into(codec: str, stored, out) -> None:
    """:func:`decode` into ``out``, a writable buffer of exactly the chunk's raw length.

    No scratch copy of the chunk: zstd frames decompress into ``out``, byte
    planes are interleaved straight into it. On an error ``out`` may hold
    partly decoded bytes; the caller must not use them.
    """
    dest = _byte_array(out)
    n = len(dest)
    if codec == "raw":
        if len(stored) != n:
            raise IntegrityError(f"raw chunk is {len(stored)} bytes, expected {n}")
        dest[:] = np.frombuffer(stored, dtype=np.uint8)
    elif codec == "zstd":
        _unzstd_into(stored, dest, "zstd chunk")
    elif codec == "bgz":
        _bytegroup_decode(stored, n, dest)
    else:
        raise IntegrityError(f"unknown codec {codec!r}")


def _byte_array(buf) -> np.ndarray:
    """A writable flat uint8 array over ``buf``'s memory."""
    a = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if a.dtype != np.uint8 or a.ndim != 1:
        a = a.reshape(-1).view(np.uint8)
    if not a.flags.writeable:
        raise ValueError("decode_into needs a writable buffer")
    return a


def _check_frame(frame, n: int, what: str) -> None:
    # The frame header states its content size; check it before the
    # decompressor allocates that much (a crafted frame could claim TiBs).
    declared = zstandard.frame_content_size(frame)
    if declared not in (-1, n):
        raise IntegrityError(f"{what} declares {declared} bytes, expected {n}")


def _unzstd(frame, n: int, what: str) -> bytes:
    """Decode one zstd frame that must hold exactly ``n`` bytes."""
    try:
        _check_frame(frame, n, what)
        out = _decompressor().decompress(frame, max_output_size=n)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{what} does not decode: {e}") from None
    if len(out) != n:
        raise IntegrityError(f"{what} decodes to {len(out)} bytes, expected {n}")
    return out


def _unzstd_into(frame, dest: np.ndarray, what: str) -> None:
    """Decode one zstd frame into ``dest`` (uint8, writable), which it must fill exactly."""
    n = len(dest)
    try:
        _check_frame(frame, n, what)
        reader = _decompressor().stream_reader(frame, read_across_frames=False)
        mv = memoryview(dest)
        got = 0
        while got < n:
            k = reader.readinto(mv[got:])
            if not k:
                break
            got += k
        extra = got == n and reader.read(1)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{what} does not decode: {e}") from None
    if got != n or extra:
        raise IntegrityError(f"{what} decodes to {'more than ' if extra else ''}{got} bytes, expected {n}")


def decode_verified(codec: str, stored, raw_len: int, hash_hex: str, where: str) -> bytes | memoryview:
    """:func:`decode`, then check the BLAKE3 hash; errors are prefixed with ``where``."""
    try:
        raw = decode(codec, stored, raw_len)
    except IntegrityError as ex:
        raise IntegrityError(f"{where}: {ex}") from None
    if hash_bytes(raw) != hash_hex:
        raise IntegrityError(f"{where}: content hash mismatch (corrupted data)")
    return raw


def decode_verified_into(codec: str, stored, out, hash_hex: str, where: str) -> None:
    """:func:`decode_into`, then check the BLAKE3 hash of ``out``; errors are prefixed with ``where``.

    On an error ``out`` holds bytes that must not be used.
    """
    try:
        decode_into(codec, stored, out)
    except IntegrityError as ex:
        raise IntegrityError(f"{where}: {ex}") from None
    if hash_bytes(out) != hash_hex:
        raise IntegrityError(f"{where}: content hash mismatch (corrupted data)")


_BG_HEAD = struct.Struct("<BBBB")
_BG_PLANE = struct.Struct("<BI")


#: Elements per block of the bfloat16 bit split: its temporaries stay in cache.
_BF16_BLOCK = 1 << 17
#: Output bytes per block when byte planes are interleaved back.
_PLANE_BLOCK_BYTES = 256 << 10


def _block_temps(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Two per-thread uint16 temporaries of at least ``n`` elements (bounded by the block size)."""
    t = getattr(_tls, "u16", None)
    if t is None or len(t[0]) < n:
        t = _tls.u16 = (np.empty(n, dtype=np.uint16), np.empty(n, dtype=np.uint16))
    return t


def _planes(arr: np.ndarray, k: int, transform: int, scratch=None) -> list[np.ndarray]:
    n = arr.size // k
    if scratch is not None and len(scratch) >= arr.size:
        t = np.frombuffer(scratch, dtype=np.uint8, count=arr.size).reshape(k, -1)
    else:
        t = np.empty((k, n), dtype=np.uint8)
    if transform == 1:  # bfloat16: exponent bits apart from sign + mantissa
        # exp = bits 14..7; sm = sign (bit 15) as bit 7 | mantissa (bits 6..0).
        # In blocks, with uint16 temporaries: ~3x faster than whole-chunk
        # expressions, whose temporaries are fresh memory each time.
        x = arr.view("<u2")
        exp, sm = t[0], t[1]
        a_, b_ = _block_temps(min(n, _BF16_BLOCK))
        for s0 in range(0, n, _BF16_BLOCK):
            xs = x[s0 : s0 + _BF16_BLOCK]
            m = len(xs)
            a, b = a_[:m], b_[:m]
            np.right_shift(xs, 7, out=a)
            np.copyto(exp[s0 : s0 + m], a, casting="unsafe")  # drops the sign bit
            np.bitwise_and(xs, 0x807F, out=a)
            np.right_shift(a, 8, out=b)
            np.bitwise_or(a, b, out=a)
            np.copyto(sm[s0 : s0 + m], a, casting="unsafe")
        return [exp, sm]
    # One transposing copy (~3.5 GB/s here) instead of k strided gathers
    # (~1.2 GB/s together); each row of the result is one plane.
    np.copyto(t, arr.reshape(-1, k).T)
    return [t[i] for i in range(k - 1, -1, -1)]  # high bytes first


def _unplanes(planes: list[np.ndarray], k: int, transform: int, n: int, out: np.ndarray | None = None) -> memoryview:
    """Interleave the planes into ``out`` (uint8, ``n * k`` bytes; new memory when None)."""
    if out is None:
        out = np.empty(n * k, dtype=np.uint8)
    if transform == 1:
        exp, sm = planes
        o16 = out.view("<u2")
        (a_, _) = _block_temps(min(n, _BF16_BLOCK))
        for s0 in range(0, n, _BF16_BLOCK):
            o = o16[s0 : s0 + _BF16_BLOCK]
            m = len(o)
            a, e, s_ = a_[:m], exp[s0 : s0 + m], sm[s0 : s0 + m]
            np.left_shift(e, 7, out=o, dtype=np.uint16)
            np.left_shift(s_, 8, out=a, dtype=np.uint16)
            np.bitwise_or(a, s_, out=a, dtype=np.uint16)
            np.bitwise_and(a, 0x807F, out=a)
            np.bitwise_or(o, a, out=o)
        return memoryview(out)
    # Block by block, so that the k strided passes over a block of the
    # destination find it in cache (~13% faster into cold memory here).
    o2 = out.reshape(n, k)
    step = _PLANE_BLOCK_BYTES // k
    for s0 in range(0, n, step):
        ob = o2[s0 : s0 + step]
        for i, p in zip(range(k - 1, -1, -1), planes):
            ob[:, i] = p[s0 : s0 + step]
    return memoryview(out)


def _plane_compressor() -> zstandard.ZstdCompressor:
    # Planes are near-memoryless byte streams (exponents): long matches are
    # rare, so a fast strategy with min_match 7 leaves almost everything to
    # the Huffman-coded literals; a tiny hash table keeps it fast. Measured
    # on all-MiniLM-L6-v2's bf16 exponents in 2M-element chunks: 2.65
    # bits/element at ~790 MB/s (order-0 entropy 2.65), against 2.90 bits at
    # ~300 MB/s for level 1 (benchmarks/micro/codec_real.py).
    c = getattr(_tls, "plane", None)
    if c is None:
        params = zstandard.ZstdCompressionParameters(
            strategy=zstandard.STRATEGY_FAST, min_match=7, window_log=20, hash_log=6, search_log=1,
            target_length=0, write_content_size=True,
        )
        c = _tls.plane = zstandard.ZstdCompressor(compression_params=params)
    return c


def _compresses(c: zstandard.ZstdCompressor, sample) -> bool:
    return len(c.compress(sample)) * PLANE_MIN_RATIO < len(sample)


#: Elements per block when 3-byte groups are packed (temporaries stay in cache).
_PACK_BLOCK = 1 << 15


def _pack_low3(x32: np.ndarray, out: np.ndarray) -> None:
    """Bytes 0-2 of every little-endian u32 of ``x32``, back to back, into ``out`` (uint8, 3 per element).

    Element i is written as one 4-byte word at ``3i`` whose top byte is the
    byte that belongs there, byte 0 of element i+1: neighbouring words
    overlap only where they hold the same byte, so the result does not
    depend on the order of the writes. The last element has no neighbour
    and is copied on its own.
    """
    m = len(x32)
    if m > 1:
        dst = np.ndarray((m - 1,), dtype="<u4", buffer=out, strides=(3,))
        t_ = getattr(_tls, "pack", None)
        if t_ is None or len(t_[0]) < min(m - 1, _PACK_BLOCK):
            k = min(m - 1, _PACK_BLOCK)
            t_ = _tls.pack = (np.empty(k, dtype="<u4"), np.empty(k, dtype="<u4"))
        for s0 in range(0, m - 1, _PACK_BLOCK):
            e0 = min(m - 1, s0 + _PACK_BLOCK)
            a, b = t_[0][: e0 - s0], t_[1][: e0 - s0]
            np.bitwise_and(x32[s0:e0], 0xFFFFFF, out=a)
            np.left_shift(x32[s0 + 1 : e0 + 1], 24, out=b)
            np.bitwise_or(a, b, out=a)
            np.copyto(dst[s0:e0], a)
    if m:
        out[3 * (m - 1) : 3 * m] = x32[m - 1 :].view(np.uint8)[:3]


def _judge(c: zstandard.ZstdCompressor, plane, i: int, judged: list, shared: list | None) -> bool:
    """Whether byte plane ``i`` (a uint8 array or buffer, possibly strided) compresses, judged on
    its first :data:`PLANE_SAMPLE` bytes; where the tensor's earlier chunks judged it (``shared``,
    see :func:`encode_pieces`), yes without a sample if they found it does, and no on a
    :data:`PLANE_PROBE` probe that does not compress if they found it does not. In ``judged``."""
    if shared is not None and shared[i] is True:
        judged[i] = True
        return True
    if shared is not None and shared[i] is False and not _compresses(c, np.ascontiguousarray(plane[:PLANE_PROBE])):
        judged[i] = False
        return False
    judged[i] = _compresses(c, np.ascontiguousarray(plane[:PLANE_SAMPLE]))
    if shared is not None:
        shared[i] = judged[i]
    return judged[i]


def _low3_fits(arr: np.ndarray, c: zstandard.ZstdCompressor, judged: list, shared: list | None = None) -> bool:
    """Whether a 4-byte-element chunk takes transform 2: its top plane's sample
    compresses and none of the low ones' does. Fills in ``judged`` (plane i,
    most significant byte first) for the planes it had to look at."""
    head = arr.reshape(-1, 4)[:PLANE_SAMPLE]
    return (_judge(c, head[:, 3], 0, judged, shared)
            and not any(_judge(c, head[:, 3 - i], i, judged, shared) for i in (1, 2, 3)))


def _low3_encode(arr: np.ndarray, c: zstandard.ZstdCompressor, scratch=None) -> list:
    """Transform 2 of a 4-byte-element chunk.

    The caller uses it when, judged on a sample, the top byte plane (sign
    and 7 exponent bits of a float32) compresses and the three low ones do
    not (random or well-trained mantissas): the top plane is stored as a
    plane, the low 3 bytes of every element stay together, raw. The stored
    size is that of transform 0 with those plane decisions; decoding is one
    gather of the groups and one plane scatter instead of four plane passes.
    """
    n = arr.size // 4
    rows = arr.reshape(-1, 4)
    if scratch is not None and len(scratch) >= arr.size:
        buf = np.frombuffer(scratch, dtype=np.uint8, count=arr.size)
    else:
        buf = np.empty(arr.size, dtype=np.uint8)
    top, low = buf[:n], buf[n:]
    np.copyto(top, rows[:, 3])
    _pack_low3(arr.view("<u4"), low)
    mode, body = 0, top.data
    z = c.compress(top.data)
    if len(z) < n:
        mode, body = 1, z
    heads = [_BG_PLANE.pack(mode, len(body)), _BG_PLANE.pack(0, 3 * n)]
    return [b"".join([_BG_HEAD.pack(1, 4, 2, 2), *heads]), body, low.data]


def _bytegroup_encode(data, k: int, transform: int, level: int, scratch=None, shared: list | None = None) -> list:
    arr = np.frombuffer(data, dtype=np.uint8)
    c = _plane_compressor()
    if shared is not None and len(shared) < k:
        shared = None
    # judged[i]: plane i (most significant byte first) compresses, judged on
    # its first PLANE_SAMPLE bytes; each sample is compressed once. shared: the
    # tensor's earlier chunks' judgements (encode_pieces), or None.
    judged: list[bool | None] = [None] * k
    if k == 4 and transform == 0 and _low3_fits(arr, c, judged, shared):
        return _low3_encode(arr, c, scratch)
    heads, bodies = [], []
    for i, plane in enumerate(_planes(arr, k, transform, scratch)):
        raw = plane.data
        mode, body = 0, raw
        if judged[i] is None and shared is not None and shared[i] is not None:
            _judge(c, raw, i, judged, shared)  # from the tensor's earlier chunks, or this one's probe
        if judged[i] is None and len(raw) <= PLANE_SAMPLE:
            # The sample is the whole plane (a small chunk: a tile): compressed once, the same
            # bytes and the same decision as judging the sample, then compressing the plane.
            z = c.compress(raw)
            if shared is not None:
                shared[i] = len(z) * PLANE_MIN_RATIO < len(raw)
            if len(z) * PLANE_MIN_RATIO < len(raw) and len(z) < len(raw):
                mode, body = 1, z
        elif judged[i] if judged[i] is not None else _judge(c, raw, i, judged, shared):
            z = c.compress(raw)
            if len(z) < len(raw):
                mode, body = 1, z
        heads.append(_BG_PLANE.pack(mode, len(body)))
        bodies.append(body)
    return [b"".join([_BG_HEAD.pack(1, k, transform, len(heads)), *heads]), *bodies]


def _bytegroup_decode(stored, raw_len: int, out: np.ndarray | None = None) -> memoryview:
    mv = memoryview(stored)
    if len(mv) < _BG_HEAD.size:
        raise IntegrityError("bgz chunk truncated")
    version, k, transform, nplanes = _BG_HEAD.unpack_from(mv)
    valid = (version == 1 and ((transform == 0 and k in (2, 4, 8) and nplanes == k)
                               or (transform == 1 and k == 2 and nplanes == 2)
                               or (transform == 2 and k == 4 and nplanes == 2)))
    if not valid or raw_len % k:
        raise IntegrityError("bgz chunk has a bad header")
    n = raw_len // k
    off = _BG_HEAD.size + nplanes * _BG_PLANE.size
    if len(mv) < off:
        raise IntegrityError("bgz chunk truncated")
    planes = []
    for i in range(nplanes):
        mode, length = _BG_PLANE.unpack_from(mv, _BG_HEAD.size + i * _BG_PLANE.size)
        body = mv[off : off + length]
        if len(body) != length:
            raise IntegrityError("bgz chunk truncated")
        off += length
        # transform 2: the second "plane" is the 3-byte groups, raw
        want = 3 * n if transform == 2 and i == 1 else n
        if mode == 0:
            plane = body
        elif mode == 1 and want == n:
            plane = _unzstd(body, n, "bgz plane")
        else:
            raise IntegrityError(f"bgz plane has unknown mode {mode}")
        if len(plane) != want:
            raise IntegrityError(f"bgz plane holds {len(plane)} bytes, expected {want}")
        planes.append(np.frombuffer(plane, dtype=np.uint8))
    if off != len(mv):
        raise IntegrityError("bgz chunk has trailing bytes")
    if transform == 2:
        return _unlow3(planes[0], planes[1], n, out)
    return _unplanes(planes, k, transform, n, out)


def _unlow3(top: np.ndarray, low: np.ndarray, n: int, out: np.ndarray | None = None) -> memoryview:
    """Inverse of transform 2: 4-byte elements from their top bytes and their 3-byte low groups."""
    if out is None:
        out = np.empty(n * 4, dtype=np.uint8)
    if n:
        # Element i's low bytes are low[3i:3i+3]: one unaligned 4-byte read
        # at 3i gets them (and a byte of the next group, overwritten by the
        # top byte right after); the last group has no byte after it and is
        # copied on its own. Block by block, so that the top bytes land in
        # lines still in cache.
        o32 = out.view("<u4")
        rows = out.reshape(n, 4)
        words = np.ndarray((n - 1,), dtype="<u4", buffer=low, strides=(3,)) if n > 1 else None
        for s0 in range(0, n, _LOW3_BLOCK):
            e0 = min(n, s0 + _LOW3_BLOCK)
            if s0 < n - 1:
                np.copyto(o32[s0 : min(e0, n - 1)], words[s0 : min(e0, n - 1)])
            if e0 == n:
                rows[n - 1, :3] = low[3 * (n - 1) :]
            rows[s0:e0, 3] = top[s0:e0]
    return memoryview(out)


#: Elements per block when transform 2 is decoded (256 KiB of output).
_LOW3_BLOCK = 1 << 16
