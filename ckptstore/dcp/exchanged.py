"""One rank's side of a DCP load that exchanges replicated pieces (:class:`ckptstore.dcp.exchange.Exchange`).

The reader (:meth:`ckptstore.dcp.CkptStoreReader.read_data`) hands this
class the items it reads directly and the regions the exchange plan names;
:meth:`ExchangedRead.prepare` is what :meth:`ckptstore.dcp.exchange.Exchanger.run`
calls for each round: read this rank's own pieces (and, in the first round,
its direct items), then build the round's send, receive and all-gather
buffers. The round loop itself, and every collective, is the exchanger's.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..format import manifest as _m
from .exchange import Exchange, Exchanger, Gather, Message, Piece, Round, as_bytes, takes_bytes


def _box(item) -> tuple:
    """The shard-local box ``((start, stop, 1), ...)`` a read item reads."""
    return tuple((o, o + n, 1) for o, n in zip(item.storage_offsets, item.lengths))


def _piece_box(item, p: Piece) -> tuple:
    """The shard-local box of rows ``p.lo:p.hi`` of a read item's box."""
    box = _box(item)
    return ((box[0][0] + p.lo, box[0][0] + p.hi, 1),) + box[1:] if box else box


def _piece_view(t: torch.Tensor, p: Piece) -> torch.Tensor:
    return t[p.lo : p.hi] if t.dim() else t


class ExchangedRead:
    """The pieces one rank reads, sends and receives, round by round; see the module docstring.

    ``direct``: ``(item, entry, shard index, box, target)`` read by this rank alone;
    ``regions``: region key -> ``[(item, entry, shard index, target), ...]``, the
    exchanged boxes of this rank's plan; ``read_all(jobs)`` reads
    ``(entry, shard index, box, target)`` jobs from the repository.
    """

    def __init__(self, xg: Exchanger, ex: Exchange, direct: list, regions: dict,
                 read_all: Callable[[list], None], stats: dict):
        self.xg = xg
        self.me = xg.rank
        self.direct = direct
        self.regions = regions
        self.read_all = read_all
        self.stats = stats
        self.by_round: list[list[Message]] = [[] for _ in range(ex.rounds)]
        for m in ex.messages:
            self.by_round[m.round].append(m)
        self.gather_of: dict[int, Gather] = {g.round: g for g in ex.gathers}

    def slot(self, buf: torch.Tensor, base: int, p: Piece) -> torch.Tensor:
        """Piece ``p`` in a flat byte buffer, as a tensor of its stored dtype and shape."""
        _, entry, _, target = self.regions[p.key][0]
        shape = _piece_view(target, p).shape
        return buf[base + p.offset : base + p.offset + p.nbytes].view(_m.DTYPES[entry.dtype]).reshape(shape)

    def read_round(self, msgs: list[Message], gather: Gather | None, with_direct: bool):
        """Read this rank's own pieces of a round (and its direct items); the send sources."""
        jobs, after, sources = [], [], {}
        if with_direct:
            jobs += [(entry, index, local, target) for _, entry, index, local, target in self.direct]
            self.stats["direct_bytes"] += sum(t.numel() * _m.itemsize(e.dtype) for _, e, _, _, t in self.direct)
        if gather is not None:
            share = torch.zeros(gather.nbytes, dtype=torch.uint8)
            for p in gather.parts[self.me]:
                item, entry, index, _ = self.regions[p.key][0]
                src = self.slot(share, 0, p)
                jobs.append((entry, index, _piece_box(item, p), src))
                after.append((src, [_piece_view(t, p) for *_, t in self.regions[p.key]]))
                self.stats["owned_bytes"] += p.nbytes
                self.stats["sent_bytes"] += (self.xg.size - 1) * p.nbytes
            sources["gather"] = share
        for m in msgs:
            if m.src != self.me:
                continue
            buf = torch.empty(m.nbytes, dtype=torch.uint8) if len(m.pieces) > 1 else None
            for p in m.pieces:
                item, entry, index, target = self.regions[p.key][0]
                stored = _m.DTYPES[entry.dtype]
                box = _piece_box(item, p)
                dest = _piece_view(target, p)
                if buf is not None:
                    src = self.slot(buf, 0, p)
                    after.append((src, [dest]))
                elif takes_bytes(dest, stored):
                    src = dest
                else:
                    src = torch.empty(dest.shape, dtype=stored)
                    after.append((src, [dest]))
                jobs.append((entry, index, box, src))
                for _, _, _, other in self.regions[p.key][1:]:  # the same box twice in this rank's plan
                    after.append((src, [_piece_view(other, p)]))
                if buf is None:
                    sources[m.id] = src
                self.stats["owned_bytes"] += p.nbytes
            if buf is not None:
                sources[m.id] = buf
        self.read_all(jobs)
        with torch.no_grad():
            for src, dests in after:
                for d in dests:
                    d.copy_(src)
        return sources

    def prepare_round(self, msgs: list[Message], gather: Gather | None, sources: dict, r: int):
        """The round's send and receive buffers (allocated before its status, so running
        out of memory is reported to every rank, not left to their transfer timeouts)."""
        sends, recvs, copies, keep = [], [], [], []
        dev = self.xg.device
        if gather is not None:
            share = sources["gather"].to(dev)
            out = torch.empty(self.xg.size * gather.nbytes, dtype=torch.uint8, device=dev)
            keep.append((share, out))
            for q, ps in enumerate(gather.parts):
                if q == self.me:
                    continue
                for p in ps:
                    copies.append((self.slot(out, q * gather.nbytes, p), [_piece_view(t, p) for *_, t in self.regions[p.key]]))
                    self.stats["received_bytes"] += p.nbytes
        for m in msgs:
            if m.src == self.me:
                src = sources[m.id]
                if src.device != dev:
                    src = src.to(dev)
                flat = as_bytes(src)
                keep.append(flat)
                for d in m.dsts:
                    sends.append((flat, d, m.id))
                self.stats["sent_bytes"] += len(m.dsts) * sum(p.nbytes for p in m.pieces)
                continue
            self.stats["received_bytes"] += sum(p.nbytes for p in m.pieces)
            if len(m.pieces) == 1:
                p = m.pieces[0]
                lst = self.regions[p.key]
                stored = _m.DTYPES[lst[0][1].dtype]
                dest = _piece_view(lst[0][3], p)
                if takes_bytes(dest, stored, dev):
                    buf = dest
                    rest = [_piece_view(t, p) for *_, t in lst[1:]]
                else:
                    buf = torch.empty(dest.shape, dtype=stored, device=dev)
                    rest = [_piece_view(t, p) for *_, t in lst]
                if rest:
                    copies.append((buf, rest))
                recvs.append((as_bytes(buf), m.src, m.id))
                continue
            buf = torch.empty(m.nbytes, dtype=torch.uint8, device=dev)
            recvs.append((buf, m.src, m.id))
            for p in m.pieces:
                copies.append((self.slot(buf, 0, p), [_piece_view(t, p) for *_, t in self.regions[p.key]]))
        return Round(sends, recvs, copies, gather=keep[0] if gather is not None else None, keep=keep)

    def prepare(self, r: int) -> Round:
        g = self.gather_of.get(r)
        return self.prepare_round(self.by_round[r], g, self.read_round(self.by_round[r], g, with_direct=(r == 0)), r)
