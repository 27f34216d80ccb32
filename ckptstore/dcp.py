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
verified) and writes into the destination tensor. A box several ranks read
(replicated state) is fetched once per job: the coordinator gives each
piece of it to one of those ranks, balanced by bytes, and the owner sends
it to the others over the process group (:mod:`ckptstore.exchange`,
``CkptStoreReader(exchange_replicated=...)``). On save, replicated items
that DCP's dedup left to one rank are rebalanced the same way
(:func:`balance_save_plans`).

A step saved here is an ordinary step (``repo.checkpoint(step).read``,
``repo.load`` assemble shards); a step saved with ``repo.save`` loads
through ``CkptStoreReader``.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import dataclasses
import io
import json
import math
import os
import re
import threading
import time
import warnings
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
from .exchange import (
    Exchange,
    Exchanger,
    Gather,
    Message,
    Piece,
    RankReadError,
    ReadRegion,
    as_bytes,
    plan_exchange,
    takes_bytes,
)
from .layout import check_step as _check_step
from .layout import manifest_key as _manifest_key
from .layout import pack_key
from .manifest import Manifest, PackUsage, SegmentRef, TensorEntry, merge_ranges
from .repository import Repository
from .repository import open as _open
from .replicas import ReplicaError, Replicator, peer_fill, replica_group
from .save import ChunkWriter, StepCommit, dedup_share, pack_usage, write_segment
from .tensors import castable
from .tree import decode_value, encode_value, leaf_values, tensor_paths

__all__ = ["CkptStoreWriter", "CkptStoreReader", "RankReadError", "RankWriteError", "split_checkpoint_id"]

MiB = 1 << 20

_SCHEMES = ("s3://", "gs://", "gcs://", "file://", "memory://")


class RankWriteError(CkptStoreError, RuntimeError):
    """One rank failed to write its items; no step was committed."""


@dataclass(frozen=True)
class _GlobalInfo:
    """What the coordinator tells every rank in ``prepare_global_plan``."""

    rank: int
    base_step: int | None
    # rows of a replicated item this rank writes: (fqn, offsets of the part) -> (the item, lo, hi)
    parts: dict | None = None


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


@dataclass(frozen=True)
class _Held:
    """The items a rank's local save plan holds, before DCP's dedup drops the replicated ones."""

    keys: tuple  # (fqn, offsets, sizes) of every tensor item, in plan order


def _write_key(item) -> tuple | None:
    """What makes two ranks' write items the same box of the same tensor (None: a bytes item)."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None or item.tensor_data.chunk is None:
        return None
    c = item.tensor_data.chunk
    return (item.index.fqn, tuple(c.offsets), tuple(c.sizes))


def _write_bytes(item) -> int:
    """Bytes a write item writes: its chunk's, not the whole tensor's (``WriteItem.tensor_storage_size``,
    which DCP's dedup counts, is the global tensor's size even for one shard of it)."""
    td = item.tensor_data
    if td is None or td.chunk is None:
        return 0
    return math.prod(td.chunk.sizes) * torch.empty((), dtype=td.properties.dtype).element_size()


def balance_save_plans(
    plans: list[SavePlan], *, chunk_size: int = 4 * MiB, min_part: int = 16 * MiB
) -> tuple[list[SavePlan], list[dict]]:
    """Reassign replicated write items so every rank writes about the same bytes.

    DCP's dedup (``dedup_save_plans``, torch 2.13) gives each replicated
    item to the rank with the fewest bytes *so far*, visiting items in plan
    order (rank 0's first), so the other ranks' own items are not counted
    yet when most replicated items are placed; and it counts a shard as
    its whole tensor (``WriteItem.tensor_storage_size``). Here each plan's
    ``storage_data`` lists what the rank held before the dedup
    (:class:`_Held`, from ``prepare_local_plan``); an item held by several
    ranks is movable between them, every other item stays where it is.

    A movable item larger than ``max(min_part, 4 x chunk_size, all bytes /
    (4 x ranks))`` with more than one row is cut along dim 0 into parts of
    about that size (at chunk boundaries where rows line up with chunks, so
    the chunks are those of the whole item and dedup against an uncut base
    still matches); the step then stores it as that many shards. Movable
    items and parts, largest first, go to the holder with the fewest bytes
    (its fixed items included). Item order within a plan follows the
    plans' original order.

    Returns the plans and, per rank, ``{(fqn, part offsets): (item, lo, hi)}``
    for the parts it writes. Plans come back unchanged when any lacks the
    record (another writer's local plan, or DCP's plan caching sent an
    empty delta).
    """
    n = len(plans)
    if n < 2 or not all(p.usable and isinstance(p.storage_data, _Held) for p in plans):
        return plans, [{} for _ in plans]
    holders: dict[tuple, list[int]] = {}
    for r, p in enumerate(plans):
        for k in p.storage_data.keys:
            holders.setdefault(k, []).append(r)
    load = [0] * n
    placed = []  # [item, rank (None: movable), holders, part (lo, hi) or None]
    for r, p in enumerate(plans):
        for item in p.items:
            k = _write_key(item)
            h = holders.get(k) if k is not None else None
            if h is not None and len(h) > 1 and r in h:
                placed.append([item, None, h, None])
            else:
                placed.append([item, r, None, None])
                load[r] += _write_bytes(item)
    total = sum(_write_bytes(x[0]) for x in placed)
    part_max = max(min_part, 4 * chunk_size, -(-total // (4 * n)))
    cut = []
    for x in placed:
        item = x[0]
        nb = _write_bytes(item)
        sizes = tuple(item.tensor_data.chunk.sizes) if item.tensor_data is not None else ()
        if x[1] is not None or nb <= part_max or len(sizes) == 0 or sizes[0] < 2:
            cut.append(x)
            continue
        rows = sizes[0]
        row_bytes = nb // rows
        align = chunk_size // row_bytes if row_bytes and chunk_size % row_bytes == 0 else 1
        k = min(rows, -(-nb // part_max))
        bounds = [0]
        for j in range(1, k):
            b = round(round(j * rows / k) / align) * align
            if bounds[-1] < b < rows:
                bounds.append(b)
        bounds.append(rows)
        for lo, hi in zip(bounds, bounds[1:]):
            cut.append([item, None, x[2], (lo, hi)])
    placed = cut

    def size(x) -> int:
        return _write_bytes(x[0]) if x[3] is None else _write_bytes(x[0]) // x[0].tensor_data.chunk.sizes[0] * (x[3][1] - x[3][0])

    for i in sorted((i for i, x in enumerate(placed) if x[1] is None), key=lambda i: (-size(placed[i]), i)):
        r = min(placed[i][2], key=lambda q: (load[q], q))
        placed[i][1] = r
        load[r] += size(placed[i])
    items: list[list] = [[] for _ in plans]
    parts: list[dict] = [{} for _ in plans]
    for item, r, _, part in placed:
        if part is not None:
            item, whole = _part_item(item, *part), item
            parts[r][(item.index.fqn, tuple(item.index.offset))] = (whole, part[0], part[1])
        items[r].append(item)
    return [dataclasses.replace(p, items=its) for p, its in zip(plans, items)], parts


def _part_item(item, lo: int, hi: int):
    """Rows ``lo:hi`` of a tensor write item, as a write item of its own (a shard of the step)."""
    c = item.tensor_data.chunk
    offsets = torch.Size((c.offsets[0] + lo, *c.offsets[1:]))
    sizes = torch.Size((hi - lo, *c.sizes[1:]))
    return dataclasses.replace(
        item,
        index=dataclasses.replace(item.index, offset=offsets, index=None),
        tensor_data=dataclasses.replace(item.tensor_data, chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes)),
    )


def _split_metadata(metadata: Metadata, parts: list[dict]) -> Metadata:
    """DCP's metadata with each cut item's chunk replaced by its parts' chunks."""
    cuts: dict[str, dict[tuple, list]] = {}
    for rank_parts in parts:
        for whole, lo, hi in rank_parts.values():
            c = _part_item(whole, lo, hi).tensor_data.chunk
            cuts.setdefault(whole.index.fqn, {}).setdefault(tuple(whole.tensor_data.chunk.offsets), []).append(c)
    if not cuts:
        return metadata
    sdm = dict(metadata.state_dict_metadata)
    for fqn, by_offsets in cuts.items():
        md = sdm[fqn]
        chunks = []
        for c in md.chunks:
            pieces = by_offsets.get(tuple(c.offsets))
            chunks.extend(sorted(pieces, key=lambda x: x.offsets[0]) if pieces else [c])
        sdm[fqn] = dataclasses.replace(md, chunks=chunks)
    return dataclasses.replace(metadata, state_dict_metadata=sdm)


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
    balance_replicated:
        Spread replicated items (held by several ranks, written once) over
        the ranks holding them by bytes, after DCP's dedup picked one
        (default True; see :func:`balance_save_plans`).
    replicas:
        1: after each save, copy every rank's new packs into another node's
        tier in the background (needs ``cache_dir``; nodes are told apart
        by their tiers; ``docs/tier.md``, "Peer replicas"). 0 (default): no
        copies. :meth:`flush` waits for them on every rank.
    process_group:
        The group ``dcp.save`` runs on (default: the default group): the
        replicas' own gloo group is made of its members, and :meth:`flush`
        is a collective over it.
    replica_timeout:
        Seconds a replica transfer may wait for its peer before the
        replicas stop (with a warning; the saves go on); None: 30 minutes.
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
        *,
        balance_replicated: bool = True,
        replicas: int = 0,
        process_group=None,
        replica_timeout: float | None = None,
        **options,
    ):
        super().__init__()
        self._default_step = None if step is None else _check_step(step)
        self.url, id_step = split_checkpoint_id(url)
        self.step = _pick_step(self.url, id_step, self._default_step, "CkptStoreWriter")
        if isinstance(replicas, bool) or replicas not in (0, 1):
            raise ValueError(f"CkptStoreWriter: replicas must be 0 or 1 (copies on another node's tier), got {replicas!r}")
        if replicas and options.get("cache_dir") is None:
            raise ValueError("CkptStoreWriter: replicas=1 copies packs between nodes' tiers: it needs cache_dir=")
        if replica_timeout is not None and not replica_timeout > 0:
            raise ValueError(f"replica_timeout must be a positive number of seconds or None, got {replica_timeout!r}")
        self.replicas = int(replicas)
        self.process_group = process_group
        self.replica_timeout = replica_timeout
        self._replicator: Replicator | None = None
        self._replica_group = None
        self._packs_written: dict[str, int] = {}
        self._collective = False  # took part in a save with collectives: flush() is a collective
        self.balance_replicated = bool(balance_replicated)
        self.storage_options = storage_options
        self.user_metadata = dict(metadata or {})
        self.base = base
        self.options = options
        self.rank = 0
        self.is_coordinator = True
        self._repo: Repository | None = None
        self._base_step: int | None = None
        self._commit: StepCommit | None = None
        self._parts: list[dict] = []
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
        self._collective = (bool(kwargs.get("use_collectives", True)) and dist.is_available()
                            and dist.is_initialized() and dist.get_world_size(self._group()) > 1)

    def _group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not plan.usable or not self.balance_replicated:
            return plan
        keys = tuple(k for k in map(_write_key, plan.items) if k is not None)
        return dataclasses.replace(plan, storage_data=_Held(keys))

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
            # Write-back: a step pending on this node is taken; the dedup base is
            # a committed step (other nodes cannot read this node's pending ones).
            base_step = self._commit.begin(pending=repo.write_back is not None, pending_base=False)
        except StepExistsError:
            self._commit = None
            raise StepExistsError(
                f"{repo.url}: step {step} already exists; nothing was written. Committed steps are "
                f"never overwritten: save a new step (checkpoint_id={repo.url.rstrip('/')}/step-M, "
                "or CkptStoreWriter(url, step=M))"
            ) from None
        self._base_step = base_step
        plans, self._parts = balance_save_plans(plans, chunk_size=repo.options.chunk_size)
        return [
            dataclasses.replace(p, storage_data=_GlobalInfo(rank=i, base_step=base_step, parts=self._parts[i] or None))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data if isinstance(plan.storage_data, _GlobalInfo) else None
        rank = info.rank if info is not None else self.rank
        base_step = info.base_step if info is not None else None
        parts = (info.parts if info is not None else None) or {}
        fut: Future = Future()
        self._packs_written = {}
        try:
            fut.set_result(self._write_items(plan, planner, rank, base_step, parts))
        except BaseException as e:
            self._replicate({})  # every rank queues every save's replicas: the transfers stay in step
            raise RankWriteError(
                f"rank {rank}: writing step {self.step} of {self.url} failed: {type(e).__name__}: {e}"
            ) from e
        self._replicate(self._packs_written)
        return fut

    def _replicate(self, packs: dict[str, int]) -> None:
        """Queue this save's packs for the peer node's tier (``replicas=1``; every rank, every save)."""
        if not self.replicas:
            return
        repo = self._get_repo()
        rep = self._replicator
        if rep is not None and rep.tier.root != repo.tier.root:  # another repository: another replicator
            rep.close()
            rep = self._replicator = None
        if rep is None:
            if not self._collective:
                if not getattr(self, "_warned_replicas", False):
                    self._warned_replicas = True
                    warnings.warn(f"CkptStoreWriter({self.url!r}): replicas=1 needs a save with collectives over "
                                  "more than one rank; no copies are made", stacklevel=3)
                return
            if self._replica_group is None:
                self._replica_group = replica_group(self._group(), self.replica_timeout)
            rep = self._replicator = Replicator(repo.tier, self._replica_group, repo.url, self.replica_timeout)
            if rep.nodes < 2:
                warnings.warn(f"{repo.url}: replicas=1, but every rank of the save shares one tier (one node): "
                              "no copies are made", stacklevel=3)
        rep.submit(self._require_step(), packs)

    def _write_items(self, plan: SavePlan, planner: SavePlanner, rank: int, base_step, parts) -> list[WriteResult]:
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
        wb = repo.write_back
        if wb is not None:
            # at most write_back_steps pending on this node, and within its cache_size
            wb.reserve(sum(_write_bytes(item) for item in plan.items), f"rank {rank}'s share of step {self.step}")
        target = wb.store if wb is not None else None  # write-back: into this node's tier
        if repo.tier is not None:
            repo.tier.note_step(self.step)  # a save under way: older steps' packs are evicted first
        try:
            writer = ChunkWriter(repo, dedup_share(repo, base_step, boxes), store=target)
        except BaseException:
            if wb is not None:
                wb.unreserve()
            raise
        pending = []
        handed_over = False
        try:
            for item in plan.items:
                part = parts.get((item.index.fqn, tuple(item.index.offset))) if parts and item.index.offset else None
                if part is not None:  # rows of a replicated item (balance_save_plans)
                    whole, lo, hi = part
                    data = planner.resolve_data(whole).narrow(0, lo, hi - lo)
                else:
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
            segment = write_segment(repo, builder, store=target) if pending else None
            if wb is not None and pending:
                # This rank's local commit: uploaded, then marked done in the store, in the background.
                wb.hand_over_rank(self.step, rank, packs, segment)
                handed_over = True
        except BaseException:
            writer.abort()
            raise
        finally:
            if wb is not None and not handed_over:
                wb.unreserve()
        self._packs_written = dict(packs)
        if repo.tier is not None:
            repo.tier.note_step(self.step, packs)  # eviction takes the newest steps' packs last
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
                self.step, _split_metadata(metadata, self._parts), results, base_step=self._base_step,
                user_metadata=self.user_metadata,
            )
            missing = [p for p, size in man.packs.items() if size is None]
            if missing:  # a reused pack the base manifest did not list: ask the store
                sizes = dict(man.packs)
                for p in missing:
                    sizes[p] = repo.store.head(pack_key(p)).size
                man = dataclasses.replace(man, packs=sizes)
            if repo.write_back is not None:
                # Committed by this node's background thread once every rank's uploads are in
                # (their markers in the store): no collective is left running.
                ranks = sorted({wr.storage_data.rank for rr in results for wr in rr
                                if isinstance(wr.storage_data, _ItemResult) and wr.storage_data.info is not None})
                repo.write_back.hand_over_commit(commit, man, ranks)
                commit = None
            else:
                commit.commit(man)
        finally:
            if commit is not None:
                commit.end()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _is_url(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url, save_id=f"step-{self.step}")

    # -- helpers ------------------------------------------------------------
    def _get_repo(self) -> Repository:
        if self._repo is None:
            if self.options.get("write_back"):
                self._repo = _write_back_handle(self.url, self.storage_options, self.options)
            else:
                self._repo = _open(self.url, storage_options=self.storage_options, **self.options)
        return self._repo

    def flush(self) -> None:
        """Wait for this writer's background work: write-back uploads (on the coordinator, the
        commits, once every rank's uploads are in) and replicas.

        After a save with collectives over several ranks, a collective like
        ``dcp.save``, on every rank of the save's group: it returns once
        every rank's work is done, and raises on every rank (naming the
        ranks and what failed) if any rank's failed. Otherwise this
        process's work only.
        """
        failure: BaseException | None = None
        repo = self._get_repo()
        try:
            if repo.write_back is not None:
                repo.write_back.flush()
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            failure = e
        if self._replicator is not None:
            err = self._replicator.flush()
            if err is not None and failure is None:
                failure = ReplicaError(f"{repo.url}: replicas stopped on rank {self.rank}: {err}")
        if self._collective:
            group = self._group()
            xg = Exchanger(group, dist.get_rank(group), None, repo.url, activity="flush", error=CkptStoreError)
            xg.status(failure, "(CkptStoreWriter.flush)")
        elif failure is not None:
            raise failure

    def _close(self, drop_lease: bool = True) -> None:
        """Between saves (``reset``) and at close; the replicas outlive resets."""
        if self._commit is not None:  # a save that never reached finish()
            if drop_lease:
                self._commit.end()
            self._commit = None
        if self._repo is not None:
            if self._repo.write_back is None:  # a write-back handle is shared, and outlives this writer
                self._repo.close()
            self._repo = None

    def close(self) -> None:
        """Release threads and connections (also done on garbage collection); waits for this
        rank's replicas of earlier saves (not a collective)."""
        self._close()
        if self._replicator is not None:
            self._replicator.close()
            self._replicator = None

    def __del__(self):
        # No requests from a finalizer (it may run on any thread, even one
        # the store's event loop waits on): a lease left behind expires
        # after the grace period.
        try:
            self._close(drop_lease=False)
        except Exception:
            pass


#: Write-back handles of this process, shared by every CkptStoreWriter with the same
#: repository and options: their background uploads and commits outlive each writer.
_WRITE_BACK_HANDLES: dict[str, Repository] = {}
_WRITE_BACK_LOCK = threading.Lock()


def _write_back_handle(url: str, storage_options, options: dict) -> Repository:
    key = json.dumps([url, storage_options, sorted((k, repr(v)) for k, v in options.items())], default=repr)
    with _WRITE_BACK_LOCK:
        repo = _WRITE_BACK_HANDLES.get(key)
        if repo is None:
            repo = _open(url, storage_options=storage_options, **options)
            _WRITE_BACK_HANDLES[key] = repo
            if len(_WRITE_BACK_HANDLES) == 1:
                atexit.register(_close_write_back_handles)
        return repo


def _close_write_back_handles() -> None:
    """At exit: finish the uploads and commits that can finish (the rest stays pending in the tier)."""
    with _WRITE_BACK_LOCK:
        handles = list(_WRITE_BACK_HANDLES.values())
        _WRITE_BACK_HANDLES.clear()
    for repo in handles:
        try:
            repo.close()
        except Exception:  # noqa: BLE001 - at exit: the tier keeps what did not finish
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


@dataclass(frozen=True, slots=True)
class _Offer:
    """What a rank's local load plan tells the coordinator: it can take part
    in the exchange, over which group."""

    global_rank: int
    group_rank: int
    group_size: int
    exchange: bool = True  # exchange_replicated is on
    tier: bool = False  # a node-local tier, peer reads on


@dataclass(frozen=True)
class _ReadStep:
    """The step a rank resolved, carried in its local load plan to the coordinator."""

    rank: int
    step: int
    offer: _Offer | None = None  # None: this rank does not exchange (option off, no group, no collectives)


@dataclass(frozen=True)
class _ReadPlan:
    """What the coordinator hands every rank in ``prepare_global_plan``."""

    rank: int
    step: int
    exchange: Exchange | None  # None: every item is read directly (no collective in read_data)
    peer: bool = False  # every rank has a tier: fill each node's from the others' first (collective)


def _box(item) -> tuple:
    """The shard-local box ``((start, stop, 1), ...)`` a read item reads."""
    return tuple((o, o + n, 1) for o, n in zip(item.storage_offsets, item.lengths))


def _piece_box(item, p: Piece) -> tuple:
    """The shard-local box of rows ``p.lo:p.hi`` of a read item's box."""
    box = _box(item)
    return ((box[0][0] + p.lo, box[0][0] + p.hi, 1),) + box[1:] if box else box


def _region_key(item) -> tuple:
    off = item.storage_index.offset
    return (item.storage_index.fqn, None if off is None else tuple(off), tuple(item.storage_offsets), tuple(item.lengths))


def _read_region(man: Manifest, key: tuple, item, chunk: int, shard_sizes: dict) -> ReadRegion | None:
    """The planner's view of one read item; ``chunk`` 0: only its bytes matter (read by one rank)."""
    entry = man.tensors.get(key[0])
    if entry is None:
        return None  # read_data names the missing tensor
    isz = _m.itemsize(entry.dtype)
    lengths = tuple(item.lengths)
    rows = lengths[0] if lengths else 1
    row_bytes = math.prod(lengths[1:]) * isz if lengths else isz
    fetch = entry.stored_bytes / entry.nbytes if entry.nbytes else 1.0
    align, row0 = 1, 0
    if chunk and lengths:
        sizes = shard_sizes.get(key[0])
        if sizes is None:
            offs, szs = entry.boxes()
            sizes = shard_sizes[key[0]] = {tuple(o): tuple(n) for o, n in zip(offs.tolist(), szs.tolist())}
        shard = sizes.get(key[1] if key[1] is not None else (0,) * len(entry.shape))
        if shard is None:
            return None  # read_data names the missing shard
        row0 = item.storage_offsets[0]
        shard_row = math.prod(shard[1:]) * isz
        if tuple(lengths[1:]) == tuple(shard[1:]) and shard_row and chunk % shard_row == 0:
            align = chunk // shard_row
    return ReadRegion(key, rows, row_bytes, fetch, row0, align)


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
    exchange_replicated:
        Read each region that several ranks want once per job and deliver
        it to the others over ``process_group`` (default True; used when a
        process group is up and DCP plans with collectives). False reads
        every item from the store on every rank that wants it.
    process_group:
        The group the exchange runs on: it must be the group DCP loads with
        (``dcp.load(..., process_group=g)`` needs ``CkptStoreReader(...,
        process_group=g)``). Default: the default group. When the ranks'
        plans do not match this group, nothing is exchanged (with a warning).
    exchange_timeout:
        Seconds any rank waits for a status or a transfer of the exchange
        before failing with an error naming what it waited for; None: the
        group's own timeout.
    exchange_round_bytes:
        Most bytes of buffers one rank holds for one round of the exchange
        (an all-gather's output, or its point-to-point messages); a rank
        holds the buffers of at most two rounds at once.
    exchange_piece_bytes:
        Replicated regions larger than this (or than a quarter of each
        rank's share) are split along dim 0 and read by several ranks;
        smaller pieces (below an eighth of it) travel packed together.
    exchange_all_gather_ranks:
        On groups of at least this many ranks, regions every rank reads
        travel by all-gather (a ring: ``ranks - 1`` steps of one message per
        rank); on smaller groups point to point, received straight into the
        destinations. The coordinator's settings of these three apply to
        every rank.
    peer_reads:
        With a ``cache_dir`` on every rank and the ranks on more than one
        node (tier), take from other nodes' tiers the packs this node's
        tier lacks before reading (each chunk hash-checked when read), so
        the object store serves only what no tier holds (default True;
        ``docs/tier.md``, "Peer replicas"). One small all-gather per load
        when no node lacks anything.

    Destination tensors may have another floating dtype than the stored
    one: values are cast like DCP's ``FileSystemReader`` casts them.
    """

    def __init__(
        self,
        url: str | os.PathLike,
        step: int | None = None,
        storage_options: dict | None = None,
        item_workers: int = 4,
        *,
        exchange_replicated: bool = True,
        process_group=None,
        exchange_timeout: float | None = None,
        exchange_round_bytes: int = 512 * MiB,
        exchange_piece_bytes: int = 8 * MiB,
        exchange_all_gather_ranks: int = 16,
        peer_reads: bool = True,
        **options,
    ):
        super().__init__()
        self._default_step = None if step is None else _check_step(step)
        self.url, id_step = split_checkpoint_id(url)
        self.step = _pick_step(self.url, id_step, self._default_step, "CkptStoreReader")
        self.peer_reads = bool(peer_reads)
        #: This rank's figures of its last peer fill (packs and bytes received from and sent to
        #: other nodes' tiers), or None when there was none.
        self.last_peer_stats: dict | None = None
        self.storage_options = storage_options
        self.options = options
        self.item_workers = item_workers
        self.exchange_replicated = bool(exchange_replicated)
        self.process_group = process_group
        if exchange_timeout is not None and not exchange_timeout > 0:
            raise ValueError(f"exchange_timeout must be a positive number of seconds or None, got {exchange_timeout!r}")
        self.exchange_timeout = exchange_timeout
        if exchange_round_bytes < 1:
            raise ValueError(f"exchange_round_bytes must be positive, got {exchange_round_bytes!r}")
        self.exchange_round_bytes = int(exchange_round_bytes)
        if exchange_piece_bytes < 1:
            raise ValueError(f"exchange_piece_bytes must be positive, got {exchange_piece_bytes!r}")
        self.exchange_piece_bytes = int(exchange_piece_bytes)
        self.exchange_all_gather_ranks = int(exchange_all_gather_ranks)
        self.rank = 0
        self._use_collectives = True
        self._repo: Repository | None = None
        self._ckpt = None
        #: This rank's figures of its last ``read_data``: bytes it read for
        #: itself and for others, sent and received, rounds.
        self.last_read_stats: dict | None = None

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

    def read_stats(self) -> dict:
        """Stored chunk bytes this rank has read, by source: ``{"tier", "peer", "store"}``."""
        return self._get_repo().read_stats()

    def _resolve_step(self) -> int:
        repo = self._get_repo()
        step = self.step
        if step is None:
            step = repo.latest()  # committed: the step every rank sees
            if step is None:
                raise StepNotFoundError(f"{repo.url}: the repository has no committed step")
        elif step in repo.pending_steps() and not repo.store.exists(_manifest_key(step)):
            # A write-back step not yet committed lives on this node's disk only:
            # the other ranks' nodes cannot read it, so no rank restores it.
            raise StepNotFoundError(
                f"{repo.url}: step {step} was saved with write-back and is not committed in the store yet "
                "(only this node's tier holds it; other ranks cannot read it): flush it first "
                f"(repo.flush(), or `ckptstore flush {repo.url} --cache-dir {repo.tier.cache_dir}`)"
            )
        return step

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._ckpt = self._get_repo().checkpoint(self._resolve_step())
        return metadata_from_manifest(self._ckpt.manifest)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = int(rank)
        self._use_collectives = bool(kwargs.get("use_collectives", True))
        if self._ckpt is None:
            self._ckpt = self._get_repo().checkpoint(self._resolve_step())

    def _group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _offer(self) -> _Offer | None:
        peer = self.peer_reads and self._get_repo().tier is not None
        if not ((self.exchange_replicated or peer) and self._use_collectives and dist.is_available()
                and dist.is_initialized()):
            return None
        group = self._group()
        group_rank = dist.get_rank(group)
        if group_rank < 0:
            return None  # this process is not in the group
        return _Offer(dist.get_rank(), group_rank, dist.get_world_size(group), self.exchange_replicated, peer)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=_ReadStep(self.rank, self._ckpt.step, self._offer()))

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
        step = next(iter(found.values()), self._ckpt.step if self._ckpt is not None else None)
        offers = self._group_offers(plans)
        peer = offers is not None and all(o.tier for o in offers)
        exchanges = self._plan_exchange(plans) if offers is not None and all(o.exchange for o in offers) else None
        return [
            dataclasses.replace(p, storage_data=_ReadPlan(i, step, None if exchanges is None else exchanges[i], peer))
            for i, p in enumerate(plans)
        ]

    def _group_offers(self, plans: list[LoadPlan]) -> list[_Offer] | None:
        """Every rank's offer when all of them can take part in collectives over the reader's group."""
        if len(plans) < 2 or self._ckpt is None:
            return None
        offers = [p.storage_data.offer if isinstance(p.storage_data, _ReadStep) else None for p in plans]
        if any(o is None for o in offers):
            return None  # some rank has it off, or DCP plans without collectives
        mine = self._offer()
        problem = None
        if mine is None:
            problem = "the coordinator is not in the reader's process group"
        elif any(o.group_size != len(plans) or o.group_rank != i or p.storage_data.rank != i
                 for i, (o, p) in enumerate(zip(offers, plans))):
            problem = (f"DCP planned {len(plans)} ranks, the reader's process group has "
                       f"{sorted({o.group_size for o in offers})} ranks")
        elif [o.global_rank for o in offers] != list(dist.get_process_group_ranks(self._group())):
            problem = "the ranks DCP planned are not the members of the reader's process group"
        if problem is not None:
            warnings.warn(
                f"{self._get_repo().url}: replicated items are read on every rank that wants them (no exchange, "
                f"no reads from peers' tiers): {problem}. A load on a sub-group needs "
                "CkptStoreReader(..., process_group=<the same group>)",
                stacklevel=3,
            )
            return None
        return offers

    def _plan_exchange(self, plans: list[LoadPlan]) -> list[Exchange | None] | None:
        """The coordinator's exchange plan, or None when the ranks read everything themselves."""
        # Which ranks read each region; nothing more to do when none is read twice (FSDP).
        keyed: list[list[tuple[tuple, Any]]] = []
        count: dict[tuple, int] = {}
        for p in plans:
            mine = {}
            for item in p.items:
                if item.type == LoadItemType.TENSOR:
                    mine.setdefault(_region_key(item), item)
            for key in mine:
                count[key] = count.get(key, 0) + 1
            keyed.append(list(mine.items()))
        if not any(c > 1 for c in count.values()):
            return None
        man = self._ckpt.manifest
        repo = self._get_repo()
        repo.config()  # the repository's chunk size: splits at chunk boundaries where rows allow
        chunk = repo.options.chunk_size
        shard_sizes: dict[str, dict[tuple, tuple]] = {}  # fqn -> shard offsets -> sizes
        cache: dict[tuple, ReadRegion | None] = {}
        wants: list[list[ReadRegion]] = []
        for mine in keyed:
            regs = []
            for key, item in mine:
                g = cache.get(key, False)
                if g is False:
                    g = cache[key] = _read_region(man, key, item, chunk if count[key] > 1 else 0, shard_sizes)
                if g is not None:
                    regs.append(g)
            wants.append(regs)
        return plan_exchange(wants, round_bytes=self.exchange_round_bytes, min_piece=self.exchange_piece_bytes,
                             gather_min_ranks=self.exchange_all_gather_ranks)

    # -- read_data ----------------------------------------------------------
    def _prepare(self, plan: LoadPlan, planner: LoadPlanner, exchanged: set):
        """Bytes items loaded; tensor items split into direct reads and exchanged regions."""
        ckpt = self._ckpt
        man = ckpt.manifest
        bytes_keys = set((man.dcp or {}).get("bytes", []))
        values = leaf_values(man.tree) if man.dcp is None else {}
        direct = []
        regions: dict[tuple, list] = {}  # key -> [(item, entry, shard index, target), ...]
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
            target = planner.resolve_tensor(item).detach()
            key = _region_key(item)
            if key in exchanged:
                stored = _m.DTYPES[entry.dtype]
                if not castable(stored, target.dtype) or tuple(target.shape) != tuple(item.lengths):
                    raise ValueError(
                        f"{ckpt.repo.url}: step {man.step}: tensor {fqn!r} is {entry.dtype}; the destination of "
                        f"its box {tuple(item.storage_offsets)}+{tuple(item.lengths)} is "
                        f"{str(target.dtype).removeprefix('torch.')}{list(target.shape)}"
                        " (values are cast only between floating dtypes, or between complex dtypes)"
                    )
                regions.setdefault(key, []).append((item, entry, index, target))
            else:
                direct.append((item, entry, index, _box(item), target))
        return direct, regions

    def _read_all(self, jobs) -> None:
        """Run ``(entry, shard index, box, target)`` reads on ``item_workers`` threads."""
        if not jobs:
            return
        ckpt = self._ckpt

        def run(job):
            entry, index, local, target = job
            (shard,) = ckpt.shards(entry.key, [index])
            ckpt.read_shard(entry, shard, local, target)

        if len(jobs) == 1:
            run(jobs[0])
            return
        with cf.ThreadPoolExecutor(min(self.item_workers, len(jobs)), thread_name_prefix="ckpt-dcp") as ex:
            futures = [ex.submit(run, j) for j in jobs]
            for f in futures:
                f.result()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        sd = plan.storage_data
        ex = sd.exchange if isinstance(sd, _ReadPlan) else None
        self.last_peer_stats = None
        if isinstance(sd, _ReadPlan) and sd.peer:
            self._peer_fill(plan, ex)
        if ex is None:
            self._read_direct(plan, planner)
        else:
            self._read_exchanged(plan, planner, ex)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _peer_fill(self, plan: LoadPlan, ex: Exchange | None) -> None:
        """Fill this node's tier from the other nodes' tiers with what this rank will read (collective)."""
        ckpt = self._ckpt
        group = self._group()
        where = f"{ckpt.repo.url}: step {ckpt.step}"
        xg = Exchanger(group, dist.get_rank(group), self.exchange_timeout, where, activity="peer fill")
        refs: list = []
        failure = None
        try:
            exchanged: set = set()
            owned: list[Piece] = []
            if ex is not None:
                exchanged = {p.key for m in ex.messages for p in m.pieces}
                exchanged.update(p.key for g in ex.gathers for ps in g.parts for p in ps)
                owned = [p for m in ex.messages if m.src == xg.rank for p in m.pieces]
                owned += [p for g in ex.gathers for p in g.parts[xg.rank]]
            boxes, first = [], {}
            for item in plan.items:
                if item.type != LoadItemType.TENSOR:
                    continue
                key = _region_key(item)
                if key in exchanged:
                    first.setdefault(key, item)
                else:
                    boxes.append((item, _box(item)))
            boxes += [(first[p.key], _piece_box(first[p.key], p)) for p in owned if p.key in first]
            jobs = []
            for item, box in boxes:
                fqn = item.storage_index.fqn
                entry = ckpt.manifest.tensors.get(fqn)
                if entry is not None:
                    jobs.append((entry, ckpt.shard_at(fqn, item.storage_index.offset), box))
            ckpt.resolve([(e.key, i) for e, i, _ in jobs])
            for e, i, box in jobs:
                (shard,) = ckpt.shards(e.key, [i])
                refs += ckpt.box_refs(e, shard, box)
        except Exception as e:  # reported to every rank before any transfer
            failure = e
        repo = self._get_repo()
        stats = peer_fill(xg, repo.tier, refs, self.exchange_round_bytes, failure)
        with repo.fetcher._lock:
            repo.fetcher.peer_packs.update(stats.pop("packs"))
        self.last_peer_stats = stats

    def _read_direct(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        direct, _ = self._prepare(plan, planner, set())
        # One batch of chunk-table reads for every shard this rank reads.
        self._ckpt.resolve([(entry.key, index) for _, entry, index, _, _ in direct])
        self._read_all([(entry, index, local, target) for _, entry, index, local, target in direct])
        for item, _, _, _, target in direct:
            planner.commit_tensor(item, target)
        n = sum(t.numel() * _m.itemsize(e.dtype) for _, e, _, _, t in direct)
        self.last_read_stats = {"rank": self.rank, "exchange": False, "direct_bytes": n, "owned_bytes": 0,
                                "sent_bytes": 0, "received_bytes": 0, "rounds": 0, "all_gathers": 0,
                                "messages": 0}

    def _read_exchanged(self, plan: LoadPlan, planner: LoadPlanner, ex: Exchange) -> None:
        """Read what this rank owns, exchange replicated pieces round by round, every wait bounded.

        Collectives happen only in :meth:`Exchanger.status` (once per
        round) and the transfers after it; a failure anywhere else is kept
        and reported at the next status, so every rank stops at the same
        point instead of waiting for a peer that has given up.
        """
        ckpt = self._ckpt
        where = f"{ckpt.repo.url}: step {ckpt.step}"
        xg = Exchanger(self._group(), dist.get_rank(self._group()), self.exchange_timeout, where)
        me = xg.rank
        stats = {"rank": me, "exchange": True, "direct_bytes": 0, "owned_bytes": 0, "sent_bytes": 0,
                 "received_bytes": 0, "rounds": ex.rounds, "all_gathers": len(ex.gathers),
                 "messages": len(ex.messages)}
        by_round: list[list[Message]] = [[] for _ in range(ex.rounds)]
        for m in ex.messages:
            by_round[m.round].append(m)
        gather_of: dict[int, Gather] = {g.round: g for g in ex.gathers}
        exchanged = {p.key for m in ex.messages for p in m.pieces}
        exchanged.update(p.key for g in ex.gathers for ps in g.parts for p in ps)
        failure: BaseException | None = None
        direct: list = []
        regions: dict = {}
        not_cuda = 1
        try:
            direct, regions = self._prepare(plan, planner, exchanged)
            missing = exchanged - set(regions)
            if missing:
                raise CkptStoreError(f"{where}: the exchange plan names regions this rank does not read: "
                                     f"{sorted(k[0] for k in missing)[:5]}")
            mine = [p for m in ex.messages if m.src == me for p in m.pieces]
            mine += [p for g in ex.gathers for p in g.parts[me]]
            owned = [(regions[p.key][0][1], regions[p.key][0][2]) for p in mine]
            ckpt.resolve([(e.key, i) for _, e, i, _, _ in direct] + [(e.key, i) for e, i in owned])
            targets = [t for lst in regions.values() for (_, _, _, t) in lst]
            not_cuda = 0 if xg.cuda_capable and targets and all(t.device.type == "cuda" for t in targets) else 1
        except Exception as e:  # reported to every rank at the first status
            failure = e

        def piece_view(t: torch.Tensor, p: Piece) -> torch.Tensor:
            return t[p.lo : p.hi] if t.dim() else t

        def slot(buf: torch.Tensor, base: int, p: Piece) -> torch.Tensor:
            """Piece ``p`` in a flat byte buffer, as a tensor of its stored dtype and shape."""
            _, entry, _, target = regions[p.key][0]
            shape = piece_view(target, p).shape
            return buf[base + p.offset : base + p.offset + p.nbytes].view(_m.DTYPES[entry.dtype]).reshape(shape)

        def read_round(msgs: list[Message], gather: Gather | None, with_direct: bool):
            """Read this rank's own pieces of a round (and its direct items); the send sources."""
            jobs, after, sources = [], [], {}
            if with_direct:
                jobs += [(entry, index, local, target) for _, entry, index, local, target in direct]
                stats["direct_bytes"] += sum(t.numel() * _m.itemsize(e.dtype) for _, e, _, _, t in direct)
            if gather is not None:
                share = torch.zeros(gather.nbytes, dtype=torch.uint8)
                for p in gather.parts[me]:
                    item, entry, index, _ = regions[p.key][0]
                    src = slot(share, 0, p)
                    jobs.append((entry, index, _piece_box(item, p), src))
                    after.append((src, [piece_view(t, p) for *_, t in regions[p.key]]))
                    stats["owned_bytes"] += p.nbytes
                    stats["sent_bytes"] += (xg.size - 1) * p.nbytes
                sources["gather"] = share
            for m in msgs:
                if m.src != me:
                    continue
                buf = torch.empty(m.nbytes, dtype=torch.uint8) if len(m.pieces) > 1 else None
                for p in m.pieces:
                    item, entry, index, target = regions[p.key][0]
                    stored = _m.DTYPES[entry.dtype]
                    box = _piece_box(item, p)
                    dest = piece_view(target, p)
                    if buf is not None:
                        src = slot(buf, 0, p)
                        after.append((src, [dest]))
                    elif takes_bytes(dest, stored):
                        src = dest
                    else:
                        src = torch.empty(dest.shape, dtype=stored)
                        after.append((src, [dest]))
                    jobs.append((entry, index, box, src))
                    for _, _, _, other in regions[p.key][1:]:  # the same box twice in this rank's plan
                        after.append((src, [piece_view(other, p)]))
                    if buf is None:
                        sources[m.id] = src
                    stats["owned_bytes"] += p.nbytes
                if buf is not None:
                    sources[m.id] = buf
            self._read_all(jobs)
            with torch.no_grad():
                for src, dests in after:
                    for d in dests:
                        d.copy_(src)
            return sources

        def prepare_round(msgs: list[Message], gather: Gather | None, sources: dict, r: int):
            """The round's send and receive buffers (allocated before its status, so running
            out of memory is reported to every rank, not left to their transfer timeouts)."""
            sends, recvs, copies, keep = [], [], [], []
            dev = xg.device
            if gather is not None:
                share = sources["gather"].to(dev)
                out = torch.empty(xg.size * gather.nbytes, dtype=torch.uint8, device=dev)
                keep.append((share, out))
                for q, ps in enumerate(gather.parts):
                    if q == me:
                        continue
                    for p in ps:
                        copies.append((slot(out, q * gather.nbytes, p), [piece_view(t, p) for *_, t in regions[p.key]]))
                        stats["received_bytes"] += p.nbytes
            for m in msgs:
                if m.src == me:
                    src = sources[m.id]
                    if src.device != dev:
                        src = src.to(dev)
                    flat = as_bytes(src)
                    keep.append(flat)
                    for d in m.dsts:
                        sends.append((flat, d, m.id))
                    stats["sent_bytes"] += len(m.dsts) * sum(p.nbytes for p in m.pieces)
                    continue
                stats["received_bytes"] += sum(p.nbytes for p in m.pieces)
                if len(m.pieces) == 1:
                    p = m.pieces[0]
                    lst = regions[p.key]
                    stored = _m.DTYPES[lst[0][1].dtype]
                    dest = piece_view(lst[0][3], p)
                    if takes_bytes(dest, stored, dev):
                        buf = dest
                        rest = [piece_view(t, p) for *_, t in lst[1:]]
                    else:
                        buf = torch.empty(dest.shape, dtype=stored, device=dev)
                        rest = [piece_view(t, p) for *_, t in lst]
                    if rest:
                        copies.append((buf, rest))
                    recvs.append((as_bytes(buf), m.src, m.id))
                    continue
                buf = torch.empty(m.nbytes, dtype=torch.uint8, device=dev)
                recvs.append((buf, m.src, m.id))
                for p in m.pieces:
                    copies.append((slot(buf, 0, p), [piece_view(t, p) for *_, t in regions[p.key]]))
            return sends, recvs, copies, keep, r

        def finish_round(pending) -> None:
            works, copies, _keep, r = pending
            xg.wait_all(works, f"(round {r + 1} of {ex.rounds})")
            with torch.no_grad():
                for src, dests in copies:
                    for d in dests:
                        d.copy_(src)

        # The transport: CPU buffers on a group with a CPU backend, CUDA buffers on an NCCL-only
        # group; a group with both uses CUDA when every rank's exchanged destinations are on CUDA,
        # which takes one status more before any reading.
        if xg.nccl_style:
            xg.device = torch.device("cuda", torch.cuda.current_device())
        elif xg.cuda_capable:
            if xg.status(failure, "before reading", not_cuda) == 0:
                xg.device = torch.device("cuda", torch.cuda.current_device())
        pending = None
        for r in range(ex.rounds):
            ready = None
            if failure is None:
                try:
                    g = gather_of.get(r)
                    ready = prepare_round(by_round[r], g, read_round(by_round[r], g, with_direct=(r == 0)), r)
                except Exception as e:
                    failure = e
            if pending is not None:
                done, pending = pending, None
                try:
                    finish_round(done)
                except RankReadError:
                    raise  # a transfer that never completed: the group cannot be trusted any more
                except Exception as e:
                    failure = failure or e
            xg.status(failure, f"in round {r + 1} of {ex.rounds}")
            sends, recvs, copies, keep, _ = ready
            try:
                works = xg.post(sends, recvs)
                if r in gather_of:
                    share, out = keep[0]
                    works.append((dist.all_gather_into_tensor(out, share, group=xg.group, async_op=True),
                                  "all-gather of every rank's share"))
            except Exception as e:
                raise RankReadError(f"{where}: rank {me}: starting the transfers of round {r + 1} failed: "
                                    f"{type(e).__name__}: {e}") from e
            pending = (works, copies, keep, r)
        if pending is not None:
            finish_round(pending)  # after the last status: a failure here is this rank's alone
        for lst in regions.values():
            for item, _, _, target in lst:
                planner.commit_tensor(item, target)
        for item, _, _, _, target in direct:
            planner.commit_tensor(item, target)
        self.last_read_stats = stats

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
