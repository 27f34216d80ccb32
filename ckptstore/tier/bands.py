"""Band copies: a tiled tensor's rows kept in the node-local tier in the tensor's own layout.

A tiled tensor (format 4.0) stores its chunks as N-dimensional tiles; a
tile's bytes are not contiguous in the tensor. A *band* is one grid index
along the first dimension: the tiles side by side across every trailing
dimension, which together are a contiguous run of the tensor's rows. Where a
save keeps decoded copies (``cache_decoded``), a tiled tensor's are band
copies, one file per band holding those rows exactly as they lie in the
tensor (``bands/<name[:2]>/<name>``), so a restart that reads whole rows
(every full load, and any dim-0 reshard) reads each band straight into its
destination with one ``preadv`` and checks it there: no per-tile file, no
buffer, no copy into place.

A band's tiles are hashed in their own (tile) layout, which the band's bytes
are not in, so the file carries its own check: a 48-byte header (magic,
length, BLAKE3-256 of the rows, computed by the save from the tensor it was
given, the same bytes its tiles were cut from) before the rows. A read
checks the length and the digest; a file that fails either is removed and
the band's tiles are read as any other chunk (the tier's compact copies, then
the store). The name is the BLAKE3 of the band's geometry and its tiles'
hashes (:func:`band_name`), so a band whose tiles are unchanged since the last
save has the same file, and a band copy never serves a different tensor's rows
under the same name.

Reads that cut a band's rows or its trailing dimensions (a column slice) do not
use band copies: they read the tiles they need from the tier's compact copies.
"""

from __future__ import annotations

import os
import struct

import blake3

from .cache import Tier, _touch

MAGIC = b"CKBAND1\0"
HEADER = len(MAGIC) + 8 + 32  # magic, u64 length of the rows, BLAKE3-256 of the rows
SUBDIR = "bands"


def band_name(itemsize: int, rows: int, trailing, tile, hashes) -> str:
    """The file name of the band whose tiles (grid order) have ``hashes``: ``rows`` rows of a shard
    whose trailing sizes are ``trailing``, cut into tiles of shape ``tile``, elements of ``itemsize``."""
    desc = "band1|{}|{}|{}|{}|{}".format(itemsize, rows, ",".join(map(str, trailing)), ",".join(map(str, tile)),
                                         ",".join(hashes))
    return blake3.blake3(desc.encode()).hexdigest()


def band_path(tier: Tier, name: str) -> str:
    return os.path.join(tier.root, SUBDIR, name[:2], name)


def keeps_bands(tier: Tier) -> bool:
    """Whether any save kept band copies in this tier (one stat per read, not one per band)."""
    return os.path.isdir(os.path.join(tier.root, SUBDIR))


def has_band(tier: Tier, name: str) -> bool:
    """Whether the tier holds band ``name``; touches it (a save found its band unchanged)."""
    path = band_path(tier, name)
    if not os.path.isfile(path):
        return False
    _touch(path)
    return True


def put_band(tier: Tier, name: str, data) -> None:
    """Keep band ``name`` (its rows, ``data``): hashed here, then published; never raises. Follows
    a :meth:`Tier.keep_decoded` that said yes, whose bytes it then stops holding in reserve."""
    mv = memoryview(data).cast("B")
    try:
        path = band_path(tier, name)
        if not os.path.isfile(path):
            header = MAGIC + struct.pack("<Q", mv.nbytes) + blake3.blake3(mv).digest()
            tier.publish_parts(path, [header, mv])
    finally:
        tier.admitted_done(mv.nbytes)


def read_band_into(tier: Tier, name: str, dest) -> bool:
    """Band ``name`` read straight into ``dest`` (exactly its rows' length) and checked there, or
    False: missing, or damaged (wrong length, magic or digest: removed). After a False the bytes in
    ``dest`` are not the band's."""
    path = band_path(tier, name)
    mv = memoryview(dest).cast("B")
    header = bytearray(HEADER)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    ok = False
    try:
        if os.fstat(fd).st_size == HEADER + mv.nbytes:
            got, want = 0, HEADER + mv.nbytes
            hv = memoryview(header)
            while got < want:
                bufs = [hv[got:], mv] if got < HEADER else [mv[got - HEADER:]]
                k = os.preadv(fd, bufs, got)
                if k <= 0:
                    break
                got += k
            ok = (got == want and bytes(header[: len(MAGIC)]) == MAGIC
                  and struct.unpack_from("<Q", header, len(MAGIC))[0] == mv.nbytes
                  and blake3.blake3(mv).digest() == bytes(header[len(MAGIC) + 8:]))
            if ok:
                _touch(fd)
    except OSError:
        ok = False
    finally:
        os.close(fd)
    if not ok:
        tier.discard_file(path)
    return ok


__all__ = ["band_name", "band_path", "keeps_bands", "has_band", "put_band", "read_band_into", "HEADER", "MAGIC"]
