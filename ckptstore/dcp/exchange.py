"""Replicated read regions fetched once per job and exchanged over a process group.

A box of a stored shard that several ranks read (DDP parameters,
replicated DTensors, the optimizer state of replicated parameters, the
same tensor-parallel slice on every data-parallel rank) is fetched from the
store once: :func:`plan_exchange` (pure) cuts it into pieces, gives each
piece to one of the ranks that want it, balanced by fetched bytes, and
plans the transfers in rounds of bounded size; :class:`Exchanger` runs the
status collectives and point-to-point transfers of one load with every wait
bounded, so a rank that fails makes every rank raise
:class:`RankReadError` naming it. The DCP reader
(:class:`ckptstore.dcp.CkptStoreReader`) turns its read items into
:class:`ReadRegion` s, reads the pieces it owns and moves the bytes.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import CkptStoreError

__all__ = ["ReadRegion", "RankReadError", "plan_exchange", "Exchanger", "Exchange", "Message", "Gather", "Piece", "Round", "TorchComm"]

MiB = 1 << 20

# ------------------------------------------------------------------ replicated reads
#
# Items several ranks read (the same box of the same stored shard: DDP
# parameters, replicated DTensors, optimizer state of replicated
# parameters) are fetched from the store once per job: the coordinator
# splits them into pieces, gives each piece to one of the ranks that want it
# (greedy by bytes, counting what each rank reads for itself anyway), and
# groups the pieces into messages sent from their owner to the other
# wanting ranks over the reader's process group, in rounds of bounded size.
# Planning is pure (below); the exchange itself is Exchanger.

_ALIGN = 64  # byte alignment of pieces packed into one message


@dataclass(frozen=True, slots=True)
class ReadRegion:
    """A box of one stored shard that a rank's plan reads, as the exchange planner sees it.

    ``key`` is ``(fqn, shard offsets, storage_offsets, lengths)``: two ranks
    whose plans hold the same key read the same bytes.
    """

    key: tuple
    rows: int  # length of the box's dim 0 (1 for a 0-d tensor)
    row_bytes: int  # stored bytes of one row of the box
    fetch: float = 1.0  # stored (compressed) bytes per raw byte: what fetching a byte costs
    row0: int = 0  # the box's first row within its shard
    align: int = 1  # a split before shard row b with b % align == 0 cuts no chunk

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``lo:hi`` of a region, at ``offset`` in its message."""

    key: tuple
    lo: int
    hi: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Message:
    """Pieces one rank reads and sends to the others that want them, in one round.

    ``dsts`` is filled in the sender's plan only (a receiver needs the sender).
    """

    id: int
    round: int
    src: int
    dsts: tuple[int, ...]
    nbytes: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True, slots=True)
class Gather:
    """One round's all-gather of pieces every rank wants: each rank contributes
    ``parts[rank]`` (packed at their offsets, padded to ``nbytes``)."""

    round: int
    nbytes: int
    parts: tuple[tuple[Piece, ...], ...]


@dataclass(frozen=True)
class Exchange:
    """One rank's part of the exchange: the all-gathers and the messages it sends or receives, by round."""

    rounds: int
    messages: tuple[Message, ...]
    gathers: tuple[Gather, ...] = ()

    def keys(self) -> set[tuple]:
        """The regions this rank's exchange moves (sent, received or gathered)."""
        out = {p.key for m in self.messages for p in m.pieces}
        out.update(p.key for g in self.gathers for ps in g.parts for p in ps)
        return out

    def owned(self, rank: int) -> list[Piece]:
        """The pieces ``rank`` reads from the store for the others: its messages' and its gather shares'."""
        mine = [p for m in self.messages if m.src == rank for p in m.pieces]
        return mine + [p for g in self.gathers for p in g.parts[rank]]


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def plan_exchange(
    wants: list[list[ReadRegion]],
    *,
    round_bytes: int = 512 * MiB,
    min_piece: int = 8 * MiB,
    solo_bytes: int | None = None,
    bundle_bytes: int | None = None,
    gather_min_ranks: int = 16,
) -> list[Exchange | None]:
    """Assign every region several ranks want to one of them, and plan the transfers.

    Pure. ``wants[r]`` lists the regions rank ``r`` reads. A region only one
    rank wants stays that rank's own read and counts towards its load. The
    others are cut along dim 0 into pieces of at most
    ``max(min_piece, replicated bytes / (4 x ranks))`` (at chunk boundaries
    where rows line up with chunks), and the pieces, largest first, go to the
    wanting rank with the smallest load so far (fetched bytes: raw bytes x
    the tensor's stored/raw ratio).

    Pieces every rank wants (DDP, fully replicated) travel in rounds: each
    rank's own pieces are packed into shares of at most ``round_bytes /
    ranks`` (pieces are cut to fit), round g carrying every rank's g-th
    share, so in each round every rank sends and receives about as much as
    any other. On ``gather_min_ranks`` ranks or more a round is one
    all-gather (a ring of ``ranks - 1`` steps of one message per rank, whose
    output is copied out); on fewer ranks each share goes point to point
    from its owner to every other rank (received straight into the
    destinations where they allow). Pieces a subset wants (a replica group
    of HSDP, say) travel point to point from owner to the other wanting
    ranks, in the rounds after those; their messages are ordered so that
    each round mixes owners and cut into rounds in which no rank holds more
    than ``round_bytes`` of them (a larger message is a round of its own).
    Point to point, a piece of ``solo_bytes`` or more is a message of its
    own; smaller ones with the same owner and the same wanting ranks are
    packed into messages of up to ``bundle_bytes``.

    ``solo_bytes`` defaults to ``min_piece / 8``, ``bundle_bytes`` to
    ``2 x min_piece``.

    Returns one :class:`Exchange` per rank, or all None when no region is
    wanted twice (then no rank takes part in any collective).
    """
    solo_bytes = max(1, min_piece // 8) if solo_bytes is None else solo_bytes
    bundle_bytes = 2 * min_piece if bundle_bytes is None else bundle_bytes
    n = len(wants)
    regions, wanting, load, replicated = _wanted(wants)
    if not replicated:
        return [None] * n
    share_max = max(_ALIGN, round_bytes // n)  # one rank's contribution to one all-gather
    pieces = _cut(regions, wanting, replicated, n, min_piece, share_max)
    owner = _assign(pieces, regions, wanting, load)
    cut = _Bundler(pieces, solo_bytes, bundle_bytes)
    nrounds, gathers, full = _everyone_rounds(pieces, owner, wanting, n, share_max, n >= gather_min_ranks, cut)
    order = _subset_order(pieces, owner, wanting, n, cut)
    per_rank, rounds = _messages(pieces, n, full, order, nrounds, round_bytes)
    return [Exchange(rounds, tuple(msgs), tuple(gathers)) for msgs in per_rank]


#: A piece while planning: (region key, first row, end row, bytes).
_PieceSpec = tuple[tuple, int, int, int]


def _wanted(wants: list[list[ReadRegion]]):
    """Each region once, the ranks wanting it, each rank's own load (regions only it wants, in
    fetched bytes) and the keys of the regions several ranks want."""
    regions: dict[tuple, ReadRegion] = {}
    wanting: dict[tuple, list[int]] = {}
    for r, regs in enumerate(wants):
        for g in regs:
            regions.setdefault(g.key, g)
            ranks = wanting.setdefault(g.key, [])
            if not ranks or ranks[-1] != r:
                ranks.append(r)
    load = [0.0] * len(wants)
    replicated = []
    for key, ranks in wanting.items():
        g = regions[key]
        if len(ranks) > 1 and g.nbytes > 0:
            replicated.append(key)
        else:
            load[ranks[0]] += g.nbytes * g.fetch
    return regions, wanting, load, replicated


def _cut(regions: dict, wanting: dict, replicated: list, n: int, min_piece: int, share_max: int) -> list[_PieceSpec]:
    """The replicated regions cut along dim 0, at chunk boundaries where rows line up with chunks."""
    total = sum(regions[k].nbytes for k in replicated)
    piece_max = max(min_piece, -(-total // (4 * n)))
    pieces: list[_PieceSpec] = []
    for key in replicated:
        g = regions[key]
        cap = min(piece_max, share_max) if len(wanting[key]) == n else piece_max
        k = min(g.rows, -(-g.nbytes // cap))
        bounds = [0]
        for j in range(1, k):
            b = round(j * g.rows / k)
            if g.align > 1:
                b = round((g.row0 + b) / g.align) * g.align - g.row0
            if bounds[-1] < b < g.rows:
                bounds.append(b)
        bounds.append(g.rows)
        for lo, hi in zip(bounds, bounds[1:]):
            pieces.append((key, lo, hi, (hi - lo) * g.row_bytes))
    return pieces


def _assign(pieces: list[_PieceSpec], regions: dict, wanting: dict, load: list[float]) -> list[int]:
    """Each piece's owner: largest first, to the least loaded rank that wants it."""
    owner = [0] * len(pieces)
    for i in sorted(range(len(pieces)), key=lambda i: (-pieces[i][3] * regions[pieces[i][0]].fetch, i)):
        key, _, _, nb = pieces[i]
        o = min(wanting[key], key=lambda r: (load[r], r))
        owner[i] = o
        load[o] += nb * regions[key].fetch
    return owner


class _Bundler:
    """Pieces as messages: ``solo`` bytes or more alone, smaller ones packed up to ``bundle`` bytes."""

    def __init__(self, pieces: list[_PieceSpec], solo: int, bundle: int):
        self.pieces, self.solo, self.bundle = pieces, solo, bundle

    def piece(self, i: int, offset: int) -> Piece:
        key, lo, hi, nb = self.pieces[i]
        return Piece(key, lo, hi, offset, nb)

    def __call__(self, idx: list[int]) -> list[tuple[list[tuple[int, int]], int]]:
        out, bundle, size = [], [], 0
        for i in idx:
            nb = self.pieces[i][3]
            if nb >= self.solo:
                out.append(([(i, 0)], nb))
                continue
            if bundle and size + nb > self.bundle:
                out.append((bundle, size))
                bundle, size = [], 0
            bundle.append((i, size))
            size += _aligned(nb)
        if bundle:
            out.append((bundle, size))
        return out


def _everyone_rounds(pieces, owner, wanting, n: int, share_max: int, gather: bool, cut: _Bundler):
    """Pieces every rank wants: each rank's own, in order, in shares of at most ``share_max``;
    round g carries every rank's g-th share (one all-gather with ``gather``, else point-to-point
    messages), so every rank sends and receives about as much as any other.
    Returns (rounds, gathers, [(round, src, members, bytes)])."""
    shares: list[list[list[int]]] = [[] for _ in range(n)]
    used = [0] * n
    for i, (key, _, _, nb) in enumerate(pieces):
        if len(wanting[key]) != n:
            continue
        o = owner[i]
        if not shares[o] or (shares[o][-1] and used[o] + nb > share_max):
            shares[o].append([])
            used[o] = 0
        shares[o][-1].append(i)
        used[o] += _aligned(nb)
    nrounds = max(len(x) for x in shares)
    gathers: list[Gather] = []
    full: list[tuple[int, int, list[tuple[int, int]], int]] = []
    for g in range(nrounds):
        if gather:
            parts = []
            for q in range(n):
                ps, off = [], 0
                for i in (shares[q][g] if g < len(shares[q]) else []):
                    ps.append(cut.piece(i, off))
                    off += _aligned(pieces[i][3])
                parts.append(tuple(ps))
            size = max((p.offset + _aligned(p.nbytes) for ps in parts for p in ps), default=0)
            gathers.append(Gather(g, size, tuple(parts)))
        else:
            for q in range(n):
                if g < len(shares[q]):
                    full += [(g, q, members, nb) for members, nb in cut(shares[q][g])]
    return nrounds, gathers, full


def _subset_order(pieces, owner, wanting, n: int, cut: _Bundler) -> list:
    """Pieces a subset wants: per (owner, wanting ranks), in region order, owners interleaved
    (the one that has sent least goes next). Returns [(src, ranks, members, bytes)]."""
    queues: dict[int, list[tuple[tuple[int, ...], list[tuple[int, int]], int]]] = {}
    groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i, (key, _, _, _) in enumerate(pieces):
        if len(wanting[key]) != n:
            groups.setdefault((owner[i], tuple(wanting[key])), []).append(i)
    for (src, ranks), idx in groups.items():
        queues.setdefault(src, []).extend((ranks, members, nb) for members, nb in cut(idx))
    sent = {src: 0 for src in queues}
    heads = {src: 0 for src in queues}
    order = []
    while heads:
        src = min(heads, key=lambda s: (sent[s], s))
        ranks, members, nb = queues[src][heads[src]]
        order.append((src, ranks, members, nb))
        sent[src] += nb
        heads[src] += 1
        if heads[src] == len(queues[src]):
            del heads[src]
    return order


def _messages(pieces, n: int, full: list, order: list, nrounds: int, round_bytes: int):
    """Every rank's messages (the sender's copy names the receivers), the subset messages cut
    into rounds after the full ones in which no rank holds more than ``round_bytes`` (a larger
    message is a round of its own). Returns (per-rank messages, rounds)."""
    cut = _Bundler(pieces, 0, 0)
    per_rank: list[list[Message]] = [[] for _ in range(n)]

    def emit(mid: int, rnd: int, src: int, ranks: tuple[int, ...], members, nb: int) -> None:
        ps = tuple(cut.piece(i, off) for i, off in members)
        dsts = tuple(r for r in ranks if r != src)
        per_rank[src].append(Message(mid, rnd, src, dsts, nb, ps))
        light = Message(mid, rnd, src, (), nb, ps)
        for r in dsts:
            per_rank[r].append(light)

    everyone = tuple(range(n))
    for mid, (rnd, src, members, nb) in enumerate(full):
        emit(mid, rnd, src, everyone, members, nb)
    rnd = nrounds
    charge: dict[int, int] = {}
    for mid, (src, ranks, members, nb) in enumerate(order, start=len(full)):
        if any(charge.get(r, 0) and charge[r] + nb > round_bytes for r in ranks):
            rnd += 1
            charge = {}
        for r in ranks:
            charge[r] = charge.get(r, 0) + nb
        emit(mid, rnd, src, ranks, members, nb)
    return per_rank, (rnd + 1 if order else nrounds)


@dataclass(slots=True)
class Round:
    """One round of an exchange on one rank, as :meth:`Exchanger.run` posts and completes it."""

    sends: list  # (tensor, dst, tag)
    recvs: list  # (tensor, src, tag)
    copies: list  # (source, [destinations]): copied once the round's transfers are in
    gather: tuple | None = None  # (this rank's share, the all-gather's output) in a gather round
    keep: list = field(default_factory=list)  # buffers that must live until the round is done


class RankReadError(CkptStoreError, RuntimeError):
    """A load failed on one or more ranks; raised on every rank, naming them."""


def _backend_devices(group) -> set[str]:
    """Device types the group's backend moves tensors of (``gloo``: cpu, ``nccl``: cuda)."""
    name = str(dist.get_backend(group)).lower()
    if ":" in name:
        return {part.split(":", 1)[0].strip() for part in name.split(",") if ":" in part}
    return {"cuda"} if name == "nccl" else {"cpu"}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def takes_bytes(t: torch.Tensor, dtype: torch.dtype, device: torch.device | None = None) -> bool:
    """Stored-dtype bytes can be written into (or sent from) ``t``'s memory as they are."""
    return (
        t.dtype == dtype
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        and (device is None or t.device == device)
    )


class TorchComm:
    """The collectives and transfers an :class:`Exchanger` uses, over a ``torch.distributed`` group.

    Every call starts the operation and returns something with
    ``wait(timeout=None) -> bool | None`` (False: not done in time). Tests
    swap in a fake of the same shape (``tests/fake_comm.py``: ranks as
    threads of one process) to run the exchange's protocol without
    processes.
    """

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.devices = _backend_devices(group)

    def all_reduce_max(self, t: torch.Tensor):
        return dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor):
        return dist.all_gather(out, t, group=self.group, async_op=True)

    def all_gather_into_tensor(self, out: torch.Tensor, t: torch.Tensor):
        return dist.all_gather_into_tensor(out, t, group=self.group, async_op=True)

    def broadcast(self, t: torch.Tensor, src: int):
        """``t`` from group rank ``src`` to every rank (in place)."""
        return dist.broadcast(t, group=self.group, group_src=src, async_op=True)

    def post(self, sends, recvs, batched: bool) -> list:
        """Start sends ``(tensor, dst, tag)`` and receives ``(tensor, src, tag)``: one work each, receives
        first (``batched``: one ``batch_isend_irecv``, sends first, as NCCL needs)."""
        if batched:
            ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=p, tag=tag) for t, p, tag in sends]
            ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=p, tag=tag) for t, p, tag in recvs]
            return dist.batch_isend_irecv(ops) if ops else []
        works = [dist.irecv(t, group=self.group, group_src=p, tag=tag) for t, p, tag in recvs]
        return works + [dist.isend(t, group=self.group, group_dst=p, tag=tag) for t, p, tag in sends]


class Exchanger:
    """Status collectives and point-to-point transfers of one load, every wait bounded.

    Every rank calls :meth:`status` at the same points; the first one that
    finds a failure makes every rank raise :class:`RankReadError` naming the
    failed ranks and what they said, before any rank waits for data that
    will never come.
    """

    def __init__(self, group, rank: int, timeout: float | None, where: str, activity: str = "load",
                 error: type[CkptStoreError] = RankReadError, comm=None):
        self.group = group
        self.comm = comm if comm is not None else TorchComm(group)
        self.activity = activity  # what failed, in messages: "load", "peer fill", "replication"...
        self.error = error  # raised on every rank when one failed
        self.rank = rank
        self.size = self.comm.size
        self.timeout = timeout
        self.where = where
        devices = self.comm.devices
        self.cuda_capable = "cuda" in devices and torch.cuda.is_available()
        self.status_device = torch.device("cpu") if "cpu" in devices else torch.device("cuda", torch.cuda.current_device())
        self.nccl_style = "cpu" not in devices  # a backend of device tensors only: batched p2p
        self.device = torch.device("cpu")

    def _wait(self, work, what: str, deadline: float | None = None) -> None:
        if work is None:
            return
        bound = "the group's timeout" if self.timeout is None else f"{self.timeout:g} s (exchange_timeout)"
        try:
            if self.timeout is None:
                ok = work.wait()
            else:
                left = self.timeout if deadline is None else max(0.0, deadline - time.monotonic())
                ok = work.wait(timeout=datetime.timedelta(seconds=left))
        except Exception as e:
            said = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise self.error(
                f"{self.where}: rank {self.rank}: {what} failed or did not complete within {bound}: "
                f"{type(e).__name__}: {said}"
            ) from e
        if ok is False:
            raise self.error(f"{self.where}: rank {self.rank}: {what} did not complete within {bound}")

    def status(self, failure: BaseException | None, stage: str, flag: int = 0) -> int:
        """Every rank's ok/failed (and the largest ``flag``); raises on every rank if any failed."""
        t = torch.tensor([1 if failure is not None else 0, flag], dtype=torch.int64, device=self.status_device)
        self._wait(self.comm.all_reduce_max(t), f"the status exchange {stage}")
        if int(t[0]) == 0:
            return int(t[1])
        text = b""
        if failure is not None:
            first = str(failure).strip()
            text = f"{type(failure).__name__}: {first}".encode("utf-8", "replace")[:_STATUS_TEXT]
        mine = torch.zeros(_STATUS_TEXT + 3, dtype=torch.uint8)
        mine[0] = 1 if failure is not None else 0
        mine[1], mine[2] = len(text) >> 8, len(text) & 0xFF
        if text:
            mine[3 : 3 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        mine = mine.to(self.status_device)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        self._wait(self.comm.all_gather(out, mine), f"the failure report {stage}")
        said = {}
        for r, b in enumerate(out):
            b = b.cpu()
            if int(b[0]):
                n = (int(b[1]) << 8) | int(b[2])
                said[r] = bytes(b[3 : 3 + n].tolist()).decode("utf-8", "replace")
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(said.items()))
        err = self.error(
            f"{self.where}: the {self.activity} failed on rank(s) {sorted(said)} {stage}, so no rank waits for "
            f"data from them ({detail})"
        )
        if failure is not None:
            raise err from failure
        raise err

    def share(self, payload: bytes | None, src: int, failure: BaseException | None, what: str) -> bytes:
        """``payload`` of group rank ``src`` on every rank: one status (a failure on any rank, ``src``'s
        read among them, raises on every rank), then one broadcast of the bytes.

        For what one rank reads and every rank needs (the newest step, the
        root manifest, the config): the store serves it once per job.
        """
        n = len(payload) if self.rank == src and payload is not None else 0
        if self.rank == src and failure is None and payload is None:
            failure = ValueError(f"nothing to share ({what})")
        size = self.status(failure, f"before sharing {what}", n)
        buf = torch.empty(size, dtype=torch.uint8, device=self.status_device)
        if self.rank == src and size:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        if size:
            self._wait(self.comm.broadcast(buf, src), f"the broadcast of {what} from rank {src}")
        return bytes(buf.cpu().numpy()) if size else b""

    def post(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]]):
        """Start sends ``(tensor, dst, tag)`` and receives ``(tensor, src, tag)``; the works to wait on."""
        works = self.comm.post(sends, recvs, self.nccl_style)
        if self.nccl_style:
            peers = [f"send to rank {p}" for _, p, _ in sends] + [f"receive from rank {p}" for _, p, _ in recvs]
        else:
            peers = [f"receive from rank {p}" for _, p, _ in recvs] + [f"send to rank {p}" for _, p, _ in sends]
        return list(zip(works, peers))

    def wait_all(self, works, stage: str) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        for work, what in works:
            self._wait(work, f"the {what} {stage}", deadline)

    # ------------------------------------------------------------ the round loop
    def pick_device(self, failure: BaseException | None, all_cuda: bool) -> None:
        """The transport: CPU buffers on a group with a CPU backend, CUDA buffers on an NCCL-only
        group; a group with both uses CUDA when every rank's destinations are on CUDA (``all_cuda``),
        which takes one status more (where a ``failure`` is reported)."""
        if self.nccl_style:
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif self.cuda_capable:
            if self.status(failure, "before reading", 0 if all_cuda else 1) == 0:
                self.device = torch.device("cuda", torch.cuda.current_device())

    def run(self, rounds: int, prepare: Callable[[int], Round], failure: BaseException | None = None) -> None:
        """Run ``rounds`` rounds: ``prepare(r)`` reads this rank's pieces of round ``r`` and builds its
        buffers while round ``r - 1``'s transfers are in flight; then one status (every rank learns of
        any failure, ``failure`` included, before waiting for data), then round ``r``'s transfers.

        Collectives happen only in :meth:`status` and the transfers after it; a failure anywhere
        else is kept and reported at the next status, so every rank stops at the same point
        instead of waiting for a peer that has given up. A transfer that never completes raises
        at once (the group cannot be trusted any more).
        """
        pending: tuple | None = None
        for r in range(rounds):
            ready = None
            if failure is None:
                try:
                    ready = prepare(r)
                except Exception as e:
                    failure = e
            if pending is not None:
                done, pending = pending, None
                try:
                    self._complete(*done, rounds)
                except self.error:
                    raise
                except Exception as e:
                    failure = failure or e
            self.status(failure, f"in round {r + 1} of {rounds}")
            try:
                works = self.post(ready.sends, ready.recvs)
                if ready.gather is not None:
                    share, out = ready.gather
                    works.append((self.comm.all_gather_into_tensor(out, share), "all-gather of every rank's share"))
            except Exception as e:
                raise self.error(f"{self.where}: rank {self.rank}: starting the transfers of round {r + 1} failed: "
                                 f"{type(e).__name__}: {e}") from e
            pending = (works, ready, r)
        if pending is not None:
            self._complete(*pending, rounds)  # after the last status: a failure here is this rank's alone

    def _complete(self, works, ready: Round, r: int, rounds: int) -> None:
        self.wait_all(works, f"(round {r + 1} of {rounds})")
        with torch.no_grad():
            for src, dests in ready.copies:
                for d in dests:
                    d.copy_(src)


_STATUS_TEXT = 480  # bytes of a failed rank's message that reach the other ranks
