"""Lightning integration: CkptStoreCheckpointIO (ModelCheckpoint rotation,
resume, path -> step mapping, no pickle) and CkptStoreModelParallelStrategy
(FSDP2 over 2 gloo ranks spawned on 127.0.0.1)."""

from __future__ import annotations

import enum
import json
import pathlib
import subprocess
import sys

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import ckptstore
from ckptstore.errors import StepExistsError, StepNotFoundError
from ckptstore.integrations import lightning as cl

from . import hf_lightning_workers as W
from .helpers import assert_tree_equal


class Net(L.LightningModule):
    def __init__(self, width: int = 16, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, width)
        self.head = torch.nn.Linear(width, 2)
        self.body.requires_grad_(False)  # a frozen layer: later steps reuse its chunks

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.head(torch.relu(self.body(x))), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.head.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3)}


def _loader():
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g)), batch_size=8)


def _trainer(tmp_path, epochs, io=None, checkpoint=None):
    return L.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path),
        plugins=[io] if io else None, callbacks=[checkpoint] if checkpoint else None,
        enable_checkpointing=checkpoint is not None,
    )


def _top2(tmp_path):
    # Keep the two newest by "step" (deterministic rotation), checkpoint at epoch ends.
    return ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), monitor="step", mode="max", save_top_k=2,
                           save_last=True, every_n_epochs=1)


def test_path_to_step_mapping():
    assert cl.name_step("epoch=0-step=10.ckpt") == 10
    assert cl.name_step("epoch=3-step=120-v1.ckpt") == 120
    assert cl.name_step("best-step=7.ckpt") == 7
    assert cl.name_step("last.ckpt") is None and cl.name_step("epoch=1-val_loss=0.50.ckpt") is None
    assert cl.name_step("epoch=0-nostep=3.ckpt") is None
    assert cl.is_last_name("last.ckpt") and cl.is_last_name("last-v2.ckpt")
    assert not cl.is_last_name("epoch=0-last.ckpt")
    assert cl.checkpoint_name("/a/b/epoch=0-step=10.ckpt") == "epoch=0-step=10.ckpt"
    with pytest.raises(ValueError):
        cl.checkpoint_name("/")


def test_top_k_rotation_deletes_steps_and_resume_equals_uninterrupted(tmp_path):
    url = str(tmp_path / "repo")
    first = Net()
    io = cl.CkptStoreCheckpointIO(url, chunk_size=4096)
    _trainer(tmp_path, 2, io, _top2(tmp_path)).fit(first, _loader())
    with ckptstore.open(url) as repo:
        assert repo.steps() == [4, 8]  # last.ckpt at step 8 is the step 8 just saved: nothing more written
        assert repo.checkpoint(8).metadata["lightning"]["path"] == "epoch=1-step=8.ckpt"
        frozen = sum(t.numel() * t.element_size() for t in (first.body.weight, first.body.bias))
    assert io.last_info is None  # the last.ckpt save wrote nothing

    # Resume from last.ckpt (the newest step; the folder does not matter) for two more epochs.
    resumed = Net()
    io2 = cl.CkptStoreCheckpointIO(url)
    trainer = _trainer(tmp_path, 4, io2, _top2(tmp_path))
    trainer.fit(resumed, _loader(), ckpt_path=str(tmp_path / "anywhere" / "last.ckpt"))
    with ckptstore.open(url) as repo:
        assert repo.steps() == [12, 16]  # rotation called remove_checkpoint -> repo.delete for 4 and 8
        assert repo.checkpoint(12).manifest.stats["reused_bytes"] >= frozen
    assert not (tmp_path / "ckpts").exists(), "nothing is written to the local checkpoint folder"

    straight = Net()
    _trainer(tmp_path / "plain", 4).fit(straight, _loader())
    for k, v in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), f"{k} differs from the uninterrupted run"

    ckpt = io2.load_checkpoint("epoch=3-step=16.ckpt")
    assert ckpt["global_step"] == 16 and ckpt["hyper_parameters"] == {"width": 16, "lr": 0.05}
    assert_tree_equal(ckpt["state_dict"], {k: v for k, v in resumed.state_dict().items()})
    assert isinstance(ckpt["optimizer_states"][0]["param_groups"][0]["betas"], tuple)
    with pytest.raises(StepNotFoundError, match="epoch=0-step=4.ckpt"):
        io2.load_checkpoint("epoch=0-step=4.ckpt")
    io2.teardown()


def test_names_without_a_step_are_found_by_their_recorded_name(tmp_path):
    io = cl.CkptStoreCheckpointIO(str(tmp_path / "repo"))
    base = {"epoch": 0, "pytorch-lightning_version": L.__version__, "state_dict": {"w": torch.ones(3)}}
    io.save_checkpoint({**base, "global_step": 5}, "/x/epoch=0-val_loss=0.50.ckpt")
    io.save_checkpoint({**base, "global_step": 9, "state_dict": {"w": torch.zeros(3)}}, "/y/best.ckpt")
    assert io.resolve("epoch=0-val_loss=0.50.ckpt") == 5 and io.resolve("best.ckpt") == 9
    # Saving a name again replaces the step it named, as overwriting the file would.
    io.save_checkpoint({**base, "global_step": 11, "state_dict": {"w": torch.full((3,), 2.0)}}, "/y/best.ckpt")
    assert io.repository.steps() == [5, 11]
    assert torch.equal(io.load_checkpoint("best.ckpt")["state_dict"]["w"], torch.full((3,), 2.0))
    with pytest.raises(StepExistsError, match="already committed"):
        io.save_checkpoint({**base, "global_step": 11}, "/y/other.ckpt")
    io.remove_checkpoint("/x/epoch=0-val_loss=0.50.ckpt")
    io.remove_checkpoint("/x/epoch=0-val_loss=0.50.ckpt")  # already gone: no error
    io.remove_checkpoint("last.ckpt")  # never deletes
    assert io.repository.steps() == [11]
    io.teardown()


class Color(enum.Enum):
    RED = "red"


def test_non_json_values_are_converted_explicitly_or_refused(tmp_path):
    io = cl.CkptStoreCheckpointIO(str(tmp_path / "repo"))
    ckpt = {
        "global_step": 3, "state_dict": {"w": torch.ones(2)},
        "hyper_parameters": {"data": pathlib.Path("/data/x"), "color": Color.RED, "scale": torch.tensor(2.0).numpy()[()]},
    }
    io.save_checkpoint(ckpt, "epoch=0-step=3.ckpt")
    hp = io.load_checkpoint("epoch=0-step=3.ckpt")["hyper_parameters"]
    assert hp == {"data": "/data/x", "color": "red", "scale": 2.0} and type(hp["scale"]) is float

    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"hyper_parameters\.model.*Opaque.*never pickles"):
        io.save_checkpoint({"global_step": 4, "hyper_parameters": {"model": Opaque()}}, "epoch=0-step=4.ckpt")
    assert io.repository.steps() == [3], "a refused save leaves the repository as it was"
    custom = cl.CkptStoreCheckpointIO(str(tmp_path / "repo"), convert=lambda path, v: {"opaque": type(v).__name__})
    custom.save_checkpoint({"global_step": 4, "hyper_parameters": {"model": Opaque()}}, "epoch=0-step=4.ckpt")
    assert custom.load_checkpoint("epoch=0-step=4.ckpt")["hyper_parameters"] == {"model": {"opaque": "Opaque"}}
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"global_step": 5}, "epoch=0-step=5.ckpt", storage_options={"x": 1})
    io.teardown()
    custom.teardown()


def test_fit_and_resume_on_s3(tmp_path, s3):
    io = cl.CkptStoreCheckpointIO(s3.url, storage_options=s3.storage_options)
    first = Net()
    _trainer(tmp_path, 1, io, _top2(tmp_path)).fit(first, _loader())
    assert io.repository.steps() == [4]
    ckpt = io.load_checkpoint("last.ckpt")
    assert ckpt["epoch"] == 0 and ckpt["global_step"] == 4
    for k, v in first.state_dict().items():
        assert torch.equal(ckpt["state_dict"][k], v), k
    again = Net()
    trainer = _trainer(tmp_path, 2, cl.CkptStoreCheckpointIO(s3.url, storage_options=s3.storage_options), _top2(tmp_path))
    trainer.fit(again, _loader(), ckpt_path="epoch=0-step=4.ckpt")
    assert trainer.global_step == 8 and io.repository.steps() == [4, 8]
    io.teardown()


def test_model_parallel_strategy_two_ranks_saves_shards_and_resumes(tmp_path):
    url = str(tmp_path / "repo")
    out = tmp_path / "res"
    out.mkdir()
    mp.spawn(W.lightning_model_parallel, args=(2, W.free_port(), url, str(tmp_path), str(out)), nprocs=2, join=True)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["steps"] == [2, 4] and r["path"] == "epoch=1-step=4.ckpt"
        assert r["resumed"] == r["straight"], "resumed run differs from the uninterrupted one"
        # ModelCheckpoint's score tensor travels as a DCP item, not as a pickle.
        assert any("kth_value" in k for k in r["extra_keys"])
        assert "ckpts" not in r["local"]
    with pytest.raises(ValueError, match="distributed checkpoints only"):
        cl.CkptStoreModelParallelStrategy(url, save_distributed_checkpoint=False)


def test_import_without_lightning_names_the_extra():
    code = "import sys; sys.modules['lightning'] = None; import ckptstore.integrations.lightning"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode != 0
    assert "ImportError" in res.stderr and "pip install 'ckptstore[integrations]'" in res.stderr
