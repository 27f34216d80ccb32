"""What a step references, as garbage collection needs it: its packs (with the bytes it uses), its
segments, and for 1.0 its chunks, read from a 2.0 or 3.0 root's lists without decoding its tensors."""

from __future__ import annotations

from dataclasses import dataclass

from .manifest_v1 import _from_doc_v1
from .manifest_v2 import _parse_pack_entry
from .model import ChunkRef, Manifest, PackUsage, is_pack_id
from .strict_json import _common_fields, _fail, _list, _load_doc

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
    """:class:`StepRefs` of a manifest, reading a 2.0 or 3.0 root's pack and segment lists only.

    A 1.x manifest is parsed whole (its chunks are its references). A 2.x
    root's packs, segments, step and creation time are validated as
    :func:`from_json` does, except that a pack listed twice is not refused
    (the pack counts as referenced, with its last entry's size and use); its tensors
    and columns are not decoded. ``intern``
    (a dict) shares the pack id strings of many steps.
    """
    doc, version = _load_doc(data)
    if version[0] < 2:
        return refs_of(_from_doc_v1(doc, version, expect_step))
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
