"""The DCP ``StorageReader``: each rank reads the boxes its plan names; replicated ones once per job."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import io
import logging
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..format import manifest as _m
from ..errors import CkptStoreError, StepNotFoundError
from .exchange import (
    Exchange,
    Exchanger,
    Piece,
    ReadRegion,
    plan_exchange,
)
from ..format.layout import check_step as _check_step
from ..format.layout import manifest_key as _manifest_key
from ..format.manifest import Manifest
from ..repo.reader import Checkpoint
from ..repo.repository import Repository
from ..repo.repository import open as _open
from .replicas import peer_fill
from ..pipeline.tensors import castable
from ..format.tree import leaf_values
from .exchanged import ExchangedRead, _box, _piece_box
from .ids import _is_url, _pick_step, split_checkpoint_id
from ..format.unpickle import check_safe_globals, load_safe
from .metadata import metadata_from_manifest
from .shared import dcp_job, pack, unpack


MiB = 1 << 20
log = logging.getLogger(__name__)


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
    #: Chunk-table segments this rank shares with others, read once by the coordinator
    #: (``ChunkTables.read_shared``): ``((segment id, header, ((block, bytes), ...)), ...)``.
    tables: tuple = ()


def _region_key(item) -> tuple:
    off = item.storage_index.offset
    return (item.storage_index.fqn, None if off is None else tuple(off), tuple(item.storage_offsets), tuple(item.lengths))


def _exchangeable(item, man: Manifest, bytes_keys: set):
    """The read item as the exchange sees it, or None: a tensor item as it is; a bytes item that
    DCP stored as a uint8 tensor (every rank of a job reads the same ones: the step number, a
    scheduler's state) as a read of its whole box, so one rank reads it and the others receive it."""
    if item.type == LoadItemType.TENSOR:
        return item
    entry = man.tensors.get(item.storage_index.fqn) if item.storage_index.fqn in bytes_keys else None
    if entry is None or len(entry.shape) != 1 or entry.shape[0] == 0:
        return None
    return dataclasses.replace(item, storage_offsets=torch.Size([0]), lengths=torch.Size([entry.shape[0]]))


def _bytes_keys(man: Manifest) -> set:
    return set((man.dcp or {}).get("bytes", []))


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


@dataclass(frozen=True)
class ExchangeOptions:
    """How a :class:`CkptStoreReader` reads replicated items once per job and moves them between ranks.

    ``replicated``: read each region several ranks want once and deliver it
    over the process group (False: every rank reads all it wants itself).
    ``timeout``: seconds any wait of the exchange (a status or a transfer)
    may take before every rank fails naming it; None: the group's own.
    ``round_bytes``: most bytes of buffers one rank holds for one round (an
    all-gather's output, or its point-to-point messages); two rounds at once
    at most. ``piece_bytes``: replicated regions larger than this (or than a
    quarter of each rank's share) are split along dim 0 and read by several
    ranks; smaller pieces (below an eighth of it) travel packed together.
    ``all_gather_ranks``: on groups of at least this many ranks, regions
    every rank reads travel by all-gather; on smaller ones point to point,
    received straight into the destinations. The coordinator's options apply
    to every rank.
    """

    replicated: bool = True
    timeout: float | None = None
    round_bytes: int = 512 * MiB
    piece_bytes: int = 8 * MiB
    all_gather_ranks: int = 16

    def check(self) -> None:
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"exchange timeout must be a positive number of seconds or None, got {self.timeout!r}")
        for name in ("round_bytes", "piece_bytes", "all_gather_ranks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"exchange {name} must be a positive integer, got {v!r}")


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
    exchange:
        How replicated items are read once per job and moved between ranks
        (:class:`ExchangeOptions`: ``replicated``, ``timeout``,
        ``round_bytes``, ``piece_bytes``, ``all_gather_ranks``). The
        keywords ``exchange_replicated``, ``exchange_timeout``,
        ``exchange_round_bytes``, ``exchange_piece_bytes`` and
        ``exchange_all_gather_ranks`` set the same fields one by one (not
        together with ``exchange=``).
    process_group:
        The group the exchange runs on: it must be the group DCP loads with
        (``dcp.load(..., process_group=g)`` needs ``CkptStoreReader(...,
        process_group=g)``). Default: the default group. When the ranks'
        plans do not match this group, nothing is exchanged (with a warning).
    peer_reads:
        With a ``cache_dir`` on every rank and the ranks on more than one
        node (tier), take from other nodes' tiers the packs this node's
        tier lacks before reading (each chunk hash-checked when read), so
        the object store serves only what no tier holds (default True;
        ``docs/tier.md``, "Peer replicas"). One small all-gather per load
        when no node lacks anything.
    safe_globals:
        Classes and functions (or ``(object, "module.name")`` pairs) that
        bytes items may hold besides ckptstore's allowlist
        (:mod:`ckptstore.format.unpickle`: tensors and torch's safe types, NumPy
        arrays and RNG states, ``OrderedDict``, ``datetime`` values,
        dataclasses of plain values), as for
        ``torch.serialization.add_safe_globals`` but for this reader only.
        A bytes item holding anything else fails the load, naming it.

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
        exchange: ExchangeOptions | None = None,
        process_group=None,
        peer_reads: bool = True,
        safe_globals=None,
        exchange_replicated: bool | None = None,
        exchange_timeout: float | None = None,
        exchange_round_bytes: int | None = None,
        exchange_piece_bytes: int | None = None,
        exchange_all_gather_ranks: int | None = None,
        **options,
    ):
        super().__init__()
        self._default_step = None if step is None else _check_step(step)
        self.url, id_step = split_checkpoint_id(url)
        self.step = _pick_step(self.url, id_step, self._default_step, "CkptStoreReader")
        self.peer_reads = bool(peer_reads)
        #: What bytes items may hold besides ckptstore's allowlist (``safe_globals``).
        self.safe_globals = check_safe_globals(safe_globals)
        #: This rank's figures of its last peer fill (packs and bytes received from and sent to
        #: other nodes' tiers), or None when there was none.
        self.last_peer_stats: dict | None = None
        self.storage_options = storage_options
        self.options = options
        self.item_workers = item_workers
        self.process_group = process_group
        loose = {"replicated": exchange_replicated, "timeout": exchange_timeout, "round_bytes": exchange_round_bytes,
                 "piece_bytes": exchange_piece_bytes, "all_gather_ranks": exchange_all_gather_ranks}
        loose = {k: v for k, v in loose.items() if v is not None}
        if exchange is not None and loose:
            raise ValueError("CkptStoreReader: pass the exchange's options either as exchange=ExchangeOptions(...) or "
                             f"as exchange_* keywords, not both (got exchange= and {sorted('exchange_' + k for k in loose)})")
        #: The replicated-read exchange's options (:class:`ExchangeOptions`).
        self.exchange = exchange if exchange is not None else ExchangeOptions(**loose)
        self.exchange.check()
        # the names the rest of the reader (and older callers) use
        self.exchange_replicated = self.exchange.replicated
        self.exchange_timeout = self.exchange.timeout
        self.exchange_round_bytes = self.exchange.round_bytes
        self.exchange_piece_bytes = self.exchange.piece_bytes
        self.exchange_all_gather_ranks = self.exchange.all_gather_ranks
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

    def read_metadata(self, *args: Any) -> Metadata:
        # No **kwargs: DCP then never asks for "rank-local" metadata (read_metadata(rank=r))
        # after a failed read, which ckptstore does not keep; a failed read fails the load.
        job = dcp_job()
        if job is None:
            self._ckpt = self._get_repo().checkpoint(self._resolve_step())
        else:
            self._ckpt = self._shared_checkpoint(job)
        return metadata_from_manifest(self._ckpt.manifest)

    def _shared_checkpoint(self, job) -> Checkpoint:
        """The coordinator resolves the step and reads its root manifest and the config; the
        other ranks receive the bytes (one listing and one read of each per job, :mod:`.shared`)."""
        repo = self._get_repo()
        xg = Exchanger(job.process_group, job.rank, self.exchange_timeout,
                       repo.url, activity="read of the step's metadata")
        payload, failure, step = None, None, None
        if job.is_coordinator:
            try:
                step = self._resolve_step()
                payload = pack({"step": step}, repo.manifest_bytes(step), repo.config_bytes())
            except Exception as e:  # reported to every rank by share()
                failure = e
        got = xg.share(payload, job.src, failure, "the step's metadata")
        if not job.is_coordinator:
            header, (raw, cfg) = unpack(got, "step's metadata")
            step = header.get("step")
            if not isinstance(step, int) or raw is None:
                raise CkptStoreError(f"{repo.url}: the step's metadata received from the coordinator names no step")
            if cfg is not None:
                repo.adopt_config(cfg)
            repo.adopt_manifest(step, raw)
        return repo.checkpoint(step)

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
        tables = self._shared_tables(plans, exchanges)
        return [
            dataclasses.replace(p, storage_data=_ReadPlan(i, step, None if exchanges is None else exchanges[i], peer,
                                                          tables[i]))
            for i, p in enumerate(plans)
        ]

    def _shared_tables(self, plans: list[LoadPlan], exchanges) -> list[tuple]:
        """The chunk-table segments several ranks need, read once here and handed to each in its plan.

        Without this, every rank reads the header and blocks of each segment it touches, and a
        segment several ranks touch (the one holding what they all load, a box two ranks'
        reshards share) is read by each (issue 44: 4 reads at an 8-rank restart). A failed read
        here is not an error: each rank then reads for itself and reports what it finds.
        """
        none = [() for _ in plans]
        if len(plans) < 2 or self._ckpt is None or self._ckpt.manifest.inline:
            return none
        try:
            needs = [self._table_needs(p, None if exchanges is None else exchanges[i], i) for i, p in enumerate(plans)]
            return self._get_repo().tables.read_shared(self._ckpt.manifest, needs)
        except Exception as e:  # noqa: BLE001 - the ranks' own reads report it, naming the object
            log.debug("%s: shared chunk-table read skipped: %s", self._get_repo().url, e)
            return none

    def _table_needs(self, plan: LoadPlan, ex: Exchange | None, rank: int) -> set[tuple[str, int]]:
        """The shards whose chunk records rank ``rank``'s ``read_data`` resolves: its direct reads
        and the exchanged regions it owns, as :meth:`_prepare` and :meth:`_read_exchanged` pick them."""
        ckpt = self._ckpt
        man = ckpt.manifest
        bytes_keys = _bytes_keys(man)
        exchanged = ex.keys() if ex is not None else set()
        owned = {p.key for p in ex.owned(rank)} if ex is not None else set()
        out: set[tuple[str, int]] = set()
        for item in plan.items:
            fqn = item.storage_index.fqn
            entry = man.tensors.get(fqn)
            if entry is None:
                continue
            if item.type == LoadItemType.BYTE_IO:
                it = _exchangeable(item, man, bytes_keys) if exchanged else None
                if it is not None and _region_key(it) in exchanged:
                    if _region_key(it) in owned:
                        out.add((fqn, ckpt.shard_at(fqn, None)))
                elif fqn in bytes_keys:
                    out.update((fqn, i) for i in range(entry.nshards))  # read whole
                continue
            key = _region_key(item)
            if key not in exchanged or key in owned:
                out.add((fqn, ckpt.shard_at(fqn, item.storage_index.offset)))
        return out

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
        man = self._ckpt.manifest
        bytes_keys = _bytes_keys(man)
        keyed: list[list[tuple[tuple, Any]]] = []
        count: dict[tuple, int] = {}
        for p in plans:
            mine = {}
            for item in p.items:
                it = _exchangeable(item, man, bytes_keys)
                if it is not None:
                    mine.setdefault(_region_key(it), it)
            for key in mine:
                count[key] = count.get(key, 0) + 1
            keyed.append(list(mine.items()))
        if not any(c > 1 for c in count.values()):
            return None
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
        """Bytes items loaded; tensor items split into direct reads and exchanged regions.

        Bytes items the exchange moves become regions too, into uint8 buffers, listed in the
        third result as ``(item, buffer)`` to load once the exchange has filled them.
        """
        ckpt = self._ckpt
        man = ckpt.manifest
        bytes_keys = _bytes_keys(man)
        values = leaf_values(man.tree) if man.dcp is None else {}
        direct = []
        regions: dict[tuple, list] = {}  # key -> [(item, entry, shard index, target), ...]
        received = []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                it = _exchangeable(item, man, bytes_keys) if exchanged else None
                if it is not None and _region_key(it) in exchanged:
                    target = torch.empty(it.lengths[0], dtype=torch.uint8)
                    regions.setdefault(_region_key(it), []).append((it, man.tensors[fqn], ckpt.shard_at(fqn, None), target))
                    received.append((item, target))
                    continue
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
                self._load_bytes(item, planner, data)
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
        return direct, regions, received

    def _load_bytes(self, item, planner: LoadPlanner, data: bytes) -> None:
        # DCP's planner unpickles unrestricted: only a value that loads through the
        # restricted unpickler and the allowlist reaches it (it then builds the same objects).
        man = self._ckpt.manifest
        load_safe(data, f"{self._ckpt.repo.url}: step {man.step}: bytes item {item.storage_index.fqn!r}",
                  self.safe_globals)
        planner.load_bytes(item, io.BytesIO(data))

    def _read_all(self, jobs) -> None:
        """Run ``(entry, shard index, box, target)`` reads, batched, on ``item_workers`` threads.

        Consecutive small boxes go together in batches of about ``max_request`` bytes, read in one
        fetch (:meth:`~ckptstore.repo.reader.Checkpoint.read_shards`), so their chunks coalesce into
        few range requests: a rank's shards of many small tensors cost a few GETs, not one each.
        """
        if not jobs:
            return
        ckpt = self._ckpt
        limit = ckpt.repo.options.max_request
        batches, cur, size = [], [], 0
        for entry, index, local, target in jobs:
            n = target.numel() * _m.itemsize(entry.dtype)
            if cur and size + n > limit:
                batches.append(cur)
                cur, size = [], 0
            cur.append((entry, index, local, target))
            size += n
        if cur:
            batches.append(cur)

        def run(batch):
            ckpt.read_shards([(e, ckpt.shards(e.key, [i])[0], local, t) for e, i, local, t in batch])

        if len(batches) == 1:
            run(batches[0])
            return
        with cf.ThreadPoolExecutor(min(self.item_workers, len(batches)), thread_name_prefix="ckpt-dcp") as ex:
            futures = [ex.submit(run, b) for b in batches]
            for f in futures:
                f.result()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        sd = plan.storage_data
        ex = sd.exchange if isinstance(sd, _ReadPlan) else None
        self.last_peer_stats = None
        if isinstance(sd, _ReadPlan) and sd.tables:
            try:
                self._get_repo().tables.adopt(self._ckpt.manifest, sd.tables)
            except CkptStoreError as e:  # checked like a read: refused bytes are read from the store instead
                warnings.warn(f"{self._get_repo().url}: chunk-table records received from the coordinator "
                              f"were refused, reading them from the store: {e}", stacklevel=2)
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
                exchanged, owned = ex.keys(), ex.owned(xg.rank)
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
        direct, _, _ = self._prepare(plan, planner, set())
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
        exchanged = ex.keys()
        failure: BaseException | None = None
        direct: list = []
        regions: dict = {}
        received: list = []
        all_cuda = False
        try:
            direct, regions, received = self._prepare(plan, planner, exchanged)
            missing = exchanged - set(regions)
            if missing:
                raise CkptStoreError(f"{where}: the exchange plan names regions this rank does not read: "
                                     f"{sorted(k[0] for k in missing)[:5]}")
            owned = [(regions[p.key][0][1], regions[p.key][0][2]) for p in ex.owned(me)]
            ckpt.resolve([(e.key, i) for _, e, i, _, _ in direct] + [(e.key, i) for e, i in owned])
            targets = [t for lst in regions.values() for (it, _, _, t) in lst if it.type == LoadItemType.TENSOR]
            all_cuda = xg.cuda_capable and bool(targets) and all(t.device.type == "cuda" for t in targets)
        except Exception as e:  # reported to every rank at the first status
            failure = e
        if failure is None:
            reads = ExchangedRead(xg, ex, direct, regions, self._read_all, stats)
            prepare = reads.prepare
        else:
            prepare = None  # never called: the failure is reported at the first status
        xg.pick_device(failure, all_cuda)
        xg.run(ex.rounds, prepare, failure)
        for lst in regions.values():
            for item, _, _, target in lst:
                if item.type == LoadItemType.TENSOR:
                    planner.commit_tensor(item, target)
        for item, buf in received:
            self._load_bytes(item, planner, buf.numpy().tobytes())
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
        try:  # no join from a finalizer (Catalog.abandon)
            if self._repo is not None:
                self._repo.abandon()
                self._repo = None
        except Exception:
            pass
