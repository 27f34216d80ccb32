"""Format 2.x at a small multi-process scale, in CI: 16 gloo ranks save 20k
DTensor shards, 8 ranks reshard-load them bit-exact, and each loading rank
reads only its share of the metadata (the root: only the coordinator)."""

from __future__ import annotations

import json

import pytest

import ckptstore
from ckptstore.format.chunk_table import BLOCK_RECORDS, RECORD_SIZE
from ckptstore.format.layout import segment_key
from ckptstore.testing import free_port

from . import dcp_workers as W
from .helpers import spawn

pytestmark = pytest.mark.slow  # 16 gloo ranks


def test_16_ranks_save_20k_shards_8_ranks_load_their_share(tmp_path):
    url = str(tmp_path / "repo")
    spawn(W.many_shards_save_worker, args=(16, free_port(), url), nprocs=16)
    with ckptstore.open(url) as repo:
        m = repo.manifest(1)
        assert sum(t.nshards for t in m.tensors.values()) == 16 * W.MANY == 20_000
        assert len(m.segments) == 16
        root = repo.store.head("manifests/00000000000000000001.json").size
        segs = {s.id: s for s in m.segments}
    out = tmp_path / "out"
    out.mkdir()
    spawn(W.many_shards_load_worker, args=(8, free_port(), url, str(out)), nprocs=8)
    by_key = {segment_key(i): s for i, s in segs.items()}
    for rank in range(8):
        r = json.loads((out / f"rank{rank}.json").read_text())
        assert r["bad"] == [], (rank, r["bad"])
        # a loading rank covers 2 saved shards of each tensor: it touches the
        # segments of exactly those 2 saving ranks, not the other 14
        assert len(r["segment_keys"]) == 2, r["segment_keys"]
        share = 2 * W.MANY * RECORD_SIZE  # the records of its shards
        # Bound: the root, plus for each segment touched its header, the
        # records of the shards read rounded up to whole blocks, and the
        # blocks' Merkle proofs (at most every proof of the segment).
        touched = [by_key[k] for k in r["segment_keys"]]
        proofs = sum(s.size - s.header - RECORD_SIZE * s.records for s in touched)
        bound = root + sum(s.header for s in touched) + proofs + share + len(touched) * BLOCK_RECORDS * RECORD_SIZE
        # the root is read once for the job, by the coordinator, and sent to the others
        assert r["manifests"] == (root if rank == 0 else 0), (rank, r["manifests"])
        assert r["manifests"] + r["segments"] <= bound, (rank, r, bound)
