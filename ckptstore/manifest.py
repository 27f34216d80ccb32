"""Step manifests: what a committed step holds, as strict JSON.

A manifest is the only object that makes a step exist. It lists every
tensor (dtype, global shape, shards) and for each shard its chunks with
their locations, plus the non-tensor values of the state dict and the
user's metadata. See ``docs/format.md`` for the schema.

Parsing is strict and bounded: sizes are checked before anything is
allocated, unknown fields are refused, and no value is ever unpickled.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from . import codec as _codec
from .errors import FormatError, UnsupportedVersionError

FORMAT = "ckptstore.manifest"
VERSION = (1, 0)
#: A manifest larger than this is refused before it is downloaded.
MAX_MANIFEST_BYTES = 1 << 30
MAX_DIMS = 64
#: Largest tensor (bytes) a manifest may describe: 1 PiB.
MAX_TENSOR_BYTES = 1 << 50
MAX_CHUNK_BYTES = 1 << 31
MAX_KEY_LEN = 4096
MAX_PACK_BYTES = 5 << 40  # S3's object size limit

#: Every dtype ckptstore stores, by its on-store name.
DTYPES: dict[str, torch.dtype] = {}
for _name in dir(torch):
    _d = getattr(torch, _name)
    if isinstance(_d, torch.dtype):
        if str(_d).startswith("torch.q"):  # quantized tensors carry scale/zero point: refused
            continue
        DTYPES.setdefault(str(_d).removeprefix("torch."), _d)
del _name, _d


def dtype_name(d: torch.dtype) -> str:
    name = str(d).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"dtype {d} cannot be stored")
    return name


def itemsize(dtype: str) -> int:
    return DTYPES[dtype].itemsize


@dataclass(frozen=True)
class ChunkRef:
    """Where one chunk lives and how to decode it."""

    hash: str
    pack: str
    offset: int
    stored_len: int
    raw_len: int
    codec: str


@dataclass(frozen=True)
class Shard:
    """A box of the global tensor stored as contiguous C-order bytes.

    ``offsets`` and ``sizes`` give the box in global coordinates; its
    bytes are the concatenation of ``chunks``' raw bytes.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    chunks: tuple[ChunkRef, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.raw_len for c in self.chunks)

    def chunk_starts(self) -> list[int]:
        out, pos = [], 0
        for c in self.chunks:
            out.append(pos)
            pos += c.raw_len
        return out


@dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    shards: tuple[Shard, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class Manifest:
    step: int
    created: float
    tensors: dict[str, TensorEntry]
    tree: Any
    packs: dict[str, int]
    metadata: dict = field(default_factory=dict)
    base_step: int | None = None
    stats: dict = field(default_factory=dict)
    dcp: Any = None
    version: tuple[int, int] = VERSION

    def chunk_refs(self):
        for t in self.tensors.values():
            for s in t.shards:
                yield from s.chunks


# ------------------------------------------------------------------ encode
def to_json(m: Manifest) -> bytes:
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
        "format": FORMAT,
        "version": list(m.version),
        "step": m.step,
        "created": m.created,
        "base_step": m.base_step,
        "metadata": m.metadata,
        "stats": m.stats,
        "packs": [{"id": p, "size": m.packs[p]} for p in pack_ids],
        "tensors": tensors,
        "tree": m.tree,
        "dcp": m.dcp,
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=True, ensure_ascii=False).encode("utf-8")


# ------------------------------------------------------------------ decode
def _fail(where: str, msg: str):
    raise FormatError(f"manifest {where}: {msg}")


def _int(v, where, lo=0, hi=1 << 63):
    if type(v) is not int or not lo <= v <= hi:
        _fail(where, f"expected an integer in [{lo}, {hi}], got {v!r:.80}")
    return v


def _str(v, where, maxlen=MAX_KEY_LEN):
    if type(v) is not str or len(v) > maxlen:
        _fail(where, f"expected a string of at most {maxlen} characters")
    return v


def _obj(v, where, required: set, optional: set = frozenset()):
    if type(v) is not dict:
        _fail(where, "expected an object")
    missing = required - v.keys()
    if missing:
        _fail(where, f"missing field(s) {sorted(missing)}")
    extra = v.keys() - required - optional
    if extra:
        _fail(where, f"unknown field(s) {sorted(extra)[:5]}")
    return v


def _list(v, where):
    if type(v) is not list:
        _fail(where, "expected a list")
    return v


def check_version(v, what: str = "manifest") -> tuple[int, int]:
    if type(v) is not list or len(v) != 2 or not all(type(x) is int and x >= 0 for x in v):
        raise FormatError(f"{what}: bad version field {v!r:.40}")
    if v[0] > VERSION[0]:
        raise UnsupportedVersionError(
            f"{what} has format version {v[0]}.{v[1]}, newer than this ckptstore reads "
            f"({VERSION[0]}.x); upgrade ckptstore"
        )
    if v[0] < 1:
        raise FormatError(f"{what}: unknown format version {v[0]}.{v[1]}")
    return v[0], v[1]


def from_json(data: bytes, expect_step: int | None = None) -> Manifest:
    """Parse and validate a manifest; raises :class:`FormatError` on any defect."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise FormatError(f"manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"manifest is not valid JSON (truncated or corrupted?): {e}") from None
    if type(doc) is not dict or doc.get("format") != FORMAT:
        raise FormatError("object is not a ckptstore manifest (missing or wrong 'format' field)")
    version = check_version(doc.get("version"))
    doc = _obj(
        doc,
        "",
        {"format", "version", "step", "created", "packs", "tensors", "tree"},
        {"metadata", "stats", "base_step", "dcp"},
    )
    step = _int(doc["step"], "step")
    if expect_step is not None and step != expect_step:
        _fail("step", f"manifest says step {step}, but is stored as step {expect_step}")
    created = doc["created"]
    if type(created) not in (int, float) or not math.isfinite(created):
        _fail("created", "expected a finite number")
    base_step = doc.get("base_step")
    if base_step is not None:
        _int(base_step, "base_step")
    metadata = doc.get("metadata") or {}
    if type(metadata) is not dict:
        _fail("metadata", "expected an object")
    stats = doc.get("stats") or {}
    if type(stats) is not dict:
        _fail("stats", "expected an object")

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
        dtype = t["dtype"]
        if type(dtype) is not str or dtype not in DTYPES:
            _fail(w, f"unknown dtype {dtype!r:.40}")
        shape = _list(t["shape"], w + " shape")
        if len(shape) > MAX_DIMS:
            _fail(w, f"{len(shape)} dimensions, over the limit {MAX_DIMS}")
        shape = tuple(_int(d, w + " shape", 0, MAX_TENSOR_BYTES) for d in shape)
        isz = DTYPES[dtype].itemsize
        if math.prod(shape) * isz > MAX_TENSOR_BYTES:
            _fail(w, f"shape {shape} is over the {MAX_TENSOR_BYTES}-byte limit")
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

    tree = doc["tree"]
    _check_tree(tree, tensors, "tree", 0)
    dcp = doc.get("dcp")
    if dcp is not None:
        _check_dcp(dcp, tensors)
    return Manifest(
        step=step,
        created=float(created),
        tensors=tensors,
        tree=tree,
        packs=packs,
        metadata=metadata,
        base_step=base_step,
        stats=stats,
        dcp=doc.get("dcp"),
        version=version,
    )


def is_pack_id(s: object) -> bool:
    return isinstance(s, str) and len(s) == 32 and all(c in "0123456789abcdef" for c in s)


# ------------------------------------------------------------------ state-dict tree
#
# Node forms (one key per JSON object):
#   {"t": KEY}            a tensor, KEY indexing the manifest's tensors
#   {"v": VALUE}          a plain JSON value (no tensors inside, dict keys str)
#   {"d": [[K, NODE]...]} a dict; K is a str or an int (optimizer state uses ints)
#   {"l": [NODE...]}      a list
#   {"u": [NODE...]}      a tuple

MAX_TREE_DEPTH = 100


def _check_tree(node, tensors, where, depth):
    if depth > MAX_TREE_DEPTH:
        _fail(where, "nested too deeply")
    if type(node) is not dict or len(node) != 1:
        _fail(where, "expected a node object with one field")
    (kind, val), = node.items()
    if kind == "t":
        if val not in tensors:
            _fail(where, f"references unknown tensor {val!r:.80}")
    elif kind == "v":
        pass
    elif kind == "d":
        for i, item in enumerate(_list(val, where)):
            if type(item) is not list or len(item) != 2 or type(item[0]) not in (str, int):
                _fail(f"{where}[{i}]", "expected [key, node] with a str or int key")
            _check_tree(item[1], tensors, f"{where}.{item[0]}", depth + 1)
    elif kind in ("l", "u"):
        for i, item in enumerate(_list(val, where)):
            _check_tree(item, tensors, f"{where}[{i}]", depth + 1)
    else:
        _fail(where, f"unknown node kind {kind!r:.20}")


def _check_dcp(dcp, tensors) -> None:
    """The ``dcp`` section of a step saved through torch.distributed.checkpoint."""
    _obj(dcp, "dcp", {"bytes"}, {"version", "planner_data", "storage_meta"})
    for i, k in enumerate(_list(dcp["bytes"], "dcp.bytes")):
        if type(k) is not str or k not in tensors:
            _fail(f"dcp.bytes[{i}]", "does not name a stored item")
        t = tensors[k]
        if t.dtype != "uint8" or len(t.shape) != 1 or len(t.shards) != 1:
            _fail(f"dcp.bytes[{i}]", "a bytes item must be one 1-d uint8 shard")
    v = dcp.get("version")
    if v is not None:
        _str(v, "dcp.version", 64)
    pd = dcp.get("planner_data")
    if pd is not None:
        _check_tree(pd, {}, "dcp.planner_data", 0)
    sm = dcp.get("storage_meta")
    if sm is not None:
        _obj(sm, "dcp.storage_meta", set(), {"checkpoint_id", "save_id", "load_id", "modules"})
        for k in ("checkpoint_id", "save_id", "load_id"):
            if sm.get(k) is not None:
                _str(sm[k], f"dcp.storage_meta.{k}")
        for m in _list(sm.get("modules", []), "dcp.storage_meta.modules"):
            _str(m, "dcp.storage_meta.modules")
