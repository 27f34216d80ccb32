"""A handle that never lists the store forgets the manifests of steps another's listing no longer
holds (issue 44 item 3): a DCP rank other than the coordinator adopts the dedup base every save, and
the coordinator's listing, shared with it, is what lets it drop the older ones."""

from __future__ import annotations

import pytest
import torch

import ckptstore
from ckptstore.dcp.writer import _step_runs, _steps_of_runs
from ckptstore.errors import CkptStoreError


def test_step_runs_round_trip():
    assert _step_runs([]) == []
    assert _step_runs([7, 3, 4, 5, 9]) == [[3, 5], [7, 7], [9, 9]]
    for steps in ([], [0], [998, 999, 1000], [1, 3, 5, 6, 7, 100]):
        assert _steps_of_runs(_step_runs(steps)) == set(steps)


@pytest.mark.parametrize("bad", [[[5, 3]], [[-1, 2]], [["a", 2]], [[1]], 7])
def test_damaged_runs_raise(bad):
    with pytest.raises(CkptStoreError):
        _steps_of_runs(bad)


def test_forget_unlisted_drops_the_cached_manifests_of_steps_not_listed(tmp_path):
    url = str(tmp_path / "repo")
    with ckptstore.open(url) as repo:
        for s in range(6):
            repo.save({"w": torch.full((64,), float(s))}, step=s)
        with ckptstore.open(url) as other:  # the rank that adopts and never lists
            for s in range(6):
                other.adopt_manifest(s, repo.manifest_bytes(s))
            assert sorted(other._manifests.keys()) == list(range(6))
            for s in (0, 1, 3):
                repo.delete(s)
            listed = repo.steps()
            assert listed == [2, 4, 5]
            # a listing read before step 5 was committed: a step newer than the newest listed stays
            other.forget_unlisted([2, 4])
            assert sorted(other._manifests.keys()) == [2, 4, 5]
            other.forget_unlisted(listed)
            assert sorted(other._manifests.keys()) == [2, 4, 5]
            assert other.manifest(4).step == 4
