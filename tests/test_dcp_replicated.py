"""Replicated state is read once per job: CkptStoreReader's exchange and CkptStoreWriter's balance.

Ranks are processes spawned with torch.multiprocessing, talking gloo over
127.0.0.1 (every collective bounded by a timeout); storage is the local
backend behind a CountingStore per rank.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

import ckptstore
from ckptstore.dcp import balance_save_plans
from ckptstore.dcp.exchange import ReadRegion, plan_exchange
from ckptstore.testing import free_port

from . import dcp_workers as W
from .helpers import spawn

pytestmark = pytest.mark.slow  # spawned gloo ranks

MiB = 1 << 20


def _ranks(out_dir, world):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


def test_fully_replicated_state_is_fetched_once_and_balanced(tmp_path):
    world = 4
    url = str(tmp_path / "repo")
    spawn(W.replicated_worker, args=(world, free_port(), url, str(tmp_path)), nprocs=world)
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
    # the save: DCP's dedup wrote every tensor once; the writer cut the 96 MiB embedding
    # into parts so the writes are balanced too
    assert sum(saved) == logical
    assert max(saved) <= 1.2 * sum(saved) / world, saved
    assert len(man.tensors["emb"].shards) > 1 and len(man.tensors["layer0.w"].shards) == 1
    assert [r["save2"]["new_bytes"] for r in ranks] == [0] * world  # the parts dedup like whole tensors
    print("save", saved, "packs on", on, "off", off)


def test_mixed_ddp_fsdp_saves_balanced_and_loads_bit_exact_with_exchange(tmp_path):
    world = 4
    url = str(tmp_path / "repo")
    spawn(W.mixed_worker, args=(world, free_port(), url, str(tmp_path)), nprocs=world)
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
    # on 4 ranks everything goes point to point (the HSDP shards between pairs of ranks too)
    assert all(r["stats"]["all_gathers"] == 0 and r["stats"]["messages"] > 0 for r in on)
    # about half: boxes close together in a pack are read in one range (Checkpoint.read_shards), which
    # also reads the gaps between them (at most coalesce_gap each): 0.48 read box by box, 0.51 batched
    assert sum(r["packs"] for r in on) < 0.55 * sum(r["packs"] for r in off)
    print("save", saved, "packs on", [r["packs"] for r in on], "off", [r["packs"] for r in off])


def test_failed_rank_fails_every_rank_naming_it_and_subgroups(tmp_path):
    world = 3
    url = str(tmp_path / "repo")
    spawn(W.exchange_failure_worker, args=(world, free_port(), url, str(tmp_path)), nprocs=world)
    ranks = _ranks(tmp_path, world)
    for r in ranks:
        err = r["pack_reads_fail"]
        assert err is not None and "rank(s) [1]" in err and "injected failure" in err and "round 2 of 4" in err, err
        err = r["bad_destination"]
        assert err is not None and "rank(s) [2]" in err and "'t5'" in err and "int32" in err, err
        assert r["clean"] is None and r["clean_equal"] and r["clean_stats"]["exchange"]
        assert r["clean_stats"]["all_gathers"] == 4 and r["clean_stats"]["owned_bytes"] == 4 * 256 * 1024
    for r in ranks[1:]:
        assert r["subgroup_passed"] is None and r["subgroup_passed_equal"]
        assert r["subgroup_passed_stats"]["exchange"] and r["subgroup_passed_stats"]["received_bytes"] > 0
        assert r["subgroup_default"] is None and r["subgroup_default_equal"]
        assert not r["subgroup_default_stats"]["exchange"]
    assert ranks[1]["subgroup_default_warnings"] and "process_group" in ranks[1]["subgroup_default_warnings"][0]


# ------------------------------------------------------------ the plans, without processes
def _check_exchange(wants, plans, round_bytes):
    """Every region wanted twice is cut into pieces covering it once, each read by one
    wanting rank and delivered to every other; the ranks' views of a message agree."""
    n = len(wants)
    wanting: dict[tuple, list[int]] = {}
    regions = {}
    for r, regs in enumerate(wants):
        for g in regs:
            wanting.setdefault(g.key, [])
            if r not in wanting[g.key]:
                wanting[g.key].append(r)
            regions[g.key] = g
    replicated = {k for k, rs in wanting.items() if len(rs) > 1 and regions[k].nbytes}
    if not replicated:
        assert plans == [None] * n
        return
    assert all(p is not None for p in plans) and len({p.rounds for p in plans}) == 1
    by_id: dict[int, object] = {}
    got: dict[int, set] = {r: set() for r in range(n)}
    for r, p in enumerate(plans):
        assert [m.id for m in p.messages] == sorted(m.id for m in p.messages)
        for m in p.messages:
            assert r == m.src or r in wanting[m.pieces[0].key]
            if r == m.src:
                by_id[m.id] = m
            for piece in m.pieces:
                got[r].add((piece.key, piece.lo, piece.hi))
    pieces: dict[tuple, list] = {}
    per_round: dict[tuple[int, int], int] = {}
    for m in by_id.values():
        ranks = sorted({m.src, *m.dsts})
        end = 0
        for piece in sorted(m.pieces, key=lambda q: q.offset):
            assert sorted(wanting[piece.key]) == ranks, "a message goes to exactly the ranks wanting its pieces"
            assert piece.offset >= end and piece.offset % 64 == 0
            end = piece.offset + piece.nbytes
            assert piece.nbytes == (piece.hi - piece.lo) * regions[piece.key].row_bytes
            pieces.setdefault(piece.key, []).append((piece.lo, piece.hi))
        assert end <= m.nbytes
        for q in ranks:
            per_round[(m.round, q)] = per_round.get((m.round, q), 0) + m.nbytes
        for q in m.dsts:  # the receivers' copy of the message is the sender's
            light = next(x for x in plans[q].messages if x.id == m.id)
            assert (light.round, light.src, light.pieces) == (m.round, m.src, m.pieces)
    for g in plans[0].gathers:  # every rank has the same all-gathers
        assert all(p.gathers == plans[0].gathers for p in plans)
        assert len(g.parts) == n
        for q, ps in enumerate(g.parts):
            end = 0
            for piece in ps:
                assert sorted(wanting[piece.key]) == list(range(n)), "all-gathers carry what every rank wants"
                assert piece.offset >= end and piece.offset % 64 == 0
                end = piece.offset + piece.nbytes
                pieces.setdefault(piece.key, []).append((piece.lo, piece.hi))
                for r in range(n):
                    got[r].add((piece.key, piece.lo, piece.hi))
            assert end <= g.nbytes
            assert end <= max(64, round_bytes // n) or len(ps) == 1, (end, round_bytes, n)
        assert g.nbytes == max(p.offset + -(-p.nbytes // 64) * 64 for ps in g.parts for p in ps)
    rounds = {g.round for g in plans[0].gathers}
    assert rounds == set(range(len(rounds))) and all(m.round >= len(rounds) for m in by_id.values())
    assert set(pieces) == replicated
    for key, spans in pieces.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == regions[key].rows
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), "pieces neither overlap nor leave gaps"
        for r in wanting[key]:
            assert {(key, lo, hi) for lo, hi in spans} <= got[r]
    for (rnd, q), total in per_round.items():
        mine = [m for m in by_id.values() if m.round == rnd and q in (m.src, *m.dsts)]
        if all(len(m.dsts) == n - 1 for m in mine):
            # every rank's share of a round: at most round_bytes / n each, unless one piece is larger
            biggest = max(p.nbytes for m in mine for p in m.pieces)
            assert total <= n * max(round_bytes // n, biggest), (rnd, q, total)
        else:
            assert total <= round_bytes or len(mine) == 1, (rnd, q, total)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 6),
    specs=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 64), st.integers(0, 63)), min_size=1, max_size=25),
    round_kib=st.integers(16, 2048),
    gather=st.booleans(),
)
def test_plan_exchange_pieces_cover_every_replicated_region_once(n, specs, round_kib, gather):
    wants = [[] for _ in range(n)]
    for i, (rows, row_kib, mask) in enumerate(specs):
        g = ReadRegion(("t%d" % i, (0, 0), (0, 0), (rows, 1)), rows, row_kib * 1024, align=1 + i % 3)
        ranks = [r for r in range(n) if mask >> r & 1] or [i % n]
        for r in ranks:
            wants[r].append(g)
    round_bytes = round_kib * 1024
    plans = plan_exchange(wants, round_bytes=round_bytes, min_piece=1 * MiB, gather_min_ranks=2 if gather else 99)
    _check_exchange(wants, plans, round_bytes)
    if plans[0] is not None and not gather:
        assert plans[0].gathers == ()


def test_plan_exchange_balances_bytes_and_cuts_at_chunk_boundaries():
    # fully replicated on 4 ranks; one region is 40% of the bytes
    n = 4
    big = ReadRegion(("emb", (0, 0), (0, 0), (40960, 1024)), 40960, 4096, align=256)  # 160 MiB; 1 MiB chunks
    rest = [ReadRegion((f"w{i}", (0, 0), (0, 0), (1024, 1024)), 1024, 4096, align=256) for i in range(60)]
    small = [ReadRegion((f"b{i}", (0,), (0,), (1024,)), 1, 4096) for i in range(50)]
    wants = [[big, *rest, *small] for _ in range(n)]
    total = big.nbytes + 60 * 4 * MiB + 50 * 4096
    # point to point (few ranks)
    plans = plan_exchange(wants)
    _check_exchange(wants, plans, 512 * MiB)
    assert plans[0].gathers == ()
    owned = [sum(p.nbytes for m in plans[r].messages if m.src == r for p in m.pieces) for r in range(n)]
    assert sum(owned) == total and max(owned) <= 1.2 * sum(owned) / n, owned
    cuts = {p.lo for m in plans[0].messages for p in m.pieces if p.key[0] == "emb"} - {0}
    assert cuts and all(c % 256 == 0 for c in cuts), cuts  # every cut is a chunk boundary
    assert len({m.id for m in plans[0].messages}) < 60 + 50  # small pieces travel packed
    # all-gathers (many ranks): each rank's share of a round at most 512 MiB / 4
    plans = plan_exchange(wants, gather_min_ranks=4)
    _check_exchange(wants, plans, 512 * MiB)
    assert all(p.messages == () for p in plans) and plans[0].gathers
    owned = [sum(p.nbytes for g in plans[0].gathers for p in g.parts[r]) for r in range(n)]
    assert sum(owned) == total and max(owned) <= 1.2 * sum(owned) / n, owned
    cuts = {p.lo for g in plans[0].gathers for ps in g.parts for p in ps if p.key[0] == "emb"} - {0}
    assert cuts and all(c % 256 == 0 for c in cuts), cuts
    assert len(plans[0].gathers) <= 2 * -(-total // (512 * MiB))  # the rounds are full

    # replicated within pairs (HSDP-style replica groups): point to point, small pieces packed
    pairs = [[] for _ in range(n)]
    for i in range(40):
        g = ReadRegion((f"p{i}", (0,), (0,), (1,)), 1, 64 * 1024 if i % 2 else 2 * MiB)
        for r in ((0, 2), (1, 3))[i % 2]:
            pairs[r].append(g)
    plans = plan_exchange(pairs, round_bytes=8 * MiB)
    _check_exchange(pairs, plans, 8 * MiB)
    assert plans[0].gathers == () and plans[0].rounds > 1
    assert len({m.id for p in plans for m in p.messages}) < 40  # the 64 KiB ones travel packed

    # one rank's own (unshared) bytes count: the others take the replicated ones
    wants = [[ReadRegion(("mine", (0,), (0,), (1,)), 100, 1 * MiB)], [], []]
    shared = [ReadRegion((f"s{i}", (0,), (0,), (1,)), 1, 1 * MiB) for i in range(100)]
    for w in wants:
        w.extend(shared)
    plans = plan_exchange(wants)
    owned = [sum(p.nbytes for m in plans[r].messages if m.src == r for p in m.pieces) for r in range(3)]
    assert owned[0] == 0 and owned[1] == owned[2] == 50 * MiB


def test_plan_exchange_is_off_without_replicated_regions():
    a = ReadRegion(("a", (0,), (0,), (8,)), 8, 4)
    b = ReadRegion(("b", (0,), (0,), (8,)), 8, 4)
    empty = ReadRegion(("e", (0,), (0,), (0,)), 0, 4)
    assert plan_exchange([[a, empty], [b, empty]]) == [None, None]


def _item(fqn, offsets, sizes, shape):
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size(shape),
        ),
    )


def _held(plan):
    from ckptstore.dcp import CkptStoreWriter

    w = CkptStoreWriter("memory://unused", step=1)
    return w.prepare_local_plan(plan)


def _bytes(plans):
    """Bytes each plan writes (its chunks' bytes)."""
    return [sum(math.prod(i.tensor_data.chunk.sizes) * 4 for i in p.items) for p in plans]


def _ddp_fsdp_plans(n):
    """Each of ``n`` ranks holds its FSDP shards (model first), then every replicated DDP tensor."""
    local = []
    for r in range(n):
        items = [_item(f"fsdp.{layer}.w", (256 // n * r, 0), (256 // n, 512), (256, 512)) for layer in range(8)]
        for layer in range(6):
            items.append(_item(f"ddp.{layer}.w", (0, 0), (256, 256), (256, 256)))  # 256 KiB replicated
            items.append(_item(f"ddp.{layer}.b", (0,), (256,), (256,)))
        local.append(_held(SavePlan(items)))
    return local


def test_balance_save_plans_spreads_replicated_writes_by_bytes():
    for n in (2, 4):
        local = _ddp_fsdp_plans(n)
        dcp_plans = dedup_save_plans(local)
        dcp_sizes = _bytes(dcp_plans)
        ours, parts = balance_save_plans(dcp_plans)
        assert parts == [{}] * n  # nothing large enough to cut
        sizes = _bytes(ours)
        print(n, "ranks: DCP's dedup", dcp_sizes, "balanced", sizes)
        if n == 2:
            # DCP's dedup visits rank 0's items first and counts the other ranks' shards
            # only after it placed the replicated items: rank 1 writes 1.27x the mean
            # (a finding on torch 2.13; if DCP changes, this assert goes)
            assert max(dcp_sizes) > 1.2 * sum(dcp_sizes) / n
        assert max(sizes) <= 1.2 * sum(sizes) / n and max(sizes) <= max(dcp_sizes), sizes
        assert sum(sizes) == sum(dcp_sizes)
        # the same items, each once; the shards stay on their rank
        assert sorted((i.index.fqn, tuple(i.index.offset)) for p in ours for i in p.items) == sorted(
            (i.index.fqn, tuple(i.index.offset)) for p in dcp_plans for i in p.items)
        for r, p in enumerate(ours):
            assert all(i.index.offset[0] == 256 // n * r for i in p.items if i.index.fqn.startswith("fsdp"))
    # plans without the writer's record (another writer, DCP's plan caching) are left alone
    bare = dedup_save_plans([SavePlan(p.items) for p in local])
    assert balance_save_plans(bare) == (bare, [{}] * n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_exchange_into_cuda_destinations(tmp_path):
    world = 2
    url = str(tmp_path / "repo")
    spawn(W.cuda_exchange_worker, args=(world, free_port(), url, str(tmp_path)), nprocs=world)
    for r in _ranks(tmp_path, world):
        assert r["bad"] == [] and r["stats"]["exchange"] and r["stats"]["received_bytes"] > 0, r
