"""Replicated state is read once per job: CkptStoreReader's exchange and CkptStoreWriter's balance.

Ranks are processes spawned with torch.multiprocessing, talking gloo over
127.0.0.1 (every collective bounded by a timeout); storage is the local
backend behind a CountingStore per rank.
"""

from __future__ import annotations

import json
import socket

import torch.multiprocessing as mp

import ckptstore

from . import dcp_workers as W


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(out_dir, world):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


def test_fully_replicated_state_is_fetched_once_and_balanced(tmp_path):
    world = 4
    url = str(tmp_path / "repo")
    mp.spawn(W.replicated_worker, args=(world, _port(), url, str(tmp_path)), nprocs=world, join=True)
    ranks = _ranks(tmp_path, world)
    with ckptstore.open(url) as repo:
        man = repo.manifest(1)
        stored = sum(t.stored_bytes for t in man.tensors.values())
        logical = man.stats["logical_bytes"]
    assert logical > 250 << 20
    for r in ranks:
        assert r["exchange=False"]["bad"] == [] and r["exchange=True"]["bad"] == []
    off = [r["exchange=False"]["packs"] for r in ranks]
    on = [r["exchange=True"]["packs"] for r in ranks]
    # today: every rank fetches every byte
    assert all(x >= stored for x in off), (off, stored)
    # exchange: about one copy in total, spread evenly
    assert sum(on) <= 1.1 * stored, (on, stored)
    mean = sum(on) / world
    assert max(on) <= 1.2 * mean, on
    # each rank received what it did not read
    for r in ranks:
        st = r["exchange=True"]["stats"]
        assert st["exchange"] and st["received_bytes"] > 0 and st["sent_bytes"] > 0
        assert st["owned_bytes"] + st["received_bytes"] == logical
    saved = [r["save"]["logical_bytes"] for r in ranks]
    assert sum(saved) == logical  # DCP's dedup wrote every tensor once
    print("save", saved, "packs on", on, "off", off)


def test_mixed_ddp_fsdp_saves_balanced_and_loads_bit_exact_with_exchange(tmp_path):
    world = 4
    url = str(tmp_path / "repo")
    mp.spawn(W.mixed_worker, args=(world, _port(), url, str(tmp_path)), nprocs=world, join=True)
    ranks = _ranks(tmp_path, world)  # each worker compared every loaded tensor bit for bit
    saved = [r["save"]["logical_bytes"] for r in ranks]
    with ckptstore.open(url) as repo:
        man = repo.manifest(1)
        assert [man.stats["ranks"][str(i)]["logical_bytes"] for i in range(world)] == saved
        assert sum(saved) == man.stats["logical_bytes"]
    assert max(saved) <= 1.2 * sum(saved) / world, saved
    on = [r["exchange=True"] for r in ranks]
    off = [r["exchange=False"] for r in ranks]
    assert all(not r["stats"]["exchange"] for r in off)
    assert all(r["stats"]["exchange"] and r["stats"]["rounds"] > 1 for r in on)
    assert sum(r["packs"] for r in on) < 0.5 * sum(r["packs"] for r in off)
    print("save", saved, "packs on", [r["packs"] for r in on], "off", [r["packs"] for r in off])


def test_failed_rank_fails_every_rank_naming_it_and_subgroups(tmp_path):
    world = 3
    url = str(tmp_path / "repo")
    mp.spawn(W.exchange_failure_worker, args=(world, _port(), url, str(tmp_path)), nprocs=world, join=True)
    ranks = _ranks(tmp_path, world)
    for r in ranks:
        err = r["pack_reads_fail"]
        assert err is not None and "rank(s) [1]" in err and "injected failure" in err and "round 2 of 3" in err, err
        err = r["bad_destination"]
        assert err is not None and "rank(s) [2]" in err and "'t5'" in err and "int32" in err, err
        assert r["clean"] is None and r["clean_equal"] and r["clean_stats"]["exchange"]
    for r in ranks[1:]:
        assert r["subgroup_passed"] is None and r["subgroup_passed_equal"]
        assert r["subgroup_passed_stats"]["exchange"] and r["subgroup_passed_stats"]["received_bytes"] > 0
        assert r["subgroup_default"] is None and r["subgroup_default_equal"]
        assert not r["subgroup_default_stats"]["exchange"]
    assert ranks[1]["subgroup_default_warnings"] and "process_group" in ranks[1]["subgroup_default_warnings"][0]
