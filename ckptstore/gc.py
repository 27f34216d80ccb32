"""Retention and garbage collection: plan with no writes, then execute.

``plan_gc`` reads the repository and returns a frozen :class:`GCPlan`
(steps to delete, packs to delete, packs to repack, uploads to abort, bytes
to free). ``GCPlan.execute`` acts, re-checking references just before each
deletion. The protocol that makes this safe while savers keep writing,
without a lock, is in ``docs/gc.md``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from . import codec as _codec
from . import manifest as _m
from . import pack as _pack
from .errors import FormatError, ObjectExistsError, ObjectNotFoundError, StepNotFoundError
from .manifest import Manifest
from .repository import (
    LEASE_PREFIX,
    PACK_PREFIX,
    RELOCATION_FORMAT,
    RELOCATION_PREFIX,
    TOMBSTONE_FORMAT,
    TOMBSTONE_PREFIX,
    RelocationTables,
    Repository,
    pack_key,
    parse_relocation,
    relocation_key,
    safety_margin,
)
from .storage.base import MultipartInfo, ParallelUploader

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str | float | int | None) -> float | None:
    """``"90s"``, ``"15m"``, ``"2h"``, ``"7d"``, ``"1w"`` or a number of seconds."""
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"duration must not be negative: {text}")
        return float(text)
    t = str(text).strip().lower()
    try:
        if t and t[-1] in _UNITS:
            value = float(t[:-1]) * _UNITS[t[-1]]
        else:
            value = float(t)
    except ValueError:
        raise ValueError(f"invalid duration {text!r}; use e.g. 90s, 15m, 2h, 7d") from None
    if value < 0 or not math.isfinite(value):
        raise ValueError(f"invalid duration {text!r}")
    return value


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
    repack: tuple[PackUse, ...]
    abort_uploads: tuple[MultipartInfo, ...]
    expired_tombstones: tuple[str, ...]
    stale_leases: tuple[str, ...]
    live_leases: tuple[str, ...]
    stats: dict = field(default_factory=dict)
    repo: Any = field(default=None, repr=False, compare=False)
    #: The wall clock GC reads (``plan_gc(clock=...)``), for planning and execution alike.
    clock: Callable[[], float] = field(default=time.time, repr=False, compare=False)

    @property
    def bytes_to_free(self) -> int:
        return sum(s for _, s in self.delete_packs) + sum(u.size - u.live_bytes for u in self.repack)

    def as_dict(self) -> dict:
        return {
            "url": self.url,
            "grace_seconds": self.grace,
            "keep_steps": {str(s): list(r) for s, r in sorted(self.keep_steps.items())},
            "delete_steps": list(self.delete_steps),
            "delete_packs": [{"pack": p, "size": s} for p, s in self.delete_packs],
            "young_packs": [{"pack": p, "size": s} for p, s in self.young_packs],
            "protected_packs": [{"pack": p, "size": s} for p, s in self.protected_packs],
            "repack": [
                {"pack": u.pack, "size": u.size, "live_bytes": u.live_bytes, "live_chunks": u.live_chunks}
                for u in self.repack
            ],
            "abort_uploads": [{"key": u.key, "upload_id": u.upload_id, "initiated": u.initiated} for u in self.abort_uploads],
            "expired_tombstones": list(self.expired_tombstones),
            "stale_leases": list(self.stale_leases),
            "live_leases": list(self.live_leases),
            "bytes_to_free": self.bytes_to_free,
            "stats": self.stats,
        }

    def __str__(self) -> str:
        from .cli._format import human_bytes

        lines = [f"GC plan for {self.url} (grace {self.grace:.0f} s)"]
        lines.append(f"  keep {len(self.keep_steps)} step(s): " + ", ".join(
            f"{s} ({'; '.join(r)})" for s, r in sorted(self.keep_steps.items())))
        lines.append(f"  delete {len(self.delete_steps)} step(s): {_short(self.delete_steps)}")
        lines.append(
            f"  delete {len(self.delete_packs)} pack(s), {human_bytes(sum(s for _, s in self.delete_packs))}"
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

    def execute(self, progress: Callable[[str, int, int], None] | None = None) -> "GCResult":
        """Carry the plan out, re-checking every reference just before deleting."""
        if self.repo is None:
            raise ValueError("this plan is detached from its repository")
        return _execute(self, self.repo, progress or (lambda what, done, total: None))


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
    repacked_packs: list[str] = field(default_factory=list)
    new_packs: list[str] = field(default_factory=list)
    aborted_uploads: int = 0
    freed_bytes: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


# ---------------------------------------------------------------------- state
@dataclass
class _State:
    """What GC reads from the store."""

    now: float
    manifests: dict[int, Manifest]
    tombstones: dict[str, tuple[float, Manifest | None]]  # key -> (mtime, manifest)
    leases: dict[str, float]  # key -> mtime
    packs: dict[str, tuple[int, float]]  # id -> (size, mtime)
    relocations: set[str]  # pack ids with a relocation record
    res: float = 0.0  # the store's mtime resolution
    listed_at: float = 0.0  # when the manifests were listed

    def age(self, mtime: float) -> float:
        """Lower bound of an object's age (truncated mtimes never make it look older)."""
        return self.now - mtime - self.res


def _read_manifests(repo: Repository) -> dict[int, Manifest]:
    out = {}
    for step in repo.steps():
        try:
            out[step] = repo.manifest(step)
        except StepNotFoundError:
            continue  # deleted meanwhile
    return out


def _read_state(repo: Repository, now: float, clock: Callable[[], float] = time.time) -> _State:
    st = repo.store
    leases = {o.key: o.mtime for o in st.list(LEASE_PREFIX)}
    tombstones = {}
    cache = repo.__dict__.setdefault("_tombstone_cache", {})  # tombstones are write-once
    for o in st.list(TOMBSTONE_PREFIX):
        if o.key not in cache:
            cache[o.key] = _read_tombstone(repo, o.key)
        tombstones[o.key] = (o.mtime, cache[o.key])
    packs = {}
    for o in st.list(PACK_PREFIX):
        name = o.key.rsplit("/", 1)[-1]
        if name.endswith(".pack") and _m.is_pack_id(name[:-5]):
            packs[name[:-5]] = (o.size, o.mtime)
    relocs = set()
    for o in st.list(RELOCATION_PREFIX):
        name = o.key.rsplit("/", 1)[-1]
        if name.endswith(".json") and _m.is_pack_id(name[:-5]):
            relocs.add(name[:-5])
    listed_at = clock()  # manifests are listed last: deletions are timed from here (G3)
    state = _State(now, _read_manifests(repo), tombstones, leases, packs, relocs, st.mtime_resolution)
    state.listed_at = listed_at
    return state


def _read_tombstone(repo: Repository, key: str) -> Manifest | None:
    try:
        doc = json.loads(repo.store.get(key))
        if doc.get("format") != TOMBSTONE_FORMAT:
            return None
        _m.check_version(doc.get("version"), key)
        return _m.from_json(doc["manifest"].encode("utf-8"))
    except (ObjectNotFoundError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _protecting_tombstones(state: _State, grace: float) -> list[Manifest]:
    """Tombstones that still protect their packs.

    A deleted step's packs stay referenced while the tombstone is younger than
    the grace period and some lease that started before the deletion is
    itself younger than the grace period: only such a saver can have read
    the step as its dedup base (savers write their lease before reading it).
    """
    margin = safety_margin(grace)
    out = []
    for _key, (tmtime, man) in state.tombstones.items():
        if man is None or state.age(tmtime) > grace:
            continue
        if any(
            lmtime <= tmtime + margin + state.res and state.age(lmtime) <= grace
            for lmtime in state.leases.values()
        ):
            out.append(man)
    return out


def _referenced(repo: Repository, manifests: Iterable[Manifest], existing: dict[str, Any], relocs: set[str]):
    """Pack ids referenced by these manifests, following relocation records.

    Returns ``(packs, chunks)``: referenced pack ids, and per pack the set of
    ``(offset, stored_len)`` of referenced chunks (for live-byte accounting).
    """
    packs: set[str] = set()
    chunks: dict[str, set[tuple[int, int, str]]] = {}
    tables = RelocationTables(repo)
    for m in manifests:
        for c in m.chunk_refs():
            # Every hop's pack holds the chunk until the next one exists.
            for r in tables.chain(c, existing, relocs):
                packs.add(r.pack)
                chunks.setdefault(r.pack, set()).add((r.offset, r.stored_len, r.hash))
    return packs, chunks


def plan_gc(
    repo: Repository,
    keep_last: int | None = None,
    keep_every: int | None = None,
    keep_within: str | float | None = None,
    keep_tags: bool | Iterable[str] = True,
    keep_steps: Iterable[int] = (),
    grace: str | float | None = None,
    repack: bool = False,
    repack_threshold: float = 0.2,
    now: float | None = None,
    clock: Callable[[], float] | None = None,
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
        The wall clock (seconds since the epoch) GC judges ages by:
        ``clock`` (default :func:`time.time`) is read when planning and again
        by :meth:`GCPlan.execute` when it re-checks ages before deleting;
        ``now`` fixes the planning time only. Tests pass a clock running
        ahead to see what GC does once the grace period has passed.
    """
    clock = clock or time.time
    now = clock() if now is None else now
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
    state = _read_state(repo, now, clock)
    tags = repo.tags()
    created = {s: m.created for s, m in state.manifests.items()}
    keep = select_steps(created, tags, policy, now)
    delete = [s for s in sorted(state.manifests) if s not in keep]

    # Live leases: savers in flight. Their fresh packs are protected by the
    # age rule; keeping the newest step keeps their likely dedup base.
    live_leases = tuple(k for k, t in state.leases.items() if state.age(t) <= g)
    stale_leases = tuple(k for k, t in state.leases.items() if state.age(t) > g)

    kept_manifests = [state.manifests[s] for s in sorted(keep)]
    tomb_manifests = _protecting_tombstones(state, g)
    # Steps deleted by this run will be tombstoned; while live leases exist
    # their packs stay protected (execute re-checks).
    pending = [state.manifests[s] for s in delete] if live_leases else []
    live_refs, live_chunks = _referenced(repo, kept_manifests, state.packs, state.relocations)
    prot_refs, _ = _referenced(repo, tomb_manifests + pending, state.packs, state.relocations)

    delete_packs, young, protected = [], [], []
    for pid, (size, mtime) in sorted(state.packs.items()):
        if pid in live_refs:
            continue
        if state.age(mtime) <= g:
            young.append((pid, size))
        elif pid in prot_refs:
            protected.append((pid, size))
        else:
            delete_packs.append((pid, size))

    uses = []
    for pid in live_refs:
        if pid not in state.packs:
            continue
        size, mtime = state.packs[pid]
        ch = live_chunks.get(pid, set())
        live = sum(sl for _, sl, _ in ch)
        uses.append(PackUse(pid, size, mtime, live, len(ch)))
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

    expired = tuple(k for k, (t, _) in state.tombstones.items() if state.age(t) > g)
    logical = sum(c.raw_len for m in kept_manifests for c in m.chunk_refs())
    uniq: dict[str, tuple[int, int]] = {}
    for m in kept_manifests:
        for c in m.chunk_refs():
            uniq[c.hash] = (c.raw_len, c.stored_len)
    uraw = sum(r for r, _ in uniq.values())
    ustored = sum(s for _, s in uniq.values())
    stats = {
        "steps": len(state.manifests),
        "packs": len(state.packs),
        "stored_bytes": stored,
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
        repack=repack_list,
        abort_uploads=tuple(uploads),
        expired_tombstones=expired,
        stale_leases=stale_leases,
        live_leases=live_leases,
        stats=stats,
        repo=repo,
        clock=clock,
    )


def _older_than_all(t: float, state: "_State", g: float) -> bool:
    """An upload started before every live lease cannot belong to a live saver."""
    live = [lt for lt in state.leases.values() if state.age(lt) <= g]
    return all(t < lt - safety_margin(g) - state.res for lt in live)


def _overhead(nchunks: int) -> int:
    return _pack.HEADER_SIZE + _pack.FOOTER_SIZE + _pack.ENTRY.size * nchunks + 64


# ====================================================================== execute
def _execute(plan: GCPlan, repo: Repository, progress) -> GCResult:
    res = GCResult()
    store = repo.store
    g = plan.grace

    # 1. Steps: re-check tags and the newest step, tombstone, then delete.
    tags = set(repo.tags().values())
    latest = repo.latest()
    for i, step in enumerate(plan.delete_steps):
        if step in tags:
            res.skipped_steps.append((step, "tagged since planning"))
            continue
        if step == latest:
            res.skipped_steps.append((step, "newest step"))
            continue
        try:
            repo.delete(step)
            res.deleted_steps.append(step)
        except StepNotFoundError:
            res.skipped_steps.append((step, "already gone"))
        progress("steps", i + 1, len(plan.delete_steps))

    # 2. Repack partly used packs: copy live chunks, record relocations.
    relocated: dict[str, dict[str, list]] = {}
    if plan.repack:
        relocated = _repack(repo, plan, res, progress)

    # 3. Re-read everything just before deleting packs, and again whenever
    #    half the safety margin has passed: a deletion must follow the
    #    listing that cleared it by less than the margin (docs/gc.md, G3).
    def reread():
        st = _read_state(repo, plan.clock(), plan.clock)
        live, chunks = _referenced(repo, st.manifests.values(), st.packs, st.relocations)
        prot, _ = _referenced(repo, _protecting_tombstones(st, g), st.packs, st.relocations)
        return st, live, chunks, prot

    state, live_refs, live_chunks, prot_refs = reread()
    todo = [pid for pid, _ in plan.delete_packs] + list(relocated)
    for i, pid in enumerate(todo):
        if plan.clock() - state.listed_at > safety_margin(g) / 2:
            state, live_refs, live_chunks, prot_refs = reread()
        info = state.packs.get(pid)
        if info is None:
            res.skipped_packs.append((pid, "already gone"))
            continue
        size, mtime = info
        if state.age(mtime) <= g:
            res.skipped_packs.append((pid, "younger than the grace period"))
            continue
        if pid in relocated:
            # Every chunk any manifest (or protecting tombstone) now uses must be relocated.
            needed = {h for _, _, h in live_chunks.get(pid, set())}
            if pid in prot_refs:
                _, pchunks = _referenced(repo, _protecting_tombstones(state, g), state.packs, state.relocations)
                needed |= {h for _, _, h in pchunks.get(pid, set())}
            if not needed <= set(relocated[pid]):
                res.skipped_packs.append((pid, "gained references during repack"))
                continue
        elif pid in live_refs or pid in prot_refs:
            res.skipped_packs.append((pid, "referenced again"))
            continue
        store.delete(pack_key(pid))
        res.deleted_packs.append(pid)
        res.freed_bytes += size
        progress("packs", i + 1, len(todo))

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
    state = _read_state(repo, plan.clock(), plan.clock)
    needed_relocs, _ = _referenced(
        repo, list(state.manifests.values()) + _protecting_tombstones(state, g), state.packs, state.relocations
    )
    for pid in state.relocations:
        if pid not in needed_relocs and pid not in state.packs:
            store.delete(relocation_key(pid))
    return res


def _repack(repo: Repository, plan: GCPlan, res: GCResult, progress) -> dict[str, dict[str, list]]:
    """Copy the live chunks of ``plan.repack`` packs into new packs.

    Returns old pack id -> {hash: new location} for packs whose relocation
    record was written.
    """
    import uuid

    store = repo.store
    state = _read_state(repo, plan.clock(), plan.clock)
    manifests = list(state.manifests.values()) + _protecting_tombstones(state, plan.grace)
    _, live_chunks = _referenced(repo, manifests, state.packs, state.relocations)
    _, io, _ = repo._pools()
    out: dict[str, dict[str, list]] = {}
    o = repo.options
    new_id = None
    builder = uploader = None
    pending: list[tuple[str, str, int, _pack.PackEntry]] = []  # (old pack, hash, new offset...)

    def open_pack():
        nonlocal new_id, builder, uploader
        new_id = uuid.uuid4().hex
        builder = _pack.PackBuilder()
        uploader = ParallelUploader(store, pack_key(new_id), o.part_size, io, window=4)
        uploader.write(_pack.header())

    def close_pack():
        nonlocal builder, uploader
        if builder is None:
            return
        uploader.write(builder.tail())
        expected = builder.final_size()
        size = uploader.close()
        if size != expected or store.head(pack_key(new_id)).size != expected:
            raise OSError(f"repack: new pack {new_id} has the wrong size")
        res.new_packs.append(new_id)
        for old, h, e in list(pending):
            out.setdefault(old, {})[h] = [new_id, e.offset, e.stored_len, e.raw_len, e.codec]
        pending.clear()
        builder = uploader = None

    try:
        for i, use in enumerate(plan.repack):
            chunks = sorted(live_chunks.get(use.pack, set()))
            if not chunks:
                continue
            entries = {e.hash: e for e in _pack.read_table(store, pack_key(use.pack))}
            ranges = [(off, off + sl) for off, sl, _ in chunks]
            datas = store.get_ranges(pack_key(use.pack), ranges)
            for (off, sl, h), data in zip(chunks, datas):
                e = entries.get(h)
                if e is None or e.offset != off:
                    raise FormatError(f"repack: pack {use.pack} has no chunk {h[:16]} at {off}")
                raw = _codec.decode(e.codec, data, e.raw_len)
                if _codec.hash_bytes(raw) != h:
                    raise FormatError(f"repack: chunk {h[:16]} in pack {use.pack} at {off} is corrupted")
                if builder is None:
                    open_pack()
                ne = builder.add(h, e.codec, len(data), e.raw_len)
                uploader.write(data)
                pending.append((use.pack, h, ne))
                if builder.size >= o.pack_size:
                    close_pack()
            progress("repack", i + 1, len(plan.repack))
        close_pack()
    except BaseException:
        if uploader is not None:
            uploader.abort()
        raise
    # Relocation records are written only once every new pack is complete;
    # like packs and manifests they are written once.
    for old, table in out.items():
        doc = {"format": RELOCATION_FORMAT, "version": list(_m.VERSION), "pack": old, "chunks": table}
        try:
            store.put_if_absent(relocation_key(old), json.dumps(doc).encode())
        except ObjectExistsError:
            # An earlier, interrupted repack already moved this pack: its
            # record stands; the copies just made are unreferenced and go
            # with a later GC.
            prev = parse_relocation(store.get(relocation_key(old)), old)
            if not set(table) <= set(prev):
                raise FormatError(f"repack: relocation record of pack {old} exists and lacks chunks") from None
            out[old] = {h: [c.pack, c.offset, c.stored_len, c.raw_len, c.codec] for h, c in prev.items()}
        res.repacked_packs.append(old)
    return out


def space_accounting(repo: Repository) -> dict:
    """Bytes stored, referenced by committed steps, dead inside partly used packs; ratios."""
    state = _read_state(repo, time.time())
    manifests = list(state.manifests.values())
    refs, chunks = _referenced(repo, manifests, state.packs, state.relocations)
    stored = sum(s for s, _ in state.packs.values())
    referenced = 0
    partial_packs = partial_dead = unreferenced = 0
    for pid, (size, _) in state.packs.items():
        if pid not in refs:
            unreferenced += size
            continue
        ch = chunks.get(pid, set())
        live = sum(sl for _, sl, _ in ch)
        referenced += live
        if size - live > _overhead(len(ch)):
            partial_packs += 1
            partial_dead += size - live
    logical = 0
    uniq: dict[str, tuple[int, int]] = {}
    for m in manifests:
        for c in m.chunk_refs():
            logical += c.raw_len
            uniq[c.hash] = (c.raw_len, c.stored_len)
    uraw = sum(r for r, _ in uniq.values())
    ustored = sum(s for _, s in uniq.values())
    return {
        "url": repo.url,
        "steps": len(manifests),
        "packs": len(state.packs),
        "stored_bytes": stored,
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
