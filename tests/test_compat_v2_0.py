"""Repositories whose chunk tables are 2.0 segments keep working next to 2.1 ones.

``tests/data/repo_v2_0`` was written by ckptstore as of commit d10e3c8 (the
last that wrote 2.0 segments: 1024-record blocks, every block's digest in
the segment's header) by ``tests/data/make_v1_repo.py`` run at that commit:
steps 1, 2 (``repo.save``), 3 (DCP, 2 ranks, a tensor in two shards), a
deleted step 4 (tombstone), tag ``best``. Each test works on a copy.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore.clock import ManualClock
from ckptstore.dcp import CkptStoreReader
from ckptstore.format.layout import segment_key

from .data.make_v1_repo import dcp_state, state
from .helpers import assert_tree_equal

V20 = Path(__file__).resolve().parent / "data" / "repo_v2_0"


def _expected(step: int) -> dict:
    return {"model": state(step)["model"], "meta": state(step)["meta"]}


def _minors(repo, step: int) -> set[int]:
    """The segment format minor versions a step's chunk tables carry."""
    return {struct.unpack_from("<H", repo.store.get(segment_key(s.id)), 10)[0] for s in repo.manifest(step).segments}


@pytest.fixture(params=["local", "s3"])
def v20_url(request, tmp_path):
    """A copy of the 2.0 repository: ``(url, storage_options)``."""
    if request.param == "local":
        dst = tmp_path / "repo"
        shutil.copytree(V20, dst)
        return str(dst), None
    env = request.getfixturevalue("s3")
    store = env.store()
    for p in sorted(V20.rglob("*")):
        if p.is_file():
            store.put(p.relative_to(V20).as_posix(), p.read_bytes())
    return env.url, env.storage_options


def test_2_0_steps_list_load_slice_and_verify(v20_url):
    url, so = v20_url
    with ckptstore.open(url, storage_options=so) as repo:
        assert repo.steps() == [1, 2, 3] and repo.tags() == {"best": 2}
        assert all(_minors(repo, s) == {0} for s in (1, 2, 3))
        for s in (1, 2):
            assert_tree_equal(_expected(s), repo.load(s))
        big, small = dcp_state()
        ck = repo.checkpoint(3)
        assert len(ck.tensor_meta("big").shards) == 2
        assert torch.equal(ck.read("big", (slice(40, 56), slice(3, 9))), big[40:56, 3:9])
        sd = {"big": torch.zeros(96, 48), "small": torch.zeros(10), "epoch": 0}
        dcp.load(sd, storage_reader=CkptStoreReader(url, step=3, storage_options=so))
        assert torch.equal(sd["big"], big) and torch.equal(sd["small"], small) and sd["epoch"] == 3
        rep = repo.verify(read_data=True)
        assert rep.ok, str(rep)


def test_new_steps_write_2_1_segments_dedup_against_2_0_steps_and_gc_keeps_what_they_share(v20_url):
    url, so = v20_url
    clock = ManualClock()
    repo = ckptstore.open(url, storage_options=so, clock=clock)
    info = repo.save(state(5), step=5, base=2)
    assert info.reused_bytes >= state(5)["model"]["frozen"].numel() * 4
    assert _minors(repo, 5) == {1}
    fresh = ckptstore.open(url, storage_options=so)
    assert fresh.steps() == [1, 2, 3, 5]
    assert_tree_equal(_expected(5), fresh.load(5))
    clock.advance(repo.grace() + 10)
    plan = repo.plan_gc(keep_last=1)  # keeps 5 and the tagged 2.0 step 2
    assert plan.delete_steps == (1, 3)
    plan.execute()
    fresh = ckptstore.open(url, storage_options=so)
    assert fresh.steps() == [2, 5]
    for s in (2, 5):
        assert_tree_equal(_expected(s), fresh.load(s))
    rep = fresh.verify(read_data=True)
    assert rep.ok, str(rep)
    assert fresh.stats()["unreferenced_pack_bytes"] == 0
    repo.close()


def test_cp_of_a_2_0_repository_writes_2_1_segments(v20_url, tmp_path):
    url, so = v20_url
    src = ckptstore.open(url, storage_options=so)
    dst = ckptstore.open(str(tmp_path / "copy"))
    assert src.cp(dst).copied == [1, 2, 3]
    for s in (1, 2):
        assert _minors(dst, s) == {1}
        assert_tree_equal(_expected(s), dst.load(s))
    big, _ = dcp_state()
    assert torch.equal(dst.checkpoint(3).read("big"), big)
    assert src.diff(1, 2) == dst.diff(1, 2)
