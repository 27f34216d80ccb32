"""What garbage collection lists and what references it: the state GC plans against and re-checks.

:func:`_read_state` lists the store (steps, tombstones, leases, packs,
segments, relocation records); :func:`_referenced` folds the references of
steps (read one at a time, :func:`_step_refs`) into a :class:`_Refs`,
following relocation records; :func:`_chunks_in` finds exactly which chunks
of some packs are used. :mod:`ckptstore.repo.gc` plans and executes with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from .catalog import Catalog
from ..clock import Clock
from ..errors import StepNotFoundError
from ..format.layout import MAX_RELOCATION_HOPS, safety_margin
from ..format.manifest import ChunkRef, StepRefs, merge_ranges
from ..pipeline.relocations import RelocationView


# ---------------------------------------------------------------------- state
@dataclass
class _State:
    """What GC lists: steps (with their creation times), tombstones, leases, packs, segments.

    No step's references are held here: they are read one step at a time
    when needed (:func:`_step_refs`) and folded into a :class:`_Refs`, so
    GC's memory is bounded by the repository's packs, not by steps times
    packs, nor by chunks (2.0 and 3.0 steps are followed by their pack lists; 1.0
    steps carry their chunk references).
    """

    now: float
    steps: dict[int, float]  # step -> created
    tombstones: dict[str, float]  # key -> mtime
    leases: dict[str, float]  # key -> mtime
    packs: dict[str, tuple[int, float]]  # id -> (size, mtime)
    relocations: set[str]  # pack ids with a relocation record
    segments: dict[str, tuple[int, float]] = field(default_factory=dict)  # id -> (size, mtime)
    res: float = 0.0  # the store's mtime resolution
    listed_at: float = 0.0  # when the manifests were listed

    def age(self, mtime: float) -> float:
        """Lower bound of an object's age (truncated mtimes never make it look older)."""
        return self.now - mtime - self.res


def _read_steps(cat: Catalog) -> dict[int, float]:
    """Every committed step with its creation time (a few bytes of each manifest)."""
    out = {}
    for step in cat.steps():
        try:
            out[step] = cat.step_created(step)
        except StepNotFoundError:
            continue  # deleted meanwhile
    return out


def _step_refs(cat: Catalog, steps: Iterable[int], stats: dict | None = None) -> Iterator[StepRefs]:
    """What each of ``steps`` references, read one at a time (steps deleted meanwhile are skipped)."""
    intern: dict[str, str] = {}
    for step in steps:
        try:
            r = cat.step_refs(step, intern)
        except StepNotFoundError:
            continue
        if stats is not None:
            for k in ("logical_bytes", "new_bytes", "stored_bytes"):
                stats[k] = stats.get(k, 0) + int(r.stats.get(k, 0) or 0)
        yield r


def _read_state(cat: Catalog, now: float, clock: Clock | None = None) -> _State:
    leases = cat.leases()
    tombstones = cat.tombstone_keys()
    cat.forget_tombstones(tombstones)  # expired ones: a GC running for weeks keeps only the listed
    packs = {pid: (o.size, o.mtime) for pid, o in cat.packs().items()}
    segments = {sid: (o.size, o.mtime) for sid, o in cat.segments().items()}
    relocs = cat.relocated_packs()
    listed_at = (clock or cat.clock).time()  # manifests are listed last: deletions are timed from here (G3)
    state = _State(now, _read_steps(cat), tombstones, leases, packs, relocs, segments, cat.store.mtime_resolution)
    state.listed_at = listed_at
    return state


def _protecting_tombstones(cat: Catalog, state: _State, grace: float) -> list[StepRefs]:
    """Tombstones that still protect their packs and segments.

    A deleted step's objects stay referenced while the tombstone is younger
    than the grace period and some lease that started before the deletion is
    itself younger than the grace period: only such a saver can have read
    the step as its dedup base (savers write their lease before reading it).
    Only those tombstones are read.
    """
    margin = safety_margin(grace)
    out = []
    for key, tmtime in state.tombstones.items():
        if state.age(tmtime) > grace:
            continue
        if any(
            lmtime <= tmtime + margin + state.res and state.age(lmtime) <= grace
            for lmtime in state.leases.values()
        ):
            refs = cat.tombstone_refs(key)
            if refs is not None:
                out.append(refs)
    return out


def _users(cat: Catalog, state: _State, grace: float) -> Iterator[StepRefs]:
    """Every committed step of ``state`` and every protecting tombstone, one at a time."""
    yield from _step_refs(cat, sorted(state.steps))
    yield from _protecting_tombstones(cat, state, grace)


@dataclass
class _Refs:
    """What a set of steps references.

    packs: pack ids (following relocation records to where moved chunks are);
    chunks: per pack, ``(offset, stored_len, hash)`` of the 1.0 steps' chunks;
    ranges: per pack, the byte ranges 2.0 and 3.0 steps use (their union is exact);
    counts: per pack, how many chunks it holds, where a 2.0 or 3.0 step recorded it;
    segments: chunk-table segment ids.
    """

    packs: set[str] = field(default_factory=set)
    chunks: dict[str, set[tuple[int, int, str]]] = field(default_factory=dict)
    ranges: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    segments: set[str] = field(default_factory=set)

    def add_ranges(self, pid: str, ranges: tuple[tuple[int, int], ...]) -> None:
        """Fold one step's ranges of a pack into the union (most steps repeat the last one's)."""
        have = self.ranges.get(pid)
        if have is None or have == ranges:
            self.ranges[pid] = ranges
        else:
            self.ranges[pid] = merge_ranges(have + ranges)

    def live_bytes(self, pid: str) -> int:
        spans = list(self.ranges.get(pid, ()))
        spans += [(off, off + sl) for off, sl, _ in self.chunks.get(pid, ())]
        return sum(e - s for s, e in merge_ranges(spans))

    def live_chunks(self, pid: str) -> int:
        """Chunks in the pack's table (for its overhead): recorded, else the 1.0 chunks seen."""
        return self.counts.get(pid) or len(self.chunks.get(pid, ()))


def _referenced(view: RelocationView, steps: Iterable[StepRefs], existing: dict[str, Any], relocs: set[str]) -> _Refs:
    """What these steps reference, following relocation records.

    A 1.0 step is followed chunk by chunk (every hop's pack holds the chunk
    until the next one exists). A 2.0 step is followed pack by pack, with
    the byte ranges it recorded: a pack that is gone keeps every pack its
    relocation record names, with the ranges the moved chunks occupy there
    (a superset of what the step needs: safe, and bounded by packs).
    """
    out = _Refs()
    for r in steps:
        out.segments.update(r.segments)
        if r.chunks is not None:
            for c in r.chunks:
                for hop in view.chain(c, existing, relocs):
                    out.packs.add(hop.pack)
                    out.chunks.setdefault(hop.pack, set()).add((hop.offset, hop.stored_len, hop.hash))
            continue
        for pid, u in r.use.items():
            out.add_ranges(pid, u.ranges)
            if u.chunks:
                out.counts[pid] = max(out.counts.get(pid, 0), u.chunks)
        for pid in r.packs:
            _follow_pack(view, pid, existing, relocs, out)
    return out


def _follow_pack(view: RelocationView, pid: str, existing, relocs, out: _Refs, hops: int = 0) -> None:
    """Mark ``pid``; if it is gone and was repacked, mark where its chunks went."""
    out.packs.add(pid)
    if pid in existing or pid not in relocs or hops >= MAX_RELOCATION_HOPS:
        return
    moved: dict[str, list[tuple[int, int]]] = {}
    for c in (view.table(pid) or {}).values():
        moved.setdefault(c.pack, []).append((c.offset, c.offset + c.stored_len))
    for new, spans in moved.items():
        out.add_ranges(new, merge_ranges(spans))
        if new not in out.packs:
            _follow_pack(view, new, existing, relocs, out, hops + 1)


def _chunks_in(cat: Catalog, steps: Iterable[StepRefs], pids: set[str], view: RelocationView,
               existing, relocs) -> dict[str, set[tuple[int, int, str]]]:
    """Exactly which chunks of packs ``pids`` these steps use: their chunk
    tables are read only for 2.0 and 3.0 steps that name one of those packs."""
    out: dict[str, set[tuple[int, int, str]]] = {}

    def add(c: ChunkRef) -> None:
        for hop in view.chain(c, existing, relocs):
            if hop.pack in pids:
                out.setdefault(hop.pack, set()).add((hop.offset, hop.stored_len, hop.hash))

    for r in steps:
        if r.chunks is not None:
            for c in r.chunks:
                add(c)
            continue
        if not any(p in pids or p in relocs for p in r.packs):
            continue
        try:
            man = cat.manifest(r.step)
        except StepNotFoundError:
            man = None
        if man is None or man.created != r.created:
            continue  # deleted (its tombstone's references were counted) or replaced
        for c in cat.tables.iter_chunks(man):
            add(c)
    return out
