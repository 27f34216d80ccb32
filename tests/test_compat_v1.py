"""Format 1.0 repositories keep working next to 2.0 steps.

``tests/data/repo_v1`` was written by ckptstore as of commit 3601330 (the
last that wrote 1.0 manifests; ``tests/data/make_v1_repo.py`` says how):
steps 1, 2 (``repo.save``), 3 (DCP, 2 ranks, a tensor in two shards), a
deleted step 4 (tombstone), tag ``best``. Each test works on a copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore.format import manifest as M
from ckptstore.clock import ManualClock
from ckptstore.dcp import CkptStoreReader
from ckptstore.errors import UnsupportedVersionError
from ckptstore.storage import open_store

from .data.make_v1_repo import dcp_state, expected, state
from .helpers import assert_tree_equal, copy_repository

V1 = Path(__file__).resolve().parent / "data" / "repo_v1"


@pytest.fixture(params=["local", "s3"])
def v1_url(request, tmp_path):
    """A copy of the 1.0 repository: ``(url, storage_options)``."""
    return copy_repository(V1, request.param, request, tmp_path)


def test_v1_steps_list_load_slice_and_verify(v1_url):
    url, so = v1_url
    with ckptstore.open(url, storage_options=so) as repo:
        assert repo.steps() == [1, 2, 3] and repo.tags() == {"best": 2}
        assert all(repo.manifest(s).version == (1, 0) for s in (1, 2, 3))
        for s in (1, 2):
            assert_tree_equal(expected(s), repo.load(s))
        big, small = dcp_state()
        ck = repo.checkpoint(3)
        assert len(ck.tensor_meta("big").shards) == 2
        assert torch.equal(ck.read("big", (slice(40, 56), slice(3, 9))), big[40:56, 3:9])  # across both shards
        sd = {"big": torch.zeros(96, 48, dtype=torch.bfloat16), "small": torch.zeros(10), "epoch": 0}
        dcp.load(sd, storage_reader=CkptStoreReader(url, step=3, storage_options=so))
        assert torch.equal(sd["big"], big.bfloat16()) and torch.equal(sd["small"], small) and sd["epoch"] == 3
        assert repo.verify(read_data=True).ok


def test_v2_saves_dedup_against_v1_steps_and_gc_keeps_what_they_share(v1_url):
    url, so = v1_url
    clock = ManualClock()
    repo = ckptstore.open(url, storage_options=so, clock=clock)
    assert repo.config()["version"] == [1, 0]  # the old config stays as written
    info = repo.save(state(5), step=5)
    m5 = repo.manifest(5)
    # 4.0: its base (step 3) lacks "model.frozen", which is then tiled (format 4.0)
    assert m5.version == (4, 0) and m5.base_step == 3 and m5.tensors["model.frozen"].tile is not None
    info = repo.save(state(6), step=6, base=2)  # dedups against a 1.0 step's chunks
    frozen = state(6)["model"]["frozen"]
    assert info.reused_bytes >= frozen.numel() * 4
    fresh = ckptstore.open(url, storage_options=so)
    assert fresh.steps() == [1, 2, 3, 5, 6]
    for s in (5, 6):
        assert_tree_equal(expected(s), fresh.load(s))
    assert fresh.verify(read_data=True).ok

    # GC next to 2.0 steps: deletes the 1.0 steps, keeps the packs 2.0 steps share with them
    clock.advance(repo.grace() + 10)
    plan = repo.plan_gc(keep_last=2)  # keeps 5, 6 and the tagged 1.0 step 2
    assert plan.delete_steps == (1, 3)
    res = plan.execute()
    assert res.deleted_steps == [1, 3] and res.deleted_packs  # what only they (and deleted step 4) used
    fresh = ckptstore.open(url, storage_options=so)
    assert fresh.steps() == [2, 5, 6]
    for s in (2, 5, 6):
        assert_tree_equal(expected(s), fresh.load(s))
    rep = fresh.verify(read_data=True)
    assert rep.ok, str(rep)
    # nothing is left that no step needs
    stats = fresh.stats()
    assert stats["unreferenced_pack_bytes"] == 0
    repo.close()


def test_cp_of_a_v1_repository_writes_v2_steps(v1_url, tmp_path):
    url, so = v1_url
    src = ckptstore.open(url, storage_options=so)
    dst = ckptstore.open(str(tmp_path / "copy"))
    res = src.copy_to(dst)
    assert res.copied == [1, 2, 3]
    for s in (1, 2):
        assert dst.manifest(s).version == (3, 0)
        assert_tree_equal(expected(s), dst.load(s))
    big, _ = dcp_state()
    assert torch.equal(dst.checkpoint(3).read("big"), big)
    assert dst.diff(1, 2)["changed"] and src.diff(1, 2) == dst.diff(1, 2)


def test_a_v1_reader_refuses_v2_manifests_with_its_version_error(monkeypatch, tmp_path):
    # What an older ckptstore does with a 2.0 step: its check_version, with VERSION (1, 0).
    repo = ckptstore.open(str(tmp_path / "r"))
    repo.save({"w": torch.ones(3)}, step=1)
    doc = json.loads(repo.store.get("manifests/00000000000000000001.json"))
    from ckptstore.format import strict_json

    monkeypatch.setattr(strict_json, "VERSION", (1, 0))  # where check_version reads it
    with pytest.raises(UnsupportedVersionError, match=r"format version 3\.0, newer than this ckptstore reads \(1\.x\)"):
        M.check_version(doc["version"])
    cfg = json.loads(open_store(str(tmp_path / "r")).get("config.json"))
    assert cfg["version"] == [3, 0]  # a new repository: a 1.x (or 2.x) reader refuses it whole
    with pytest.raises(UnsupportedVersionError):
        M.check_version(cfg["version"], "config.json")
