"""Step manifests: what a committed step holds, as strict JSON.

A manifest is the only object that makes a step exist. It lists every
tensor (dtype, global shape, shards), the non-tensor values of the state
dict and the user's metadata, and says where each shard's chunks are. See
``docs/format.md`` for the schema. These versions are read:

- **1.0**: every shard's chunk list inline, as JSON;
- **2.0** and **3.0** (written now): a *root* holding shard boxes (a compact form for
  even splits, binary columns otherwise) and, per shard, a run of records
  in a chunk-table *segment* (:mod:`ckptstore.format.chunk_table`) that a reader
  fetches only for the shards it reads. The root also lists every pack the
  step references with the stored bytes it uses there. The two differ
  only in the segments they name: 3.0 segments have small blocks, each
  with a Merkle proof, so reading one shard costs about 1 KB per segment.

Parsing is strict and bounded: sizes are checked before anything is
allocated, unknown fields are refused, and no value is ever unpickled.
"""

from __future__ import annotations

from .manifest_v1 import _from_doc_v1, _to_json_v1
from .manifest_v2 import _from_doc_v2, _to_json_v2
from .model import (
    DTYPES,
    FORMAT,
    MAX_CHUNK_BYTES,
    MAX_DIMS,
    MAX_KEY_LEN,
    MAX_MANIFEST_BYTES,
    MAX_PACK_BYTES,
    MAX_PACK_RANGES,
    MAX_SHARDS,
    MAX_TENSOR_BYTES,
    V1,
    VERSION,
    ChunkRef,
    Manifest,
    PackUsage,
    SegmentRef,
    Shard,
    TableRef,
    TensorEntry,
    UnresolvedError,
    dtype_name,
    even_split,
    is_pack_id,
    itemsize,
    merge_ranges,
    split_boxes,
)
from .refs import StepRefs, parse_refs, refs_of
from .strict_json import MAX_TREE_DEPTH, _load_doc, check_tree, check_version

__all__ = [
    "DTYPES", "FORMAT", "MAX_CHUNK_BYTES", "MAX_DIMS", "MAX_KEY_LEN", "MAX_MANIFEST_BYTES", "MAX_PACK_BYTES",
    "MAX_PACK_RANGES", "MAX_SHARDS", "MAX_TENSOR_BYTES", "MAX_TREE_DEPTH", "V1", "VERSION", "ChunkRef", "Manifest",
    "PackUsage", "SegmentRef", "Shard", "StepRefs", "TableRef", "TensorEntry", "UnresolvedError", "check_tree",
    "check_version", "dtype_name", "even_split", "from_json", "is_pack_id", "itemsize", "merge_ranges",
    "parse_refs", "refs_of", "split_boxes", "to_json",
]

# ------------------------------------------------------------------ encode
def to_json(m: Manifest) -> bytes:
    """The manifest's bytes, in the format of its version (3.0 for new steps)."""
    if m.version[0] >= 2:
        return _to_json_v2(m)
    return _to_json_v1(m)


def from_json(data: bytes, expect_step: int | None = None) -> Manifest:
    """Parse and validate a manifest (1.x, 2.x or 3.x); raises :class:`FormatError` on any defect."""
    doc, version = _load_doc(data)
    if version[0] >= 2:
        return _from_doc_v2(doc, version, expect_step)
    return _from_doc_v1(doc, version, expect_step)
