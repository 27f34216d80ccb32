"""Step manifests: what a committed step holds, as strict JSON.

A manifest is the only object that makes a step exist. It lists every
tensor (dtype, global shape, shards), the non-tensor values of the state
dict and the user's metadata, and says where each shard's chunks are. See
``docs/format.md`` for the schema. Two versions are read:

- **1.0**: every shard's chunk list inline, as JSON;
- **2.0** (written now): a *root* holding shard boxes (a compact form for
  even splits, binary columns otherwise) and, per shard, a run of records
  in a chunk-table *segment* (:mod:`ckptstore.format.chunk_table`) that a reader
  fetches only for the shards it reads. The root also lists every pack the
  step references with the stored bytes it uses there.

Parsing is strict and bounded: sizes are checked before anything is
allocated, unknown fields are refused, and no value is ever unpickled.
"""

from __future__ import annotations

import base64
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zstandard

from . import codec as _codec
from ..errors import FormatError, UnsupportedVersionError

FORMAT = "ckptstore.manifest"
#: The manifest version this ckptstore writes; it reads 1.x and 2.x.
VERSION = (2, 0)
V1 = (1, 0)
#: A manifest larger than this is refused before it is downloaded.
MAX_MANIFEST_BYTES = 1 << 30
MAX_DIMS = 64
#: Largest tensor (bytes) a manifest may describe: 1 PiB.
MAX_TENSOR_BYTES = 1 << 50
MAX_CHUNK_BYTES = 1 << 31
MAX_KEY_LEN = 4096
MAX_PACK_BYTES = 5 << 40  # S3's object size limit
#: Most shards one 2.0 manifest may describe (its columns are sized from this).
MAX_SHARDS = 1 << 28

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
class TableRef:
    """A shard's chunk records: ``count`` records from ``first`` in segment ``segment`` (2.0)."""

    segment: int
    first: int
    count: int


@dataclass(frozen=True)
class SegmentRef:
    """A chunk-table segment a 2.0 root names (see :mod:`ckptstore.format.chunk_table`)."""

    id: str
    size: int
    records: int
    header: int  # bytes [0, header) are the segment's header
    digest: str  # BLAKE3 of the header, hex


@dataclass(frozen=True)
class PackUsage:
    """Which bytes of one pack a 2.0 step's chunks use.

    ``ranges``: sorted, disjoint ``(start, end)`` byte ranges of the step's
    chunks in the pack (adjacent chunks merged); ``chunks``: how many chunks
    the pack holds in all (its table's length; 0 when the writer did not
    know). GC takes the union of the ranges of every kept step: the pack's
    live bytes, exactly, without reading chunk tables.
    """

    chunks: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def live(self) -> int:
        return sum(e - s for s, e in self.ranges)


#: At most this many ranges per pack in a root: beyond it the smallest gaps
#: are closed (live bytes may then count a gap: GC keeps more, never less).
MAX_PACK_RANGES = 32


def merge_ranges(ranges, limit: int | None = None) -> tuple[tuple[int, int], ...]:
    """Sorted, disjoint ``(start, end)`` ranges covering the same bytes.

    With ``limit``, at most that many ranges: the smallest gaps between
    them are closed first (the result then covers a few bytes more).
    """
    out: list[list[int]] = []
    for s, e in sorted(ranges):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    if limit is not None and len(out) > limit:
        gaps = sorted(range(1, len(out)), key=lambda i: out[i][0] - out[i - 1][1], reverse=True)
        keep = sorted(gaps[: limit - 1])  # the largest gaps stay open
        bounds = [0] + keep + [len(out)]
        out = [[out[a][0], out[b - 1][1]] for a, b in zip(bounds, bounds[1:])]
    return tuple((s, e) for s, e in out)


class UnresolvedError(FormatError):
    """A 2.0 shard's chunks were asked for before its chunk table was read."""


@dataclass(frozen=True)
class Shard:
    """A box of the global tensor stored as contiguous C-order bytes.

    ``offsets`` and ``sizes`` give the box in global coordinates; its
    bytes are the concatenation of ``chunks``' raw bytes. In a 2.0 step
    the chunks are in a segment (``table``) until a reader resolves them
    (:meth:`ckptstore.catalog.Catalog.resolve`): ``chunks`` is None until then.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    chunks: tuple[ChunkRef, ...] | None
    table: TableRef | None = None

    def _chunks(self) -> tuple[ChunkRef, ...]:
        if self.chunks is None:
            raise UnresolvedError("the chunk table of this shard was not read (resolve it first)")
        return self.chunks

    @property
    def nbytes(self) -> int:
        return sum(c.raw_len for c in self._chunks())

    def chunk_starts(self) -> list[int]:
        out, pos = [], 0
        for c in self._chunks():
            out.append(pos)
            pos += c.raw_len
        return out


class TensorEntry:
    """One stored tensor: dtype, global shape, shards.

    A 2.0 root keeps a tensor's shard boxes as arrays; :attr:`shards` makes
    :class:`Shard` objects from them on first use, and :meth:`boxes` gives
    the arrays themselves (a reader picks the shards a slice meets with
    them, without a Python object per shard).
    """

    __slots__ = ("key", "dtype", "shape", "_shards", "_offsets", "_sizes", "_tables", "stored_bytes", "nchunks")

    def __init__(self, key: str, dtype: str, shape: tuple[int, ...], shards=None, *,
                 offsets: np.ndarray | None = None, sizes: np.ndarray | None = None,
                 tables: np.ndarray | None = None, stored_bytes: int | None = None, nchunks: int | None = None):
        self.key = key
        self.dtype = dtype
        self.shape = tuple(shape)
        self._shards = tuple(shards) if shards is not None else None
        self._offsets, self._sizes, self._tables = offsets, sizes, tables
        if self._shards is not None and all(s.chunks is not None for s in self._shards):
            stored_bytes = sum(c.stored_len for s in self._shards for c in s.chunks)
            nchunks = sum(len(s.chunks) for s in self._shards)
        self.stored_bytes = stored_bytes
        self.nchunks = nchunks

    def __repr__(self) -> str:
        return f"TensorEntry({self.key!r}, {self.dtype}, {list(self.shape)}, {self.nshards} shard(s))"

    def __eq__(self, other) -> bool:
        if not isinstance(other, TensorEntry):
            return NotImplemented
        return (self.key, self.dtype, self.shape, self.shards) == (other.key, other.dtype, other.shape, other.shards)

    __hash__ = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def nshards(self) -> int:
        return len(self._shards) if self._shards is not None else len(self._offsets)

    @property
    def shards(self) -> tuple[Shard, ...]:
        if self._shards is None:
            offs, sizes, tabs = self._offsets.tolist(), self._sizes.tolist(), self._tables.tolist()
            self._shards = tuple(
                Shard(tuple(o), tuple(n), None, TableRef(*t)) for o, n, t in zip(offs, sizes, tabs)
            )
        return self._shards

    def shard(self, i: int) -> Shard:
        """Shard ``i`` (made from the arrays alone when the shards were not materialized)."""
        if self._shards is not None:
            return self._shards[i]
        return Shard(tuple(self._offsets[i].tolist()), tuple(self._sizes[i].tolist()), None,
                     TableRef(*(int(x) for x in self._tables[i])))

    def boxes(self) -> tuple[np.ndarray, np.ndarray]:
        """``(offsets, sizes)``: int64 arrays of shape (shards, dims)."""
        if self._offsets is None:
            n, nd = len(self._shards), len(self.shape)
            self._offsets = np.array([s.offsets for s in self._shards], dtype=np.int64).reshape(n, nd)
            self._sizes = np.array([s.sizes for s in self._shards], dtype=np.int64).reshape(n, nd)
        return self._offsets, self._sizes

    def meeting(self, lo, sizes) -> np.ndarray:
        """Indices of the shards whose boxes overlap the box at ``lo`` of ``sizes`` (empty shards never do)."""
        offs, szs = self.boxes()
        if len(offs) == 0 or offs.shape[1] == 0:
            return np.arange(len(offs))
        lo = np.asarray(lo, dtype=np.int64)
        hi = lo + np.asarray(sizes, dtype=np.int64)
        meet = np.all((offs < hi) & (offs + szs > lo), axis=1) & np.all(szs > 0, axis=1)
        return np.nonzero(meet)[0]

    def known_chunks(self, i: int) -> tuple[ChunkRef, ...] | None:
        """Shard ``i``'s chunks if this entry already holds them (1.0, or built by a writer)."""
        if self._shards is None:
            return None
        return self._shards[i].chunks

    def weight(self) -> int:
        """Estimated bytes this entry holds in memory."""
        w = 400
        if self._offsets is not None:
            w += self._offsets.nbytes + self._sizes.nbytes + (self._tables.nbytes if self._tables is not None else 0)
        if self._shards is not None:
            w += 200 * len(self._shards) + 700 * sum(len(s.chunks) for s in self._shards if s.chunks is not None)
        return w

    def tables(self) -> np.ndarray | None:
        """``(segment, first, count)`` of every shard, an int64 array (shards, 3); None if a shard has none."""
        if self._tables is None:
            if any(s.table is None for s in self._shards):
                return None
            self._tables = np.array(
                [(s.table.segment, s.table.first, s.table.count) for s in self._shards], dtype=np.int64
            ).reshape(-1, 3)
        return self._tables

    def with_shards(self, shards) -> "TensorEntry":
        """The same tensor with other (e.g. resolved) shards."""
        return TensorEntry(self.key, self.dtype, self.shape, shards,
                           stored_bytes=self.stored_bytes, nchunks=self.nchunks)


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
    #: 2.0: the chunk-table segments, and which bytes of each pack the step uses.
    segments: tuple[SegmentRef, ...] = ()
    pack_use: dict = field(default_factory=dict)  # pack id -> PackUsage

    def chunk_refs(self):
        """Every chunk reference, for a manifest whose shards are all resolved (1.0, or built by a writer)."""
        for t in self.tensors.values():
            for s in t.shards:
                yield from s._chunks()

    @property
    def inline(self) -> bool:
        """Whether every shard's chunks are in the manifest itself (1.0)."""
        return self.version[0] < 2


# ------------------------------------------------------------------ encode
def to_json(m: Manifest) -> bytes:
    """The manifest's bytes, in the format of its version (2.0 for new steps)."""
    if m.version[0] >= 2:
        return _to_json_v2(m)
    return _to_json_v1(m)


def _common_doc(m: Manifest) -> dict:
    """The fields both versions write first, in this order (GC reads ``created`` from a root's first bytes)."""
    return {"format": FORMAT, "version": list(m.version), "step": m.step, "created": m.created,
            "base_step": m.base_step, "metadata": m.metadata, "stats": m.stats}


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


def _load_doc(data: bytes) -> tuple[dict, tuple[int, int]]:
    """The manifest's JSON object and version, bounded and checked to be a manifest."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise FormatError(f"manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"manifest is not valid JSON (truncated or corrupted?): {e}") from None
    if type(doc) is not dict or doc.get("format") != FORMAT:
        raise FormatError("object is not a ckptstore manifest (missing or wrong 'format' field)")
    return doc, check_version(doc.get("version"))


def _common_fields(doc: dict, expect_step: int | None):
    """``(step, created, base_step, metadata, stats)``, the fields both versions share."""
    step = _int(doc.get("step"), "step")
    if expect_step is not None and step != expect_step:
        _fail("step", f"manifest says step {step}, but is stored as step {expect_step}")
    created = doc.get("created")
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
    return step, created, base_step, metadata, stats


def _manifest(doc: dict, version, common: tuple, packs: dict, tensors: dict, **v2) -> Manifest:
    """The :class:`Manifest` of a parsed document, once its tree and DCP metadata check against ``tensors``."""
    step, created, base_step, metadata, stats = common
    tree = doc["tree"]
    _check_tree(tree, tensors, "tree", 0)
    dcp = doc.get("dcp")
    if dcp is not None:
        _check_dcp(dcp, tensors)
    return Manifest(step=step, created=float(created), tensors=tensors, tree=tree, packs=packs,
                    metadata=metadata, base_step=base_step, stats=stats, dcp=dcp, version=version, **v2)


def _dtype_and_shape(t: dict, w: str) -> tuple[str, tuple[int, ...]]:
    """A tensor entry's dtype and shape, bounded (both versions)."""
    dtype = t["dtype"]
    if type(dtype) is not str or dtype not in DTYPES:
        _fail(w, f"unknown dtype {dtype!r:.40}")
    shape = _list(t["shape"], w + " shape")
    if len(shape) > MAX_DIMS:
        _fail(w, f"{len(shape)} dimensions, over the limit {MAX_DIMS}")
    shape = tuple(_int(d, w + " shape", 0, MAX_TENSOR_BYTES) for d in shape)
    if math.prod(shape) * DTYPES[dtype].itemsize > MAX_TENSOR_BYTES:
        _fail(w, f"shape {shape} is over the {MAX_TENSOR_BYTES}-byte limit")
    return dtype, shape


def from_json(data: bytes, expect_step: int | None = None) -> Manifest:
    """Parse and validate a manifest (1.x or 2.x); raises :class:`FormatError` on any defect."""
    doc, version = _load_doc(data)
    if version[0] >= 2:
        return _from_doc_v2(doc, version, expect_step)
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


_PACK_ID = re.compile(r"[0-9a-f]{32}")


def is_pack_id(s: object) -> bool:
    """32 lowercase hex digits (a regex: GC parses hundreds of thousands of them per run)."""
    return isinstance(s, str) and _PACK_ID.fullmatch(s) is not None


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


# ------------------------------------------------------------------ 2.0 roots
#
# A 2.0 root carries, besides the JSON fields of 1.0:
#   "segments": [{"id", "size", "records", "header", "digest"}]
#   "packs":    [{"id", "size", "live"}]     live: stored bytes the step's chunk references use there
#   "tensors":  [{"key", "dtype", "shape", "shards": N, "stored", "chunks", "split": [dim, parts]?}]
#   "columns":  {"boxes": B64, "tables": B64}  zstd frames of little-endian int64 arrays:
#       boxes:  for each tensor without "split", in order, its N x dims offsets then N x dims sizes
#       tables: for every shard of every tensor, in order, (segment, first record, count)

_INT64 = np.dtype("<i8")


def even_split(shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray) -> tuple[int, int] | None:
    """``(dim, parts)`` when the boxes cut ``shape`` along one dim as ``torch.chunk`` does, in order.

    Part ``i`` starts at ``min(i * c, n)`` and holds ``max(0, min(c, n - i * c))``
    rows, ``c = ceil(n / parts)``; every other dim is whole. FSDP's dim-0
    sharding is this form, and so is a single whole-tensor shard.
    """
    parts = len(offsets)
    if parts == 0:
        return None
    for dim in range(len(shape)) if shape else ():
        n = shape[dim]
        c = -(-n // parts)
        i = np.arange(parts, dtype=np.int64)
        want_off = np.zeros_like(offsets)
        want_size = np.broadcast_to(np.array(shape, dtype=np.int64), sizes.shape).copy()
        want_off[:, dim] = np.minimum(i * c, n)
        want_size[:, dim] = np.maximum(0, np.minimum(c, n - i * c))
        if np.array_equal(offsets, want_off) and np.array_equal(sizes, want_size):
            return dim, parts
    if not shape and parts == 1:
        return -1, 1  # a 0-d tensor: one whole shard
    return None


def split_boxes(shape: tuple[int, ...], dim: int, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """The boxes of :func:`even_split`'s form."""
    nd = len(shape)
    offsets = np.zeros((parts, nd), dtype=np.int64)
    sizes = np.broadcast_to(np.array(shape, dtype=np.int64), (parts, nd)).copy()
    if dim >= 0:
        n = shape[dim]
        c = -(-n // parts) if parts else 0
        i = np.arange(parts, dtype=np.int64)
        offsets[:, dim] = np.minimum(i * c, n)
        sizes[:, dim] = np.maximum(0, np.minimum(c, n - i * c))
    return offsets, sizes


def _pack_column(a: np.ndarray) -> str:
    """Delta-coded (each value minus the one before), then zstd: regular layouts shrink to almost nothing."""
    a = np.ascontiguousarray(a, dtype=_INT64)
    d = np.diff(a, prepend=np.int64(0)) if len(a) else a
    raw = d.astype(_INT64).tobytes()
    return base64.b64encode(zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)).decode("ascii")


def _unpack_column(text, n: int, where: str) -> np.ndarray:
    """An int64 array of exactly ``n`` values from a column (bounded before decompressing)."""
    return np.cumsum(_unpack_raw(text, n, where), dtype=_INT64)


def _unpack_raw(text, n: int, where: str) -> np.ndarray:
    if type(text) is not str or len(text) > 4 * (8 * n) + 1024:
        _fail(where, "expected a base64 string of the right size")
    try:
        frame = base64.b64decode(text, validate=True)
    except ValueError:
        _fail(where, "not valid base64")
    want = 8 * n
    try:
        declared = zstandard.frame_content_size(frame)
        if declared not in (-1, want):
            _fail(where, f"holds {declared} bytes, expected {want}")
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=max(want, 1))
    except zstandard.ZstdError as e:
        _fail(where, f"does not decode: {e}")
    if len(raw) != want:
        _fail(where, f"holds {len(raw)} bytes, expected {want}")
    return np.frombuffer(raw, dtype=_INT64)


def _pack_entry(pid: str, size: int, use: PackUsage | None) -> dict:
    use = use or PackUsage(0, ())
    return {"id": pid, "size": size, "chunks": use.chunks, "live": use.live,
            "ranges": [x for r in use.ranges for x in r]}


_PACK_FIELDS = frozenset({"id", "size", "chunks", "live", "ranges"})


def _parse_pack_entry(p, where: str) -> tuple[str, int, PackUsage]:
    # The common case, a well-formed entry, checked in one pass (GC parses
    # hundreds of thousands per run); anything else takes the path below,
    # which accepts and refuses exactly the same entries and names the fault.
    if type(p) is dict and p.keys() == _PACK_FIELDS:
        pid, size, nchunks, live, flat = p["id"], p["size"], p["chunks"], p["live"], p["ranges"]
        if (type(pid) is str and _PACK_ID.fullmatch(pid) is not None and type(size) is int
                and 0 <= size <= MAX_PACK_BYTES and type(nchunks) is int and 0 <= nchunks <= 1 << 40
                and type(live) is int and type(flat) is list and not len(flat) % 2):
            ranges = []
            prev, total = -1, 0
            for k in range(0, len(flat), 2):
                a, b = flat[k], flat[k + 1]
                if type(a) is not int or type(b) is not int or not prev < a < b <= size:  # prev starts at -1
                    break
                ranges.append((a, b))
                total += b - a
                prev = b
            else:
                if total == live:
                    return pid, size, PackUsage(nchunks, tuple(ranges))
    return _parse_pack_entry_checked(p, where)


def _parse_pack_entry_checked(p, where: str) -> tuple[str, int, PackUsage]:
    """:func:`_parse_pack_entry` field by field, naming what is wrong."""
    p = _obj(p, where, _PACK_FIELDS)
    pid = p["id"]
    if not is_pack_id(pid):
        _fail(where + ".id", f"not a pack id: {pid!r:.80}")
    size = _int(p["size"], where + ".size", 0, MAX_PACK_BYTES)
    nchunks = _int(p["chunks"], where + ".chunks", 0, 1 << 40)
    flat = _list(p["ranges"], where + ".ranges")
    if len(flat) % 2:
        _fail(where + ".ranges", "expected start, end pairs")
    ranges = []
    prev = -1
    for k in range(0, len(flat), 2):
        a, b = _int(flat[k], where + ".ranges", 0, size), _int(flat[k + 1], where + ".ranges", 0, size)
        if not prev < a < b if prev >= 0 else not a < b:
            _fail(where + ".ranges", "ranges must be sorted, disjoint and non-empty")
        ranges.append((a, b))
        prev = b
    use = PackUsage(nchunks, tuple(ranges))
    if _int(p["live"], where + ".live", 0, size) != use.live:
        _fail(where + ".live", "does not match its ranges")
    return pid, size, use


def _to_json_v2(m: Manifest) -> bytes:
    seg_index = {s.id: i for i, s in enumerate(m.segments)}
    boxes, tables, tensors = [], [], []
    for t in m.tensors.values():
        offs, sizes = t.boxes()
        tabs = t.tables()
        if tabs is None or len(tabs) != len(offs):
            raise ValueError(f"tensor {t.key!r}: every shard needs its chunk-table run to write a 2.0 manifest")
        entry = {"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "shards": int(len(offs)),
                 "stored": int(t.stored_bytes or 0), "chunks": int(t.nchunks or 0)}
        split = even_split(t.shape, offs, sizes)
        if split is not None:
            entry["split"] = list(split)
        else:
            boxes.append(offs.reshape(-1))
            boxes.append(sizes.reshape(-1))
        tables.append(tabs)
        tensors.append(entry)
    if len(seg_index) != len(m.segments):
        raise ValueError("duplicate segment ids")
    doc = {
        **_common_doc(m),
        "segments": [
            {"id": s.id, "size": s.size, "records": s.records, "header": s.header, "digest": s.digest}
            for s in m.segments
        ],
        "packs": [_pack_entry(p, m.packs[p], m.pack_use.get(p)) for p in sorted(m.packs)],
        "tensors": tensors,
        "columns": {
            "boxes": _pack_column(np.concatenate(boxes) if boxes else np.zeros(0, _INT64)),
            # column by column (all segments, all firsts, all counts): runs delta-code well
            "tables": _pack_column(np.concatenate(tables).T.reshape(-1) if tables else np.zeros(0, _INT64)),
        },
        "tree": m.tree,
        "dcp": m.dcp,
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=True, ensure_ascii=False).encode("utf-8")


def _from_doc_v2(doc: dict, version: tuple[int, int], expect_step: int | None) -> Manifest:
    doc = _obj(
        doc,
        "",
        {"format", "version", "step", "created", "packs", "segments", "tensors", "columns", "tree"},
        {"metadata", "stats", "base_step", "dcp"},
    )
    step, created, base_step, metadata, stats = _common_fields(doc, expect_step)

    packs: dict[str, int] = {}
    use: dict[str, PackUsage] = {}
    for i, p in enumerate(_list(doc["packs"], "packs")):
        pid, size, u = _parse_pack_entry(p, f"packs[{i}]")
        if pid in packs:
            _fail(f"packs[{i}].id", f"duplicate pack {pid}")
        packs[pid] = size
        use[pid] = u

    segments = []
    seen = set()
    for i, g in enumerate(_list(doc["segments"], "segments")):
        g = _obj(g, f"segments[{i}]", {"id", "size", "records", "header", "digest"})
        if not is_pack_id(g["id"]) or g["id"] in seen:
            _fail(f"segments[{i}].id", "not a segment id, or a duplicate")
        seen.add(g["id"])
        d = g["digest"]
        if type(d) is not str or len(d) != 64 or any(c not in "0123456789abcdef" for c in d):
            _fail(f"segments[{i}].digest", "expected 64 lowercase hex digits")
        size = _int(g["size"], f"segments[{i}].size", 0, MAX_PACK_BYTES)
        records = _int(g["records"], f"segments[{i}].records", 0, 1 << 40)
        header = _int(g["header"], f"segments[{i}].header", 0, size)
        if header + 56 * records != size:
            _fail(f"segments[{i}]", f"size {size} does not hold a {header}-byte header and {records} records")
        segments.append(SegmentRef(g["id"], size, records, header, d))
    seg_records = np.array([s.records for s in segments], dtype=np.int64)

    specs = []
    total_shards = 0
    total_box = 0
    for i, t in enumerate(_list(doc["tensors"], "tensors")):
        w = f"tensors[{i}]"
        t = _obj(t, w, {"key", "dtype", "shape", "shards", "stored", "chunks"}, {"split"})
        key = _str(t["key"], w + ".key")
        w = f"tensor {key!r}"
        dtype, shape = _dtype_and_shape(t, w)
        n = _int(t["shards"], w + " shards", 0, MAX_SHARDS)
        split = t.get("split")
        if split is not None:
            if type(split) is not list or len(split) != 2 or split[1] != n:
                _fail(w, "split must be [dim, parts] with parts == shards")
            dim = split[0]
            if type(dim) is not int or not (-1 <= dim < max(1, len(shape))) or (dim == -1) != (len(shape) == 0):
                _fail(w, f"split dim {dim!r:.20} does not fit the shape")
        else:
            total_box += 2 * n * len(shape)
        total_shards += n
        if total_shards > MAX_SHARDS:
            _fail("tensors", "too many shards")
        specs.append((key, dtype, shape, n, split, _int(t["stored"], w + " stored", 0, MAX_TENSOR_BYTES),
                      _int(t["chunks"], w + " chunks", 0, 1 << 40)))

    cols = _obj(doc["columns"], "columns", {"boxes", "tables"})
    boxes = _unpack_column(cols["boxes"], total_box, "columns.boxes")
    tables = _unpack_column(cols["tables"], 3 * total_shards, "columns.tables").reshape(3, -1).T
    if len(tables):
        seg, first, count = tables[:, 0], tables[:, 1], tables[:, 2]
        if np.any(seg < 0) or np.any(seg >= len(segments)) or np.any(first < 0) or np.any(count < 0):
            _fail("columns.tables", "a shard names a segment or record outside the manifest's segments")
        if np.any(first + count > seg_records[seg]):
            _fail("columns.tables", "a shard's records run past the end of its segment")

    tensors: dict[str, TensorEntry] = {}
    bpos = tpos = 0
    for key, dtype, shape, n, split, stored, nchunks in specs:
        if key in tensors:
            _fail(f"tensor {key!r}", "duplicate tensor key")
        nd = len(shape)
        if split is not None:
            offs, sizes = split_boxes(shape, split[0], n)
        else:
            offs = boxes[bpos : bpos + n * nd].reshape(n, nd)
            sizes = boxes[bpos + n * nd : bpos + 2 * n * nd].reshape(n, nd)
            bpos += 2 * n * nd
            if np.any(offs < 0) or np.any(sizes < 0) or np.any(offs + sizes > np.array(shape, dtype=np.int64)):
                _fail(f"tensor {key!r}", "a shard box reaches outside the tensor's shape")
        tabs = tables[tpos : tpos + n]
        tpos += n
        tensors[key] = TensorEntry(key, dtype, shape, offsets=offs, sizes=sizes, tables=tabs,
                                   stored_bytes=stored, nchunks=nchunks)

    return _manifest(doc, version, (step, created, base_step, metadata, stats), packs, tensors,
                     segments=tuple(segments), pack_use=use)


# ------------------------------------------------------------------ what a step references (GC)
@dataclass
class StepRefs:
    """What one step (or tombstone) keeps alive, as GC needs it.

    ``packs`` maps each pack the step names to its size at commit; ``use``
    which of its bytes the step uses (2.0; None for 1.0); ``segments`` its
    chunk-table segments (2.0); ``chunks`` every chunk reference of a 1.0
    manifest (None for 2.0: GC works per pack).
    """

    step: int
    created: float
    packs: dict[str, int]
    use: dict[str, PackUsage] | None
    segments: tuple[str, ...]
    chunks: list[ChunkRef] | None
    stats: dict


def refs_of(m: Manifest) -> StepRefs:
    if m.inline:
        return StepRefs(m.step, m.created, dict(m.packs), None, (), list(m.chunk_refs()), m.stats)
    return StepRefs(m.step, m.created, dict(m.packs), dict(m.pack_use), tuple(s.id for s in m.segments), None, m.stats)


def parse_refs(data: bytes, expect_step: int | None = None, intern: dict | None = None) -> StepRefs:
    """:class:`StepRefs` of a manifest, reading a 2.0 root's pack and segment lists only.

    A 1.x manifest is parsed whole (its chunks are its references). A 2.x
    root's packs, segments, step and creation time are validated as
    :func:`from_json` does, except that a pack listed twice is not refused
    (the pack counts as referenced, with its last entry's size and use); its tensors
    and columns are not decoded. ``intern``
    (a dict) shares the pack id strings of many steps.
    """
    doc, version = _load_doc(data)
    if version[0] < 2:
        return refs_of(from_json(data, expect_step))
    intern = {} if intern is None else intern
    step, created, _, _, stats = _common_fields(doc, expect_step)
    packs: dict[str, int] = {}
    use: dict[str, PackUsage] = {}
    for i, p in enumerate(_list(doc.get("packs"), "packs")):
        pid, size, u = _parse_pack_entry(p, f"packs[{i}]")
        pid = intern.setdefault(pid, pid)
        packs[pid] = size
        use[pid] = u
    segs = []
    for i, g in enumerate(_list(doc.get("segments"), "segments")):
        if type(g) is not dict or not is_pack_id(g.get("id")):
            _fail(f"segments[{i}]", "expected an object with a segment id")
        segs.append(g["id"])
    return StepRefs(step, float(created), packs, use, tuple(segs), None, stats)
