"""Peer replicas: each node's new packs copied into another node's tier, and restores that read peers' tiers.

Nodes are told apart by their tiers: every rank reports its tier's id
(:meth:`ckptstore.tier.cache.Tier.node_id`, the same for every process sharing a
``cache_dir``), and the ranks with one id are one node. Nodes are ordered by
their first rank; node ``k`` keeps its replicas on node ``k + 1`` (the last on
the first), local rank ``i`` sending to local rank ``i mod size`` there
(:func:`replica_peers`).

Writing (:class:`Replicator`, ``CkptStoreWriter(..., replicas=1)``): after a
save, each rank's background thread sends the packs it wrote to its peer,
over a gloo group of the writer's own (created once, at the first save), so
no transfer shares a group with the training loop's collectives. Per step,
every rank of the group takes part (a rank that wrote nothing, or whose
write failed, sends an empty header): a header naming the packs, the peer's
answer (the packs its tier already holds are not sent: a copy there counts),
then the packs, one at a time. The peer keeps them as ordinary cached packs
of its tier. A transfer that fails or times out stops this writer's
replicas (with a warning; :meth:`Replicator.flush` reports it): the
object store, or the write-back step in the sender's tier, stays the
source of truth; a replica is only ever a faster copy.

Reading (:func:`peer_fill`, the DCP reader with a ``cache_dir``): before a
load reads, the ranks tell each other which packs they need that their tier
lacks, then which of those their tiers hold; each pack a node needs is sent
once, to one of its ranks, by the rank holding it that has sent least, in
rounds of bounded size, and kept in the receiving node's tier. The load
then reads as usual: each chunk of a received pack is checked against its
hash like any other chunk of the tier, and one that fails comes from the
object store, which serves only what no tier holds.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from ..errors import CkptStoreError
from .exchange import Exchanger

log = logging.getLogger(__name__)

__all__ = ["ReplicaError", "Replicator", "peer_fill", "plan_peer_fill", "replica_peers", "nodes_of", "Transfer",
           "replica_group", "replicator_for", "retire_replica_group"]

_TAG_LEN, _TAG_HEADER, _TAG_WANTED, _TAG_DATA = 1, 2, 3, 16


class ReplicaError(CkptStoreError, RuntimeError):
    """Copying packs to, or reading them from, a peer node's tier failed."""


# ---------------------------------------------------------------- the nodes (pure)
def nodes_of(node_ids: Sequence[str]) -> list[list[int]]:
    """The group's ranks by node (the same tier id), nodes ordered by their first rank."""
    nodes: dict[str, list[int]] = {}
    for r, nid in enumerate(node_ids):
        nodes.setdefault(nid, []).append(r)
    return list(nodes.values())


def replica_peers(node_ids: Sequence[str]) -> dict[int, int]:
    """rank -> the rank whose tier keeps its replicas (empty with fewer than two nodes)."""
    nodes = nodes_of(node_ids)
    if len(nodes) < 2:
        return {}
    peers = {}
    for k, node in enumerate(nodes):
        nxt = nodes[(k + 1) % len(nodes)]
        for i, r in enumerate(node):
            peers[r] = nxt[i % len(nxt)]
    return peers


@dataclass(frozen=True, slots=True)
class Transfer:
    """Pack ``pack`` (``size`` bytes) sent from rank ``src``'s tier to rank ``dst``'s."""

    src: int
    dst: int
    pack: str
    size: int


def plan_peer_fill(node_ids: Sequence[str], missing: Sequence[Sequence[str]], union: Sequence[str],
                   held: Sequence[Sequence[int]], round_bytes: int) -> list[list[Transfer]]:
    """The transfers of a peer fill, in rounds; the same on every rank (pure).

    ``missing[r]``: packs rank ``r`` needs and its tier lacks; ``union``: all
    of them, sorted; ``held[r][j]``: bytes of ``union[j]`` in rank ``r``'s
    tier (0: none). Each pack a node lacks goes once, to the lowest of its
    ranks that asked, from the holder on another node that has sent least
    (then the lowest rank). A round holds at most ``round_bytes`` sent and
    received per rank (a larger pack travels alone).
    """
    node_of = {}
    for k, ranks in enumerate(nodes_of(node_ids)):
        for r in ranks:
            node_of[r] = k
    col = {p: j for j, p in enumerate(union)}
    need: dict[tuple[int, str], int] = {}
    for r, packs in enumerate(missing):
        for p in packs:
            need.setdefault((node_of[r], p), r)
    sent = [0] * len(node_ids)
    transfers = []
    for (nd, p), dst in sorted(need.items(), key=lambda kv: (kv[1], kv[0][1])):
        j = col[p]
        if any(held[r][j] > 0 for r in range(len(node_ids)) if node_of[r] == nd):
            continue  # another rank of the node holds it: the tier is shared
        cands = [r for r in range(len(node_ids)) if node_of[r] != nd and held[r][j] > 0]
        if not cands:
            continue  # no tier holds it: the object store serves it
        src = min(cands, key=lambda r: (sent[r], r))
        sent[src] += held[src][j]
        transfers.append(Transfer(src, dst, p, int(held[src][j])))
    rounds: list[list[Transfer]] = []
    loads: list[dict[int, int]] = []
    for t in transfers:
        for k, load in enumerate(loads):
            if all(load.get(r, 0) == 0 or load[r] + t.size <= round_bytes for r in (t.src, t.dst)):
                break
        else:
            rounds.append([])
            loads.append({})
            k = len(rounds) - 1
        rounds[k].append(t)
        loads[k][t.src] = loads[k].get(t.src, 0) + t.size
        loads[k][t.dst] = loads[k].get(t.dst, 0) + t.size
    return rounds


# ---------------------------------------------------------------- transport helpers
def gather_json(xg: Exchanger, obj) -> list:
    """Every rank's JSON value, over the exchanger's group (sizes, then padded bytes; never pickle)."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    dev = xg.status_device
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(xg.size)]
    xg._wait(xg.comm.all_gather(sizes, n), "the size exchange")
    width = max(int(s) for s in sizes)
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(dev)
    out = [torch.empty_like(mine) for _ in range(xg.size)]
    xg._wait(xg.comm.all_gather(out, mine), "the exchange of what each rank holds")
    return [json.loads(bytes(o[: int(s)].cpu().numpy())) for o, s in zip(out, sizes)]


def _pack_message(tier, pack: str, size: int) -> torch.Tensor:
    """A pack's bytes and one flag byte: 1 when this tier's copy is there and ``size`` long, else 0."""
    buf = torch.zeros(size + 1, dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    for path in tier.pack_paths(pack):
        try:
            with open(path, "rb") as f:
                n = f.readinto(mv[:size])
                extra = f.read(1)
        except OSError:
            continue
        if n == size and not extra:
            buf[size] = 1
        break
    return buf


def _received(tier, pack: str, buf: torch.Tensor) -> bool:
    """Keep a received pack in the tier when its sender had it; whether the tier has it now."""
    buf = buf.cpu()
    if int(buf[-1]) != 1:
        return False
    return tier.publish_pack(pack, buf[:-1].numpy())


# ---------------------------------------------------------------- reading: fill from peers
def peer_fill(xg: Exchanger, tier, refs, round_bytes: int, failure: BaseException | None = None) -> dict:
    """Fetch into this node's tier, from other nodes' tiers, the packs of ``refs`` it lacks (collective).

    Every rank of ``xg``'s group calls it at the same point of a load;
    ``failure`` (preparing this rank's reads failed) is reported to every
    rank first. Returns figures and ``packs``: the packs received, whose
    chunks the fetcher counts as read from a peer.
    """
    stats = {"packs_missing": 0, "received_packs": 0, "received_bytes": 0, "sent_packs": 0, "sent_bytes": 0,
             "rounds": 0, "packs": set()}
    xg.status(failure, "before the peer fill")
    missing: set[str] = set()
    local: dict[str, bool] = {}
    for r in refs:
        if r.pack in missing or local.get(r.pack):
            continue
        if r.pack not in local:
            local[r.pack] = tier.has_pack(r.pack)
            if local[r.pack]:
                continue
        if not tier.has_chunk(r.hash):
            missing.add(r.pack)
    stats["packs_missing"] = len(missing)
    said = gather_json(xg, {"node": tier.node_id(), "missing": sorted(missing)})
    node_ids = [s["node"] for s in said]
    union = sorted(set().union(*(s["missing"] for s in said)))
    if not union or len(set(node_ids)) < 2:
        return stats
    mine = torch.tensor([tier.pack_size(p) for p in union], dtype=torch.int64, device=xg.status_device)
    held = [torch.empty_like(mine) for _ in range(xg.size)]
    xg._wait(xg.comm.all_gather(held, mine), "the exchange of the packs each tier holds")
    held_lists = [h.cpu().tolist() for h in held]
    rounds = plan_peer_fill(node_ids, [s["missing"] for s in said], union, held_lists, round_bytes)
    stats["rounds"] = len(rounds)
    me = xg.rank
    dev = torch.device("cuda", torch.cuda.current_device()) if xg.nccl_style else torch.device("cpu")
    for k, transfers in enumerate(rounds):
        sends, recvs, got = [], [], []
        for tag, t in enumerate(transfers):
            if t.src == me:
                sends.append((_pack_message(tier, t.pack, t.size).to(dev), t.dst, _TAG_DATA + tag))
                stats["sent_packs"] += 1
                stats["sent_bytes"] += t.size
            elif t.dst == me:
                buf = torch.empty(t.size + 1, dtype=torch.uint8, device=dev)
                recvs.append((buf, t.src, _TAG_DATA + tag))
                got.append((t, buf))
        if not sends and not recvs:
            continue
        xg.wait_all(xg.post(sends, recvs), f"(peer fill, round {k + 1} of {len(rounds)})")
        for t, buf in got:
            if _received(tier, t.pack, buf):
                stats["received_packs"] += 1
                stats["received_bytes"] += t.size
                stats["packs"].add(t.pack)
    return stats


# ---------------------------------------------------------------- writing: replicas in the background
class Replicator:
    """One writer's replicas on one rank: sends its packs to its peer, keeps its sources' packs.

    Built at a save, on every rank of the writer's group at once (it gathers
    the tiers' ids over ``group``, a gloo group of its own). :meth:`submit`
    queues one save's packs (every rank queues every save, an empty one
    too); a background thread runs the transfers in save order.
    """

    def __init__(self, tier, group, where: str, timeout: float | None = None, comm=None):
        self.tier = tier
        self.where = where
        rank = dist.get_rank(group) if comm is None else comm.rank
        self.xg = Exchanger(group, rank, timeout, where, activity="replication", error=ReplicaError, comm=comm)
        ids = gather_json(self.xg, tier.node_id())
        peers = replica_peers(ids)
        self.nodes = len(set(ids))
        self.dst = peers.get(rank)
        self.srcs = sorted(r for r, p in peers.items() if p == rank)
        self.stats = {"sent_packs": 0, "sent_bytes": 0, "skipped_packs": 0, "received_packs": 0,
                      "received_bytes": 0, "steps": 0}
        self._jobs: list[tuple[int, dict]] = []
        self._cond = threading.Condition()
        self._busy = False
        self._error: BaseException | None = None
        self.broken: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def active(self) -> bool:
        """False with one node (nothing to copy to) or after a failure stopped the replicas."""
        return self.nodes > 1 and self.broken is None

    def submit(self, step: int, packs: dict[str, int]) -> None:
        """Queue one save's replicas (``packs``: id -> bytes this rank wrote; may be empty)."""
        if self._closed:
            raise ReplicaError(f"{self.where}: this replicator was closed; make a new one")
        if not self.active:
            return
        with self._cond:
            self._jobs.append((step, dict(packs)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckpt-replicas", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self) -> BaseException | None:
        """Wait until every queued save is copied; the failure that stopped the replicas, reported once."""
        with self._cond:
            while self._jobs or self._busy:
                self._cond.wait()
            err, self._error = self._error, None
        return err

    @property
    def closed(self) -> bool:
        return self._closed

    def retire(self) -> None:
        """Send what was queued, then stop the thread (a newer replicator took the group over);
        a failure stays to be reported by :meth:`flush`."""
        with self._cond:
            while self._jobs or self._busy:
                self._cond.wait()
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        err = self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if err is not None:
            log.warning("ckptstore: %s: replicas stopped: %s", self.where, err)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                step, packs = self._jobs.pop(0)
                self._busy = True
            try:
                if self.broken is None:
                    self._replicate(step, packs)
            except BaseException as e:  # noqa: BLE001 - kept and reported at flush; the store is the source of truth
                self.broken = e
                with self._cond:
                    self._error = e
                log.warning("ckptstore: %s: replicas stopped for this writer (the saves themselves are "
                            "unaffected): %s", self.where, e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _replicate(self, step: int, packs: dict[str, int]) -> None:
        """One save: headers, the peer's answer, then the packs it lacks, one at a time."""
        xg, dst, srcs = self.xg, self.dst, self.srcs
        stage = f"(replicas of step {step})"
        names = sorted(packs)
        header = json.dumps({"step": step, "packs": [[p, packs[p]] for p in names]}).encode()
        out_len = torch.tensor([len(header)], dtype=torch.int64)
        in_len = {s: torch.zeros(1, dtype=torch.int64) for s in srcs}
        xg.wait_all(xg.post([(out_len, dst, _TAG_LEN)], [(t, s, _TAG_LEN) for s, t in in_len.items()]), stage)
        out_hdr = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        in_hdr = {s: torch.empty(int(t), dtype=torch.uint8) for s, t in in_len.items()}
        xg.wait_all(xg.post([(out_hdr, dst, _TAG_HEADER)], [(t, s, _TAG_HEADER) for s, t in in_hdr.items()]), stage)
        offers: dict[int, list] = {}
        for s, t in in_hdr.items():
            said = json.loads(bytes(t.numpy()))
            if said.get("step") != step:
                raise ReplicaError(f"{self.where}: rank {xg.rank} expected the replicas of step {step} from "
                                   f"rank {s}, which sent step {said.get('step')}: the ranks' saves went out of step")
            offers[s] = said["packs"]
        # The answer: one byte per offered pack, 1 = send it (this tier lacks it); a leading byte
        # so that no message is empty.
        answers = {s: torch.tensor([1] + [0 if self.tier.has_pack(p) else 1 for p, _ in offers[s]], dtype=torch.uint8)
                   for s in srcs}
        wanted = torch.zeros(1 + len(names), dtype=torch.uint8)
        xg.wait_all(xg.post([(t, s, _TAG_WANTED) for s, t in answers.items()], [(wanted, dst, _TAG_WANTED)]), stage)
        outgoing = [p for p, w in zip(names, wanted[1:].tolist()) if w]
        self.stats["skipped_packs"] += len(names) - len(outgoing)
        incoming = {s: [(p, n) for (p, n), w in zip(offers[s], answers[s][1:].tolist()) if w] for s in srcs}
        rounds = max([len(outgoing)] + [len(v) for v in incoming.values()])
        for k in range(rounds):
            sends, recvs, got = [], [], []
            if k < len(outgoing):
                p = outgoing[k]
                sends.append((_pack_message(self.tier, p, packs[p]), dst, _TAG_DATA))
            for s, lst in incoming.items():
                if k < len(lst):
                    p, n = lst[k]
                    buf = torch.empty(int(n) + 1, dtype=torch.uint8)
                    recvs.append((buf, s, _TAG_DATA))
                    got.append((p, buf))
            xg.wait_all(xg.post(sends, recvs), f"(replicas of step {step}, pack {k + 1} of {rounds})")
            for t, _, _ in sends:
                if int(t[-1]) == 1:
                    self.stats["sent_packs"] += 1
                    self.stats["sent_bytes"] += t.numel() - 1
            for p, buf in got:
                if _received(self.tier, p, buf):
                    self.stats["received_packs"] += 1
                    self.stats["received_bytes"] += buf.numel() - 1
        self.stats["steps"] += 1


#: The replicas' gloo groups of this process, by (members, timeout): one per set of ranks, reused
#: by every writer (torchtitan makes a writer a save: a group each made a new gloo group a save,
#: and groups accumulated over a run; issue 44). Retired only when a failure was reported on
#: every rank (:func:`retire_replica_group`, from the writer's collective ``flush``).
_GROUPS: dict[tuple, object] = {}
#: The replicator last built over each pooled group: a new writer's waits for it first, so that
#: two replicators never send over one group at once.
_LAST: dict[int, "Replicator"] = {}
_GROUPS_LOCK = threading.Lock()


def replica_group(group, timeout=None):
    """The gloo group of ``group``'s members for the replicas' background transfers.

    Made once per set of members and timeout in a process (collective on the members the first
    time: every rank of a save asks at the same save, so every rank makes it or finds it), then
    reused by every later writer on the same ranks.
    """
    import datetime

    ranks = tuple(dist.get_process_group_ranks(group))
    key = (ranks, timeout)
    with _GROUPS_LOCK:
        got = _GROUPS.get(key)
    if got is not None:
        return got
    kw = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    made = dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=True, **kw)
    with _GROUPS_LOCK:
        _GROUPS[key] = made
    return made


def replicator_for(tier, group, where: str, timeout: float | None = None) -> "Replicator":
    """A new :class:`Replicator` over a pooled ``group``, once the previous one over it has sent
    everything it was given and stopped (every rank waits for its own: their transfers pair up)."""
    with _GROUPS_LOCK:
        prev = _LAST.get(id(group))
    if prev is not None:
        prev.retire()  # its thread ends: one replicator thread per group, however many writers
    rep = Replicator(tier, group, where, timeout)
    with _GROUPS_LOCK:
        _LAST[id(group)] = rep
    return rep


def retire_replica_group(group) -> None:
    """Stop reusing ``group`` (a failure on it was reported on every rank): the next writer makes a new one."""
    with _GROUPS_LOCK:
        for key, g in list(_GROUPS.items()):
            if g is group:
                del _GROUPS[key]
        _LAST.pop(id(group), None)


def pooled_groups() -> int:
    """How many replica groups this process holds (for soak checks)."""
    with _GROUPS_LOCK:
        return len(_GROUPS)
