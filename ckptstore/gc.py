"""Retention and garbage collection: plan with no writes, then execute.

``plan_gc`` reads the repository and returns a frozen :class:`GCPlan`
(steps to delete, packs to delete, packs to repack, uploads to abort, bytes
to free). ``GCPlan.execute`` acts, re-checking references just before each
deletion. The protocol that makes this safe while savers keep writing,
without a lock, is in ``docs/gc.md``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from . import pack as _pack
from .catalog import Catalog
from .clock import Clock
from .errors import FormatError, ObjectExistsError, ObjectNotFoundError, StepNotFoundError
from .layout import (
    MAX_RELOCATION_HOPS,
    PACK_PREFIX,
    UPLOAD_PREFIX,
    pack_key,
    parse_relocation,
    relocation_key,
    relocation_record,
    safety_margin,
    segment_key,
)
from .manifest import ChunkRef, StepRefs, merge_ranges
from .packs import PackWriter
from .progress import callback as progress_callback
from .relocations import RelocationView
from .storage.base import MultipartInfo
from .units import human_bytes, parse_duration

__all__ = ["RetentionPolicy", "select_steps", "plan_gc", "GCPlan", "GCResult", "PackUse", "space_accounting",
           "parse_duration"]


# ====================================================================== retention
@dataclass(frozen=True)
class RetentionPolicy:
    """Which steps survive; the union of every rule is kept.

    keep_last: the newest N steps.
    keep_every: steps divisible by K.
    keep_within: steps created less than this many seconds ago.
    keep_tags: True keeps every tagged step; a tuple keeps steps with those tags.
    keep_steps: these step numbers.
    The newest committed step is always kept.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_within: float | None = None
    keep_tags: bool | tuple[str, ...] = True
    keep_steps: tuple[int, ...] = ()

    def __post_init__(self):
        if self.keep_last is not None and self.keep_last < 0:
            raise ValueError("keep_last must be >= 0")
        if self.keep_every is not None and self.keep_every < 1:
            raise ValueError("keep_every must be >= 1")


def select_steps(
    steps: dict[int, float], tags: dict[str, int], policy: RetentionPolicy, now: float
) -> dict[int, tuple[str, ...]]:
    """Pure: the steps to keep, each with the rules that keep it.

    ``steps`` maps step -> creation time; ``tags`` maps tag -> step.
    """
    reasons: dict[int, list[str]] = {}

    def keep(s, why):
        reasons.setdefault(s, []).append(why)

    ordered = sorted(steps)
    if ordered:
        keep(ordered[-1], "newest")
    if policy.keep_last:
        for s in ordered[-policy.keep_last :]:
            keep(s, f"last {policy.keep_last}")
    if policy.keep_every:
        for s in ordered:
            if s % policy.keep_every == 0:
                keep(s, f"every {policy.keep_every}")
    if policy.keep_within is not None:
        for s in ordered:
            if now - steps[s] <= policy.keep_within:
                keep(s, "within")
    if policy.keep_tags:
        wanted = None if policy.keep_tags is True else set(policy.keep_tags)
        for name, s in tags.items():
            if s in steps and (wanted is None or name in wanted):
                keep(s, f"tag {name}")
    for s in policy.keep_steps:
        if s in steps:
            keep(s, "explicit")
    return {s: tuple(r) for s, r in reasons.items()}


# ====================================================================== plan
@dataclass(frozen=True)
class PackUse:
    """How much of one pack the kept steps still use."""

    pack: str
    size: int
    mtime: float
    live_bytes: int  # stored bytes of referenced chunks
    live_chunks: int

    @property
    def dead_bytes(self) -> int:
        return max(0, self.size - self.live_bytes)


@dataclass(frozen=True)
class GCPlan:
    """Everything one GC run would do; computed with no writes. Print it, then ``execute()``."""

    url: str
    created: float
    grace: float
    policy: RetentionPolicy
    keep_steps: dict[int, tuple[str, ...]]
    delete_steps: tuple[int, ...]
    delete_packs: tuple[tuple[str, int], ...]
    young_packs: tuple[tuple[str, int], ...]  # unreferenced but younger than the grace period
    protected_packs: tuple[tuple[str, int], ...]  # unreferenced, old, but held by young tombstones
    delete_segments: tuple[tuple[str, int], ...]  # unreferenced chunk-table segments older than the grace period
    repack: tuple[PackUse, ...]
    abort_uploads: tuple[MultipartInfo, ...]
    expired_tombstones: tuple[str, ...]
    stale_leases: tuple[str, ...]
    live_leases: tuple[str, ...]
    stats: dict = field(default_factory=dict)
    #: Tag name -> step as planning saw them; execute keeps a step whose tags changed since.
    tags: dict[str, int] = field(default_factory=dict)
    #: ``uploads/`` markers (a DCP rank's write-back uploads) older than the grace period:
    #: their step was committed (and they were left) or can no longer commit.
    stale_markers: tuple[str, ...] = ()
    repo: Any = field(default=None, repr=False, compare=False)
    #: The clock GC judges ages by, when planning and again when executing.
    clock: Any = field(default=None, repr=False, compare=False)

    @property
    def bytes_to_free(self) -> int:
        return (sum(s for _, s in self.delete_packs) + sum(s for _, s in self.delete_segments)
                + sum(u.size - u.live_bytes for u in self.repack))

    def as_dict(self) -> dict:
        return {
            "url": self.url,
            "grace_seconds": self.grace,
            "keep_steps": {str(s): list(r) for s, r in sorted(self.keep_steps.items())},
            "delete_steps": list(self.delete_steps),
            "delete_packs": [{"pack": p, "size": s} for p, s in self.delete_packs],
            "young_packs": [{"pack": p, "size": s} for p, s in self.young_packs],
            "protected_packs": [{"pack": p, "size": s} for p, s in self.protected_packs],
            "delete_segments": [{"segment": p, "size": s} for p, s in self.delete_segments],
            "repack": [
                {"pack": u.pack, "size": u.size, "live_bytes": u.live_bytes, "live_chunks": u.live_chunks}
                for u in self.repack
            ],
            "abort_uploads": [{"key": u.key, "upload_id": u.upload_id, "initiated": u.initiated} for u in self.abort_uploads],
            "expired_tombstones": list(self.expired_tombstones),
            "stale_leases": list(self.stale_leases),
            "stale_markers": list(self.stale_markers),
            "live_leases": list(self.live_leases),
            "bytes_to_free": self.bytes_to_free,
            "stats": self.stats,
        }

    def __str__(self) -> str:
        lines = [f"GC plan for {self.url} (grace {self.grace:.0f} s)"]
        lines.append(f"  keep {len(self.keep_steps)} step(s): " + ", ".join(
            f"{s} ({'; '.join(r)})" for s, r in sorted(self.keep_steps.items())))
        lines.append(f"  delete {len(self.delete_steps)} step(s): {_short(self.delete_steps)}")
        lines.append(
            f"  delete {len(self.delete_packs)} pack(s), {human_bytes(sum(s for _, s in self.delete_packs))}"
        )
        if self.delete_segments:
            lines.append(
                f"  delete {len(self.delete_segments)} unreferenced chunk-table segment(s), "
                f"{human_bytes(sum(s for _, s in self.delete_segments))}"
            )
        if self.repack:
            live = sum(u.live_bytes for u in self.repack)
            total = sum(u.size for u in self.repack)
            lines.append(
                f"  repack {len(self.repack)} partly used pack(s): {human_bytes(total)} -> {human_bytes(live)} live"
            )
        if self.young_packs:
            lines.append(
                f"  keep {len(self.young_packs)} unreferenced pack(s) younger than the grace period, "
                f"{human_bytes(sum(s for _, s in self.young_packs))}"
            )
        if self.protected_packs:
            lines.append(
                f"  keep {len(self.protected_packs)} pack(s) of recently deleted steps while savers may use them"
            )
        if self.abort_uploads:
            lines.append(f"  abort {len(self.abort_uploads)} incomplete multipart upload(s)")
        if self.live_leases:
            lines.append(f"  {len(self.live_leases)} saver(s) in flight")
        st = self.stats
        if st:
            lines.append(
                f"  stored {human_bytes(st['stored_bytes'])}; kept steps reference {human_bytes(st['referenced_bytes'])}; "
                f"dead bytes in partly used packs {human_bytes(st['partial_dead_bytes'])}"
            )
        lines.append(f"  frees {human_bytes(self.bytes_to_free)}")
        return "\n".join(lines)

    def execute(self, progress: Callable[[str, int, int], None] | bool | None = None) -> "GCResult":
        """Carry the plan out, re-checking every reference just before deleting.

        ``progress``: None, True (bars on stderr) or a callable, as in :mod:`ckptstore.progress`.
        """
        if self.repo is None:
            raise ValueError("this plan is detached from its repository")
        report, close = progress_callback(progress)
        try:
            return _execute(self, self.repo, report)
        finally:
            close()


#: Packs (and segments) GC clears and deletes together, in one
#: ``delete_many``: on S3 four ``DeleteObjects`` requests of 1000 keys in
#: flight (benchmarks/gc_deletes.py: 8.9x faster than a DeleteObject per
#: key on a loopback SeaweedFS, 1.17x faster than 1000-key batches).
DELETE_BATCH = 4000


class _FnClock(Clock):
    """A wall clock given as a function (``lambda: time.time() + ahead``)."""

    def __init__(self, fn: Callable[[], float]):
        self._fn = fn

    def time(self) -> float:
        return self._fn()


def _gc_clock(cat: Catalog, clock) -> Clock:
    if clock is None:
        return cat.clock
    return clock if isinstance(clock, Clock) else _FnClock(clock)


def _short(steps: Iterable[int], n: int = 12) -> str:
    steps = list(steps)
    if not steps:
        return "none"
    head = ", ".join(map(str, steps[:n]))
    return head + (f", ... ({len(steps)} in all)" if len(steps) > n else "")


@dataclass
class GCResult:
    deleted_steps: list[int] = field(default_factory=list)
    skipped_steps: list[tuple[int, str]] = field(default_factory=list)
    deleted_packs: list[str] = field(default_factory=list)
    skipped_packs: list[tuple[str, str]] = field(default_factory=list)
    deleted_segments: list[str] = field(default_factory=list)
    repacked_packs: list[str] = field(default_factory=list)
    new_packs: list[str] = field(default_factory=list)
    aborted_uploads: int = 0
    freed_bytes: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


# ---------------------------------------------------------------------- state
@dataclass
class _State:
    """What GC lists: steps (with their creation times), tombstones, leases, packs, segments.

    No step's references are held here: they are read one step at a time
    when needed (:func:`_step_refs`) and folded into a :class:`_Refs`, so
    GC's memory is bounded by the repository's packs, not by steps times
    packs, nor by chunks (2.0 steps are followed by their pack lists; 1.0
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
    ranges: per pack, the byte ranges 2.0 steps use (their union is exact);
    counts: per pack, how many chunks it holds, where a 2.0 step recorded it;
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
    tables are read only for 2.0 steps that name one of those packs."""
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


def plan_gc(
    cat: Catalog,
    keep_last: int | None = None,
    keep_every: int | None = None,
    keep_within: str | float | None = None,
    keep_tags: bool | Iterable[str] = True,
    keep_steps: Iterable[int] = (),
    grace: str | float | None = None,
    repack: bool = False,
    repack_threshold: float = 0.2,
    now: float | None = None,
    clock: Clock | Callable[[], float] | None = None,
) -> GCPlan:
    """Compute what GC would do. Reads only; see :class:`GCPlan`.

    Parameters
    ----------
    keep_last, keep_every, keep_within, keep_tags, keep_steps:
        Retention rules (:class:`RetentionPolicy`); ``keep_within`` and
        ``grace`` take durations like ``"7d"``, ``"2h"`` or seconds.
    grace:
        Minimum age of an unreferenced object before deletion. Defaults to
        the repository's grace; a smaller value is refused, since savers
        rely on the repository's value.
    repack:
        Rewrite the live chunks of partly used packs when dead bytes in such
        packs exceed ``repack_threshold`` of the stored bytes.
    now, clock:
        The clock GC judges ages by: ``clock`` (a :class:`~ckptstore.clock.Clock`
        or a function returning seconds since the epoch; default: the
        repository's clock) is read when planning and again by
        :meth:`GCPlan.execute` when it re-checks ages before deleting; ``now``
        fixes the planning time only. Tests pass a clock running ahead to see
        what GC does once the grace period has passed.
    """
    repo = cat
    repo.require_repository()  # a mistyped URL is not an empty repository
    gclock = _gc_clock(cat, clock)
    now = gclock.time() if now is None else now
    repo_grace = repo.grace()
    g = repo_grace if grace is None else parse_duration(grace)
    if g < repo_grace:
        raise ValueError(
            f"grace {g:.0f} s is shorter than the repository's grace period ({repo_grace:.0f} s), "
            "which savers rely on; use at least that"
        )
    if isinstance(keep_tags, (list, tuple, set, frozenset)):
        keep_tags = tuple(sorted(keep_tags))
    policy = RetentionPolicy(
        keep_last=keep_last,
        keep_every=keep_every,
        keep_within=parse_duration(keep_within),
        keep_tags=keep_tags if isinstance(keep_tags, (bool, tuple)) else tuple(keep_tags),
        keep_steps=tuple(int(s) for s in keep_steps),
    )
    state = _read_state(repo, now, gclock)
    tags = repo.tags()
    keep = select_steps(state.steps, tags, policy, now)
    delete = [s for s in sorted(state.steps) if s not in keep]

    # Live leases: savers in flight. Their fresh packs are protected by the
    # age rule; keeping the newest step keeps their likely dedup base.
    live_leases = tuple(k for k, t in state.leases.items() if state.age(t) <= g)
    stale_leases = tuple(k for k, t in state.leases.items() if state.age(t) > g)
    stale_markers = tuple(o.key for o in repo.store.list(UPLOAD_PREFIX) if state.age(o.mtime) > g)

    # Steps deleted by this run will be tombstoned; while live leases exist
    # their packs stay protected (execute re-checks).
    view = repo.relocations.view()
    kept_stats: dict = {}
    live = _referenced(view, _step_refs(repo, sorted(keep), kept_stats), state.packs, state.relocations)
    prot = _referenced(
        view,
        itertools.chain(_protecting_tombstones(repo, state, g), _step_refs(repo, delete if live_leases else ())),
        state.packs, state.relocations,
    )

    delete_packs, young, protected = [], [], []
    for pid, (size, mtime) in sorted(state.packs.items()):
        if pid in live.packs:
            continue
        if state.age(mtime) <= g:
            young.append((pid, size))
        elif pid in prot.packs:
            protected.append((pid, size))
        else:
            delete_packs.append((pid, size))
    delete_segments = [
        (sid, size) for sid, (size, mtime) in sorted(state.segments.items())
        if sid not in live.segments and sid not in prot.segments and state.age(mtime) > g
    ]

    uses = []
    for pid in live.packs:
        if pid not in state.packs:
            continue
        size, mtime = state.packs[pid]
        uses.append(PackUse(pid, size, mtime, min(size, live.live_bytes(pid)), live.live_chunks(pid)))
    stored = sum(s for s, _ in state.packs.values())
    referenced = sum(u.live_bytes for u in uses)
    partial = [u for u in uses if u.dead_bytes > _overhead(u.live_chunks)]
    partial_dead = sum(u.dead_bytes for u in partial)
    repack_list: tuple[PackUse, ...] = ()
    if repack and stored and partial_dead / stored > repack_threshold:
        # Only packs old enough that no in-flight save is still writing or
        # committing against them in a way GC cannot see.
        repack_list = tuple(sorted((u for u in partial if state.age(u.mtime) > g), key=lambda u: u.pack))

    uploads = []
    # Uploads of packs, and uploads whose target is unreadable (a saver
    # killed while creating its local upload marker).
    for u in (u for u in repo.store.list_multipart("") if u.key.startswith(PACK_PREFIX) or not u.key):
        if state.age(u.initiated) > g and not live_leases:
            uploads.append(u)
        elif state.age(u.initiated) > g and _older_than_all(u.initiated, state, g):
            uploads.append(u)

    expired = tuple(k for k, t in state.tombstones.items() if state.age(t) > g)
    # Ratios from what each kept step recorded (bounded by steps, not chunks):
    # logical bytes over the bytes they first stored; ckptstore stats counts exactly.
    logical = kept_stats.get("logical_bytes", 0)
    uraw = kept_stats.get("new_bytes", 0)
    ustored = kept_stats.get("stored_bytes", 0)
    stats = {
        "steps": len(state.steps),
        "packs": len(state.packs),
        "segments": len(state.segments),
        "stored_bytes": stored,
        "segment_bytes": sum(s for s, _ in state.segments.values()),
        "referenced_bytes": referenced,
        "partial_packs": len(partial),
        "partial_dead_bytes": partial_dead,
        "partial_dead_share": (partial_dead / stored) if stored else 0.0,
        "kept_logical_bytes": logical,
        "dedup_ratio": (logical / uraw) if uraw else 1.0,
        "compression_ratio": (uraw / ustored) if ustored else 1.0,
    }
    return GCPlan(
        url=repo.url,
        created=now,
        grace=g,
        policy=policy,
        keep_steps=keep,
        delete_steps=tuple(delete),
        delete_packs=tuple(delete_packs),
        young_packs=tuple(young),
        protected_packs=tuple(protected),
        delete_segments=tuple(delete_segments),
        repack=repack_list,
        abort_uploads=tuple(uploads),
        expired_tombstones=expired,
        stale_leases=stale_leases,
        stale_markers=stale_markers,
        live_leases=live_leases,
        stats=stats,
        tags=dict(tags),
        repo=repo,
        clock=gclock,
    )


def _older_than_all(t: float, state: "_State", g: float) -> bool:
    """An upload started before every live lease cannot belong to a live saver."""
    live = [lt for lt in state.leases.values() if state.age(lt) <= g]
    return all(t < lt - safety_margin(g) - state.res for lt in live)


def _overhead(nchunks: int) -> int:
    return _pack.HEADER_SIZE + _pack.FOOTER_SIZE + _pack.ENTRY.size * nchunks + 64


# ====================================================================== execute
def _execute(plan: GCPlan, cat: Catalog, progress) -> GCResult:
    res = GCResult()
    store = cat.store
    clock = plan.clock or cat.clock
    g = plan.grace

    # 1. Steps: re-check tags and the newest step, tombstone, then delete.
    # A step is kept if a tag the policy keeps points at it now, or a tag
    # points at it that did not at planning (the policy judged it untagged).
    kept_tags = plan.policy.keep_tags
    protected: dict[int, str] = {}
    for name, s in cat.tags().items():
        if plan.tags.get(name) != s:
            protected.setdefault(s, "tagged since planning")
        elif kept_tags is True or (kept_tags and name in kept_tags):
            protected.setdefault(s, f"tag {name}")
    latest = cat.latest()
    for i, step in enumerate(plan.delete_steps):
        if step in protected:
            res.skipped_steps.append((step, protected[step]))
            continue
        if step == latest:
            res.skipped_steps.append((step, "newest step"))
            continue
        try:
            cat.delete(step)
            res.deleted_steps.append(step)
        except StepNotFoundError:
            res.skipped_steps.append((step, "already gone"))
        progress("steps", i + 1, len(plan.delete_steps))

    # 2. Repack partly used packs: copy live chunks, record relocations.
    relocated: dict[str, dict[str, ChunkRef]] = {}
    if plan.repack:
        relocated = _repack(cat, plan, res, progress)

    # 3. Re-read everything just before deleting packs, and again whenever
    #    half the safety margin has passed: a deletion must follow the
    #    listing that cleared it by less than the margin (docs/gc.md, G3).
    def reread():
        st = _read_state(cat, clock.time(), clock)
        view = cat.relocations.view()
        return st, view, _referenced(view, _users(cat, st, g), st.packs, st.relocations)

    def needs(st, view) -> dict[str, set[str]]:
        # exactly which chunks of the repacked packs are used now
        found = _chunks_in(cat, _users(cat, st, g), set(relocated), view, st.packs, st.relocations)
        return {pid: {h for _, _, h in found.get(pid, ())} for pid in relocated}

    #    Deletions go out in batches (``store.delete_many``: 1000 keys a
    #    request on S3, four requests in flight). Each batch is cleared
    #    against the latest listing and sent at once; the listing is renewed
    #    before a batch whenever half the margin has passed since it, and a
    #    batch that took over a quarter of the margin makes the next ones
    #    smaller, so every key's deletion stays within the margin of the
    #    listing that cleared it.
    margin = safety_margin(g)
    state, view, refs = reread()
    moved_needs = needs(state, view) if relocated else {}

    def delete_batched(what, items, clear, key_of, done) -> None:
        nonlocal state, view, refs, moved_needs
        size, i = DELETE_BATCH, 0
        while i < len(items):
            if clock.time() - state.listed_at > margin / 2:
                state, view, refs = reread()
                if relocated:
                    moved_needs = needs(state, view)
            part = items[i : i + size]
            i += len(part)
            batch = [c for c in map(clear, part) if c is not None]
            if batch:
                t0 = clock.time()
                store.delete_many([key_of(x) for x, _ in batch])
                done(batch)
                if clock.time() - t0 > margin / 4:
                    size = max(1, size // 4)
            progress(what, i, len(items))

    def clear_pack(pid):
        info = state.packs.get(pid)
        if info is None:
            res.skipped_packs.append((pid, "already gone"))
            return None
        size, mtime = info
        if state.age(mtime) <= g:
            res.skipped_packs.append((pid, "younger than the grace period"))
            return None
        if pid in relocated:
            # Every chunk any manifest (or protecting tombstone) now uses must be relocated.
            if not moved_needs.get(pid, set()) <= set(relocated[pid]):
                res.skipped_packs.append((pid, "gained references during repack"))
                return None
        elif pid in refs.packs:
            res.skipped_packs.append((pid, "referenced again"))
            return None
        return pid, size

    def packs_deleted(batch):
        res.deleted_packs.extend(pid for pid, _ in batch)
        res.freed_bytes += sum(size for _, size in batch)

    todo = [pid for pid, _ in plan.delete_packs] + list(relocated)
    delete_batched("packs", todo, clear_pack, pack_key, packs_deleted)

    # 3b. Chunk-table segments no step (or protecting tombstone) names, old enough.
    state, view, refs = reread()

    def clear_segment(sid):
        info = state.segments.get(sid)
        if info is None or sid in refs.segments or state.age(info[1]) <= g:
            return None
        return sid, info[0]

    def segments_deleted(batch):
        res.deleted_segments.extend(sid for sid, _ in batch)
        res.freed_bytes += sum(size for _, size in batch)

    delete_batched("segments", [sid for sid, _ in plan.delete_segments], clear_segment, segment_key,
                   segments_deleted)

    # 4. Incomplete multipart uploads of crashed savers.
    for u in plan.abort_uploads:
        try:
            store.abort_multipart(u.key, u.upload_id)
            res.aborted_uploads += 1
        except (ObjectNotFoundError, FileNotFoundError):
            pass

    # 5. Expired bookkeeping: tombstones and leases past the grace period,
    #    relocation records nobody needs.
    for key in plan.expired_tombstones:
        store.delete(key)
    for key in plan.stale_leases:
        store.delete(key)
    for key in plan.stale_markers:
        store.delete(key)
    state = _read_state(cat, clock.time(), clock)
    needed = _referenced(cat.relocations.view(), _users(cat, state, g), state.packs, state.relocations)
    for pid in state.relocations:
        if pid not in needed.packs and pid not in state.packs:
            store.delete(relocation_key(pid))
    return res


def _repack(cat: Catalog, plan: GCPlan, res: GCResult, progress) -> dict[str, dict[str, ChunkRef]]:
    """Copy the live chunks of ``plan.repack`` packs into new packs.

    Chunks are read through the repository's chunk fetcher (verified
    against their hashes) and written, as stored, through the pack writer.
    Returns old pack id -> {hash: new location} for packs whose relocation
    record was written.
    """
    store = cat.store
    clock = plan.clock or cat.clock
    state = _read_state(cat, clock.time(), clock)
    live_chunks = _chunks_in(cat, _users(cat, state, plan.grace), {u.pack for u in plan.repack},
                             cat.relocations.view(), state.packs, state.relocations)
    writer = PackWriter(store, cat.runtime, cat.options, window=4)
    moved: dict[str, dict[str, ChunkRef]] = {}
    try:
        for i, use in enumerate(plan.repack):
            chunks = sorted(live_chunks.get(use.pack, set()))
            if not chunks:
                continue
            entries = {e.hash: e for e in _pack.read_table(store, pack_key(use.pack))}
            refs = []
            for off, sl, h in chunks:
                e = entries.get(h)
                if e is None or e.offset != off or e.stored_len != sl:
                    raise FormatError(f"repack: pack {use.pack} has no chunk {h[:16]} at {off}")
                refs.append(ChunkRef(h, use.pack, off, sl, e.raw_len, e.codec))
            stored: list = [None] * len(refs)

            def keep(k: int, raw, data) -> None:
                stored[k] = bytes(data)

            cat.fetcher.fetch(refs, keep, lambda k, p=use.pack: f"{cat.url}: repack of pack {p}: ")
            for r, data in zip(refs, stored):
                moved.setdefault(use.pack, {})[r.hash] = writer.add(r.hash, r.codec, [data], r.raw_len)
            progress("repack", i + 1, len(plan.repack))
        res.new_packs.extend(writer.finish())
    except BaseException:
        writer.abort()
        raise
    # Relocation records are written only once every new pack is complete;
    # like packs and manifests they are written once.
    out: dict[str, dict[str, ChunkRef]] = {}
    for old, table in moved.items():
        try:
            store.put_if_absent(relocation_key(old), relocation_record(old, table))
            out[old] = table
        except ObjectExistsError:
            # An earlier, interrupted repack already moved this pack: its
            # record stands; the copies just made are unreferenced and go
            # with a later GC.
            prev = parse_relocation(store.get(relocation_key(old)), old)
            if not set(table) <= set(prev):
                raise FormatError(f"repack: relocation record of pack {old} exists and lacks chunks") from None
            out[old] = prev
        res.repacked_packs.append(old)
    return out


def space_accounting(repo: Catalog) -> dict:
    """Bytes stored, referenced by committed steps, dead inside partly used packs; ratios.

    Exact: every step's chunk references are read (2.0 chunk tables
    included), so time and memory grow with the chunks of the repository;
    GC's plan uses the bounded per-pack figures instead.
    """
    repo.require_repository()
    state = _read_state(repo, repo.clock.time())
    view = repo.relocations.view()
    chunks: dict[str, set[tuple[int, int, str]]] = {}
    uniq: dict[str, tuple[int, int]] = {}
    logical = 0
    for r in _step_refs(repo, sorted(state.steps)):
        if r.chunks is not None:
            it = r.chunks
        else:
            try:
                it = repo.tables.iter_chunks(repo.manifest(r.step))
            except StepNotFoundError:
                continue  # deleted meanwhile
        for c in it:
            logical += c.raw_len
            uniq[c.hash] = (c.raw_len, c.stored_len)
            for hop in view.chain(c, state.packs, state.relocations):
                chunks.setdefault(hop.pack, set()).add((hop.offset, hop.stored_len, hop.hash))
    stored = sum(s for s, _ in state.packs.values())
    referenced = 0
    partial_packs = partial_dead = unreferenced = 0
    for pid, (size, _) in state.packs.items():
        if pid not in chunks:
            unreferenced += size
            continue
        ch = chunks[pid]
        live = sum(sl for _, sl, _ in ch)
        referenced += live
        if size - live > _overhead(len(ch)):
            partial_packs += 1
            partial_dead += size - live
    uraw = sum(r for r, _ in uniq.values())
    ustored = sum(s for _, s in uniq.values())
    return {
        "url": repo.url,
        "steps": len(state.steps),
        "packs": len(state.packs),
        "segments": len(state.segments),
        "stored_bytes": stored,
        "segment_bytes": sum(s for s, _ in state.segments.values()),
        "referenced_bytes": referenced,
        "unreferenced_pack_bytes": unreferenced,
        "partial_packs": partial_packs,
        "partial_dead_bytes": partial_dead,
        "logical_bytes": logical,
        "unique_raw_bytes": uraw,
        "unique_stored_bytes": ustored,
        "dedup_ratio": (logical / uraw) if uraw else 1.0,
        "compression_ratio": (uraw / ustored) if ustored else 1.0,
        "total_ratio": (logical / stored) if stored else 1.0,
    }
