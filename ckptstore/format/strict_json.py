"""Strict, bounded JSON checks shared by the manifest versions: sizes checked before anything is
allocated, unknown fields refused, and no value ever unpickled."""

from __future__ import annotations

import json
import math

from ..errors import FormatError, UnsupportedVersionError
from .model import (
    DTYPES,
    FORMAT,
    MAX_DIMS,
    MAX_KEY_LEN,
    MAX_MANIFEST_BYTES,
    MAX_TENSOR_BYTES,
    VERSION,
    Manifest,
)

def _encode(doc: dict) -> bytes:
    """A manifest document's bytes: compact UTF-8 JSON, as every version writes it."""
    return json.dumps(doc, separators=(",", ":"), allow_nan=True, ensure_ascii=False).encode("utf-8")


def _common_doc(m: Manifest) -> dict:
    """The fields both versions write first, in this order (GC reads ``created`` from a root's first bytes)."""
    return {"format": FORMAT, "version": list(m.version), "step": m.step, "created": m.created,
            "base_step": m.base_step, "metadata": m.metadata, "stats": m.stats}


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
    check_tree(tree, tensors, "tree", 0)
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


# ------------------------------------------------------------------ state-dict tree
#
# Node forms (one key per JSON object):
#   {"t": KEY}            a tensor, KEY indexing the manifest's tensors
#   {"v": VALUE}          a plain JSON value (no tensors inside, dict keys str)
#   {"d": [[K, NODE]...]} a dict; K is a str or an int (optimizer state uses ints)
#   {"l": [NODE...]}      a list
#   {"u": [NODE...]}      a tuple

MAX_TREE_DEPTH = 100


def check_tree(node, tensors, where, depth):
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
            check_tree(item[1], tensors, f"{where}.{item[0]}", depth + 1)
    elif kind in ("l", "u"):
        for i, item in enumerate(_list(val, where)):
            check_tree(item, tensors, f"{where}[{i}]", depth + 1)
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
        check_tree(pd, {}, "dcp.planner_data", 0)
    sm = dcp.get("storage_meta")
    if sm is not None:
        _obj(sm, "dcp.storage_meta", set(), {"checkpoint_id", "save_id", "load_id", "modules"})
        for k in ("checkpoint_id", "save_id", "load_id"):
            if sm.get(k) is not None:
                _str(sm[k], f"dcp.storage_meta.{k}")
        for m in _list(sm.get("modules", []), "dcp.storage_meta.modules"):
            _str(m, "dcp.storage_meta.modules")
