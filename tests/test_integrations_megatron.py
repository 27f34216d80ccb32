"""Megatron-Core integration: dist_checkpointing through ckptstore on CPU gloo ranks.

TP=2 over 2 spawned ranks saves Megatron's own ColumnParallelLinear /
RowParallelLinear sharded state dicts (plus a ShardedObject and common
state); one rank with TP=1 loads them bit-exact (bodies in
tests/mg_workers.py).
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch.multiprocessing as mp

import ckptstore
from ckptstore.testing import free_port

from . import mg_workers as W

pytestmark = pytest.mark.slow  # Megatron-Core on spawned gloo ranks


def test_import_without_megatron_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "ckptstore.integrations.megatron", raising=False)
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "megatron", None)
    with pytest.raises(ImportError, match=r"pip install 'ckptstore\[integrations\]'"):
        importlib.import_module("ckptstore.integrations.megatron")


def test_tp2_saved_tp1_loaded_bit_exact(tmp_path):
    # file:// only: the S3 path is CkptStoreWriter/Reader's, run against moto by tests/test_dcp.py
    # and by the DeepSpeed integration's S3 test; this keeps the suite's time in bounds.
    url, so = f"file://{tmp_path}/repo", None
    mp.spawn(W.save_worker, args=(2, free_port(), url, so, str(tmp_path)), nprocs=2, join=True)
    repo = ckptstore.open(url, storage_options=so)
    assert repo.steps() == [5, 6]
    m5 = repo.manifest(5)
    assert m5.metadata["megatron"]["format"] == 1
    # the column-parallel weight is one global tensor stored as two shards, one per TP rank
    col = m5.tensors["col.weight"]
    assert col.shape == (W.HID, W.IN) and len(col.shards) == 2
    assert m5.stats["ranks"].keys() == {"0", "1"}
    repo.close()
    mp.spawn(W.load_worker, args=(1, free_port(), url, so, str(tmp_path)), nprocs=1, join=True)


def test_load_refuses_a_torch_dist_directory(tmp_path):
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from ckptstore.integrations import megatron as cmg

    strat = cmg.load_strategy(f"file://{tmp_path}/repo", step=1)
    with pytest.raises(CheckpointingException, match="torch_dist"):
        strat.check_backend_compatibility("torch_dist")
