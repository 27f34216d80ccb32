"""Retention and garbage collection: plan with no writes, then execute.

``plan_gc`` reads the repository and returns a frozen :class:`GCPlan`
(steps to delete, packs to delete, packs to repack, uploads to abort, bytes
to free). ``GCPlan.execute`` acts, re-checking references just before each
deletion. The protocol that makes this safe while savers keep writing,
without a lock, is in ``docs/gc.md``.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..format import pack as _pack
from .catalog import Catalog
from ..clock import Clock
from ..errors import FormatError, ObjectExistsError, ObjectNotFoundError, StepNotFoundError
from .gc_refs import _chunks_in, _protecting_tombstones, _read_state, _referenced, _State, _step_refs, _users
from ..format.layout import (
    PACK_PREFIX,
    UPLOAD_PREFIX,
    pack_key,
    parse_relocation,
    relocation_key,
    relocation_record,
    safety_margin,
    segment_key,
)
from ..format.manifest import ChunkRef
from ..pipeline.pack_writer import PackWriter
from ..progress import callback as progress_callback
from ..storage.base import MultipartInfo
from ..units import human_bytes, parse_duration

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
#: flight (measured against one request per key and against single batches:
#: ``docs/performance.md``, "GC over 1000 steps: deleting").
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
    clock:
        The clock GC judges ages by (a :class:`~ckptstore.clock.Clock` or a
        function returning seconds since the epoch; default: the
        repository's clock), read when planning and again by
        :meth:`GCPlan.execute` when it re-checks ages before deleting. Tests
        pass a clock running ahead to see what GC does once the grace period
        has passed.
    now:
        Deprecated (a warning says so): fixes the planning time only; pass
        ``clock`` instead.
    """
    repo = cat
    repo.require_repository()  # a mistyped URL is not an empty repository
    gclock = _gc_clock(cat, clock)
    if now is not None:
        warnings.warn("plan_gc(now=) is deprecated: pass clock= (a Clock or a function returning "
                      "seconds since the epoch)", DeprecationWarning, stacklevel=2)
    now = gclock.time() if now is None else now
    g = _check_grace(repo, grace)
    policy = _policy(keep_last, keep_every, keep_within, keep_tags, keep_steps)
    state = _read_state(repo, now, gclock)
    tags = repo.tags()
    keep = select_steps(state.steps, tags, policy, now)
    delete = [s for s in sorted(state.steps) if s not in keep]
    live_leases, stale_leases, stale_markers = _leases(repo, state, g)
    garbage = _plan_garbage(repo, state, g, keep, delete, live_leases)
    repack_list: tuple[PackUse, ...] = ()
    if repack and garbage.stats["stored_bytes"] and garbage.stats["partial_dead_share"] > repack_threshold:
        # Only packs old enough that no in-flight save is still writing or
        # committing against them in a way GC cannot see.
        repack_list = tuple(sorted((u for u in garbage.partial if state.age(u.mtime) > g), key=lambda u: u.pack))
    uploads = _abandoned_uploads(repo, state, g, live_leases)
    expired = tuple(k for k, t in state.tombstones.items() if state.age(t) > g)
    return GCPlan(
        url=repo.url,
        created=now,
        grace=g,
        policy=policy,
        keep_steps=keep,
        delete_steps=tuple(delete),
        delete_packs=tuple(garbage.delete_packs),
        young_packs=tuple(garbage.young),
        protected_packs=tuple(garbage.protected),
        delete_segments=tuple(garbage.delete_segments),
        repack=repack_list,
        abort_uploads=tuple(uploads),
        expired_tombstones=expired,
        stale_leases=stale_leases,
        stale_markers=stale_markers,
        live_leases=live_leases,
        stats=garbage.stats,
        tags=dict(tags),
        repo=repo,
        clock=gclock,
    )


def _check_grace(repo: Catalog, grace: str | float | None) -> float:
    """The grace period a plan uses: the repository's unless a longer one is asked for."""
    repo_grace = repo.grace()
    g = repo_grace if grace is None else parse_duration(grace)
    if g < repo_grace:
        raise ValueError(
            f"grace {g:.0f} s is shorter than the repository's grace period ({repo_grace:.0f} s), "
            "which savers rely on; use at least that"
        )
    return g


def _policy(keep_last, keep_every, keep_within, keep_tags, keep_steps) -> RetentionPolicy:
    if isinstance(keep_tags, (list, tuple, set, frozenset)):
        keep_tags = tuple(sorted(keep_tags))
    return RetentionPolicy(
        keep_last=keep_last,
        keep_every=keep_every,
        keep_within=parse_duration(keep_within),
        keep_tags=keep_tags if isinstance(keep_tags, (bool, tuple)) else tuple(keep_tags),
        keep_steps=tuple(int(s) for s in keep_steps),
    )


def _leases(repo: Catalog, state: "_State", g: float) -> tuple[tuple, tuple, tuple]:
    """Live leases (savers in flight), stale leases, and stale upload markers.

    Live savers' fresh packs are protected by the age rule; keeping the newest
    step keeps their likely dedup base.
    """
    live_leases = tuple(k for k, t in state.leases.items() if state.age(t) <= g)
    stale_leases = tuple(k for k, t in state.leases.items() if state.age(t) > g)
    stale_markers = tuple(o.key for o in repo.store.list(UPLOAD_PREFIX) if state.age(o.mtime) > g)
    return live_leases, stale_leases, stale_markers


@dataclass
class _Garbage:
    """What no kept step references: the packs and segments to delete, and the space figures."""

    delete_packs: list
    young: list
    protected: list
    delete_segments: list
    stats: dict
    partial: list


def _plan_garbage(repo: Catalog, state: "_State", g: float, keep, delete, live_leases) -> _Garbage:
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
    delete_packs, young, protected = _classify_packs(state, live, prot, g)
    delete_segments = [
        (sid, size) for sid, (size, mtime) in sorted(state.segments.items())
        if sid not in live.segments and sid not in prot.segments and state.age(mtime) > g
    ]
    stats, partial = _space(state, live, kept_stats)
    return _Garbage(delete_packs, young, protected, delete_segments, stats, partial)


def _classify_packs(state: "_State", live, prot, g: float):
    """Unreferenced packs: to delete, too young (within the grace period), or protected by a
    tombstone or a live saver's likely base; ``(pid, size)`` each, sorted."""
    delete, young, protected = [], [], []
    for pid, (size, mtime) in sorted(state.packs.items()):
        if pid in live.packs:
            continue
        if state.age(mtime) <= g:
            young.append((pid, size))
        elif pid in prot.packs:
            protected.append((pid, size))
        else:
            delete.append((pid, size))
    return delete, young, protected


def _space(state: "_State", live, kept_stats: dict) -> tuple[dict, list]:
    """The plan's figures, and the partly used packs (dead bytes past their overhead)."""
    uses = []
    for pid in live.packs:
        if pid not in state.packs:
            continue
        size, mtime = state.packs[pid]
        uses.append(PackUse(pid, size, mtime, min(size, live.live_bytes(pid)), live.live_chunks(pid)))
    stored = sum(s for s, _ in state.packs.values())
    partial = [u for u in uses if u.dead_bytes > _overhead(u.live_chunks)]
    partial_dead = sum(u.dead_bytes for u in partial)
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
        "referenced_bytes": sum(u.live_bytes for u in uses),
        "partial_packs": len(partial),
        "partial_dead_bytes": partial_dead,
        "partial_dead_share": (partial_dead / stored) if stored else 0.0,
        "kept_logical_bytes": logical,
        "dedup_ratio": (logical / uraw) if uraw else 1.0,
        "compression_ratio": (uraw / ustored) if ustored else 1.0,
    }
    return stats, partial


def _abandoned_uploads(repo: Catalog, state: "_State", g: float, live_leases) -> list:
    """Unfinished multipart uploads of packs (or of an unreadable target: a saver killed while
    creating its local upload marker) older than the grace period that no live saver can own."""
    uploads = []
    for u in (u for u in repo.store.list_multipart("") if u.key.startswith(PACK_PREFIX) or not u.key):
        if state.age(u.initiated) > g and (not live_leases or _older_than_all(u.initiated, state, g)):
            uploads.append(u)
    return uploads


def _older_than_all(t: float, state: "_State", g: float) -> bool:
    """An upload started before every live lease cannot belong to a live saver."""
    live = [lt for lt in state.leases.values() if state.age(lt) <= g]
    return all(t < lt - safety_margin(g) - state.res for lt in live)


def _overhead(nchunks: int) -> int:
    return _pack.HEADER_SIZE + _pack.FOOTER_SIZE + _pack.ENTRY.size * nchunks + 64


# ====================================================================== execute
def _execute(plan: GCPlan, cat: Catalog, progress) -> GCResult:
    return _Executor(plan, cat, progress).run()


class _Executor:
    """One run of :meth:`GCPlan.execute`, phase by phase (each a method):

    1. :meth:`delete_steps`: re-check tags and the newest step, tombstone, delete;
    2. repack partly used packs (:func:`_repack`): copy live chunks, record relocations;
    3. :meth:`delete_packs`, then :meth:`delete_segments`: each batch cleared against the
       latest listing (:meth:`clear_pack`, :meth:`clear_segment`), re-read whenever half
       the safety margin has passed (:meth:`delete_batched`, docs/gc.md, G3);
    4. :meth:`abort_uploads` of crashed savers;
    5. :meth:`expire_bookkeeping`: tombstones, leases and upload markers past the grace
       period, relocation records nobody needs.
    """

    def __init__(self, plan: GCPlan, cat: Catalog, progress):
        self.plan = plan
        self.cat = cat
        self.store = cat.store
        self.progress = progress
        self.clock = plan.clock or cat.clock
        self.g = plan.grace
        self.margin = safety_margin(plan.grace)
        self.res = GCResult()
        self.relocated: dict[str, dict[str, ChunkRef]] = {}
        self.moved_needs: dict[str, set[str]] = {}
        self.state = self.view = self.refs = None

    def run(self) -> GCResult:
        self.delete_steps()
        if self.plan.repack:
            self.relocated = _repack(self.cat, self.plan, self.res, self.progress)
        self.delete_packs()
        self.delete_segments()
        self.abort_uploads()
        self.expire_bookkeeping()
        return self.res

    # ------------------------------------------------------------ 1. steps
    def delete_steps(self) -> None:
        """A step is kept if a tag the policy keeps points at it now, or a tag points at it that
        did not at planning (the policy judged it untagged), or it is the newest step now."""
        plan, res = self.plan, self.res
        kept_tags = plan.policy.keep_tags
        protected: dict[int, str] = {}
        for name, s in self.cat.tags().items():
            if plan.tags.get(name) != s:
                protected.setdefault(s, "tagged since planning")
            elif kept_tags is True or (kept_tags and name in kept_tags):
                protected.setdefault(s, f"tag {name}")
        latest = self.cat.latest()
        for i, step in enumerate(plan.delete_steps):
            if step in protected:
                res.skipped_steps.append((step, protected[step]))
                continue
            if step == latest:
                res.skipped_steps.append((step, "newest step"))
                continue
            try:
                self.cat.delete(step)
                res.deleted_steps.append(step)
            except StepNotFoundError:
                res.skipped_steps.append((step, "already gone"))
            self.progress("steps", i + 1, len(plan.delete_steps))

    # ------------------------------------------------------------ 3. listings and batches
    def reread(self, needs: bool = True) -> None:
        """A fresh listing, and what every step and protecting tombstone references in it (and,
        with ``needs``, which chunks of the repacked packs are used now)."""
        cat = self.cat
        self.state = _read_state(cat, self.clock.time(), self.clock)
        self.view = cat.relocations.view()
        self.refs = _referenced(self.view, _users(cat, self.state, self.g), self.state.packs, self.state.relocations)
        if self.relocated and needs:
            found = _chunks_in(cat, _users(cat, self.state, self.g), set(self.relocated), self.view,
                               self.state.packs, self.state.relocations)
            self.moved_needs = {pid: {h for _, _, h in found.get(pid, ())} for pid in self.relocated}

    def delete_batched(self, what: str, items: list, clear, key_of, done) -> None:
        """Delete ``items`` in batches (``store.delete_many``: 1000 keys a request on S3, four in
        flight), each cleared against the latest listing and sent at once; the listing is renewed
        before a batch whenever half the margin has passed since it, and a batch that took over a
        quarter of the margin makes the next ones smaller, so every key's deletion stays within
        the margin of the listing that cleared it."""
        size, i = DELETE_BATCH, 0
        while i < len(items):
            if self.clock.time() - self.state.listed_at > self.margin / 2:
                self.reread()
            part = items[i : i + size]
            i += len(part)
            batch = [c for c in map(clear, part) if c is not None]
            if batch:
                t0 = self.clock.time()
                self.store.delete_many([key_of(x) for x, _ in batch])
                done(batch)
                if self.clock.time() - t0 > self.margin / 4:
                    size = max(1, size // 4)
            self.progress(what, i, len(items))

    def clear_pack(self, pid: str):
        """``(pid, size)`` if the pack may go now, else None (the reason noted in the result)."""
        res, state = self.res, self.state
        info = state.packs.get(pid)
        if info is None:
            res.skipped_packs.append((pid, "already gone"))
            return None
        size, mtime = info
        if state.age(mtime) <= self.g:
            res.skipped_packs.append((pid, "younger than the grace period"))
            return None
        if pid in self.relocated:
            # Every chunk any manifest (or protecting tombstone) now uses must be relocated.
            if not self.moved_needs.get(pid, set()) <= set(self.relocated[pid]):
                res.skipped_packs.append((pid, "gained references during repack"))
                return None
        elif pid in self.refs.packs:
            res.skipped_packs.append((pid, "referenced again"))
            return None
        return pid, size

    def delete_packs(self) -> None:
        def deleted(batch):
            self.res.deleted_packs.extend(pid for pid, _ in batch)
            self.res.freed_bytes += sum(size for _, size in batch)

        self.reread()
        todo = [pid for pid, _ in self.plan.delete_packs] + list(self.relocated)
        self.delete_batched("packs", todo, self.clear_pack, pack_key, deleted)

    def clear_segment(self, sid: str):
        """``(sid, size)`` for a chunk-table segment no step (or protecting tombstone) names, old enough."""
        info = self.state.segments.get(sid)
        if info is None or sid in self.refs.segments or self.state.age(info[1]) <= self.g:
            return None
        return sid, info[0]

    def delete_segments(self) -> None:
        def deleted(batch):
            self.res.deleted_segments.extend(sid for sid, _ in batch)
            self.res.freed_bytes += sum(size for _, size in batch)

        self.reread(needs=False)
        self.delete_batched("segments", [sid for sid, _ in self.plan.delete_segments], self.clear_segment,
                            segment_key, deleted)

    # ------------------------------------------------------------ 4. and 5.
    def abort_uploads(self) -> None:
        for u in self.plan.abort_uploads:
            try:
                self.store.abort_multipart(u.key, u.upload_id)
                self.res.aborted_uploads += 1
            except (ObjectNotFoundError, FileNotFoundError):
                pass

    def expire_bookkeeping(self) -> None:
        store, plan, cat = self.store, self.plan, self.cat
        for key in (*plan.expired_tombstones, *plan.stale_leases, *plan.stale_markers):
            store.delete(key)
        state = _read_state(cat, self.clock.time(), self.clock)
        needed = _referenced(cat.relocations.view(), _users(cat, state, self.g), state.packs, state.relocations)
        for pid in state.relocations:
            if pid not in needed.packs and pid not in state.packs:
                store.delete(relocation_key(pid))


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
