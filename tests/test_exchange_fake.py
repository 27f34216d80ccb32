"""The exchange's protocol (``Exchanger.run``, its status collectives) and the peer-tier protocols
(``replicas.peer_fill``, ``Replicator``) on a fake process group: ranks as threads (tests/fake_comm.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from ckptstore.dcp.exchange import Exchanger, RankReadError, Round
from ckptstore.dcp.replicas import Replicator, peer_fill
from ckptstore.tier.cache import Tier

from .fake_comm import run_ranks

N = 3


def _exchanger(r, comm, timeout=30.0):
    return Exchanger(None, r, timeout, "fake://repo: step 1", comm=comm)


def test_run_moves_every_round_s_messages_and_gathers_then_copies_them_out():
    rounds = 3

    def body(r, comm):
        xg = _exchanger(r, comm)
        got = [torch.zeros(4) for _ in range(rounds)]
        gathered = torch.zeros(N * 2)
        out = torch.empty(N * 2)  # the all-gather's output

        def prepare(k: int) -> Round:
            if k == rounds - 1:  # the last round: one all-gather of every rank's share
                share = torch.full((2,), float(10 * r + k))
                return Round([], [], [(out, [gathered])], gather=(share, out), keep=[share])
            send = torch.full((4,), float(100 * r + k))
            recv = torch.empty(4)
            return Round([(send, (r + 1) % N, k)], [(recv, (r - 1) % N, k)], [(recv, [got[k]])], keep=[send])

        xg.run(rounds, prepare)
        return got, gathered

    res = run_ranks(N, body)
    for r, (got, gathered) in enumerate(res):
        src = (r - 1) % N
        for k in range(rounds - 1):
            assert torch.equal(got[k], torch.full((4,), float(100 * src + k))), (r, k)
        assert torch.equal(gathered, torch.tensor([float(10 * q + rounds - 1) for q in range(N) for _ in range(2)]))


def test_a_failure_on_one_rank_is_raised_on_every_rank_naming_it_before_any_transfer_of_that_round():
    def body(r, comm):
        xg = _exchanger(r, comm)

        def prepare(k: int) -> Round:
            if k == 1 and r == 1:
                raise OSError("injected: the store said no")
            t = torch.full((2,), float(r))
            return Round([(t, (r + 1) % N, k)], [(torch.empty(2), (r - 1) % N, k)], [])

        xg.run(3, prepare)

    res = run_ranks(N, body)
    for r, e in enumerate(res):
        assert isinstance(e, RankReadError), (r, e)
        assert "failed on rank(s) [1] in round 2 of 3" in str(e) and "injected: the store said no" in str(e)


def test_a_rank_that_never_answers_is_a_bounded_wait_naming_what_was_waited_for():
    def body(r, comm):
        if r == 2:
            return None  # gone: never takes part
        xg = _exchanger(r, comm, timeout=0.3)
        xg.status(None, "before reading")

    res = run_ranks(N, body)
    for r in (0, 1):
        assert isinstance(res[r], RankReadError) and "the status exchange before reading did not complete" in str(res[r])


def _tier(tmp_path, name: str) -> Tier:
    t = Tier(tmp_path / name, "file:///fake/repo")
    t.prepare()
    return t


def test_peer_fill_sends_each_missing_pack_once_per_node_from_another_node_s_tier(tmp_path):
    # nodes: ranks 0, 1 share tier A (wiped); rank 2 has tier B holding both packs
    a, b = _tier(tmp_path, "A"), _tier(tmp_path, "B")
    packs = {"0" * 31 + "1": os.urandom(3000), "0" * 31 + "2": os.urandom(5000)}
    for pid, data in packs.items():
        assert b.publish_pack(pid, data)
    refs = [SimpleNamespace(pack=pid, hash=f"h{i}") for i, pid in enumerate(packs)]
    tiers = [a, a, b]
    want = [refs, refs[:1], []]  # ranks 0 and 1 both need the first pack: it travels once

    def body(r, comm):
        xg = Exchanger(None, r, 30.0, "fake://repo: step 1", activity="peer fill", comm=comm)
        return peer_fill(xg, tiers[r], want[r], round_bytes=1 << 20)

    res = run_ranks(N, body)
    assert all(not isinstance(x, BaseException) for x in res), res
    assert res[2]["sent_packs"] == 2 and res[0]["received_packs"] + res[1]["received_packs"] == 2
    for pid, data in packs.items():
        with open(a.pack_path(pid), "rb") as f:
            assert f.read() == data
    # nothing missing any more: one all-gather, no transfer
    again = run_ranks(N, lambda r, comm: peer_fill(Exchanger(None, r, 30.0, "x", comm=comm), tiers[r], want[r], 1 << 20))
    assert [x["received_packs"] for x in again] == [0, 0, 0] and again[0]["rounds"] == 0


def test_replicator_copies_each_save_s_packs_to_the_next_node_and_skips_what_it_holds(tmp_path):
    tiers = [_tier(tmp_path, "A"), _tier(tmp_path, "B")]
    mine = {0: {"a" * 32: os.urandom(2000)}, 1: {"b" * 32: os.urandom(1000), "c" * 32: os.urandom(500)}}
    for r, packs in mine.items():
        for pid, data in packs.items():
            tiers[r].publish_pack(pid, data)
    tiers[0].publish_pack("c" * 32, mine[1]["c" * 32])  # node A holds one of B's packs already

    def body(r, comm):
        rep = Replicator(tiers[r], None, "fake://repo", timeout=30.0, comm=comm)
        rep.submit(1, {pid: len(d) for pid, d in mine[r].items()})
        rep.submit(2, {})  # a save that wrote nothing on this rank
        err = rep.flush()
        rep.close()
        return err, dict(rep.stats)

    res = run_ranks(2, body)
    for err, _ in res:
        assert err is None
    assert res[0][1]["sent_packs"] == 1 and res[1][1]["sent_packs"] == 1 and res[1][1]["skipped_packs"] == 1
    assert res[0][1]["steps"] == res[1][1]["steps"] == 2
    assert tiers[1].has_pack("a" * 32) and tiers[0].has_pack("b" * 32)


def test_replicas_out_of_step_stop_with_an_error_not_a_hang(tmp_path):
    tiers = [_tier(tmp_path, "A"), _tier(tmp_path, "B")]

    def body(r, comm):
        rep = Replicator(tiers[r], None, "fake://repo", timeout=5.0, comm=comm)
        rep.submit(1 if r == 0 else 2, {})  # the ranks disagree on which save this is
        return rep.flush()

    res = run_ranks(2, body)
    assert any(e is not None and "went out of step" in str(e) for e in res), res
