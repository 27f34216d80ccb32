"""The DCP ``StorageWriter``: every rank writes its own packs, the coordinator commits one manifest."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..format.chunk_table import TableBuilder
from ..errors import CkptStoreError, StepExistsError
from .exchange import Exchanger
from ..format.layout import check_step as _check_step
from ..format.layout import pack_key, segment_key
from ..repo.repository import Repository
from ..repo.repository import open as _open
from .replicas import ReplicaError, Replicator, replica_group, replicator_for, retire_replica_group
from ..repo.save import ChunkWriter, StepCommit, dedup_share, discard_uncommitted, pack_usage, tile_for, write_segment
from .ids import _is_url, _pick_step, split_checkpoint_id
from .metadata import _ItemResult, _RankInfo, build_manifest
from .shared import Job, dcp_job, pack, unpack


MiB = 1 << 20


class RankWriteError(CkptStoreError, RuntimeError):
    """One rank failed to write its items; no step was committed."""


@dataclass(frozen=True)


class _GlobalInfo:
    """What the coordinator tells every rank in ``prepare_global_plan``."""

    rank: int
    base_step: int | None
    # rows of a replicated item this rank writes: (fqn, offsets of the part) -> (the item, lo, hi)
    parts: dict | None = None
    # the coordinator broadcasts the config and the base's root in write_data (every rank takes part)
    share: bool = False


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
        self._replica_error: BaseException | None = None  # of a replicator this writer had to replace
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
        #: the config and dedup base's root shared by the coordinator in the last write_data (packed bytes)
        self.shared_blob: bytes | None = None

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
        # The group DCP saves on: the config and the dedup base's root are read once and shared over it.
        self._job = dcp_job() if self._collective else None
        self._shared = None

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
        # The commit protocol every writer follows (ckptstore.repo.save.StepCommit):
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
        share = self._job is not None and self._job.size == len(plans) > 1
        if share:
            try:
                base = repo.manifest_bytes(base_step) if base_step is not None else None
                listed = None if self._commit.listed is None else _step_runs(self._commit.listed)
                self._shared = pack({"base": base_step, "steps": listed}, base, repo.config_bytes())
            except BaseException:
                self._commit.end()
                self._commit = None
                raise
        plans, self._parts = balance_save_plans(plans, chunk_size=repo.options.chunk_size)
        return [
            dataclasses.replace(p, storage_data=_GlobalInfo(rank=i, base_step=base_step, parts=self._parts[i] or None,
                                                            share=share))
            for i, p in enumerate(plans)
        ]

    def _receive_shared(self) -> None:
        """Every rank: the config and the dedup base's root from the coordinator (one broadcast)."""
        repo = self._get_repo()
        job = self._job
        if job is None:  # the coordinator found DCP's job and this rank did not: take part all the same
            group = self._group()
            job = Job(group, dist.get_global_rank(group, 0), dist.get_world_size(group), dist.get_rank(group))
        xg = Exchanger(job.process_group, job.rank, None, repo.url,
                       activity="save", error=RankWriteError)
        mine = self._shared if job.is_coordinator else None
        got = xg.share(mine, job.src, None, "the config and the dedup base's root manifest")
        self._shared = None
        self.shared_blob = mine if job.is_coordinator else got  # what a background upload adopts
        if job.is_coordinator:
            return
        header, (base, cfg) = unpack(got, "config and dedup base")
        if cfg is not None:
            repo.adopt_config(cfg)
        if header.get("steps") is not None:
            # The coordinator's listing: this rank's handle (shared by every writer of the run) adopts a
            # dedup base every save and never lists the store, so it forgets what the store no longer holds.
            repo.forget_unlisted(_steps_of_runs(header["steps"]))
        if base is not None:
            repo.adopt_manifest(header["base"], base)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data if isinstance(plan.storage_data, _GlobalInfo) else None
        rank = info.rank if info is not None else self.rank
        base_step = info.base_step if info is not None else None
        parts = (info.parts if info is not None else None) or {}
        fut: Future = Future()
        self._packs_written = {}
        try:
            if info is not None and info.share:
                self._receive_shared()  # a collective: before anything that may fail on one rank alone
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
        elif rep is not None and rep.closed:  # a later writer's replicator took the pooled group over
            self._replica_error = self._replica_error or rep.flush()  # still reported by flush()
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
            rep = self._replicator = replicator_for(repo.tier, self._replica_group, repo.url, self.replica_timeout)
            if rep.nodes < 2:
                warnings.warn(f"{repo.url}: replicas=1, but every rank of the save shares one tier (one node): "
                              "no copies are made", stacklevel=3)
        rep.submit(self._require_step(), packs)

    def _write_items(self, plan: SavePlan, planner: SavePlanner, rank: int, base_step, parts) -> list[WriteResult]:
        def resolve(item):
            part = parts.get((item.index.fqn, tuple(item.index.offset))) if parts and item.index.offset else None
            if part is not None:  # rows of a replicated item (balance_save_plans)
                whole, lo, hi = part
                return planner.resolve_data(whole).narrow(0, lo, hi - lo)
            return planner.resolve_data(item)

        results, packs, stats = write_rank(self._get_repo(), self._require_step(), rank, base_step, plan.items, resolve)
        self._packs_written = dict(packs)
        self.last_rank_stats = stats
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
        except BaseException as e:
            if commit is not None and repo.write_back is None and commit.uncommitted(e):
                self._discard_ranks_uploads(repo, results, e)
            raise
        finally:
            if commit is not None:
                commit.end()

    def _discard_ranks_uploads(self, repo: Repository, results, error: BaseException) -> None:
        """The coordinator's commit failed before its manifest create: delete every rank's new packs and
        chunk tables (each rank's result names the packs its references use; those not in the dedup
        base's manifest are the ones it wrote). Left to GC when the base cannot be read."""
        base = None
        if self._base_step is not None:
            try:
                base = repo.manifest(self._base_step)
            except Exception:  # noqa: BLE001 - not sure what is reused: delete nothing
                return
        packs: set[str] = set()
        segments: list[str] = []
        for rr in results:
            for wr in rr:
                info = wr.storage_data.info if isinstance(wr.storage_data, _ItemResult) else None
                if info is None:
                    continue
                packs.update(p for p in info.packs if base is None or p not in base.packs)
                if info.segment is not None:
                    segments.append(segment_key(info.segment.id))
        discard_uncommitted(repo, self.step, error, sorted(packs), segments)

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
        if self._replicator is not None or self._replica_error is not None:
            err = self._replicator.flush() if self._replicator is not None else None
            err, self._replica_error = err or self._replica_error, None
            if err is not None and failure is None:
                failure = ReplicaError(f"{repo.url}: replicas stopped on rank {self.rank}: {err}")
        if self._collective:
            group = self._group()
            xg = Exchanger(group, dist.get_rank(group), None, repo.url, activity="flush", error=CkptStoreError)
            try:
                xg.status(failure, "(CkptStoreWriter.flush)")
            except CkptStoreError:
                # reported on every rank: every rank stops reusing the replicas' group (a timed-out
                # gloo group may be unusable), so the next writer makes a new one on all of them
                if self._replica_group is not None:
                    retire_replica_group(self._replica_group)
                    self._replica_group = None
                raise
        elif failure is not None:
            raise failure

    def _close(self, drop_lease: bool = True) -> None:
        """Between saves (``reset``) and at close (``drop_lease=False``: from the finalizer, which
        sends nothing and joins no thread); the replicas outlive resets."""
        if self._commit is not None:  # a save that never reached finish()
            if drop_lease:
                self._commit.end()
            self._commit = None
        if self._repo is not None:
            if self._repo.write_back is None:  # a write-back handle is shared, and outlives this writer
                self._repo.close() if drop_lease else self._repo.abandon()
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
#: repository and options: their background uploads and commits outlive each writer, and
#: are finished at interpreter exit (``ckptstore.repo.writeback.finish_at_exit``, as every
#: write-back handle's: bounded, or naming the steps left and the command that commits them).
_WRITE_BACK_HANDLES: dict[str, Repository] = {}
_WRITE_BACK_LOCK = threading.Lock()


def _write_back_handle(url: str, storage_options, options: dict) -> Repository:
    key = json.dumps([url, storage_options, sorted((k, repr(v)) for k, v in options.items())], default=repr)
    with _WRITE_BACK_LOCK:
        repo = _WRITE_BACK_HANDLES.get(key)
        if repo is None:
            repo = _open(url, storage_options=storage_options, **options)
            _WRITE_BACK_HANDLES[key] = repo
        return repo


def _step_runs(steps) -> list[list[int]]:
    """Ascending steps as runs ``[first, last]`` of consecutive ones (a listing kept short: a
    ``keep_last`` repository's is one run)."""
    runs: list[list[int]] = []
    for s in sorted(steps):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return runs


def _steps_of_runs(runs) -> set[int]:
    """The steps of :func:`_step_runs`'s runs; a damaged value raises :class:`CkptStoreError`."""
    try:
        out: set[int] = set()
        for first, last in runs:
            if not (isinstance(first, int) and isinstance(last, int) and 0 <= first <= last):
                raise ValueError(f"bad run {[first, last]}")
            out.update(range(first, last + 1))
        return out
    except (TypeError, ValueError) as e:
        raise CkptStoreError(f"the listing of steps received from the coordinator is damaged ({e})") from None


def _share_boxes(items) -> list:
    """The boxes a rank writes, ``(key, offsets, sizes)`` (a bytes item: the whole key)."""
    boxes = []
    for item in items:
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            boxes.append((item.index.fqn, (0,), (1 << 62,)))
        else:
            boxes.append((item.index.fqn, tuple(item.tensor_data.chunk.offsets), tuple(item.tensor_data.chunk.sizes)))
    return boxes


def _item_tensor(repo: Repository, item, data, base_man) -> tuple:
    """``(tensor, is_bytes, tile)`` of a write item's data (bytes items as uint8 tensors)."""
    if item.type == WriteItemType.BYTE_IO:
        buf = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        t = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        return t, True, None
    tile = None
    # Tiles from the global shape, anchored at this item's box: every rank cuts its shard
    # of a tensor with the same grid, aligned to its shard (DTensor placements).
    if item.tensor_data is not None and tuple(data.shape) == tuple(item.tensor_data.chunk.sizes):
        tile = tile_for(repo.options, item.index.fqn, item.tensor_data.size, data.dtype, base_man)
    return data, False, tile


def write_rank(repo: Repository, step: int, rank: int, base_step: int | None, items, resolve) -> tuple:
    """Upload one rank's items of step ``step`` (its packs and chunk-table segment); no collective.

    ``items``: DCP ``WriteItem``s; ``resolve(item)``: the item's data (a
    tensor, or ``io.BytesIO``/bytes for a bytes item), asked for in order,
    one at a time. Returns ``(results, packs, stats)``: the ``WriteResult``s
    the coordinator's :meth:`CkptStoreWriter.finish` builds the manifest
    from, ``{pack id: size}`` of the packs written, and this rank's byte
    counts. On failure, what this rank uploaded for the step is deleted
    before the error propagates (nothing can reference it).
    """
    repo.config()  # adopt the repository's chunk size (dedup needs the same cut)
    # Dedup against this rank's share of the base: the base's shards that
    # meet the boxes it writes (bytes items: any shard of the same key).
    boxes = _share_boxes(items)
    wb = repo.write_back
    share = sum(_write_bytes(item) for item in items)
    if wb is not None:
        # at most write_back_steps pending on this node, and within its cache_size
        wb.reserve(share, f"rank {rank}'s share of step {step}")
    target = wb.store if wb is not None else None  # write-back: into this node's tier
    if repo.tier is not None:
        repo.tier.note_step(step, expect=share)  # a save under way: older steps' packs are evicted first
    try:
        writer = ChunkWriter(repo, dedup_share(repo, base_step, boxes), store=target)
    except BaseException:
        if wb is not None:
            wb.unreserve()
        raise
    pending = []
    handed_over = False
    segments: list[str] = []  # the chunk table this rank wrote (deleted if the rank fails)
    base_man = repo.manifest(base_step) if base_step is not None else None
    try:
        for item in items:
            t, is_bytes, tile = _item_tensor(repo, item, resolve(item), base_man)
            refs = writer.add(t, tile=tile)
            pending.append((item, is_bytes, t.numel() * t.element_size(), refs, tile))
        packs = writer.finish()
        builder = TableBuilder()
        runs = [builder.extend(refs) for _, _, _, refs, _ in pending]
        segment = write_segment(repo, builder, store=target, written=segments) if pending else None
        if wb is not None and pending:
            # This rank's local commit: uploaded, then marked done in the store, in the background.
            wb.hand_over_rank(step, rank, packs, segment)
            handed_over = True
    except BaseException as e:
        writer.abort()
        # Nothing can reference what this rank uploaded for the step: no step is committed without it.
        if not handed_over and (wb is None or wb.records.read(wb.records.name(step, rank)) is None):
            discard_uncommitted(repo, step, e, writer.started(), segments, store=target)
        raise
    finally:
        if wb is not None and not handed_over:
            wb.unreserve()
    if repo.tier is not None:
        repo.tier.note_step(step, packs)  # eviction takes the newest steps' packs last
    stats = writer.stats(packs)
    if segment is not None:
        stats["segment_bytes"] = segment.size
    all_refs = [c for _, _, _, refs, _ in pending for c in refs]
    sizes = dict(packs)
    base = repo.cached_manifest(base_step) if base_step is not None else None
    for c in all_refs:
        if c.pack not in sizes:
            sizes[c.pack] = base.packs[c.pack] if base is not None and c.pack in base.packs else None
    info = _RankInfo(rank, segment, sizes, pack_usage(all_refs, writer.packs.counts, base), stats)
    results = []
    for n, ((item, is_bytes, nbytes, refs, tile), (first, count)) in enumerate(zip(pending, runs)):
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
                    tile=tile,
                ),
            )
        )
    if not results and packs:
        raise RankWriteError(f"rank {rank}: wrote packs but no items")
    return results, packs, dict(stats, rank=rank)
