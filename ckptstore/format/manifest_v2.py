"""Manifest 2.0, 3.0 and 4.0 roots (the same JSON; a 3.0 root names 3.0 chunk-table segments, a 4.0
root may also give a tensor a ``tile`` shape, :mod:`ckptstore.format.tiles`): shard
boxes (a compact form for even splits, binary columns otherwise), per shard a run of records in a
chunk-table segment, and every pack with the bytes the step uses there."""

from __future__ import annotations

import base64

import numpy as np
import zstandard

from .model import (
    segment_sizes,
    _PACK_ID,
    MAX_PACK_BYTES,
    MAX_SHARDS,
    MAX_TENSOR_BYTES,
    Manifest,
    PackUsage,
    SegmentRef,
    TensorEntry,
    even_split,
    is_pack_id,
    split_boxes,
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

# ------------------------------------------------------------------ 2.0 and 3.0 roots
#
# A 2.0 root carries, besides the JSON fields of 1.0:
#   "segments": [{"id", "size", "records", "header", "digest"}]
#   "packs":    [{"id", "size", "live"}]     live: stored bytes the step's chunk references use there
#   "tensors":  [{"key", "dtype", "shape", "shards": N, "stored", "chunks", "split": [dim, parts]?}]
#   "columns":  {"boxes": B64, "tables": B64}  zstd frames of little-endian int64 arrays:
#       boxes:  for each tensor without "split", in order, its N x dims offsets then N x dims sizes
#       tables: for every shard of every tensor, in order, (segment, first record, count)

_INT64 = np.dtype("<i8")


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
    if m.version[0] == 2 and any(s.size != segment_sizes(s.header, s.records)[0] for s in m.segments):
        raise ValueError("a 2.x root can only name 2.0 chunk-table segments; write it as version 3")
    seg_index = {s.id: i for i, s in enumerate(m.segments)}
    boxes, tables, tensors = [], [], []
    for t in m.tensors.values():
        offs, sizes = t.boxes()
        tabs = t.tables()
        if tabs is None or len(tabs) != len(offs):
            raise ValueError(f"tensor {t.key!r}: every shard needs its chunk-table run to write a 2.0 or 3.0 manifest")
        entry = {"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "shards": int(len(offs)),
                 "stored": int(t.stored_bytes or 0), "chunks": int(t.nchunks or 0)}
        if t.tile is not None:
            if m.version[0] < 4:
                raise ValueError(f"tensor {t.key!r} is tiled: a step with tiles is written as version 4")
            entry["tile"] = list(t.tile)
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
    return _encode(doc)


def _tile(tile, shape: tuple[int, ...], where: str) -> tuple[int, ...] | None:
    """A 4.0 tensor's tile shape: one positive size per dimension, none past the tensor's."""
    if tile is None:
        return None
    if type(tile) is not list or len(tile) != len(shape) or not shape:
        _fail(where + " tile", "expected one tile size per dimension of the tensor")
    for t, n in zip(tile, shape):
        if type(t) is not int or not 1 <= t <= max(1, n):
            _fail(where + " tile", f"tile size {t!r:.20} does not fit the shape {list(shape)}")
    return tuple(tile)


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
        # a 2.x root names 2.0 segments; a 3.x root the 3.0 layout (or, read leniently, 2.0)
        sizes = segment_sizes(header, records)
        if size not in (sizes[:1] if version[0] == 2 else sizes):
            _fail(f"segments[{i}]", f"size {size} does not hold a {header}-byte header and {records} records")
        segments.append(SegmentRef(g["id"], size, records, header, d))
    seg_records = np.array([s.records for s in segments], dtype=np.int64)

    specs = []
    total_shards = 0
    total_box = 0
    for i, t in enumerate(_list(doc["tensors"], "tensors")):
        w = f"tensors[{i}]"
        t = _obj(t, w, {"key", "dtype", "shape", "shards", "stored", "chunks"},
                 {"split", "tile"} if version[0] >= 4 else {"split"})
        key = _str(t["key"], w + ".key")
        w = f"tensor {key!r}"
        dtype, shape = _dtype_and_shape(t, w)
        tile = _tile(t.get("tile"), shape, w)
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
                      _int(t["chunks"], w + " chunks", 0, 1 << 40), tile))

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
    for key, dtype, shape, n, split, stored, nchunks, tile in specs:
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
        if tile is not None and n:
            grid = -(-sizes // np.array(tile, dtype=np.int64))
            if np.any(np.prod(grid, axis=1) != tabs[:, 2]):
                _fail(f"tensor {key!r}", "a shard's record count is not the number of tiles of its box")
        tensors[key] = TensorEntry(key, dtype, shape, offsets=offs, sizes=sizes, tables=tabs,
                                   stored_bytes=stored, nchunks=nchunks, tile=tile)

    return _manifest(doc, version, (step, created, base_step, metadata, stats), packs, tensors,
                     segments=tuple(segments), pack_use=use)
