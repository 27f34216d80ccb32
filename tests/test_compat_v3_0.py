"""Format 3.0 repositories (written before tiled tensors, format 4.0) keep loading and resharding.

``tests/data/repo_v3_0`` was written by ckptstore as of commit d734c0c (the last that wrote
only row-major chunk runs) by ``tests/data/make_v1_repo.py`` run at that commit: steps 1, 2
(``repo.save``), 3 (DCP, 2 ranks, ``big`` as ``Shard(0)``), a deleted step 4 (tombstone), tag
``best``. Each test works on a copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore.dcp import CkptStoreReader
from ckptstore.testing import free_port

from . import tile_workers as W
from .data.make_v1_repo import dcp_state, expected, state
from .helpers import assert_tree_equal, copy_repository, spawn

V30 = Path(__file__).resolve().parent / "data" / "repo_v3_0"


@pytest.fixture(params=["local", "s3"])
def v30_url(request, tmp_path):
    """A copy of the 3.0 repository: ``(url, storage_options)``."""
    return copy_repository(V30, request.param, request, tmp_path)


def test_3_0_steps_list_load_slice_and_verify(v30_url):
    url, so = v30_url
    with ckptstore.open(url, storage_options=so) as repo:
        assert repo.steps() == [1, 2, 3] and repo.tags() == {"best": 2}
        assert all(repo.manifest(s).version == (3, 0) for s in (1, 2, 3))
        for s in (1, 2):
            assert_tree_equal(expected(s), repo.load(s))
        frozen = state(1)["model"]["frozen"]
        ck = repo.checkpoint(2)
        assert torch.equal(ck.read("model.frozen", (slice(None), slice(100, 140))), frozen[:, 100:140])
        big, small = dcp_state()
        ck = repo.checkpoint(3)
        assert torch.equal(ck.read("big", (slice(40, 56), slice(3, 9))), big[40:56, 3:9])
        sd = {"big": torch.zeros(96, 48), "small": torch.zeros(10), "epoch": 0}
        dcp.load(sd, storage_reader=CkptStoreReader(url, step=3, storage_options=so))
        assert torch.equal(sd["big"], big) and torch.equal(sd["small"], small) and sd["epoch"] == 3
        rep = repo.verify(read_data=True)
        assert rep.ok, str(rep)


def test_a_3_0_dcp_step_reshards_shard0_into_shard1_on_2_ranks(tmp_path):
    url = str(tmp_path / "repo")
    import shutil

    shutil.copytree(V30, url)
    big, _ = dcp_state()
    torch.save(big, tmp_path / "big.pt")
    out = tmp_path / "out"
    out.mkdir()
    spawn(W.reshard_load_worker, args=(2, free_port(), url, None, 3, {"big": str(tmp_path / "big.pt")}, 1,
                                       str(out)), nprocs=2)
    for r in range(2):
        assert json.loads((out / f"rank{r}.json").read_text())["bad"] == []


def test_new_steps_in_a_3_0_repository_dedup_against_its_steps(v30_url):
    url, so = v30_url
    with ckptstore.open(url, storage_options=so) as repo:
        info = repo.save(state(5), step=5, base=2)
        assert info.reused_bytes >= state(5)["model"]["frozen"].numel() * 4
        assert repo.config()["version"] == [3, 0]
        assert_tree_equal(expected(5), repo.load(5))
        for s in (2, 5):
            assert_tree_equal(expected(s), repo.load(s))
        rep = repo.verify(read_data=True)
        assert rep.ok, str(rep)
