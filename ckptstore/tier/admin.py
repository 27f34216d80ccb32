"""Inspecting and pruning a node-local tier directory (the ``ckptstore cache`` commands).

Pure planning, separate execution, as GC does it: :func:`scan` reads what
a tier holds (a frozen :class:`TierScan`), :func:`plan_prune` picks the
files to remove from a scan without touching the disk (a frozen, printable
:class:`PrunePlan`), and :meth:`PrunePlan.execute` removes them.

Only the files :func:`ckptstore.tier.cache.tier_files` lists are ever removed
(whole packs under ``packs/``, segments under ``segments/``, chunk files
under ``chunks/``), never a pack or segment that a pending step (saved with
write-back, not yet in the object store) needs, never a folder, a pending
record, ``repo.json``, the ``TIER`` mark or ``.tmp/``: the processes of the
node that use the tier keep working while it is pruned (a reader that finds
a file gone reads that chunk from the object store), and a directory without
the ``TIER`` mark is refused outright (:class:`NotATierError`).
"""

from __future__ import annotations

import dataclasses
import json
import os

from ..errors import CkptStoreError
from .cache import FREE_FLOOR, PENDING_NAME, is_pending_file, is_tier, parse_size, pending_ids, repo_key, tier_files
from ..units import human_bytes


class NotATierError(CkptStoreError, FileNotFoundError):
    """A directory that holds no node-local tier (no ``TIER`` file)."""


@dataclasses.dataclass(frozen=True)
class TierFile:
    """One cached file: a whole pack (``kind="pack"``), a segment (``"segment"``) or one chunk's stored bytes (``"chunk"``)."""

    path: str
    size: int
    #: Last use: a read touches the file (the tier's LRU order).
    mtime: float
    key: str
    kind: str


@dataclasses.dataclass(frozen=True)
class RepoUsage:
    """What a tier holds of one repository."""

    key: str
    #: The repository's URL as its ``repo.json`` records it (None when unreadable).
    url: str | None
    packs: int
    segments: int
    chunks: int
    bytes: int
    last_used: float | None
    #: Steps saved with write-back whose commit in the object store is still to come.
    pending_steps: tuple[int, ...] = ()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TierScan:
    """A tier's files at one moment, least recently used first."""

    cache_dir: str
    files: tuple[TierFile, ...]
    repos: tuple[RepoUsage, ...]
    #: Files under the repositories' ``.tmp/``: copies being written, or left by a process that died.
    tmp_files: int
    tmp_bytes: int
    #: Ids of the packs and segments pending steps need: never pruned.
    pending_ids: frozenset = frozenset()

    def is_pending(self, f: TierFile) -> bool:
        return is_pending_file(f.path) or f.kind != "chunk" and os.path.basename(f.path).split(".")[0] in self.pending_ids

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def url_of(self, key: str) -> str | None:
        return next((r.url for r in self.repos if r.key == key), None)


def scan(cache_dir) -> TierScan:
    """What the tier at ``cache_dir`` holds; :class:`NotATierError` when it is not a tier."""
    cache_dir = os.path.abspath(os.fspath(cache_dir))
    if not is_tier(cache_dir):
        why = "no such directory" if not os.path.isdir(cache_dir) else "no TIER file"
        raise NotATierError(f"{cache_dir}: not a ckptstore node-local tier ({why})")
    files = sorted((TierFile(*f) for f in tier_files(cache_dir)), key=lambda f: (f.mtime, f.path))
    by_key: dict[str, list[TierFile]] = {}
    for f in files:
        by_key.setdefault(f.key, []).append(f)
    repos_dir = os.path.join(cache_dir, "repos")
    try:
        keys = sorted(set(os.listdir(repos_dir)) | set(by_key))
    except FileNotFoundError:
        keys = sorted(by_key)
    repos, tmp_files, tmp_bytes = [], 0, 0
    for key in keys:
        if not os.path.isdir(os.path.join(repos_dir, key)):
            continue
        mine = by_key.get(key, [])
        repos.append(RepoUsage(
            key=key, url=_recorded_url(cache_dir, key),
            packs=sum(f.kind == "pack" for f in mine), segments=sum(f.kind == "segment" for f in mine),
            chunks=sum(f.kind == "chunk" for f in mine), bytes=sum(f.size for f in mine),
            last_used=max((f.mtime for f in mine), default=None),
            pending_steps=_pending_steps(os.path.join(repos_dir, key, "pending")),
        ))
        n, b = _tmp_usage(os.path.join(repos_dir, key, ".tmp"))
        tmp_files += n
        tmp_bytes += b
    return TierScan(cache_dir, tuple(files), tuple(repos), tmp_files, tmp_bytes, frozenset(pending_ids(cache_dir)))


def stats(cache_dir, free_floor: float = FREE_FLOOR) -> dict:
    """Totals of a tier and of its file system: bytes held, free space and the free-space floor.

    ``floor_bytes`` is the space every handle leaves free (``free_floor`` of
    the file system, the handles' default); ``free_above_floor`` negative
    means the next write to the tier evicts.
    """
    s = scan(cache_dir)
    st = os.statvfs(s.cache_dir)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    floor = int(free_floor * total)
    return {
        "cache_dir": s.cache_dir,
        "repositories": len(s.repos),
        "packs": sum(r.packs for r in s.repos),
        "segments": sum(r.segments for r in s.repos),
        "chunks": sum(r.chunks for r in s.repos),
        "bytes": s.bytes,
        "pending_steps": sum(len(r.pending_steps) for r in s.repos),
        "pending_bytes": sum(f.size for f in s.files if s.is_pending(f)),
        "oldest_use": s.files[0].mtime if s.files else None,
        "newest_use": max((f.mtime for f in s.files), default=None),
        "tmp_files": s.tmp_files,
        "tmp_bytes": s.tmp_bytes,
        "fs_total_bytes": total,
        "fs_free_bytes": free,
        "free_floor": free_floor,
        "floor_bytes": floor,
        "free_above_floor": free - floor,
    }


# ---------------------------------------------------------------- prune
@dataclasses.dataclass(frozen=True)
class PruneResult:
    removed: int
    freed_bytes: int
    #: Planned files another process had removed already (evicted, or found damaged).
    already_gone: int
    #: Planned files left alone: read since the plan, or needed by a step that became pending.
    skipped: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PrunePlan:
    """Files to remove from a tier, least recently used first; printable; :meth:`execute` removes them."""

    cache_dir: str
    #: What was asked, in words ("down to 10.0 GiB", "every file of s3://b/run", "everything").
    rule: str
    held_bytes: int
    files: tuple[TierFile, ...]
    urls: tuple[tuple[str, str | None], ...]  # (key, url) of the repositories the plan touches
    #: Files the rule would have taken that pending steps need: kept.
    kept_pending: tuple[TierFile, ...] = ()

    @property
    def freed_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def by_repo(self) -> list[dict]:
        urls = dict(self.urls)
        out: dict[str, dict] = {}
        for f in self.files:
            r = out.setdefault(f.key, {"key": f.key, "url": urls.get(f.key), "packs": 0, "segments": 0, "chunks": 0,
                                       "bytes": 0})
            r[f.kind + "s"] += 1
            r["bytes"] += f.size
        return list(out.values())

    def as_dict(self) -> dict:
        return {
            "cache_dir": self.cache_dir, "rule": self.rule, "held_bytes": self.held_bytes,
            "freed_bytes": self.freed_bytes, "files": len(self.files),
            "left_bytes": self.held_bytes - self.freed_bytes, "repositories": self.by_repo(),
            "kept_pending_files": len(self.kept_pending), "kept_pending_bytes": sum(f.size for f in self.kept_pending),
        }

    def __str__(self) -> str:
        head = (f"prune {self.cache_dir} ({self.rule}): {len(self.files)} file(s), "
                f"{human_bytes(self.freed_bytes)} of {human_bytes(self.held_bytes)} held, "
                f"{human_bytes(self.held_bytes - self.freed_bytes)} left")
        lines = [head]
        for r in self.by_repo():
            lines.append(f"  {r['url'] or r['key']}: {r['packs']} pack(s), {r['segments']} segment(s), "
                         f"{r['chunks']} chunk(s), {human_bytes(r['bytes'])}")
        if self.kept_pending:
            lines.append(f"  kept {len(self.kept_pending)} file(s), "
                         f"{human_bytes(sum(f.size for f in self.kept_pending))}, that pending steps need "
                         "(saved with write-back, not yet in the object store)")
        return "\n".join(lines)

    def execute(self) -> PruneResult:
        """Remove the planned files, except those used or needed since the plan was made.

        Pending records are read again first (a write-back save may have
        committed locally meanwhile), and a file whose modification time
        moved (read or rewritten since the scan) is left alone.
        """
        protected = pending_ids(self.cache_dir)
        removed = freed = gone = skipped = 0
        for f in self.files:
            if is_pending_file(f.path) or f.kind != "chunk" and os.path.basename(f.path).split(".")[0] in protected:
                skipped += 1
                continue
            try:
                if os.stat(f.path).st_mtime != f.mtime:
                    skipped += 1
                    continue
                os.unlink(f.path)
            except FileNotFoundError:
                gone += 1
                continue
            removed += 1
            freed += f.size
        return PruneResult(removed, freed, gone, skipped)


def plan_prune(s: TierScan, max_size=None, repo: str | None = None, everything: bool = False) -> PrunePlan:
    """The files to remove from a scanned tier (pure: nothing is read or removed).

    ``max_size``: least recently used files until the tier (or, with
    ``repo``, that repository's part of it) holds at most this many bytes
    (``"10GB"`` or bytes). ``repo`` alone: every file of that repository (its
    URL as given to :func:`ckptstore.open`, as ``ckptstore cache ls`` shows
    it, or its key). ``everything``: every file of every repository.
    """
    if everything and (max_size is not None or repo is not None):
        raise ValueError("--all removes everything; it takes neither --max-size nor --repo")
    if not everything and max_size is None and repo is None:
        raise ValueError("say what to prune: --max-size SIZE, --repo URL or --all")
    files = s.files
    rule = "everything"
    if repo is not None:
        key = resolve_repo(s, repo)
        files = tuple(f for f in files if f.key == key)
        rule = f"every file of {s.url_of(key) or key}"
    held = sum(f.size for f in files)
    kept = tuple(f for f in files if s.is_pending(f))
    if max_size is not None:
        limit = parse_size(max_size)
        picked, kept, over = [], [], held - limit
        for f in files:  # least recently used first
            if over <= 0:
                break
            if s.is_pending(f):
                kept.append(f)
                continue
            picked.append(f)
            over -= f.size
        files, kept = tuple(picked), tuple(kept)
        rule = f"least recently used down to {human_bytes(limit)}"
        if repo is not None:
            rule += f" for {s.url_of(key) or key}"
    else:
        files = tuple(f for f in files if not s.is_pending(f))
    keys = sorted({f.key for f in files})
    return PrunePlan(s.cache_dir, rule, held, tuple(files), tuple((k, s.url_of(k)) for k in keys), kept)


def resolve_repo(s: TierScan, repo: str) -> str:
    """The key of the repository ``repo`` names in a scanned tier; ValueError naming those it holds."""
    wanted = {repo, repo.rstrip("/"), canonical_url(repo)}
    for r in s.repos:
        if r.key == repo or r.url in wanted or r.key in {repo_key(u) for u in wanted if u}:
            return r.key
    held = ", ".join(r.url or r.key for r in s.repos) or "none"
    raise ValueError(f"{s.cache_dir}: the tier holds nothing of {repo} (repositories in it: {held})")


def canonical_url(url: str) -> str:
    """The URL a repository handle reports (``repo.url``) for ``url``, without opening a store.

    A plain path becomes ``file://`` and absolute; ``gcs://`` is ``gs://``,
    ``abfs(s)://`` is ``az://``; a trailing slash goes.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "file://" + (os.path.abspath(os.path.expanduser(url)).rstrip("/") or "/")
    scheme = {"gcs": "gs", "abfs": "az", "abfss": "az"}.get(scheme.lower(), scheme.lower())
    if scheme == "file":
        return "file:///" + rest.partition("/")[2].strip("/")
    return f"{scheme}://{rest.strip('/') if scheme == 'memory' else rest.rstrip('/')}"


def _recorded_url(cache_dir: str, key: str) -> str | None:
    try:
        with open(os.path.join(cache_dir, "repos", key, "repo.json"), "rb") as f:
            doc = json.loads(f.read(65536))
    except (OSError, ValueError):
        return None
    return doc.get("url") if isinstance(doc, dict) and isinstance(doc.get("url"), str) else None


def _pending_steps(folder: str) -> tuple[int, ...]:
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return ()
    return tuple(sorted(int(m.group(1)) for m in map(PENDING_NAME.match, names) if m))


def _tmp_usage(folder: str) -> tuple[int, int]:
    n = b = 0
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return 0, 0
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        n += 1
        b += st.st_size
    return n, b


__all__ = ["NotATierError", "TierFile", "RepoUsage", "TierScan", "PrunePlan", "PruneResult", "scan", "stats",
           "plan_prune", "resolve_repo", "canonical_url"]
