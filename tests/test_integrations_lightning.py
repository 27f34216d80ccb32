"""Lightning integration: CkptStoreCheckpointIO (ModelCheckpoint rotation,
resume, path -> step mapping, no pickle) and CkptStoreModelParallelStrategy
(FSDP2 over 2 gloo ranks spawned on 127.0.0.1)."""

from __future__ import annotations

import enum
import json
import os
import pathlib
import shutil
import subprocess
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import ckptstore
from ckptstore.errors import StepNotFoundError
from ckptstore.integrations import lightning as cl
from ckptstore.testing import free_port

from . import hf_lightning_workers as W
from .helpers import assert_tree_equal, spawn

pytestmark = pytest.mark.slow  # Lightning fits, spawned ranks


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


def _listing(folder):
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_top_k_rotation_deletes_steps_and_resume_equals_uninterrupted(tmp_path):
    url = str(tmp_path / "repo")
    ckpts = tmp_path / "ckpts"
    first = Net()
    io = cl.CkptStoreCheckpointIO(url, chunk_size=4096)
    _trainer(tmp_path, 2, io, _top2(tmp_path)).fit(first, _loader())
    with ckptstore.open(url) as repo:
        # every save is a step; last.ckpt saved again moved its name from step 5 to 9
        assert repo.steps() == [4, 5, 8, 9]
        assert repo.names(cl.NAMESPACE) == {"epoch=0-step=4.ckpt": 4, "epoch=1-step=8.ckpt": 8, "last.ckpt": 9}
        assert repo.checkpoint(9).metadata["lightning"]["global_step"] == 8
        frozen = sum(t.numel() * t.element_size() for t in (first.body.weight, first.body.bias))
    # the folder holds what Lightning's own IO writes there, loadable with torch.load
    assert _listing(ckpts) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    local = torch.load(ckpts / "last.ckpt", weights_only=True)
    assert_tree_equal(local["state_dict"], io.load_checkpoint(ckpts / "last.ckpt")["state_dict"])

    # Resume from last.ckpt on a machine without the folder: only the name counts.
    shutil.rmtree(ckpts)
    resumed = Net()
    io2 = cl.CkptStoreCheckpointIO(url)
    trainer = _trainer(tmp_path, 4, io2, _top2(tmp_path))
    trainer.fit(resumed, _loader(), ckpt_path=str(tmp_path / "anywhere" / "last.ckpt"))
    with ckptstore.open(url) as repo:
        # rotation removed epoch=0 and epoch=1 (their steps 4 and 8); the older last.ckpt steps stay for GC
        assert repo.steps() == [5, 9, 12, 13, 16, 17]
        assert repo.names(cl.NAMESPACE) == {"epoch=2-step=12.ckpt": 12, "epoch=3-step=16.ckpt": 16, "last.ckpt": 17}
        assert repo.checkpoint(12).manifest.stats["reused_bytes"] >= frozen
    assert _listing(ckpts) == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"]

    straight = Net()
    _trainer(tmp_path / "plain", 4).fit(straight, _loader())
    for k, v in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), f"{k} differs from the uninterrupted run"

    ckpt = io2.load_checkpoint("epoch=3-step=16.ckpt")
    assert ckpt["global_step"] == 16 and ckpt["hyper_parameters"] == {"width": 16, "lr": 0.05}
    assert_tree_equal(ckpt["state_dict"], {k: v for k, v in resumed.state_dict().items()})
    assert isinstance(ckpt["optimizer_states"][0]["param_groups"][0]["betas"], tuple)
    with pytest.raises(FileNotFoundError, match="epoch=0-step=4.ckpt"):  # as Lightning's own IO raises
        io2.load_checkpoint(tmp_path / "nowhere" / "epoch=0-step=4.ckpt")
    with pytest.raises(StepNotFoundError, match="epoch=0-step=4.ckpt"):
        io2.resolve("epoch=0-step=4.ckpt")
    io2.teardown()


def _ckpt(gs, value, **extra):
    return {"epoch": 0, "global_step": gs, "pytorch-lightning_version": L.__version__,
            "state_dict": {"w": torch.full((3,), float(value))}, **extra}


def test_saving_a_name_again_loads_the_new_state_and_keeps_the_older_step(tmp_path):
    io = cl.CkptStoreCheckpointIO(str(tmp_path / "repo"))
    io.save_checkpoint(_ckpt(5, 1), tmp_path / "epoch=0-val_loss=0.50.ckpt")
    io.save_checkpoint(_ckpt(9, 2), tmp_path / "best.ckpt")
    assert io.resolve("epoch=0-val_loss=0.50.ckpt") == 5 and io.resolve("/elsewhere/best.ckpt") == 9
    # the same name at a global step already committed (a rerun into the same folder): a new step
    io.save_checkpoint(_ckpt(5, 3), tmp_path / "best.ckpt")
    io.save_checkpoint(_ckpt(9, 4), tmp_path / "other.ckpt")  # two names at one global step
    with ckptstore.open(str(tmp_path / "repo")) as repo:
        assert repo.steps() == [5, 9, 10, 11]
        assert repo.names(cl.NAMESPACE) == {"epoch=0-val_loss=0.50.ckpt": 5, "best.ckpt": 10, "other.ckpt": 11}
        assert repo.checkpoint(10).metadata["lightning"]["global_step"] == 5
    assert torch.equal(io.load_checkpoint(tmp_path / "best.ckpt")["state_dict"]["w"], torch.full((3,), 3.0))
    assert torch.equal(torch.load(tmp_path / "best.ckpt", weights_only=True)["state_dict"]["w"], torch.full((3,), 3.0))
    io.remove_checkpoint(tmp_path / "epoch=0-val_loss=0.50.ckpt")
    io.remove_checkpoint(tmp_path / "epoch=0-val_loss=0.50.ckpt")  # already gone: no error
    with ckptstore.open(str(tmp_path / "repo")) as repo:
        assert repo.steps() == [9, 10, 11] and "epoch=0-val_loss=0.50.ckpt" not in repo.names(cl.NAMESPACE)
    assert not (tmp_path / "epoch=0-val_loss=0.50.ckpt").exists()
    with pytest.raises(FileNotFoundError, match="epoch=0-val_loss=0.50.ckpt"):
        io.load_checkpoint(tmp_path / "epoch=0-val_loss=0.50.ckpt")


class Color(enum.Enum):
    RED = "red"


def test_non_json_values_are_converted_explicitly_or_refused(tmp_path):
    io = cl.CkptStoreCheckpointIO(str(tmp_path / "repo"))
    ckpt = {
        "global_step": 3, "state_dict": {"w": torch.ones(2)},
        "hyper_parameters": {"data": pathlib.Path("/data/x"), "color": Color.RED, "scale": torch.tensor(2.0).numpy()[()]},
    }
    io.save_checkpoint(ckpt, tmp_path / "epoch=0-step=3.ckpt")
    hp = io.load_checkpoint("epoch=0-step=3.ckpt")["hyper_parameters"]
    assert hp == {"data": "/data/x", "color": "red", "scale": 2.0} and type(hp["scale"]) is float

    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"hyper_parameters\.model.*Opaque.*never pickles"):
        io.save_checkpoint({"global_step": 4, "hyper_parameters": {"model": Opaque()}}, tmp_path / "epoch=0-step=4.ckpt")
    assert io.repository.steps() == [3], "a refused save leaves the repository as it was"
    assert not (tmp_path / "epoch=0-step=4.ckpt").exists(), "and writes no file"
    custom = cl.CkptStoreCheckpointIO(  # stand-ins: a local file would pickle Opaque, as Lightning's own IO does
        str(tmp_path / "repo"), local_files="stub", convert=lambda path, v: {"opaque": type(v).__name__}
    )
    custom.save_checkpoint({"global_step": 4, "hyper_parameters": {"model": Opaque()}}, tmp_path / "epoch=0-step=4.ckpt")
    assert custom.load_checkpoint("epoch=0-step=4.ckpt")["hyper_parameters"] == {"model": {"opaque": "Opaque"}}
    # storage_options: Lightning's own IO refuses them for the local file, before the repository changes
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"global_step": 5}, tmp_path / "epoch=0-step=5.ckpt", storage_options={"x": 1})
    stub = cl.CkptStoreCheckpointIO(str(tmp_path / "repo"), local_files="stub")
    with pytest.raises(TypeError, match="storage_options"):
        stub.save_checkpoint({"global_step": 5}, tmp_path / "epoch=0-step=5.ckpt", storage_options={"x": 1})
    assert io.repository.steps() == [3, 4]
    with pytest.raises(ValueError, match="local_files"):
        cl.CkptStoreCheckpointIO(str(tmp_path / "repo"), local_files="none")
    io.teardown()
    custom.teardown()


def test_hydra_omegaconf_hparams_round_trip_as_omegaconf(tmp_path):
    from omegaconf import DictConfig, ListConfig, OmegaConf

    class HNet(Net):
        def __init__(self, cfg):
            super().__init__()
            self.save_hyperparameters(cfg)

    cfg = OmegaConf.create({"lr": 0.05, "width": 16, "name": "run-${width}", "layers": [1, 2]})
    io = cl.CkptStoreCheckpointIO(str(tmp_path / "repo"))
    mc = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), filename="{epoch}")
    _trainer(tmp_path, 1, io, mc).fit(HNet(cfg), _loader())
    ckpt = io.load_checkpoint("epoch=0.ckpt")
    hp = ckpt["hyper_parameters"]
    assert isinstance(hp, DictConfig) and isinstance(hp.layers, ListConfig)
    assert ckpt["hparams_type"] is DictConfig
    assert hp.name == "run-16" and OmegaConf.to_container(hp)["name"] == "run-${width}", "interpolation kept"
    # Lightning rebuilds the module from the stored hparams
    again = HNet.load_from_checkpoint(str(tmp_path / "ckpts" / "epoch=0.ckpt"), weights_only=False)
    assert isinstance(again.hparams, DictConfig) and again.hparams.width == 16


def test_no_thread_is_left_running_outside_fit(tmp_path):
    import threading

    before = set(threading.enumerate())
    io = cl.CkptStoreCheckpointIO(str(tmp_path / "repo"), workers=2, io_workers=2)
    io.save_checkpoint(_ckpt(3, 1), tmp_path / "a.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"], torch.ones(3))
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert set(threading.enumerate()) - before == set()


def test_ddp_spawn_hands_rank_zero_weights_back_through_the_io(tmp_path):
    # Lightning's ddp_spawn launcher saves rank 0's module state dict as <tmp>/.temp.ckpt
    # through the IO at the end of fit, loads it in the main process and removes it.
    io = cl.CkptStoreCheckpointIO(str(tmp_path / "repo"))
    weights = {"body.weight": torch.randn(4, 8)}
    hand_off = tmp_path / "tmpdir" / ".temp.ckpt"
    io.save_checkpoint(weights, hand_off)
    assert_tree_equal(io.load_checkpoint(hand_off), weights)
    io.remove_checkpoint(hand_off)
    assert not hand_off.exists() and io.repository.steps() == [], "a hand-off is not a checkpoint of the run"
    io.teardown()

    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "c"))],
        plugins=[cl.CkptStoreCheckpointIO(str(tmp_path / "repo"))],
    )
    trainer.fit(model, _loader())
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed == ["head.weight", "head.bias"], "the trained weights came back to the main process"
    with ckptstore.open(str(tmp_path / "repo")) as repo:
        assert repo.names(cl.NAMESPACE) == {"epoch=0-step=2.ckpt": 2}
        assert_tree_equal(repo.load(2)["state_dict"], model.state_dict())


def test_stub_mode_keeps_stand_ins_that_modelcheckpoint_versions(tmp_path):
    url = str(tmp_path / "repo")
    folder = tmp_path / "ckpts"
    for run in range(2):  # a fresh run into the same folder: ModelCheckpoint sees the first run's files
        mc = ModelCheckpoint(dirpath=str(folder), filename="{epoch}", save_top_k=-1, monitor="epoch", mode="max")
        _trainer(tmp_path, 2, cl.CkptStoreCheckpointIO(url, local_files="stub"), mc).fit(Net(), _loader())
    assert _listing(folder) == ["epoch=0-v1.ckpt", "epoch=0.ckpt", "epoch=1-v1.ckpt", "epoch=1.ckpt"]
    assert all(os.path.getsize(folder / f) < 1024 for f in _listing(folder)), "no checkpoint bytes locally"
    with ckptstore.open(url) as repo:
        names = repo.names(cl.NAMESPACE)
        assert names == {"epoch=0.ckpt": 4, "epoch=1.ckpt": 8, "epoch=0-v1.ckpt": 9, "epoch=1-v1.ckpt": 10}
        assert repo.checkpoint(10).metadata["lightning"]["global_step"] == 8
    with pytest.raises(RuntimeError) as e:
        torch.load(folder / "epoch=1-v1.ckpt", weights_only=True)
    msg = str(e.value)
    assert "\n" not in msg and f"step 10 of {ckptstore.open(url).url}" in msg and "ckptstore export" in msg
    io = cl.CkptStoreCheckpointIO(url, local_files="stub")
    assert io.load_checkpoint(folder / "epoch=1-v1.ckpt")["global_step"] == 8
    io.remove_checkpoint(folder / "epoch=1-v1.ckpt")
    assert not (folder / "epoch=1-v1.ckpt").exists() and 10 not in io.repository.steps()
    io.teardown()


def test_rerun_into_the_same_folder_overwrites_a_name_without_version_counter(tmp_path):
    url = str(tmp_path / "repo")
    folder = tmp_path / "ckpts"
    models = []
    for run in range(2):
        mc = ModelCheckpoint(dirpath=str(folder), filename="{epoch}", save_top_k=-1, monitor="epoch", mode="max",
                             enable_version_counter=False)
        model = Net(lr=0.05 * (run + 1))
        _trainer(tmp_path, 1, cl.CkptStoreCheckpointIO(url), mc).fit(model, _loader())
        models.append(model)
    assert _listing(folder) == ["epoch=0.ckpt"]
    io = cl.CkptStoreCheckpointIO(url)
    with ckptstore.open(url) as repo:
        assert repo.steps() == [4, 5] and repo.names(cl.NAMESPACE) == {"epoch=0.ckpt": 5}
        first = repo.load(4)["state_dict"]
    assert_tree_equal(io.load_checkpoint(folder / "epoch=0.ckpt")["state_dict"], models[1].state_dict())
    assert_tree_equal(first, models[0].state_dict())
    io.teardown()


def test_custom_last_names_and_extensions(tmp_path):
    class LastNamed(ModelCheckpoint):
        CHECKPOINT_NAME_LAST = "last-{epoch}"
        FILE_EXTENSION = ".tpkc"

    url = str(tmp_path / "repo")
    mc = LastNamed(dirpath=str(tmp_path / "ckpts"), save_last=True, save_top_k=-1, monitor="step", mode="max")
    model = Net()
    _trainer(tmp_path, 2, cl.CkptStoreCheckpointIO(url), mc).fit(model, _loader())
    assert _listing(tmp_path / "ckpts") == ["epoch=0-step=4.tpkc", "epoch=1-step=8.tpkc", "last-epoch=1.tpkc"]
    io = cl.CkptStoreCheckpointIO(url)
    assert_tree_equal(io.load_checkpoint("last-epoch=1.tpkc")["state_dict"], model.state_dict())
    assert "last-epoch=0.tpkc" not in io.repository.names(cl.NAMESPACE), "the previous last name was removed"
    io.teardown()


def test_a_failed_commit_leaves_no_file_standing_for_it(tmp_path):
    from ckptstore.storage import open_store
    from ckptstore.storage.faults import FaultStore, permanent

    store = FaultStore(open_store(str(tmp_path / "repo")))
    repo = ckptstore.Repository(store)
    io = cl.CkptStoreCheckpointIO(repo)
    io.save_checkpoint(_ckpt(1, 1), tmp_path / "best.ckpt")
    store.add_fault(op="put_if_absent", key="manifests/*", kind="error", error=permanent())
    with pytest.raises(Exception, match="injected permanent failure"):
        io.save_checkpoint(_ckpt(2, 2), tmp_path / "best.ckpt")
    assert not (tmp_path / "best.ckpt").exists(), "the file would claim a state the repository did not take"
    assert repo.names(cl.NAMESPACE) == {"best.ckpt": 1}
    assert torch.equal(io.load_checkpoint(tmp_path / "best.ckpt")["state_dict"]["w"], torch.ones(3))
    store.clear()

    def disk_full(checkpoint, path, storage_options=None):
        raise OSError(28, "No space left on device")

    io._torch_io.save_checkpoint = disk_full  # Lightning's file fails while the step commits
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint(_ckpt(3, 3), tmp_path / "best.ckpt")
    assert repo.names(cl.NAMESPACE) == {"best.ckpt": 1}, "the name stays on the state it named"
    assert 3 in repo.steps(), "the committed step is left to GC, unnamed"
    repo.close()


def test_fit_and_resume_on_s3(tmp_path, s3):
    io = cl.CkptStoreCheckpointIO(s3.url, storage_options=s3.storage_options)
    first = Net()
    _trainer(tmp_path, 1, io, _top2(tmp_path)).fit(first, _loader())
    assert io.repository.steps() == [4, 5]
    ckpt = io.load_checkpoint("last.ckpt")
    assert ckpt["epoch"] == 0 and ckpt["global_step"] == 4
    for k, v in first.state_dict().items():
        assert torch.equal(ckpt["state_dict"][k], v), k
    again = Net()
    trainer = _trainer(tmp_path, 2, cl.CkptStoreCheckpointIO(s3.url, storage_options=s3.storage_options), _top2(tmp_path))
    trainer.fit(again, _loader(), ckpt_path="epoch=0-step=4.ckpt")
    assert trainer.global_step == 8 and io.repository.steps() == [4, 5, 8, 9]
    io.teardown()


def test_model_parallel_strategy_two_ranks_saves_shards_and_resumes(tmp_path):
    url = str(tmp_path / "repo")
    out = tmp_path / "res"
    out.mkdir()
    spawn(W.lightning_model_parallel, args=(2, free_port(), url, str(tmp_path), str(out)), nprocs=2)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["steps"] == [2, 4] and r["path"] == "epoch=1-step=4.ckpt"
        assert r["names"] == {"epoch=0-step=2.ckpt": 2, "epoch=1-step=4.ckpt": 4}
        assert r["resumed"] == r["straight"], "resumed run differs from the uninterrupted one"
        # ModelCheckpoint's score tensor travels as a DCP item, not as a pickle.
        assert any("kth_value" in k for k in r["extra_keys"])
        assert r["local"] == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"] and r["local_max_bytes"] < 1024
    with pytest.raises(ValueError, match="distributed checkpoints only"):
        cl.CkptStoreModelParallelStrategy(url, save_distributed_checkpoint=False)


def test_import_without_lightning_names_the_extra():
    code = "import sys; sys.modules['lightning'] = None; import ckptstore.integrations.lightning"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode != 0
    assert "ImportError" in res.stderr and "pip install 'ckptstore[integrations]'" in res.stderr


def test_a_name_whose_step_was_deleted_reads_the_file_or_says_so(tmp_path):
    full = cl.CkptStoreCheckpointIO(str(tmp_path / "repo"))
    full.save_checkpoint(_ckpt(1, 1), tmp_path / "a.ckpt")
    stub = cl.CkptStoreCheckpointIO(str(tmp_path / "repo"), local_files="stub")
    stub.save_checkpoint(_ckpt(2, 2), tmp_path / "b.ckpt")
    with ckptstore.open(str(tmp_path / "repo")) as repo:
        repo.delete(1)  # retention removed the named steps (names do not keep steps)
        repo.delete(2)
    # Lightning's own file is still there: it is read (weights_only), as Lightning would
    assert torch.equal(full.load_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"], torch.ones(3))
    with pytest.raises(StepNotFoundError, match=r"'b.ckpt' was saved as step 2, which has been deleted"):
        stub.load_checkpoint(tmp_path / "b.ckpt")
