"""Megatron-Core integration: dist_checkpointing through ckptstore on CPU gloo ranks.

TP=2 over 2 spawned ranks saves Megatron's own ColumnParallelLinear /
RowParallelLinear sharded state dicts (plus a ShardedObject and common
state); one rank with TP=1 loads them bit-exact. A GPT saved at TP2 x PP2
on 4 ranks loads bit-exact at other TP x PP layouts, as Megatron's own
torch_dist format of the same save does (bodies in tests/mg_workers.py).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.testing import free_port

from . import mg_workers as W
from .helpers import spawn

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
    spawn(W.save_worker, args=(2, free_port(), url, so, str(tmp_path)), nprocs=2)
    repo = ckptstore.open(url, storage_options=so)
    assert repo.steps() == [5, 6]
    m5 = repo.manifest(5)
    assert m5.metadata["megatron"]["format"] == 1
    # the column-parallel weight is one global tensor stored as two shards, one per TP rank
    col = m5.tensors["col.weight"]
    assert col.shape == (W.HID, W.IN) and len(col.shards) == 2
    assert m5.stats["ranks"].keys() == {"0", "1"}
    repo.close()
    spawn(W.load_worker, args=(1, free_port(), url, so, str(tmp_path)), nprocs=1)


def test_gpt_tp2_pp2_loads_bit_exact_on_other_tp_pp_as_torch_dist_does(tmp_path):
    # 4 ranks save a GPT (4 layers, tied embeddings) at TP2 x PP2, in both layer numberings, through
    # ckptstore and as a torch_dist folder; the same ranks then load it at TP1 x PP1, TP1 x PP2 and
    # TP2 x PP1 (layers move between stages; data-parallel replicas make up the rest).
    url = f"file://{tmp_path}/repo"
    targets = [(1, 1), (1, 2), (2, 1)]
    spawn(W.tp_pp_worker, args=(4, free_port(), url, str(tmp_path), targets), nprocs=4)
    with ckptstore.open(url) as repo:
        assert repo.steps() == [1, 2]
        m1, m2 = repo.manifest(1), repo.manifest(2)
        assert m1.stats["ranks"].keys() == {"0", "1", "2", "3"}
        # offsets: one global tensor per layer weight, (layers, ...), a shard per (stage's layer, TP rank)
        qkv = m1.tensors["decoder.layers.self_attention.linear_qkv.weight"]
        assert qkv.shape == (W.GPT_LAYERS, 3 * W.GPT_HIDDEN, W.GPT_HIDDEN) and len(qkv.shards) == 2 * W.GPT_LAYERS
        # the tied output layer is the first stage's word embeddings (the last stage's copy is a replica)
        assert "embedding.word_embeddings.weight" in m1.tensors and "output_layer.weight" not in m1.tensors
        # per layer: one key per layer, numbered in the whole model
        assert {f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(W.GPT_LAYERS)} <= m2.tensors.keys()
        # the repository's own reader assembles the global tensors the ranks wrote
        ckpt = repo.checkpoint(1)
        for key in ("decoder.layers.self_attention.linear_qkv.weight", "embedding.word_embeddings.weight"):
            assert torch.equal(ckpt.read(key), W.global_value(key, ckpt.tensor_meta(key).shape)), key


def test_load_refuses_a_torch_dist_directory(tmp_path):
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from ckptstore.integrations import megatron as cmg

    strat = cmg.load_strategy(f"file://{tmp_path}/repo", step=1)
    with pytest.raises(CheckpointingException, match="torch_dist"):
        strat.check_backend_compatibility("torch_dist")


def test_async_save_through_megatrons_queue(tmp_path):
    # Megatron's AsyncCallsQueue runs the upload in its worker: the persistent one (spawned), then the
    # temporal one (forked per save), each on a repository of its own; the state at the call is stored;
    # finalize commits; failures raise on every rank and leave nothing (bodies in tests/mg_workers.py)
    modes = ["persistent", "temporal"]
    spawn(W.async_worker, args=(2, free_port(), str(tmp_path), modes), nprocs=2)
    for mode in modes:
        with ckptstore.open(f"file://{tmp_path}/{mode}/repo") as repo:
            assert repo.steps() == ([10, 15, 20] if mode == "persistent" else [10, 15, 20, 50, 60]), mode
            assert repo.manifest(20).stats["ranks"].keys() == {"0", "1"}
            if mode == "temporal":  # FullyParallelSaveStrategyWrapper: both data-parallel replicas wrote a share
                for step in (50, 60):
                    ranks = repo.manifest(step).stats["ranks"]
                    assert ranks.keys() == {"0", "1"} and all(r["logical_bytes"] > 0 for r in ranks.values()), ranks


def test_async_save_refuses_write_back_and_replicas_and_needs_a_step(tmp_path):
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from ckptstore.integrations import megatron as cmg

    url = f"file://{tmp_path}/repo"
    d = tmp_path / "iter_0000007"
    d.mkdir()
    for opt in ({"write_back": True, "cache_dir": str(tmp_path / "tier")}, {"replicas": 1}):
        with pytest.raises(CheckpointingException, match=f"{next(iter(opt))}= is not supported by async saves"):
            cmg.save_strategy(url, **opt).async_save({}, d, "mcore")
    with pytest.raises(CheckpointingException, match="nvidia-resiliency-ext"):
        cmg.save_strategy(url).async_save({}, d, "nvrx")
    assert cmg.save_strategy(url).step_for(d) == 7 and cmg.save_strategy(url, step=3).step_for(d) == 3
    with pytest.raises(ValueError, match=r"not named iter_<step>.*pass step="):
        cmg.save_strategy(url).step_for(tmp_path / "release")
    assert not (tmp_path / "repo").exists()  # refused before anything was written


def test_errors_keep_megatrons_types(tmp_path):
    # a key the checkpoint lacks: torch's CheckpointException, as Megatron's strategy raises it (it
    # was a KeyError, and Megatron's test_load_error_msg failed); ckptstore's own errors keep theirs
    spawn(W.errors_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)


def _overlay() -> str | None:
    """The Megatron-Core 0.19 overlay: where ``make test`` put it, else a ``.mcore019`` in the checkout."""
    env = os.environ.get("CKPTSTORE_MCORE_OVERLAY")
    if env:
        return env
    local = Path(__file__).resolve().parent.parent / ".mcore019"
    return str(local) if (local / "megatron" / "core").is_dir() else None


def test_megatron_019_overlay():
    # This module's tests again, with megatron-core 0.19.2 (requirements/megatron-0.19.txt) first on
    # the path: one integration at both ends of the supported range.
    import megatron.core

    if not megatron.core.__version__.startswith("0.16"):
        pytest.skip(f"this run is the overlay's own (megatron-core {megatron.core.__version__})")
    overlay = _overlay()
    if overlay is None:
        pytest.skip("no megatron-core 0.19 overlay: `make test` installs it (requirements/megatron-0.19.txt)")
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, overlay]))
    probe = subprocess.run([sys.executable, "-W", "ignore", "-c", "import megatron.core as m; print(m.__version__)"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0 and probe.stdout.startswith("0.19."), (overlay, probe.stdout, probe.stderr[-2000:])
    # all but the 4-rank GPT layouts (80 s on the 2-core CI machine; Megatron's layer numbering, which
    # ckptstore's code does not touch): the 0.17+ changes are in the save/load path the others run
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-k", "not overlay and not gpt_tp2_pp2",
                          os.path.join(root, "tests", "test_integrations_megatron.py")],
                         cwd=root, env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]
