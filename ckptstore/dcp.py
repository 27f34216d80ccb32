"""torch.distributed.checkpoint storage backend.

``CkptStoreWriter`` and ``CkptStoreReader`` plug ckptstore into DCP's
planners, so FSDP/DTensor state dicts, multi-rank saves and resharding on
load work as DCP users expect::

    import torch.distributed.checkpoint as dcp
    from ckptstore.dcp import CkptStoreWriter, CkptStoreReader

    dcp.save(sd, storage_writer=CkptStoreWriter("s3://bucket/run", step=1000))
    dcp.load(sd, storage_reader=CkptStoreReader("s3://bucket/run", step=1000))

Save: the coordinator checks the step is free and picks the dedup base in
``prepare_global_plan``; every rank chunks, hashes, compresses and uploads
its own items into its own packs in ``write_data`` (chunks already in the
dedup base are referenced, not uploaded); the coordinator's ``finish``
builds the step's one manifest from all ranks' results and commits it with
an exclusive create, like :meth:`Repository.save`. DCP's bytes items (values
DCP serializes itself) are stored as opaque chunks; DCP's metadata is kept
in the manifest as JSON and rebuilt by ``read_metadata``. No pickle is
written or read by this module.

Load: each read item becomes a box of one stored shard; the range-reading
loader fetches only the chunks covering it (coalesced, concurrent,
verified) and writes into the destination tensor.

A step saved here is an ordinary step (``repo.checkpoint(step).read``,
``repo.load`` assemble shards); a step saved with ``repo.save`` loads
through ``CkptStoreReader``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import io
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

import numpy as np

from . import manifest as _m
from .chunktable import TableBuilder
from .errors import CkptStoreError, FormatError, StepExistsError, StepNotFoundError
from .layout import check_step as _check_step
from .layout import pack_key
from .manifest import Manifest, PackUsage, SegmentRef, TensorEntry, merge_ranges
from .repository import Repository
from .repository import open as _open
from .save import ChunkWriter, StepCommit, dedup_share, pack_usage, write_segment
from .tree import decode_value, encode_value, leaf_values, tensor_paths

__all__ = ["CkptStoreWriter", "CkptStoreReader", "RankWriteError", "split_checkpoint_id"]

_SCHEMES = ("s3://", "gs://", "gcs://", "file://", "memory://")


class RankWriteError(CkptStoreError, RuntimeError):
    """One rank failed to write its items; no step was committed."""


@dataclass(frozen=True)
class _GlobalInfo:
    """What the coordinator tells every rank in ``prepare_global_plan``."""

    rank: int
    base_step: int | None


@dataclass(frozen=True)
class _RankInfo:
    """What a rank wrote, carried to the coordinator on its first result (O(packs), never O(chunks))."""

    rank: int
    segment: SegmentRef | None  # its chunk-table segment (None when it wrote no item)
    packs: dict  # pack id -> size, every pack its chunk references name
    use: dict  # pack id -> PackUsage: which bytes of it its references use
    stats: dict  # its byte counts


@dataclass(frozen=True, slots=True)
class _ItemResult:
    """A rank's record of one written item: where its chunk records are in the rank's segment."""

    rank: int
    bytes_item: bool
    nbytes: int
    first: int
    count: int
    stored: int
    info: _RankInfo | None = None  # on the first result of a rank


def _is_url(checkpoint_id) -> bool:
    return isinstance(checkpoint_id, (str, os.PathLike))


_STEP_SEGMENT = re.compile(r"step-([0-9]{1,19})")


def split_checkpoint_id(checkpoint_id: str | os.PathLike) -> tuple[str, int | None]:
    """The repository URL and step a DCP ``checkpoint_id`` names.

    A URL or path whose last segment is ``step-N`` (``s3://bucket/run/step-1000``,
    ``/ckpt/run/step-1000``, as torchtitan and most trainers name their
    checkpoints) names step N of the repository at its parent
    (``s3://bucket/run``). Anything else names a repository, and the step
    comes from the writer's or reader's ``step`` argument.

    >>> split_checkpoint_id("s3://bucket/run/step-1000")
    ('s3://bucket/run', 1000)
    >>> split_checkpoint_id("s3://bucket/run")
    ('s3://bucket/run', None)
    """
    text = os.fspath(checkpoint_id)
    head, sep, last = text.rstrip("/").rpartition("/")
    m = _STEP_SEGMENT.fullmatch(last)
    if not sep or m is None or not head or head.endswith(":/"):
        return text, None
    return head, _check_step(int(m.group(1)))


def _pick_step(url: str, id_step: int | None, step: int | None, what: str) -> int | None:
    if id_step is not None and step is not None and id_step != step:
        raise ValueError(f"{what}: {url!r} names step {id_step} but step={step} was given")
    return id_step if id_step is not None else step


class CkptStoreWriter(StorageWriter):
    """DCP ``StorageWriter`` that saves one step of a ckptstore repository.

    Parameters
    ----------
    url:
        Repository URL (``s3://bucket/prefix``, a path, ``memory://name``...),
        or the URL of one step of it (``s3://bucket/prefix/step-1000``, see
        :func:`split_checkpoint_id`). A ``checkpoint_id`` passed to
        ``dcp.save`` replaces it, so one writer serves many saves:
        ``dcp.save(sd, checkpoint_id=f"{url}/step-{n}", storage_writer=w)``.
    step:
        Step number to commit when the URL (or ``checkpoint_id``) names none;
        it must not exist yet (committed steps are never overwritten).
    storage_options:
        Backend options, as for :func:`ckptstore.open`.
    metadata:
        JSON dict stored with the step.
    base:
        Dedup base: ``"latest"`` (default), a step number, or None.
    **options:
        Repository tunables (``chunk_size``, ``pack_size``, ``workers``...).
    """

    def __init__(
        self,
        url: str | os.PathLike,
        step: int | None = None,
        storage_options: dict | None = None,
        metadata: dict | None = None,
        base: int | str | None = "latest",
        **options,
    ):
        super().__init__()
        self._default_step = None if step is None else _check_step(step)
        self.url, id_step = split_checkpoint_id(url)
        self.step = _pick_step(self.url, id_step, self._default_step, "CkptStoreWriter")
        self.storage_options = storage_options
        self.user_metadata = dict(metadata or {})
        self.base = base
        self.options = options
        self.rank = 0
        self.is_coordinator = True
        self._repo: Repository | None = None
        self._base_step: int | None = None
        self._commit: StepCommit | None = None
        self.last_rank_stats: dict | None = None

    # -- DCP protocol -------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.url, id_step = split_checkpoint_id(checkpoint_id)
            self.step = id_step if id_step is not None else self._default_step
        self._close()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = int(rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def _require_step(self) -> int:
        if self.step is None:
            raise ValueError(
                f"CkptStoreWriter({self.url!r}): no step to save; pass step=N, or a checkpoint_id "
                f"that names one ({self.url.rstrip('/')}/step-N)"
            )
        return self.step

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        repo = self._get_repo()
        step = self._require_step()
        # The commit protocol every writer follows (ckptstore.save.StepCommit):
        # the coordinator claims the step, writes the lease and picks the
        # dedup base here, and commits in finish().
        self._commit = StepCommit(repo, step, self.base)
        try:
            base_step = self._commit.begin()
        except StepExistsError:
            self._commit = None
            raise StepExistsError(
                f"{repo.url}: step {step} already exists; nothing was written. Committed steps are "
                f"never overwritten: save a new step (checkpoint_id={repo.url.rstrip('/')}/step-M, "
                "or CkptStoreWriter(url, step=M))"
            ) from None
        self._base_step = base_step
        return [
            dataclasses.replace(p, storage_data=_GlobalInfo(rank=i, base_step=base_step))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data if isinstance(plan.storage_data, _GlobalInfo) else None
        rank = info.rank if info is not None else self.rank
        base_step = info.base_step if info is not None else None
        fut: Future = Future()
        try:
            fut.set_result(self._write_items(plan, planner, rank, base_step))
        except BaseException as e:
            raise RankWriteError(
                f"rank {rank}: writing step {self.step} of {self.url} failed: {type(e).__name__}: {e}"
            ) from e
        return fut

    def _write_items(self, plan: SavePlan, planner: SavePlanner, rank: int, base_step) -> list[WriteResult]:
        repo = self._get_repo()
        repo.config()  # adopt the repository's chunk size (dedup needs the same cut)
        # Dedup against this rank's share of the base: the base's shards that
        # meet the boxes it writes (bytes items: any shard of the same key).
        boxes = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                boxes.append((item.index.fqn, (0,), (1 << 62,)))
            else:
                boxes.append((item.index.fqn, tuple(item.tensor_data.chunk.offsets), tuple(item.tensor_data.chunk.sizes)))
        writer = ChunkWriter(repo, dedup_share(repo, base_step, boxes))
        pending = []
        try:
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    buf = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                    t = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
                    is_bytes = True
                else:
                    t = data
                    is_bytes = False
                refs = writer.add(t)
                pending.append((item, is_bytes, t.numel() * t.element_size(), refs))
            packs = writer.finish()
            builder = TableBuilder()
            runs = [builder.extend(refs) for _, _, _, refs in pending]
            segment = write_segment(repo, builder) if pending else None
        except BaseException:
            writer.abort()
            raise
        stats = writer.stats(packs)
        if segment is not None:
            stats["segment_bytes"] = segment.size
        self.last_rank_stats = dict(stats, rank=rank)
        all_refs = [c for _, _, _, refs in pending for c in refs]
        sizes = dict(packs)
        base = repo.cached_manifest(base_step) if base_step is not None else None
        for c in all_refs:
            if c.pack not in sizes:
                sizes[c.pack] = base.packs[c.pack] if base is not None and c.pack in base.packs else None
        info = _RankInfo(rank, segment, sizes, pack_usage(all_refs, writer.packs.counts, base), stats)
        results = []
        for n, ((item, is_bytes, nbytes, refs), (first, count)) in enumerate(zip(pending, runs)):
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=nbytes,
                    storage_data=_ItemResult(
                        rank=rank,
                        bytes_item=is_bytes,
                        nbytes=nbytes,
                        first=first,
                        count=count,
                        stored=sum(c.stored_len for c in refs),
                        info=info if n == 0 else None,
                    ),
                )
            )
        if not results and packs:
            raise RankWriteError(f"rank {rank}: wrote packs but no items")
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        repo = self._get_repo()
        commit, self._commit = self._commit, None
        if commit is None:
            raise CkptStoreError(f"{repo.url}: finish() without prepare_global_plan() on the coordinator")
        try:
            man = build_manifest(
                self.step, metadata, results, base_step=self._base_step, user_metadata=self.user_metadata
            )
            missing = [p for p, size in man.packs.items() if size is None]
            if missing:  # a reused pack the base manifest did not list: ask the store
                sizes = dict(man.packs)
                for p in missing:
                    sizes[p] = repo.store.head(pack_key(p)).size
                man = dataclasses.replace(man, packs=sizes)
            commit.commit(man)
        finally:
            commit.end()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _is_url(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url, save_id=f"step-{self.step}")

    # -- helpers ------------------------------------------------------------
    def _get_repo(self) -> Repository:
        if self._repo is None:
            self._repo = _open(self.url, storage_options=self.storage_options, **self.options)
        return self._repo

    def _close(self, drop_lease: bool = True) -> None:
        if self._commit is not None:  # a save that never reached finish()
            if drop_lease:
                self._commit.end()
            self._commit = None
        if self._repo is not None:
            self._repo.close()
            self._repo = None

    def close(self) -> None:
        """Release threads and connections (also done on garbage collection)."""
        self._close()

    def __del__(self):
        # No requests from a finalizer (it may run on any thread, even one
        # the store's event loop waits on): a lease left behind expires
        # after the grace period.
        try:
            self._close(drop_lease=False)
        except Exception:
            pass


def build_manifest(
    step: int, metadata: Metadata, results: list[list[WriteResult]], base_step=None, user_metadata=None
) -> Manifest:
    """The 2.0 root of a DCP save, from DCP's global metadata and every rank's results.

    O(ranks + packs + shards) work and memory: each result carries where its
    item's records are in its rank's segment, never the chunk records.
    Shard boxes and table runs are filled into arrays, placed by the index
    hints DCP's default planner writes (``MetadataIndex.index``), by offsets
    otherwise.
    """
    stats = {"logical_bytes": 0, "new_bytes": 0, "stored_bytes": 0, "reused_bytes": 0, "pack_bytes": 0,
             "segment_bytes": 0}
    ranks: dict[str, dict] = {}
    seg_of_rank: dict[int, int] = {}
    segments: list[SegmentRef] = []
    packs: dict[str, int | None] = {}
    use: dict[str, list] = {}
    pack_chunks: dict[str, int] = {}
    for rank_results in results:
        for wr in rank_results:
            sd = wr.storage_data
            if not isinstance(sd, _ItemResult):
                raise FormatError(f"step {step}: a write result carries no ckptstore data (mixed storage writers?)")
            info = sd.info
            if info is None:
                continue
            if info.rank in seg_of_rank:
                raise FormatError(f"step {step}: rank {info.rank} reported twice")
            if info.segment is not None:
                seg_of_rank[info.rank] = len(segments)
                segments.append(info.segment)
            for p, size in info.packs.items():
                if packs.get(p) is None:
                    packs[p] = size
            for p, u in info.use.items():
                use.setdefault(p, []).extend(u.ranges)
                pack_chunks[p] = max(pack_chunks.get(p, 0), u.chunks)
            ranks[str(info.rank)] = info.stats
            for k in stats:
                stats[k] += info.stats.get(k, 0)
    stats["ranks"] = ranks

    # Where each item landed: by DCP's index hint (position in md.chunks), else by offsets.
    placed: dict[str, dict[int, _ItemResult]] = {}
    by_offset: dict[tuple[str, tuple], _ItemResult] = {}
    for rank_results in results:
        for wr in rank_results:
            idx = wr.index
            if idx.index is not None:
                placed.setdefault(idx.fqn, {})[idx.index] = (idx.offset, wr.storage_data)
            else:
                by_offset[(idx.fqn, tuple(idx.offset) if idx.offset is not None else None)] = wr.storage_data

    def seg(sd: _ItemResult, fqn: str) -> int:
        g = seg_of_rank.get(sd.rank)
        if g is None:
            raise FormatError(f"step {step}: {fqn!r}: rank {sd.rank} wrote no chunk-table segment")
        return g

    tensors: dict[str, TensorEntry] = {}
    bytes_keys: list[str] = []
    for fqn, md in metadata.state_dict_metadata.items():
        hints = placed.get(fqn, {})
        if isinstance(md, BytesStorageMetadata):
            sd = by_offset.get((fqn, None))
            if sd is None and len(hints) == 1:
                sd = next(iter(hints.values()))[1]
            if sd is None or not sd.bytes_item:
                raise FormatError(f"step {step}: bytes item {fqn!r} was not written exactly once")
            n = sd.nbytes
            tensors[fqn] = TensorEntry(
                fqn, "uint8", (n,), offsets=np.zeros((1, 1), np.int64), sizes=np.array([[n]], np.int64),
                tables=np.array([[seg(sd, fqn), sd.first, sd.count]], np.int64), stored_bytes=sd.stored, nchunks=sd.count,
            )
            bytes_keys.append(fqn)
            continue
        shape = tuple(md.size)
        dtype = _m.dtype_name(md.properties.dtype)
        isz = _m.itemsize(dtype)
        chunks = md.chunks
        n, nd = len(chunks), len(shape)
        offs = np.array([tuple(c.offsets) for c in chunks], dtype=np.int64).reshape(n, nd)
        sizes = np.array([tuple(c.sizes) for c in chunks], dtype=np.int64).reshape(n, nd)
        tabs = np.empty((n, 3), dtype=np.int64)
        stored = nchunks = 0
        for i, c in enumerate(chunks):
            hint = hints.get(i)
            sd = hint[1] if hint is not None and tuple(hint[0]) == tuple(c.offsets) else None
            if sd is None:
                sd = by_offset.get((fqn, tuple(c.offsets)))
                if sd is None:  # a hint at another position
                    sd = next((h[1] for h in hints.values() if tuple(h[0]) == tuple(c.offsets)), None)
            if sd is None:
                raise FormatError(f"step {step}: no rank wrote tensor {fqn!r} at offsets {tuple(c.offsets)}")
            want = math.prod(c.sizes) * isz
            if sd.nbytes != want:
                raise FormatError(
                    f"step {step}: tensor {fqn!r} at {tuple(c.offsets)}: wrote {sd.nbytes} bytes, planned "
                    f"{tuple(c.sizes)} ({want} bytes)"
                )
            tabs[i] = (seg(sd, fqn), sd.first, sd.count)
            stored += sd.stored
            nchunks += sd.count
        tensors[fqn] = TensorEntry(fqn, dtype, shape, offsets=offs, sizes=sizes, tables=tabs,
                                   stored_bytes=stored, nchunks=nchunks)

    planner_data = metadata.planner_data
    tree = _tree_from_planner_data([k for k in tensors if k not in bytes_keys], planner_data)
    try:
        pd_node = encode_value(planner_data) if planner_data is not None else None
    except TypeError:
        pd_node = None  # a custom planner's private data; not needed to load tensors
    sm = metadata.storage_meta
    dcp_section = {
        "bytes": bytes_keys,
        "version": metadata.version,
        "planner_data": pd_node,
        "storage_meta": None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id,
            "load_id": sm.load_id,
            "modules": list(sm.modules or []),
        },
    }
    return Manifest(
        step=step,
        created=time.time(),
        tensors=tensors,
        tree=tree,
        packs=packs,
        metadata=user_metadata or {},
        base_step=base_step,
        stats=stats,
        dcp=dcp_section,
        segments=tuple(segments),
        pack_use={p: PackUsage(pack_chunks.get(p, 0), merge_ranges(r, _m.MAX_PACK_RANGES)) for p, r in use.items()},
    )


def _tree_from_planner_data(keys: list[str], planner_data) -> dict:
    """Nest tensor fqns by the paths DCP's planner recorded (flat if unknown)."""
    paths = {}
    if isinstance(planner_data, dict):
        for k in keys:
            p = planner_data.get(k)
            if isinstance(p, (tuple, list)) and p and all(type(x) in (str, int) for x in p):
                paths[k] = tuple(p)
    if len(paths) != len(keys):
        return {"d": [[k, {"t": k}] for k in keys]}
    root: dict = {}
    for k in keys:
        node = root
        p = paths[k]
        for part in p[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                return {"d": [[k, {"t": k}] for k in keys]}
            node = nxt
        if p[-1] in node:
            return {"d": [[k, {"t": k}] for k in keys]}
        node[p[-1]] = k

    def to_node(d):
        return {"d": [[name, {"t": v} if isinstance(v, str) else to_node(v)] for name, v in d.items()]}

    return to_node(root)


@dataclass(frozen=True)
class _ReadStep:
    """The step a rank resolved, carried in its local load plan to the coordinator."""

    rank: int
    step: int


class CkptStoreReader(StorageReader):
    """DCP ``StorageReader`` over one committed step.

    Parameters
    ----------
    url:
        Repository URL, or the URL of one step (``.../step-1000``, see
        :func:`split_checkpoint_id`); a ``checkpoint_id`` passed to
        ``dcp.load`` replaces it.
    step:
        Step to load when the URL (or ``checkpoint_id``) names none; None
        reads the newest committed step. Every rank resolves it on its own
        (no collective, so ``no_dist=True`` and sub-groups work), and the
        coordinator checks in ``prepare_global_plan`` that all ranks found
        the same step: a step committed while the ranks were starting fails
        the load on every rank with an error, never mixes steps.
    storage_options:
        Backend options, as for :func:`ckptstore.open`.
    item_workers:
        Read items processed concurrently (each fans out to coalesced,
        concurrent range reads on the repository's I/O pool).

    Destination tensors may have another floating dtype than the stored
    one: values are cast like DCP's ``FileSystemReader`` casts them.
    """

    def __init__(
        self,
        url: str | os.PathLike,
        step: int | None = None,
        storage_options: dict | None = None,
        item_workers: int = 4,
        **options,
    ):
        super().__init__()
        self._default_step = None if step is None else _check_step(step)
        self.url, id_step = split_checkpoint_id(url)
        self.step = _pick_step(self.url, id_step, self._default_step, "CkptStoreReader")
        self.storage_options = storage_options
        self.options = options
        self.item_workers = item_workers
        self.rank = 0
        self._repo: Repository | None = None
        self._ckpt = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            url, id_step = split_checkpoint_id(checkpoint_id)
            if url != self.url:
                self.close()  # a cached repository must not serve another checkpoint
                self.url = url
            self.step = id_step if id_step is not None else self._default_step
        self._ckpt = None

    def _get_repo(self) -> Repository:
        if self._repo is None:
            self._repo = _open(self.url, storage_options=self.storage_options, **self.options)
        return self._repo

    def _resolve_step(self) -> int:
        step = self.step
        if step is None:
            step = self._get_repo().latest()
            if step is None:
                raise StepNotFoundError(f"{self._get_repo().url}: the repository has no committed step")
        return step

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._ckpt = self._get_repo().checkpoint(self._resolve_step())
        return metadata_from_manifest(self._ckpt.manifest)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = int(rank)
        if self._ckpt is None:
            self._ckpt = self._get_repo().checkpoint(self._resolve_step())

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=_ReadStep(self.rank, self._ckpt.step))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        found = {p.storage_data.rank: p.storage_data.step for p in plans if isinstance(p.storage_data, _ReadStep)}
        if len(set(found.values())) > 1:
            by_step: dict[int, list[int]] = {}
            for rank, step in sorted(found.items()):
                by_step.setdefault(step, []).append(rank)
            seen = "; ".join(f"step {s} on rank(s) {r}" for s, r in sorted(by_step.items()))
            raise CkptStoreError(
                f"{self._get_repo().url}: the ranks found different latest steps ({seen}): a step was "
                "committed while the load started. Load again, or pass step= so every rank reads the same step"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        ckpt = self._ckpt
        man = ckpt.manifest
        bytes_keys = set((man.dcp or {}).get("bytes", []))
        values = leaf_values(man.tree) if man.dcp is None else {}
        tensor_jobs = []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                if fqn in bytes_keys:
                    data = ckpt.read(fqn).numpy().tobytes()
                elif fqn in values:
                    # A step saved by repo.save holds plain JSON values; DCP
                    # expects them as torch.save bytes of the value.
                    buf = io.BytesIO()
                    torch.save(values[fqn][0], buf)
                    data = buf.getvalue()
                else:
                    raise KeyError(f"{ckpt.repo.url}: step {man.step} has no value {fqn!r}")
                _check_weights_only(data, f"{ckpt.repo.url}: step {man.step}: bytes item {fqn!r}")
                planner.load_bytes(item, io.BytesIO(data))
                continue
            entry = man.tensors.get(fqn)
            if entry is None:
                raise KeyError(f"{ckpt.repo.url}: step {man.step} has no tensor {fqn!r}")
            index = ckpt.shard_at(fqn, item.storage_index.offset)
            local = tuple((o, o + n, 1) for o, n in zip(item.storage_offsets, item.lengths))
            target = planner.resolve_tensor(item).detach()
            tensor_jobs.append((item, entry, index, local, target))
        # One batch of chunk-table reads for every shard this rank reads.
        ckpt.resolve([(entry.key, index) for _, entry, index, _, _ in tensor_jobs])

        def run(job):
            _, entry, index, local, target = job
            (shard,) = ckpt.shards(entry.key, [index])
            ckpt.read_shard(entry, shard, local, target)

        if tensor_jobs:
            with cf.ThreadPoolExecutor(min(self.item_workers, len(tensor_jobs)), thread_name_prefix="ckpt-dcp") as ex:
                futures = [ex.submit(run, j) for j in tensor_jobs]
                for f in futures:
                    f.result()
            for item, _, _, _, target in tensor_jobs:
                planner.commit_tensor(item, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _is_url(checkpoint_id)

    def close(self) -> None:
        if self._repo is not None:
            self._repo.close()
            self._repo = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _check_weights_only(data: bytes, what: str) -> None:
    """Refuse a DCP bytes item that ``torch.load(weights_only=True)`` would refuse.

    DCP's default planner unpickles bytes items with ``weights_only=False``
    (torch 2.13's ``DefaultLoadPlanner.load_bytes``): any object a stored
    pickle names would be imported and run. Loading it with the restricted
    unpickler first proves it holds only tensors, containers and the types
    ``torch.serialization`` allows (``add_safe_globals`` extends them), so
    the planner's own load then builds the same objects.
    """
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FormatError(
            f"{what} is not loadable with torch.load(weights_only=True), so it is not handed to DCP's planner "
            f"(which would unpickle it unrestricted). Allow its types with "
            f"torch.serialization.add_safe_globals if you trust them. torch said: {first}"
        ) from None


def metadata_from_manifest(man: Manifest) -> Metadata:
    """DCP ``Metadata`` for a step (saved through DCP or by ``repo.save``)."""
    sdm: dict[str, Any] = {}
    if man.dcp is not None:
        bytes_keys = set(man.dcp.get("bytes", []))
        for key, e in man.tensors.items():
            if key in bytes_keys:
                sdm[key] = BytesStorageMetadata()
            else:
                sdm[key] = _tensor_md(e)
        pd = man.dcp.get("planner_data")
        planner_data = decode_value(pd) if pd is not None else None
        sm = man.dcp.get("storage_meta")
        storage_meta = StorageMeta(**{k: v for k, v in sm.items()}) if sm else None
        return Metadata(
            state_dict_metadata=sdm,
            planner_data=planner_data,
            storage_meta=storage_meta,
            version=man.dcp.get("version"),
        )
    paths = tensor_paths(man.tree)
    planner_data: dict[str, tuple] = {}
    for key, e in man.tensors.items():
        sdm[key] = _tensor_md(e)
        planner_data[key] = paths.get(key, (key,))
    for key, (_, path) in leaf_values(man.tree).items():
        sdm.setdefault(key, BytesStorageMetadata())
        planner_data.setdefault(key, path)
    return Metadata(state_dict_metadata=sdm, planner_data=planner_data)


def _tensor_md(e: TensorEntry) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=_m.DTYPES[e.dtype]),
        size=torch.Size(e.shape),
        chunks=[
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n))
            for o, n in zip(*(a.tolist() for a in e.boxes()))
        ],
    )
