"""Format 2.0 repositories (2.0 roots naming 2.0 chunk-table segments) keep working next to 3.0 steps.

``tests/data/repo_v2_0`` was written by ckptstore as of commit d10e3c8 (the
last that wrote 2.0 segments: 1024-record blocks, every block's digest in
the segment's header) by ``tests/data/make_v1_repo.py`` run at that commit:
steps 1, 2 (``repo.save``), 3 (DCP, 2 ranks, a tensor in two shards), a
deleted step 4 (tombstone), tag ``best``. Each test works on a copy.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore.clock import ManualClock
from ckptstore.dcp import CkptStoreReader
from ckptstore.errors import FormatError, UnsupportedVersionError
from ckptstore.format import manifest as M
from ckptstore.format import strict_json
from ckptstore.format.layout import segment_key

from .data.make_v1_repo import dcp_state, expected, state
from .helpers import assert_tree_equal, copy_repository

V20 = Path(__file__).resolve().parent / "data" / "repo_v2_0"


def _versions(repo, step: int) -> set[tuple[int, int]]:
    """The manifest's version, and the versions of the chunk-table segments it names."""
    m = repo.manifest(step)
    return {m.version} | {struct.unpack_from("<HH", repo.store.get(segment_key(s.id)), 8) for s in m.segments}


@pytest.fixture(params=["local", "s3"])
def v20_url(request, tmp_path):
    """A copy of the 2.0 repository: ``(url, storage_options)``."""
    return copy_repository(V20, request.param, request, tmp_path)


def test_2_0_steps_list_load_slice_and_verify(v20_url):
    url, so = v20_url
    with ckptstore.open(url, storage_options=so) as repo:
        assert repo.steps() == [1, 2, 3] and repo.tags() == {"best": 2}
        assert all(_versions(repo, s) == {(2, 0)} for s in (1, 2, 3))
        assert repo.config()["version"] == [2, 0]
        for s in (1, 2):
            assert_tree_equal(expected(s), repo.load(s))
        big, small = dcp_state()
        ck = repo.checkpoint(3)
        assert len(ck.tensor_meta("big").shards) == 2
        assert torch.equal(ck.read("big", (slice(40, 56), slice(3, 9))), big[40:56, 3:9])
        sd = {"big": torch.zeros(96, 48), "small": torch.zeros(10), "epoch": 0}
        dcp.load(sd, storage_reader=CkptStoreReader(url, step=3, storage_options=so))
        assert torch.equal(sd["big"], big) and torch.equal(sd["small"], small) and sd["epoch"] == 3
        rep = repo.verify(read_data=True)
        assert rep.ok, str(rep)


def test_new_steps_write_3_0_segments_dedup_against_2_0_steps_and_gc_keeps_what_they_share(v20_url):
    url, so = v20_url
    clock = ManualClock()
    repo = ckptstore.open(url, storage_options=so, clock=clock)
    info = repo.save(state(5), step=5, base=2)
    assert info.reused_bytes >= state(5)["model"]["frozen"].numel() * 4
    assert _versions(repo, 5) == {(3, 0)}
    assert repo.config()["version"] == [2, 0]  # the repository's config stays as written
    fresh = ckptstore.open(url, storage_options=so)
    assert fresh.steps() == [1, 2, 3, 5]
    assert_tree_equal(expected(5), fresh.load(5))
    clock.advance(repo.grace() + 10)
    plan = repo.plan_gc(keep_last=1)  # keeps 5 and the tagged 2.0 step 2
    assert plan.delete_steps == (1, 3)
    plan.execute()
    fresh = ckptstore.open(url, storage_options=so)
    assert fresh.steps() == [2, 5]
    for s in (2, 5):
        assert_tree_equal(expected(s), fresh.load(s))
    rep = fresh.verify(read_data=True)
    assert rep.ok, str(rep)
    assert fresh.stats()["unreferenced_pack_bytes"] == 0
    repo.close()


def test_cp_of_a_2_0_repository_writes_3_0_steps(v20_url, tmp_path):
    url, so = v20_url
    src = ckptstore.open(url, storage_options=so)
    dst = ckptstore.open(str(tmp_path / "copy"))
    assert src.cp(dst).copied == [1, 2, 3]
    for s in (1, 2):
        assert _versions(dst, s) == {(3, 0)}
        assert_tree_equal(expected(s), dst.load(s))
    big, _ = dcp_state()
    assert torch.equal(dst.checkpoint(3).read("big"), big)
    assert src.diff(1, 2) == dst.diff(1, 2)


def test_a_2_x_reader_refuses_3_0_steps_and_new_repositories_with_its_version_error(monkeypatch, tmp_path):
    # What a 2.x ckptstore does with a 3.0 step: its check_version, with VERSION (2, 0).
    repo = ckptstore.open(str(tmp_path / "r"))
    repo.save({"w": torch.ones(3)}, step=1)
    doc = json.loads(repo.store.get("manifests/00000000000000000001.json"))
    cfg = json.loads(repo.store.get("config.json"))
    assert doc["version"] == [3, 0] and cfg["version"] == [3, 0]
    monkeypatch.setattr(strict_json, "VERSION", (2, 0))  # where check_version reads it
    for v, what in ((doc["version"], "manifest"), (cfg["version"], "config.json")):
        with pytest.raises(UnsupportedVersionError, match=r"3\.0, newer than this ckptstore reads \(2\.x\); upgrade"):
            M.check_version(v, what)


def test_a_2_0_root_names_only_2_0_segments(tmp_path):
    repo = ckptstore.open(str(tmp_path / "r"))
    repo.save({f"w{i}": torch.full((4,), float(i)) for i in range(40)}, step=1)  # 40 records: 3 blocks
    m = repo.manifest(1)
    with pytest.raises(ValueError, match="a 2.x root can only name 2.0 chunk-table segments"):
        M.to_json(dataclasses.replace(m, version=(2, 0)))
    doc = json.loads(M.to_json(m))
    doc["version"] = [2, 0]  # the same root, said to be 2.0: its segment's size is not a 2.0 one
    with pytest.raises(FormatError, match=r"segments\[0\]: size .* does not hold"):
        M.from_json(json.dumps(doc).encode())
