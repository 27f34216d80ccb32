"""Manifest 1.0: every shard's chunk list inline, as JSON (read; written only for 1.0 steps)."""

from __future__ import annotations

import math

from . import codec as _codec
from .model import (
    DTYPES,
    MAX_CHUNK_BYTES,
    MAX_PACK_BYTES,
    MAX_TENSOR_BYTES,
    ChunkRef,
    Manifest,
    Shard,
    TensorEntry,
    is_pack_id,
)
from .strict_json import (
    _common_doc,
    _common_fields,
    _dtype_and_shape,
    _encode,
    _fail,
    _int,
    _list,
    _manifest,
    _obj,
    _str,
)

def _to_json_v1(m: Manifest) -> bytes:
    pack_ids = sorted(m.packs)
    index = {p: i for i, p in enumerate(pack_ids)}
    tensors = []
    for t in m.tensors.values():
        shards = []
        for s in t.shards:
            shards.append(
                {
                    "offsets": list(s.offsets),
                    "sizes": list(s.sizes),
                    "chunks": [
                        [c.hash, index[c.pack], c.offset, c.stored_len, c.raw_len, c.codec] for c in s.chunks
                    ],
                }
            )
        tensors.append({"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "shards": shards})
    doc = {
        **_common_doc(m),
        "packs": [{"id": p, "size": m.packs[p]} for p in pack_ids],
        "tensors": tensors,
        "tree": m.tree,
        "dcp": m.dcp,
    }
    return _encode(doc)


def _from_doc_v1(doc: dict, version: tuple[int, int], expect_step: int | None) -> Manifest:
    """A 1.x manifest: every shard's chunk list inline."""
    doc = _obj(
        doc,
        "",
        {"format", "version", "step", "created", "packs", "tensors", "tree"},
        {"metadata", "stats", "base_step", "dcp"},
    )
    step, created, base_step, metadata, stats = _common_fields(doc, expect_step)

    packs: dict[str, int] = {}
    pack_ids: list[str] = []
    pack_sizes: list[int] = []
    for i, p in enumerate(_list(doc["packs"], "packs")):
        p = _obj(p, f"packs[{i}]", {"id", "size"})
        pid = p["id"]
        if not is_pack_id(pid):
            _fail(f"packs[{i}].id", f"not a pack id: {pid!r:.80}")
        if pid in packs:
            _fail(f"packs[{i}].id", f"duplicate pack {pid}")
        packs[pid] = _int(p["size"], f"packs[{i}].size", 0, MAX_PACK_BYTES)
        pack_ids.append(pid)
        pack_sizes.append(packs[pid])

    tensors: dict[str, TensorEntry] = {}
    for i, t in enumerate(_list(doc["tensors"], "tensors")):
        w = f"tensors[{i}]"
        t = _obj(t, w, {"key", "dtype", "shape", "shards"})
        key = _str(t["key"], w + ".key")
        if key in tensors:
            _fail(w + ".key", f"duplicate tensor key {key!r}")
        w = f"tensor {key!r}"
        dtype, shape = _dtype_and_shape(t, w)
        isz = DTYPES[dtype].itemsize
        shards = []
        for j, s in enumerate(_list(t["shards"], w + " shards")):
            ws = f"{w} shard {j}"
            s = _obj(s, ws, {"offsets", "sizes", "chunks"})
            offs = tuple(_int(x, ws + " offsets", 0, MAX_TENSOR_BYTES) for x in _list(s["offsets"], ws))
            sizes = tuple(_int(x, ws + " sizes", 0, MAX_TENSOR_BYTES) for x in _list(s["sizes"], ws))
            if len(offs) != len(shape) or len(sizes) != len(shape):
                _fail(ws, "offsets/sizes do not match the tensor's dimensions")
            if any(o + n > d for o, n, d in zip(offs, sizes, shape)):
                _fail(ws, f"box offsets {offs} sizes {sizes} reaches outside shape {shape}")
            chunks = []
            total = 0
            for k, c in enumerate(_list(s["chunks"], ws + " chunks")):
                wc = f"{ws} chunk {k}"
                if type(c) is not list or len(c) != 6:
                    _fail(wc, "expected [hash, pack, offset, stored_len, raw_len, codec]")
                h, pi, off, slen, rlen, cod = c
                if not _codec.is_hash(h):
                    _fail(wc, f"hash is not {_codec.HASH_HEX_LEN} lowercase hex digits")
                _int(pi, wc + " pack index", 0, len(pack_ids) - 1 if pack_ids else -1)
                _int(off, wc + " offset", 0, MAX_PACK_BYTES)
                _int(slen, wc + " stored_len", 0, MAX_CHUNK_BYTES)
                _int(rlen, wc + " raw_len", 0, MAX_CHUNK_BYTES)
                if off + slen > pack_sizes[pi]:
                    _fail(wc, f"range [{off}, {off + slen}) is past the end of pack {pack_ids[pi]} ({pack_sizes[pi]} bytes)")
                if cod not in _codec.CODECS:
                    _fail(wc, f"unknown codec {cod!r:.40}")
                if cod == "raw" and slen != rlen:
                    _fail(wc, "raw chunk with stored_len != raw_len")
                total += rlen
                chunks.append(ChunkRef(h, pack_ids[pi], off, slen, rlen, cod))
            if total != math.prod(sizes) * isz:
                _fail(ws, f"chunks hold {total} bytes, the box needs {math.prod(sizes) * isz}")
            shards.append(Shard(offs, sizes, tuple(chunks)))
        tensors[key] = TensorEntry(key, dtype, shape, tuple(shards))

    return _manifest(doc, version, (step, created, base_step, metadata, stats), packs, tensors)
