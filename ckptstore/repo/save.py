"""Writing steps: the commit protocol, and a save around the chunk pipeline.

- :class:`~ckptstore.repo.chunks.ChunkWriter` (:mod:`.chunks`) cuts tensors
  into chunks, hashes and compresses them on the CPU pool, and appends the
  new ones in order to packs; chunks the dedup base or this save already
  holds are referenced instead.
- :class:`StepCommit` is the commit protocol every writer follows
  (``Repository.save``, the DCP writer, ``cp`` and ``import``)::

      begin()   refuse an existing step, refuse a store that fakes conditional
                creates (:func:`check_conditional_create`), create config.json,
                write the lease, start the clock, then choose the dedup base
                (in that order: docs/gc.md)
      ...       the caller writes chunks and finishes its packs
      commit()  record pack sizes, refuse if the dedup base may have been
                collected meanwhile (invariant 5), create the manifest with
                put-if-absent (invariant 2)
      end()     drop the lease (also on failure)

A writer that fails in its own process before its manifest create was sent
(an exception, ``KeyboardInterrupt``, a SIGTERM handler that raises) deletes
the packs and chunk-table segments it uploaded for the step
(:func:`discard_uncommitted`): no manifest names them, and none can, since
only this step's own commit could. Its multipart uploads are aborted as it
stops. A killed process, or a failure of the manifest create itself (whose
outcome is unknown), leaves them to GC after the grace period.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import time
from dataclasses import dataclass
from typing import Mapping

import torch

from ..format import manifest as _m
from .catalog import Catalog
from ..format.chunk_table import TableBuilder
from ..errors import (
    ConditionalWriteUnsupportedError,
    ManifestTooLargeError,
    ObjectExistsError,
    ObjectNotFoundError,
    PackVanishedError,
    StaleBaseError,
    StepExistsError,
    StorageError,
)
from ..format.layout import (
    check_step,
    lease_record,
    manifest_key,
    new_pack_id,
    pack_key,
    probe_key,
    safety_margin,
    segment_key,
)
from ..format import tiles as _tiles
from ..format.manifest import (
    MAX_PACK_RANGES,
    ChunkRef,
    Manifest,
    PackUsage,
    SegmentRef,
    Shard,
    TableRef,
    TensorEntry,
    merge_ranges,
)
from ..pipeline.tp_plan import TPPlan
from ..progress import Counter
from ..progress import callback as progress_callback
from ..storage.upload import ParallelUploader
from ..format.tree import flatten, tree_keys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInfo:
    """What one save did.

    Attributes
    ----------
    step: the step number committed.
    logical_bytes: raw bytes of every tensor in the state dict.
    uploaded_bytes: bytes written to the store (packs, manifest).
    reused_bytes: raw bytes referenced from chunks already stored.
    new_bytes: raw bytes of chunks stored for the first time.
    stored_bytes: compressed size of those new chunks.
    compression_ratio: ``new_bytes / stored_bytes`` (1.0 when nothing new).
    seconds: wall time of the save.
    unchanged_chunks, blocked_seconds, waited_seconds: see below (async saves).
    """

    step: int
    logical_bytes: int
    uploaded_bytes: int
    reused_bytes: int
    new_bytes: int
    stored_bytes: int
    compression_ratio: float
    seconds: float
    tensors: int
    new_chunks: int
    reused_chunks: int
    packs: int
    #: Of ``reused_chunks``, those an async save found unchanged by comparing bytes with its previous
    #: snapshot (:mod:`ckptstore.pipeline.snapshot`): referenced again without being hashed.
    unchanged_chunks: int = 0
    #: ``save(blocking=False)``: seconds the call blocked the caller (snapshot included), and of those
    #: the seconds it waited for the previous async save to finish writing; None for a blocking save.
    blocked_seconds: float | None = None
    waited_seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


# ==================================================================== dedup base
def dedup_index(cat: Catalog, base_step: int | None) -> dict[str, ChunkRef]:
    """The chunks of the whole dedup base step, by hash ({} without a base)."""
    refs: dict[str, ChunkRef] = {}
    if base_step is not None:
        for c in cat.tables.iter_chunks(cat.manifest(base_step)):
            refs.setdefault(c.hash, c)
    return refs


def dedup_share(cat: Catalog, base_step: int | None, boxes) -> dict[str, ChunkRef]:
    """The chunks of the base step's shards that meet ``boxes``, by hash.

    ``boxes`` are ``(tensor key, offsets, sizes)`` a writer is about to
    save: a rank reads the chunk tables of its own share of the base, never
    the whole step (a chunk that moved to another box is uploaded again).
    """
    if base_step is None:
        return {}
    man = cat.manifest(base_step)
    wanted = set()
    for key, offsets, sizes in boxes:
        t = man.tensors.get(key)
        if t is None or len(offsets) != len(t.shape):
            continue
        wanted.update((key, int(i)) for i in t.meeting(offsets, sizes))
    refs: dict[str, ChunkRef] = {}
    for chunks in cat.tables.resolve(man, wanted).values():
        for c in chunks:
            refs.setdefault(c.hash, c)
    return refs


@functools.lru_cache(maxsize=8)
def _tile_plan(entries: tuple) -> TPPlan:
    """The parsed ``tile_plan`` (once per plan, not once per tensor)."""
    return TPPlan(dict(entries), 0, 1)


def tile_for(options, key: str, shape, dtype: torch.dtype, base: Manifest | None) -> tuple[int, ...] | None:
    """The tile shape tensor ``key`` is saved with (None: row-major runs).

    A tensor the dedup base holds with the same shape and dtype keeps the base's layout, tiles or
    runs, so that its unchanged chunks are the base's (an unchanged tensor stores no new bytes,
    also in a repository written before tiles); any other is tiled when ``options.tiles`` allows:
    by :func:`~ckptstore.format.tiles.split_tile` along the dimension ``options.tile_plan`` splits
    it on, if it does, else by :func:`~ckptstore.format.tiles.choose_tile`.
    """
    shape = tuple(int(n) for n in shape)
    name = _m.dtype_name(dtype)
    if base is not None:
        b = base.tensors.get(key)
        if b is not None and b.shape == shape and b.dtype == name:
            return b.tile
    if not options.tiles:
        return None
    if options.tile_plan is not None:
        split = _tile_plan(tuple(options.tile_plan.items())).split(key, shape)
        if split.dim is not None:
            tile = _tiles.split_tile(shape, dtype.itemsize, options.chunk_size, split.dim)
            if tile is not None:
                return tile
    return _tiles.choose_tile(shape, dtype.itemsize, options.chunk_size)


def pack_usage(refs, counts: dict[str, int], base: Manifest | None = None) -> dict[str, PackUsage]:
    """Which bytes of each pack these chunk references use (see :class:`~ckptstore.format.manifest.PackUsage`).

    ``counts`` gives the chunk count of packs this writer wrote; a reused
    pack's comes from the base manifest (0 where it does not say).
    """
    spans: dict[str, list[tuple[int, int]]] = {}
    for c in refs:
        spans.setdefault(c.pack, []).append((c.offset, c.offset + c.stored_len))
    out = {}
    for pid, rs in spans.items():
        n = counts.get(pid)
        if n is None and base is not None and pid in base.pack_use:
            n = base.pack_use[pid].chunks
        out[pid] = PackUsage(n or 0, merge_ranges(rs, MAX_PACK_RANGES))
    return out


def write_segment(cat: Catalog, builder: TableBuilder, store=None, written: list | None = None) -> SegmentRef:
    """Write one chunk-table segment (a new, write-once object) and check its size.

    ``store``: where to write it (default the repository's store; a
    write-back save writes it into the node-local tier). ``written``: a
    list its key is appended to before the upload starts (what a failed
    save deletes, :func:`discard_uncommitted`).
    """
    data, header_len, digest = builder.encode()
    sid = new_pack_id()
    key = segment_key(sid)
    if written is not None:
        written.append(key)
    o = cat.options
    store = cat.store if store is None else store
    up = ParallelUploader(store, key, o.part_size, cat.runtime.io, window=4,
                          buffers=cat.runtime.buffers("parts", o.part_size, (o.packs_in_flight + 1) * 5))
    try:
        up.write(data)
        size = up.close()
    except BaseException:
        up.abort()
        raise
    try:
        got = store.head(key).size
    except ObjectNotFoundError:
        raise PackVanishedError(f"{cat.url}/{key}: segment vanished after its upload completed") from None
    if size != len(data) or got != len(data):
        raise StorageError(f"{cat.url}/{key}: stored size {got}, expected {len(data)}")
    if cat.tier is not None and store is cat.store:
        cat.tier.put_segment(sid, data)  # write-through: a restart on this node reads its chunk table here
    return SegmentRef(sid, len(data), len(builder), header_len, digest.hex())


def discard_uncommitted(cat: Catalog, step: int, error: BaseException, packs=(), keys=(), store=None,
                        tier: bool = True) -> None:
    """Delete what a writer uploaded for ``step`` that it did not commit: packs and segment keys.

    Nothing references them (only the step's own commit could), so they go
    now rather than after GC's grace period; so do the tier's copies of the
    packs (``tier``, when they went to the repository's store). ``error``:
    why the step was not committed, for the log. A failed delete leaves
    them for GC, with a warning.
    """
    keys = [pack_key(p) for p in packs] + list(keys)
    if not keys:
        return
    store = cat.store if store is None else store
    why = type(error).__name__ + (f": {error}" if str(error) else "")
    try:
        store.delete_many(keys)
    except BaseException as e:  # noqa: BLE001 - a second Ctrl-C, an unreachable store: GC's job then
        log.warning("ckptstore: %s: step %d was not committed (%s); %d object(s) its save uploaded could not be "
                    "deleted (%s: %s): gc reclaims them after the grace period",
                    cat.url, step, why, len(keys), type(e).__name__, e)
        return
    if tier and cat.tier is not None and store is cat.store:
        for p in packs:
            cat.tier.discard_pack(p)
    log.info("ckptstore: %s: step %d was not committed (%s); deleted the %d pack(s) and %d chunk table(s) "
             "its save uploaded", cat.url, step, why, len(packs), len(keys) - len(packs))


# ==================================================================== commit protocol
#: Stores (by :attr:`~ckptstore.storage.base.ObjectStore.identity`) whose conditional creates this
#: process has seen refused: probed once per process, not once per handle or save.
_CONDITIONAL_OK: set[str] = set()


def check_conditional_create(cat: Catalog) -> None:
    """Refuse a remote store that accepts a second ``If-None-Match: *`` create of one key.

    The commit (invariant 2) rests on the store refusing the second of two
    creates of a manifest; a store that ignores the condition (SeaweedFS up
    to 4.16 under concurrency, proxies that drop the header) would let a
    second writer of a step replace the first. The probe: create a fresh key
    under ``leases/``, create it again with other bytes (this must be
    refused), delete it. Three requests, once per store and process; local
    and memory stores make their creates exclusive themselves.
    """
    store = cat.store
    ident = store.identity
    if not store.remote or ident in _CONDITIONAL_OK:
        return
    key = probe_key()
    body = lease_record(-1, cat.clock.time())
    store.put_if_absent(key, body)
    try:
        try:
            store.put_if_absent(key, body + b"\n")
        except ObjectExistsError:
            _CONDITIONAL_OK.add(ident)
            return
        raise ConditionalWriteUnsupportedError(
            f"{cat.url}: the store accepted a second conditional create (If-None-Match: *) of {key}: it does "
            "not support conditional writes, so two writers of one step could replace each other's manifest. "
            "ckptstore does not commit to it; nothing was committed. Use a store (or version) that refuses a "
            "create of an existing key with 412 Precondition Failed"
        )
    finally:
        cat.drop_lease(key)


class StepCommit:
    """The commit protocol of one step; see the module docstring.

    Parameters
    ----------
    cat:
        The destination repository.
    step:
        The step to commit.
    base:
        Dedup base: ``"latest"``, a step number, or None.
    """

    def __init__(self, cat: Catalog, step: int, base: int | str | None = "latest"):
        self.cat = cat
        self.step = check_step(step)
        self.base = base
        self.base_step: int | None = None
        self.lease: str | None = None
        self.t0: float | None = None
        #: The manifest's create was sent: from then on this writer's objects may be referenced.
        self.creating = False
        #: The steps :meth:`begin` listed to pick a ``"latest"`` base (None: it listed none); a DCP
        #: coordinator passes them on, so that the other ranks' handles forget the steps it no longer
        #: lists, as its own does (:meth:`~ckptstore.repo.catalog.Catalog.forget_unlisted`).
        self.listed: list[int] | None = None

    def begin(self, base_read_at: float | None = None, pending: bool = False, pending_base: bool | None = None) -> int | None:
        """Claim the step (not committed yet), write the lease; returns the dedup base step.

        ``base_read_at`` (the clock's monotonic time) is for a writer that
        read what it reuses earlier, under a lease of its own held since
        then (``cp``): the base-age check counts from there. ``pending``:
        a write-back save, which also refuses a step pending in the tier and
        (unless ``pending_base=False``: a DCP save, whose other ranks cannot
        read this node's pending steps) may take a pending step as its
        dedup base.
        """
        cat = self.cat
        if cat.store.exists(manifest_key(self.step)) or (pending and self.step in cat.pending_steps()):
            raise StepExistsError(f"{cat.url}: step {self.step} already exists; nothing was written")
        check_conditional_create(cat)
        cat.ensure_config()
        # The lease goes up, and the clock starts, before the dedup base is read.
        self.lease = cat.write_lease(self.step)
        self.t0 = cat.clock.monotonic() if base_read_at is None else base_read_at
        if self.base == "latest":
            self.listed = cat.steps(pending=pending if pending_base is None else pending_base)
            self.base_step = self.listed[-1] if self.listed else None
        else:
            self.base_step = None if self.base is None else check_step(self.base)
        return self.base_step

    def check_base_age(self) -> None:
        """Invariant 5: refuse to commit once the dedup base may have been collected.

        GC keeps the packs of a deleted step for the grace period after the
        deletion; a save that outlived ``grace - margin`` since reading its
        base can no longer rely on that.
        """
        grace = self.cat.grace()
        margin = safety_margin(grace)
        age = self.cat.clock.monotonic() - self.t0
        if age > grace - margin:
            raise StaleBaseError(
                f"{self.cat.url}: step {self.step}: this save read its dedup base {age:.3g} s ago, longer than the "
                f"repository's GC grace period ({grace:.3g} s) less the safety margin ({margin:.3g} s); "
                "chunks it reuses may have been collected, so it does not commit. Save again, or raise "
                "the grace period (ckptstore.open(..., grace=SECONDS) on an empty repository)."
            )

    def pack_sizes(self, man: Manifest, new_packs: dict[str, int], known: dict[str, int] | None = None) -> Manifest:
        """``man`` with the size of every pack it names (written here, known, or from the store)."""
        sizes = {}
        base = self.cat.cached_manifest(self.base_step) if self.base_step is not None else None
        for pid in man.packs:
            if pid in new_packs:
                sizes[pid] = new_packs[pid]
            elif known is not None and pid in known:
                sizes[pid] = known[pid]
            elif base is not None and pid in base.packs:
                sizes[pid] = base.packs[pid]
            else:
                sizes[pid] = self.cat.store.head(pack_key(pid)).size
        return Manifest(**{**man.__dict__, "packs": sizes})

    def check_manifest_size(self, man: Manifest, body: bytes) -> None:
        if len(body) > _m.MAX_MANIFEST_BYTES:
            raise ManifestTooLargeError(
                f"{self.cat.url}: step {man.step}: the manifest would be {len(body)} bytes, over the "
                f"{_m.MAX_MANIFEST_BYTES}-byte limit readers accept; nothing was committed. Save with a "
                "larger chunk_size, or fewer, larger shards"
            )

    def commit(self, man: Manifest) -> bytes:
        """Create the step's manifest (exclusive create): the step now exists."""
        cat = self.cat
        self.check_base_age()
        body = _m.to_json(man)
        self.check_manifest_size(man, body)
        check_conditional_create(cat)  # a commit whose begin() ran elsewhere (write-back drains)
        self.creating = True
        try:
            cat.store.put_if_absent(manifest_key(man.step), body)
        except ObjectExistsError:
            # A retried create whose first response was lost finds its own
            # manifest: accept it if it is byte-identical, refuse otherwise.
            try:
                stored = cat.store.get(manifest_key(man.step))
            except ObjectNotFoundError:
                stored = None
            if stored != body:
                raise StepExistsError(
                    f"{cat.url}: step {man.step} was committed by another writer during this save; "
                    "this save's packs are unreferenced: the save deletes them (else gc reclaims them)"
                ) from None
        cat.remember(man)
        return body

    def uncommitted(self, error: BaseException) -> bool:
        """Whether a writer that failed with ``error`` knows its step was not committed by it: the
        manifest's create was never sent, or another writer's manifest took the step."""
        return not self.creating or isinstance(error, StepExistsError)

    def end(self) -> None:
        """Drop the lease (a stale one only delays GC)."""
        self.cat.drop_lease(self.lease)
        self.lease = None

    def __enter__(self) -> "StepCommit":
        self.begin()
        return self

    def __exit__(self, *exc) -> None:
        self.end()


# ==================================================================== chunk pipeline: .chunks
from .chunks import ChunkWriter  # noqa: E402  (re-exported: the DCP writer, transfer and tests use it here)

# ==================================================================== Repository.save
def check_metadata(metadata) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError("metadata must be a dict of JSON values")
    try:
        json.dumps(metadata, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata is not JSON-serializable: {e}") from None
    return metadata


def save_step(cat: Catalog, tree, tensors: dict[str, torch.Tensor], step: int, metadata: dict, base,
              progress=None, known: "KnownChunks | None" = None, refs_out: dict | None = None) -> StepInfo:
    """Save one flattened state dict as a new step (the body of ``Repository.save``).

    ``known``: chunks an async save found unchanged since its previous step
    (:class:`KnownChunks`), used only if that step is this save's dedup base.
    ``refs_out``: filled with each tensor's ``(chunk references, tile shape or None)`` once saved.
    """
    report, close = progress_callback(progress)
    report = report if progress not in (None, False) else None
    args = (known, refs_out)
    try:
        if cat.write_back is None or not cat.tier.writable:
            return _save_step(cat, tree, tensors, step, metadata, base, report, None, *args)
        try:
            return _save_step(cat, tree, tensors, step, metadata, base, report, cat.write_back, *args)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # The tier is full: this save goes straight to the store (nothing
            # of it was committed anywhere), with a warning, never failing.
            log.warning("ckptstore: write-back: the node-local tier %s is full (%s); step %d is saved "
                        "straight to %s", cat.tier.cache_dir, e, step, cat.url)
            cat.tier.disable_writes(e)
            return _save_step(cat, tree, tensors, step, metadata, base, report, None, *args)
    finally:
        close()


@dataclass(frozen=True)
class KnownChunks:
    """Chunks of an async save's tensors whose bytes equal those of step ``step``'s chunks
    (:mod:`ckptstore.pipeline.snapshot`): ``refs[key][j]`` is chunk ``j``'s reference there, or None
    (changed, or not compared), ``tiles[key]`` the tile shape those chunks were cut in (None: runs).
    Valid only for ``chunk_size`` chunks, for a save whose dedup base is ``step`` (:meth:`for_base`
    says) and for a tensor cut the same way again (:meth:`of`)."""

    step: int
    chunk_size: int
    refs: dict
    tiles: dict = dataclasses.field(default_factory=dict)

    def for_base(self, base_step: int | None, chunk_size: int) -> "KnownChunks | None":
        return self if base_step == self.step and chunk_size == self.chunk_size else None

    def of(self, key: str, tile) -> list | None:
        """``refs[key]`` if the tensor is cut in ``tile`` again, else None."""
        return self.refs.get(key) if self.tiles.get(key) == tile else None


def _queue_tensors(cat: Catalog, writer: ChunkWriter, tree, tensors, base_step, same: KnownChunks | None,
                   entries: dict) -> None:
    """Queue every tensor's chunks in state-dict order: ``entries[key] = (tensor, refs, tile)``."""
    base_man = cat.manifest(base_step) if base_step is not None else None
    for key in tree_keys(tree):
        t = tensors[key]
        tile = tile_for(cat.options, key, t.shape, t.dtype, base_man)
        entries[key] = (t, writer.add(t, same.of(key, tile) if same is not None else None, tile), tile)


def _save_step(cat: Catalog, tree, tensors, step: int, metadata: dict, base, report, wb,
               known: KnownChunks | None = None, refs_out: dict | None = None) -> StepInfo:
    t0 = time.perf_counter()
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    if wb is not None:
        # at most write_back_steps pending, and within cache_size: wait for the oldest
        wb.reserve(raw, f"step {step}")
    if cat.tier is not None:
        cat.tier.note_step(step, expect=raw)  # a save under way: older steps' packs are evicted before the newest
    commit = StepCommit(cat, step, base)
    handed_over = False
    target = wb.store if wb is not None else None  # write-back: packs and segment go to the tier
    writer: ChunkWriter | None = None
    segments: list[str] = []  # keys of the chunk tables this save wrote
    try:
        base_step = commit.begin(pending=wb is not None)
        on_bytes = None
        if report is not None:
            on_bytes = Counter(report, "save bytes", sum(t.numel() * t.element_size() for t in tensors.values())).add
        writer = ChunkWriter(cat, dedup_index(cat, base_step), on_bytes, store=target)
        same = known.for_base(base_step, cat.options.chunk_size) if known is not None else None
        entries: dict[str, tuple[torch.Tensor, list, tuple | None]] = {}
        try:
            _queue_tensors(cat, writer, tree, tensors, base_step, same, entries)
            writer.drain()
            # The chunk table goes out while the last pack is completed; the
            # manifest naming both is created only once both are verified.
            builder = TableBuilder()
            te = {}
            for key, (t, refs, tile) in entries.items():
                shape = tuple(t.shape)
                first, count = builder.extend(refs)
                te[key] = TensorEntry(key, _m.dtype_name(t.dtype), shape,
                                      (Shard((0,) * len(shape), shape, tuple(refs), TableRef(0, first, count)),),
                                      tile=tile)
            seg = write_segment(cat, builder, store=target, written=segments)
            packs = writer.finish()
        except PackVanishedError as e:
            writer.abort()
            commit.check_base_age()  # a slow save: say so
            raise StorageError(str(e)) from None
        except BaseException:
            writer.abort()
            raise
        stats = writer.stats(packs)
        stats["segment_bytes"] = seg.size
        man = Manifest(
            step=commit.step,
            created=cat.clock.time(),
            tensors=te,
            tree=tree,
            packs={c.pack: 0 for r in te.values() for s in r.shards for c in s.chunks},
            metadata=metadata,
            base_step=base_step,
            stats=stats,
            segments=(seg,),
            pack_use=pack_usage((c for _, refs, _ in entries.values() for c in refs), writer.packs.counts,
                                cat.cached_manifest(base_step) if base_step is not None else None),
        )
        if wb is not None:
            body = wb.hand_over(commit, commit.pack_sizes(man, packs), packs, seg)  # committed in the background
            handed_over = True
        else:
            body = commit.commit(commit.pack_sizes(man, packs))
        if cat.tier is not None:
            cat.tier.note_step(commit.step, packs)  # eviction takes the newest steps' packs last
        if refs_out is not None:
            refs_out.update((key, (refs, tile)) for key, (_, refs, tile) in entries.items())
    except BaseException as e:
        # Not committed here (and, write-back, not recorded as pending): what it uploaded goes now.
        if (writer is not None and not handed_over and commit.uncommitted(e)
                and (wb is None or wb.records.read(commit.step) is None)):
            writer.abort()
            discard_uncommitted(cat, commit.step, e, writer.started(), segments, store=target)
        raise
    finally:
        if not handed_over:
            commit.end()
            if wb is not None:
                wb.unreserve()
    return StepInfo(
        step=commit.step,
        logical_bytes=writer.logical,
        uploaded_bytes=sum(packs.values()) + seg.size + len(body),
        reused_bytes=writer.reused,
        new_bytes=writer.new_raw,
        stored_bytes=writer.new_stored,
        compression_ratio=(writer.new_raw / writer.new_stored) if writer.new_stored else 1.0,
        seconds=time.perf_counter() - t0,
        tensors=len(te),
        new_chunks=writer.new_chunks,
        reused_chunks=writer.reused_chunks,
        packs=len(packs),
        unchanged_chunks=writer.unchanged_chunks,
    )


def flatten_for_save(state_dict: Mapping, step, metadata) -> tuple[dict, dict, int, dict]:
    """Checked inputs of a save: ``(tree, tensors, step, metadata)``."""
    step = check_step(step)
    tree, tensors = flatten(state_dict)
    return tree, tensors, step, check_metadata(metadata)
