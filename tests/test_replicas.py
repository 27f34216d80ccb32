"""Peer replicas (issue 26 item 5): each node's packs copied into another node's tier; a wiped node
restores from its peer's copy, every chunk hash-checked, and from the object store only what no tier holds."""

from __future__ import annotations

import json

import pytest

from ckptstore.dcp.replicas import Transfer, nodes_of, plan_peer_fill, replica_peers
from ckptstore.testing import free_port

from .helpers import spawn


def test_nodes_are_told_apart_by_their_tiers_and_each_keeps_the_next_one_s_replicas():
    ids = ["a", "a", "b", "b", "c"]
    assert nodes_of(ids) == [[0, 1], [2, 3], [4]]
    assert replica_peers(ids) == {0: 2, 1: 3, 2: 4, 3: 4, 4: 0}
    assert replica_peers(["a", "a"]) == {}  # one node: nothing to copy to


def test_a_peer_fill_sends_each_missing_pack_once_per_node_from_the_least_loaded_holder():
    ids = ["A", "A", "B", "B"]
    union = ["p1", "p2", "p3"]
    # node A (ranks 0, 1) was wiped: both ranks need p1, rank 1 also p2; p3 is on no tier
    missing = [["p1"], ["p1", "p2"], [], []]
    held = [[0, 0, 0], [0, 0, 0], [100, 0, 0], [100, 50, 0]]
    rounds = plan_peer_fill(ids, missing, union, held, round_bytes=1 << 20)
    flat = [t for r in rounds for t in r]
    assert sorted(flat, key=lambda t: t.pack) == [Transfer(2, 0, "p1", 100), Transfer(3, 1, "p2", 50)]
    # a node holding the pack itself takes nothing; rounds hold at most round_bytes a rank
    assert plan_peer_fill(ids, [["p1"], [], [], []], union, [[0, 0, 0], [100, 0, 0], [100, 0, 0], [0, 0, 0]], 1) == []
    rounds = plan_peer_fill(["A", "B"], [["p1", "p2"], []], union, [[0, 0, 0], [100, 50, 0]], round_bytes=120)
    assert [[t.pack for t in r] for r in rounds] == [["p1"], ["p2"]]


def _run(tmp_path, replicas, write_back=False, damage="wipe"):
    from . import replica_workers as W

    url = str(tmp_path / "repo")
    spawn(W.run, args=(2, free_port(), url, str(tmp_path), replicas, write_back, damage), nprocs=2)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("write_back", [False, True], ids=["write-through", "write-back"])
def test_a_wiped_node_restores_from_its_peer_s_replica_with_no_pack_bytes_from_the_store(tmp_path, write_back):
    res = _run(tmp_path, replicas=1, write_back=write_back)
    assert res[0]["wrote"] and res[1]["wrote"]
    for r in (0, 1):
        other = res[1 - r]
        # each node's tier holds its own packs and its peer's after the flush
        assert set(other["wrote"]) <= set(res[r]["packs_after_flush"]), f"rank {r} lacks its peer's packs"
        assert res[r]["replica_stats"]["sent_packs"] == len(res[r]["wrote"])
        assert res[r]["equal"]
        assert res[r]["read"]["store"] == 0, f"rank {r} read pack bytes from the object store: {res[r]['read']}"
    assert res[0]["read"]["peer"] > 0 and res[0]["peer"]["received_packs"] >= 1
    assert res[1]["read"]["peer"] == 0 and res[1]["peer"]["sent_packs"] == res[0]["peer"]["received_packs"]


@pytest.mark.slow
def test_without_replicas_a_wiped_node_reads_its_share_from_the_store(tmp_path):
    res = _run(tmp_path, replicas=0)
    assert res[0]["replica_stats"] is None
    assert not set(res[0]["wrote"]) & set(res[1]["packs_after_flush"])  # no copies anywhere
    assert res[0]["equal"] and res[1]["equal"]
    assert res[0]["read"]["store"] > 0 and res[0]["read"]["peer"] == 0
    # the store serves what the wiped node wrote, at most (rank 1 reads the part of the
    # replicated tensor rank 0 wrote, if the exchange gives it that part), nothing twice
    assert res[0]["read"]["store"] + res[1]["read"]["store"] <= res[0]["wrote_bytes"]


@pytest.mark.slow
def test_a_damaged_replica_is_caught_by_the_hash_check_and_only_those_chunks_come_from_the_store(tmp_path):
    clean = _run(tmp_path / "clean", replicas=1)
    res = _run(tmp_path / "damaged", replicas=1, damage="wipe-damaged-copy")
    assert res[0]["equal"] and res[1]["equal"], "wrong data from a damaged peer copy"
    got = res[0]["read"]
    total = clean[0]["read"]["peer"] + clean[0]["read"]["tier"]
    assert 0 < got["store"] < total // 4, got  # one chunk a damaged pack, not the share
    assert got["peer"] > 0


@pytest.mark.slow
def test_failed_replicas_leave_the_save_committed_and_flush_raises_on_every_rank_naming_them(tmp_path):
    from . import replica_workers as W

    url = str(tmp_path / "repo")
    spawn(W.run_broken, args=(2, free_port(), url, str(tmp_path)), nprocs=2)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert r["steps"] == [1], "a replica failure must not fail or undo the save"
        assert r["flush"].startswith("CkptStoreError") and "injected: the peer link is down" in r["flush"], r
        assert r["later"] == "returned"
    assert "rank(s) [0, 1]" in res[0]["flush"]  # rank 0 timed out waiting for rank 1


def test_replicas_need_a_tier_and_take_0_or_1(tmp_path):
    from ckptstore.dcp import CkptStoreWriter

    with pytest.raises(ValueError, match="needs cache_dir"):
        CkptStoreWriter(str(tmp_path / "r"), step=1, replicas=1)
    with pytest.raises(ValueError, match="replicas must be 0 or 1"):
        CkptStoreWriter(str(tmp_path / "r"), step=1, cache_dir=tmp_path / "t", replicas=2)


@pytest.mark.slow
def test_replicas_with_async_save_beside_the_training_loop_s_collectives(tmp_path):
    from . import replica_workers as W

    spawn(W.run_async, args=(2, free_port(), str(tmp_path / "repo"), str(tmp_path)), nprocs=2)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert r["steps"] == [1, 2]
        # step 2 rewrites only "shared" (each rank's own tensor dedups): a rank may send nothing for it
        assert r["stats"]["steps"] == 2 and r["stats"]["sent_packs"] >= 1 and r["stats"]["received_packs"] >= 1
    assert set(res[0]["packs"]) == set(res[1]["packs"]), "each node holds its own packs and its peer's"
