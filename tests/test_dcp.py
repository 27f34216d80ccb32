"""torch.distributed.checkpoint backend: multi-rank saves, resharding, dedup, failures.

Ranks are processes spawned with torch.multiprocessing, talking gloo over
127.0.0.1; storage is the local backend and moto S3.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptstore
from ckptstore.dcp import CkptStoreReader, CkptStoreWriter
from ckptstore.pipeline import planner as _plan
from ckptstore.repo.repository import Repository
from ckptstore.storage import open_store
from ckptstore.storage.wrappers import CountingStore
from ckptstore.testing import free_port

from . import dcp_workers as W
from .helpers import spawn

pytestmark = pytest.mark.slow  # multi-rank saves and loads on spawned gloo ranks


@pytest.fixture(params=["local", "s3"])
def dcp_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "repo"), None
    env = request.getfixturevalue("s3")
    return env.url, env.storage_options


def test_save_4_ranks_load_with_2_3_1(dcp_url, tmp_path):
    url, so = dcp_url
    expect = str(tmp_path / "expected.pt")
    spawn(W.save_worker, args=(4, free_port(), url, so, expect), nprocs=4)

    repo = ckptstore.open(url, storage_options=so)
    assert repo.steps() == [1]
    m = repo.manifest(1)
    assert m.dcp is not None
    # sharded over 4 ranks; replicated tensors stored once
    assert len(m.tensors["big"].shards) == 4
    assert len(m.tensors["rep_dt"].shards) == 1 and len(m.tensors["rep_plain"].shards) == 1
    assert len(m.stats["ranks"]) == 4
    unique = sum(t.nbytes for t in m.tensors.values())
    assert m.stats["logical_bytes"] == unique  # no rank wrote a replicated tensor twice

    # the step reads like any other: assembled slices and full tensors
    expected = torch.load(expect, weights_only=True)
    ck = repo.checkpoint(1)
    assert torch.equal(ck.read("big", (slice(100, 300), slice(3, 9))), expected["big"][100:300, 3:9])
    full = repo.load(1)
    W.compare(expected["model"], full["model"])
    W.compare(expected["optim"]["state"], full["optim"]["state"])
    repo.close()

    # a slice of the resharded tensor fetches only its covering chunks
    store = CountingStore(open_store(url, so))
    counted = Repository(store)
    ck = counted.checkpoint(1)
    meta = ck.tensor_meta("big")  # 512 x 256 fp32: 4 shards of 128 rows, 2 chunks each
    store.reset()
    got = ck.read("big", (slice(100, 140), slice(None)))  # crosses the shard 0/1 boundary
    assert torch.equal(got, expected["big"][100:140])
    chunk_stored = max(c.stored_len for s in ck.shards("big", range(4)) for c in s.chunks)
    packs_read = store.read_by_prefix["packs"]
    e = ck.entry("big")
    if e.tile is None:
        assert packs_read <= 2 * chunk_stored  # one chunk from each of two shards
    else:  # tiles (format 4.0): the tiles of shards 0 and 1 that hold rows 100:140, no more
        box, _ = _plan.normalize_index((slice(100, 140), slice(None)), e.shape)
        covering = 0
        for shard in ck.shards("big", range(4)):
            hit = _plan.intersect(box, shard.offsets, shard.sizes)
            covering += 0 if hit is None else sum(c.stored_len for c in ck.box_refs(e, shard, hit[0]))
        assert 0 < packs_read == covering  # a row slab of tiles is one run of a pack
    assert packs_read < meta.stored_bytes / 3
    counted.close()

    for world in (2, 3):
        spawn(W.load_worker, args=(world, free_port(), url, so, expect), nprocs=world)
    W.load_single_process(url, so, expect)


def test_unchanged_rank_uploads_nothing_and_failed_rank_commits_nothing(dcp_url, tmp_path):
    url, so = dcp_url
    out = tmp_path / "out.json"
    spawn(W.dedup_and_failure_worker, args=(2, free_port(), url, so, str(out)), nprocs=2)
    results = json.loads(out.read_text())
    r0, r1 = results[0]["stats"], results[1]["stats"]
    assert r0["rank"] == 0 and r0["new_bytes"] == 0 and r0["pack_bytes"] == 0
    assert r0["reused_bytes"] == 256 * 1024
    assert r1["new_bytes"] == 256 * 1024 and r1["pack_bytes"] > 0
    for r in results:
        assert r["err"] is not None and "rank 1" in r["err"] and "injected failure" in r["err"]
    repo = ckptstore.open(url, storage_options=so)
    assert repo.steps() == [1, 2]
    m2 = repo.manifest(2)
    assert m2.stats["ranks"]["0"]["new_bytes"] == 0
    repo.close()


def test_repo_save_step_loads_through_dcp_reader_and_back(tmp_path):
    url = str(tmp_path / "repo")
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Linear(30, 4))
    with ckptstore.open(url) as repo:
        repo.save({"model": model.state_dict(), "meta": {"epoch": 4, "tag": "x"}}, step=5)
    fresh = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Linear(30, 4))
    sd = {"model": fresh.state_dict(), "meta": {"epoch": 0, "tag": ""}}
    dcp.load(sd, storage_reader=CkptStoreReader(url))  # step=None: latest
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)
    assert sd["meta"] == {"epoch": 4, "tag": "x"}
    # and a single-process DCP save is an ordinary step, deduplicated against step 5
    w = CkptStoreWriter(url, step=6)
    dcp.save({"model": model.state_dict()}, storage_writer=w)
    with ckptstore.open(url) as repo:
        assert repo.steps() == [5, 6]
        assert repo.manifest(6).stats["new_bytes"] == 0
        out = repo.load(6)
        for k, v in model.state_dict().items():
            assert torch.equal(out["model"][k], v)
        # existing step: refused before anything is uploaded
        with pytest.raises(CheckpointException, match="already exists"):
            dcp.save({"model": model.state_dict()}, storage_writer=CkptStoreWriter(url, step=6))


def test_async_save_through_dcp(tmp_path):
    url = str(tmp_path / "repo")
    w = torch.randn(1000, 100)
    expected = w.clone()
    fut = dcp.async_save({"w": w}, storage_writer=CkptStoreWriter(url, step=1))
    w.add_(1)
    fut.result(timeout=120)
    with ckptstore.open(url) as repo:
        assert torch.equal(repo.load(1)["w"], expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_round_trip(tmp_path):
    url = str(tmp_path / "repo")
    w = torch.randn(3000, 1000, device="cuda")
    dcp.save({"w": w}, storage_writer=CkptStoreWriter(url, step=1, chunk_size=1 << 20))
    dest = {"w": torch.zeros_like(w)}
    dcp.load(dest, storage_reader=CkptStoreReader(url, step=1))
    assert torch.equal(dest["w"], w)
    with ckptstore.open(url) as repo:
        repo.save({"w": w}, step=2)
        into = {"w": torch.zeros_like(w)}
        repo.load(2, into=into)
        assert torch.equal(into["w"], w)
        assert torch.equal(repo.checkpoint(2).read("w", (slice(5, 10),)).cuda(), w[5:10])
