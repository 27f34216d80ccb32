"""The metadata plane of a repository: config, steps, manifests, tags, leases, tombstones.

:class:`Catalog` is what every pipeline (save, load, verify, GC, transfer,
DCP) works against: the store, the handle's options and runtime, the clock,
and every small object that says what the repository holds. It reads and
writes no chunk data. :class:`~ckptstore.repo.repository.Repository` is the
public facade built on it.
"""

from __future__ import annotations

import re
from typing import Iterator

from ..format import manifest as _m
from ..clock import SYSTEM_CLOCK, Clock
from ..errors import FormatError, ObjectExistsError, ObjectNotFoundError, RepositoryNotFoundError, StepNotFoundError
from ..pipeline.fetch import ChunkFetcher
from ..format.layout import (
    CONFIG_KEY,
    LEASE_PREFIX,
    MANIFEST_PREFIX,
    NAME_PREFIX,
    PACK_PREFIX,
    RELOCATION_PREFIX,
    SEGMENT_PREFIX,
    TAG_PREFIX,
    TOMBSTONE_PREFIX,
    check_namespace,
    check_step,
    config_record,
    lease_key,
    lease_record,
    manifest_key,
    name_key,
    name_of_key,
    name_record,
    pack_id_of_key,
    pack_id_of_relocation_key,
    parse_config,
    parse_name,
    parse_tag,
    parse_tombstone,
    segment_id_of_key,
    step_of_manifest_key,
    tag_key,
    tag_of_key,
    tag_record,
    tombstone_key,
    tombstone_record,
)
from ..format.manifest import Manifest, StepRefs, parse_refs, refs_of
from ..pipeline.options import RepoOptions
from ..pipeline.relocations import Relocations
from ..pipeline.runtime import LRUCache, Runtime
from ..storage.base import ObjectInfo, ObjectStore
from ..tier.cache import Tier
from ..pipeline.table_reader import ChunkTables

#: ``"step":N,"created":X`` as the writers of both manifest versions begin them.
_CREATED = re.compile(rb'^\{"format":"ckptstore\.manifest","version":\[\d+,\d+\],"step":(\d+),"created":(-?[0-9.eE+-]+),')

#: Tombstones whose parsed manifests a handle keeps (they are write-once).
TOMBSTONE_CACHE_BYTES = 64 << 20


def refs_weight(r: StepRefs) -> int:
    ranges = sum(len(u.ranges) for u in r.use.values()) if r.use else 0
    return 512 + 350 * len(r.packs) + 80 * ranges + (700 * len(r.chunks) if r.chunks is not None else 0)


def manifest_weight(m: Manifest) -> int:
    """Estimated bytes a parsed manifest holds in memory (about 700 a chunk it holds)."""
    ranges = sum(len(u.ranges) for u in m.pack_use.values())
    return 2048 + 350 * len(m.packs) + 80 * ranges + 200 * len(m.segments) + sum(t.weight() for t in m.tensors.values())


class Catalog:
    """A repository's metadata on one object store; see the module docstring.

    Parameters
    ----------
    store:
        The object store holding the repository.
    clock:
        Wall and monotonic time for leases, tombstones, GC ages and the
        saver's dedup-base age (tests pass a :class:`~ckptstore.clock.ManualClock`).
    cache_dir, cache_size, cache_decoded:
        A node-local tier (:mod:`ckptstore.tier.cache`): saves write their packs
        through to it (and decoded copies of their chunks: None, the default,
        where the budget has room; True; False), reads take each chunk from it first.
    **options:
        :class:`~ckptstore.pipeline.options.RepoOptions` fields.
    """

    def __init__(self, store: ObjectStore, clock: Clock | None = None, cache_dir=None, cache_size=None,
                 cache_decoded: bool | None = None, **options):
        self.store = store
        self.url = store.url
        self.options = RepoOptions.from_kwargs(bool(getattr(store, "remote", False)), **options)
        self._fit_part_size(store)
        self.clock = clock or SYSTEM_CLOCK
        self.runtime = Runtime(self.options)
        self.relocations = Relocations(store)
        if cache_dir is None and cache_size is not None:
            raise ValueError("cache_size needs a cache_dir")
        if cache_decoded and cache_dir is None:
            raise ValueError("cache_decoded needs a cache_dir")
        self.tier = Tier(cache_dir, store.url, cache_size, decoded=cache_decoded) if cache_dir is not None else None
        self.fetcher = ChunkFetcher(store, self.runtime, self.options, self.relocations, self.tier)
        self.tables = ChunkTables(store, self.runtime, self.tier)
        #: The write-back queue (:mod:`ckptstore.repo.writeback`) of a handle opened with ``write_back=True``.
        self.write_back = None
        self._config: dict | None = None
        self._config_raw: bytes | None = None
        self._manifests: LRUCache[int, Manifest] = LRUCache(self.options.manifest_cache_bytes, manifest_weight)
        self._tombstones: LRUCache[str, tuple[StepRefs | None]] = LRUCache(
            TOMBSTONE_CACHE_BYTES, lambda v: refs_weight(v[0]) if v[0] is not None else 64
        )

    def _fit_part_size(self, store: ObjectStore) -> None:
        """The part size at least the store's minimum: raised from the default, refused if given."""
        floor = int(getattr(store, "min_part_size", 0) or 0)
        o = self.options
        if o.part_size >= floor:
            return
        if "part_size" in o.explicit:
            raise ValueError(
                f"part_size={o.part_size} is below the smallest multipart part {store.url} accepts "
                f"({floor} bytes, its storage option min_part_size): use part_size >= {floor}"
            )
        o.part_size = -(-floor // (1 << 20)) * (1 << 20)

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Wait for async saves, stop worker threads and close the store."""
        self.runtime.close()
        self.store.close()

    def abandon(self) -> None:
        """What a finalizer may do: stop the worker threads without joining them and leave the store
        to its own collection. A garbage collection can run a finalizer inside ``threading``'s locks
        (a thread starting: ``_maintain_shutdown_locks``), where joining a thread deadlocks."""
        self.runtime.close(wait=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # ------------------------------------------------------------ config
    def config(self) -> dict:
        """The repository's config object ({} until the first save)."""
        if self._config is None:
            try:
                raw = self.store.get(CONFIG_KEY)
            except ObjectNotFoundError:
                return {}
            self.adopt_config(raw)
        return self._config

    def config_bytes(self) -> bytes | None:
        """The config object as stored (None until the first save): what one rank reads for a job."""
        self.config()
        return self._config_raw

    def adopt_config(self, raw: bytes) -> None:
        """Take the config from its stored bytes, read by this handle or by another rank of the job."""
        self._config = parse_config(raw, self.url)
        self._config_raw = bytes(raw)
        self.options.adopt(self._config)

    def ensure_config(self) -> dict:
        """The config, created from this handle's options if the repository has none."""
        if self.config():
            return self._config
        body = config_record(self.options, self.clock.time())
        try:
            self.store.put_if_absent(CONFIG_KEY, body)
        except ObjectExistsError:
            self._config = None  # another writer created it first: use theirs
            return self.config()
        self.adopt_config(body)  # what this handle just created: no need to read it back
        return self._config

    def adopt_defaults(self, cfg: dict) -> None:
        """Take another repository's write defaults (chunking, codec, grace) where not given.

        Used before the first write into a new repository that receives
        copies, so later saves cut chunks the same way and dedup against them.
        """
        self.options.adopt(cfg, ("chunk_size", "pack_size", "codec", "level", "grace"))

    def exists(self) -> bool:
        """Whether the location holds a repository: its ``config.json`` (or, lacking it, a committed step).

        Reads only; opening a location and asking never creates anything.
        """
        if self._config or self.store.exists(CONFIG_KEY):
            return True
        # Every writer creates the config before its first manifest; a step
        # without one is a damaged repository, still one to read and verify.
        return next(iter(self.store.list(MANIFEST_PREFIX)), None) is not None

    def require_repository(self) -> None:
        """Raise :class:`RepositoryNotFoundError` unless :meth:`exists`.

        For reads that need a repository (a mistyped URL must not look like
        an empty repository); ``steps()`` and ``latest()`` never call it.
        """
        if not self.exists():
            raise self._no_repository()

    def _no_repository(self, note: str = "") -> RepositoryNotFoundError:
        return RepositoryNotFoundError(
            f"no ckptstore repository at {self.url} (no {CONFIG_KEY}); save a step to create one{note}"
        )

    def _not_committed(self, step: int) -> StepNotFoundError:
        """The error for a step that is not committed: :class:`RepositoryNotFoundError` if there is no repository."""
        if not self.exists():
            return self._no_repository()
        return StepNotFoundError(f"{self.url}: step {step} is not committed")

    def grace(self) -> float:
        """Seconds an unreferenced object must age before GC may delete it."""
        cfg = self.config()
        if "grace" in self.options.explicit or "grace" not in cfg:
            return float(self.options.grace)
        return float(cfg["grace"])

    # ------------------------------------------------------------ steps
    def steps(self, pending: bool = False) -> list[int]:
        """Committed steps, ascending; with ``pending``, also the steps saved with write-back that
        this node's tier holds and the store does not yet (:meth:`pending_steps`)."""
        # Pending steps first: the write-back drain commits a step, then drops its pending record, so a
        # step not pending any more when read here is committed when the store is listed after it.
        # (Listed first, a step committed between the two reads was in neither: a save's dedup base
        # went one step back, seen at step 42 of tests/test_every_step.py on the 2-core machine.)
        pend = self.pending_steps() if pending else ()
        out = {s for s in (step_of_manifest_key(o.key) for o in self.store.list(MANIFEST_PREFIX)) if s is not None}
        self._drop_deleted(out)
        out.update(pend)
        return sorted(out)

    def _drop_deleted(self, listed: set[int]) -> None:
        """Forget cached manifests of steps the store no longer lists (deleted, by this handle or
        another's GC): a handle saving every step for weeks next to a ``keep_last`` GC would
        otherwise keep every manifest it wrote, up to ``manifest_cache_bytes`` (issue 44).
        Steps newer than the newest listed (committed since) and pending ones are kept."""
        if not listed:
            return
        top = max(listed)
        stale = [s for s in self._manifests.keys() if s not in listed and s < top]
        if stale:
            keep = set(self.pending_steps())
            for s in stale:
                if s not in keep:
                    m = self._manifests.get(s)
                    self._manifests.pop(s)
                    if m is not None and not m.inline:
                        self.tables.forget(seg.id for seg in m.segments)

    def forget_unlisted(self, listed) -> None:
        """Forget cached manifests (and their segments' headers) of steps not in ``listed``: a listing
        of the store's committed steps read elsewhere (the DCP coordinator's, at a save). A rank that
        never lists the store itself would otherwise keep every dedup base it adopted, one a save, up
        to ``manifest_cache_bytes`` (issue 44). As in :meth:`steps`: steps newer than the newest
        listed, and pending ones, are kept."""
        self._drop_deleted(set(listed))

    def forget_tombstones(self, listed) -> None:
        """Forget cached tombstones the store no longer lists (expired: GC removed them)."""
        listed = set(listed)
        for key in self._tombstones.keys():
            if key not in listed:
                self._tombstones.pop(key)

    def latest(self, pending: bool = False) -> int | None:
        """The newest committed step (with ``pending``, pending ones too), or None in an empty
        repository (or where there is none)."""
        s = self.steps(pending=pending)
        return s[-1] if s else None

    def pending_steps(self) -> list[int]:
        """Steps saved with write-back into this handle's tier, not yet committed in the store."""
        return self.tier.pending.steps() if self.tier is not None else []

    def newest_step(self) -> int:
        """The newest committed step; :class:`StepNotFoundError` if none (:class:`RepositoryNotFoundError` if no repository)."""
        s = self.latest()
        if s is None:
            if not self.exists():
                raise self._no_repository(" (so there is no committed step to read)")
            raise StepNotFoundError(f"{self.url}: the repository has no committed step")
        return s

    def manifest(self, step: int) -> Manifest:
        """Parse and return one step's manifest (cached by size; manifests are immutable)."""
        step = check_step(step)
        m = self._manifests.get(step)
        if m is not None:
            return m
        return self.adopt_manifest(step, self._manifest_bytes(step))

    def manifest_bytes(self, step: int) -> bytes:
        """One step's root manifest as stored (parsed and cached too): what one rank reads for a job."""
        step = check_step(step)
        raw = self._manifest_bytes(step)
        self.adopt_manifest(step, raw)
        return raw

    def adopt_manifest(self, step: int, raw: bytes) -> Manifest:
        """Parse and cache a step's root manifest from its stored bytes (read here or by another rank).

        The bytes are checked as if read from the store: a root of another
        step, or one that does not parse, raises :class:`FormatError`.
        """
        step = check_step(step)
        if len(raw) > _m.MAX_MANIFEST_BYTES:
            raise FormatError(f"{self.url}: step {step}: manifest is {len(raw)} bytes, over the limit")
        try:
            m = _m.from_json(raw, expect_step=step)
        except FormatError as e:
            raise type(e)(f"{self.url}: step {step}: {e}") from None
        self._manifests.put(step, m)
        return m

    def chunks(self, step: int):
        """Every chunk reference of a committed step (a 2.0 or 3.0 step's chunk tables are read, whole)."""
        return self.tables.iter_chunks(self.manifest(step))

    def resolved_manifest(self, step: int) -> Manifest:
        """A step's manifest with every shard's chunks in it (2.0: all its chunk tables read)."""
        return self.tables.resolve_all(self.manifest(step))

    def step_created(self, step: int) -> float:
        """A committed step's creation time, from the first bytes of its manifest.

        Writers put ``"created"`` among the first fields; a manifest where it
        is not found there is parsed whole (its references read and dropped).
        """
        step = check_step(step)
        m = self._manifests.get(step)
        if m is not None:
            return m.created
        key = manifest_key(step)
        try:
            info = self.store.head(key)
            (head,) = self.store.get_ranges(key, [(0, min(info.size, 512))])
        except ObjectNotFoundError:
            raise self._not_committed(step) from None
        found = _CREATED.search(bytes(head))
        if found is not None and int(found.group(1)) == step:
            return float(found.group(2))
        return self.step_refs(step).created

    def step_refs(self, step: int, intern: dict | None = None) -> StepRefs:
        """What a committed step references (packs, live bytes, segments), without caching its root.

        GC reads every step this way: a 2.0 or 3.0 root's tensors and columns are
        not decoded, so the cost is the root's JSON, not its shards.
        """
        step = check_step(step)
        m = self._manifests.get(step)
        if m is not None:
            return refs_of(m)
        raw = self._manifest_bytes(step)
        try:
            return parse_refs(raw, expect_step=step, intern=intern)
        except FormatError as e:
            raise type(e)(f"{self.url}: step {step}: {e}") from None

    def _manifest_bytes(self, step: int) -> bytes:
        key = manifest_key(step)
        try:
            info = self.store.head(key)
            if info.size > _m.MAX_MANIFEST_BYTES:
                raise FormatError(f"{self.url}: step {step}: manifest is {info.size} bytes, over the limit")
            return self.store.get(key)
        except ObjectNotFoundError:
            pending = self._pending_manifest(step)
            if pending is not None:
                return pending
            raise self._not_committed(step) from None

    def _pending_manifest(self, step: int) -> bytes | None:
        """The manifest a pending step (write-back, in this node's tier) will commit, or None."""
        if self.tier is None:
            return None
        rec = self.tier.pending.read(step)
        if rec is None or rec.get("url") != self.url or not isinstance(rec.get("manifest"), str):
            return None
        raw = rec["manifest"].encode("utf-8")
        if len(raw) > _m.MAX_MANIFEST_BYTES:
            raise FormatError(f"{self.url}: pending step {step}: manifest is {len(raw)} bytes, over the limit")
        return raw

    def remember(self, m: Manifest) -> None:
        """Cache a manifest this handle just committed."""
        self._manifests.put(m.step, m)

    def forget(self, step: int) -> None:
        """Drop a manifest this handle cached (a pending step given up)."""
        self._manifests.pop(step)

    def cached_manifest(self, step: int) -> Manifest | None:
        return self._manifests.get(step)

    def delete(self, step: int) -> None:
        """Delete one step; its packs are reclaimed by GC.

        A tombstone holding the manifest is written first, so packs the step
        referenced stay protected from GC while a saver that read it as its
        dedup base may still commit (``docs/gc.md``).
        """
        step = check_step(step)
        key = manifest_key(step)
        try:
            raw = self.store.get(key)
        except ObjectNotFoundError:
            raise self._not_committed(step) from None
        self.store.put(tombstone_key(step), tombstone_record(step, raw, self.clock.time()))
        self.store.delete(key)
        self._manifests.pop(step)

    # ------------------------------------------------------------ tags
    def tag(self, step: int, name: str) -> None:
        """Point tag ``name`` at a committed step (replacing an earlier target)."""
        step = check_step(step)
        key = tag_key(name)
        if step not in self.steps():
            raise self._not_committed(step)
        self.store.put(key, tag_record(step))

    def tags(self) -> dict[str, int]:
        """Tag name -> step (unreadable tags are skipped)."""
        out = {}
        for info in self.store.list(TAG_PREFIX):
            name = tag_of_key(info.key)
            if name is None:
                continue
            try:
                out[name] = parse_tag(self.store.get(info.key))
            except (ObjectNotFoundError, ValueError, KeyError, TypeError):
                continue
        return out

    # ------------------------------------------------------------ checkpoint names
    # A framework names its checkpoints (a DeepSpeed tag, a Lightning file
    # name) and may save a name again. Steps are never rewritten, so a name
    # is a mutable record pointing at a step, moved with one atomic write
    # after the new step is committed ("docs/format.md#checkpoint-names").
    # Names do not keep steps from retention or GC (tags do).
    def set_name(self, ns: str, name: str, step: int) -> None:
        """Point checkpoint name ``name`` of name space ``ns`` at a committed step, in one write."""
        step = check_step(step)
        key = name_key(ns, name)
        if step not in self.steps():
            if not self.exists():
                raise self._no_repository()
            raise StepNotFoundError(f"{self.url}: cannot name step {step} {name!r}: the step is not committed")
        self.store.put(key, name_record(ns, name, step, self.clock.time()))

    def name_step(self, ns: str, name: str) -> int | None:
        """The step ``name`` points at (perhaps deleted since), or None if there is no such name."""
        key = name_key(ns, name)
        try:
            raw = self.store.get(key)
        except ObjectNotFoundError:
            return None
        try:
            return parse_name(raw, ns, name)
        except FormatError as e:
            raise type(e)(f"{self.url}: {e}") from None

    def names(self, ns: str) -> dict[str, int]:
        """Name -> step of every checkpoint name in ``ns`` (records that do not parse are skipped)."""
        out = {}
        for info in self.store.list(f"{NAME_PREFIX}{check_namespace(ns)}/"):
            parsed = name_of_key(info.key)
            if parsed is None or parsed[0] != ns:
                continue
            try:
                out[parsed[1]] = parse_name(self.store.get(info.key), ns, parsed[1])
            except (ObjectNotFoundError, FormatError):
                continue
        return out

    def all_names(self) -> dict[str, dict[str, int]]:
        """Name space -> name -> step, every checkpoint name in the repository."""
        spaces = sorted({parsed[0] for parsed in map(name_of_key, (o.key for o in self.store.list(NAME_PREFIX))) if parsed})
        return {ns: names for ns in spaces if (names := self.names(ns))}

    def drop_name(self, ns: str, name: str) -> bool:
        """Remove a checkpoint name (its step stays); False if there was none."""
        key = name_key(ns, name)
        try:
            self.store.head(key)
        except ObjectNotFoundError:
            return False
        self.store.delete(key)
        return True

    def free_step(self, preferred: int) -> int:
        """``preferred`` if no step of that number is committed, else one past the newest committed step.

        For saving a checkpoint name again: the new state gets a step of its
        own, and the name is moved to it.
        """
        preferred = check_step(preferred)
        steps = self.steps()
        if preferred not in steps:
            return preferred
        return check_step(steps[-1] + 1)

    # ------------------------------------------------------------ leases (docs/gc.md)
    def write_lease(self, step: int) -> str:
        """Announce a saver in flight to GC; returns the lease's key."""
        key = lease_key()
        self.store.put(key, lease_record(step, self.clock.time()))
        return key

    def drop_lease(self, key: str | None) -> None:
        if key is None:
            return
        try:
            self.store.delete(key)
        except Exception:
            pass  # a stale lease only delays GC; it expires after the grace period

    # ------------------------------------------------------------ listings
    def leases(self) -> dict[str, float]:
        """Lease key -> mtime."""
        return {o.key: o.mtime for o in self.store.list(LEASE_PREFIX)}

    def tombstone_keys(self) -> dict[str, float]:
        """Tombstone key -> mtime."""
        return {o.key: o.mtime for o in self.store.list(TOMBSTONE_PREFIX)}

    def tombstone_refs(self, key: str) -> StepRefs | None:
        """What the deleted step a tombstone keeps references (None if unreadable or gone); cached."""
        hit = self._tombstones.get(key)
        if hit is None:
            try:
                hit = (parse_tombstone(self.store.get(key), key),)
            except ObjectNotFoundError:
                return None  # expired meanwhile
            self._tombstones.put(key, hit)
        return hit[0]

    def _listed(self, prefix: str, id_of) -> dict[str, ObjectInfo]:
        """Id -> listing of the objects under ``prefix`` whose key ``id_of`` parses (others skipped)."""
        out = {}
        for o in self.store.list(prefix):
            oid = id_of(o.key)
            if oid is not None:
                out[oid] = o
        return out

    def packs(self) -> dict[str, ObjectInfo]:
        """Pack id -> what the store lists for it."""
        return self._listed(PACK_PREFIX, pack_id_of_key)

    def segments(self) -> dict[str, ObjectInfo]:
        """Chunk-table segment id -> what the store lists for it."""
        return self._listed(SEGMENT_PREFIX, segment_id_of_key)

    def relocated_packs(self) -> set[str]:
        """Ids of packs that have a relocation record."""
        return {p for p in (pack_id_of_relocation_key(o.key) for o in self.store.list(RELOCATION_PREFIX)) if p}

    def manifest_objects(self) -> Iterator[ObjectInfo]:
        """Everything listed under ``manifests/`` (verify reports what does not parse)."""
        return self.store.list(MANIFEST_PREFIX)
