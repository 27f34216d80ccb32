"""torchtitan integration: CkptStoreCheckpointManager (its config override, saves as steps,
the newest step, load_step, initial loads, keep_latest_k as GC, a step saved again, async
saves, the last save in Hugging Face names) on one process, and torchtitan's llama3
debugmodel trained on 2 gloo ranks that resumes from an s3:// repository bit for bit."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("torchtitan")

import ckptstore  # noqa: E402
from ckptstore.dcp import CkptStoreWriter  # noqa: E402
from ckptstore.integrations import torchtitan as tt  # noqa: E402
from ckptstore.testing import bits_equal, free_port  # noqa: E402
from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402
from torchtitan.config import Configurable  # noqa: E402
from torchtitan.config.override import OverrideConfig, apply_overrides, parse_cli_imports  # noqa: E402

from . import torchtitan_workers as W
from .helpers import spawn


class TrainState:
    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


class Data:
    def __init__(self):
        self.pos = 0

    def state_dict(self):
        return {"pos": torch.tensor(self.pos)}

    def load_state_dict(self, sd):
        self.pos = int(sd["pos"])


@dataclass
class Job:
    manager: tt.CkptStoreCheckpointManager
    model: nn.Module
    optimizers: object
    train: TrainState
    data: Data

    def step(self, n: int) -> None:
        """One optimizer step, then torchtitan's save call for step ``n``."""
        self.model(torch.randn(2, 4, generator=torch.Generator().manual_seed(n))).sum().backward()
        self.optimizers.step()
        self.optimizers.zero_grad()
        self.train.step, self.data.pos = n, 10 * n
        self.manager.save(n)


def job(folder, seed: int = 0, sd_adapter=None, **cfg) -> Job:
    torch.manual_seed(seed)
    model = nn.Linear(4, 4)
    opt = default_adamw(lr=0.1).build(model_parts=[model])
    lr = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=opt, training_steps=20)
    train, data = TrainState(), Data()
    cfg.setdefault("keep_latest_k", 0)
    cfg.setdefault("interval", 1)
    config = tt.CkptStoreCheckpointManager.Config(enable=True, folder=os.fspath(folder), **cfg)
    manager = config.build(dataloader=data, model_parts=[model], optimizers=opt, lr_schedulers=lr,
                           states={"train_state": train}, sd_adapter=sd_adapter, base_folder="")
    return Job(manager, model, opt, train, data)


def weights(m: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bits_equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- the override and the config
@dataclass(kw_only=True, slots=True)
class Root(Configurable.Config):
    """A config tree with torchtitan's checkpoint field, as Trainer.Config declares it."""

    checkpoint: BaseCheckpointManager.Config = field(default_factory=CheckpointManager.Config)


def test_the_override_turns_torchtitans_config_into_ours_with_repository_options():
    root = Root(checkpoint=CheckpointManager.Config(enable=True, folder="s3://b/run", interval=7, keep_latest_k=3,
                                                    async_mode="async", exclude_from_loading=["dataloader"]))
    imports = parse_cli_imports(['ckptstore.integrations.torchtitan.ckptstore_checkpoint={"cache_dir": "/nvme", '
                                 '"storage_options": {"region_name": "eu-west-1"}}'])
    replaced = apply_overrides(OverrideConfig(imports=imports), root)
    cfg = root.checkpoint
    assert len(replaced) == 1 and type(cfg) is tt.CkptStoreCheckpointManager.Config
    assert (cfg.folder, cfg.interval, cfg.keep_latest_k, cfg.async_mode) == ("s3://b/run", 7, 3, "async")
    assert cfg.exclude_from_loading == ["dataloader"] and cfg.cache_dir == "/nvme"
    assert cfg.storage_options == {"region_name": "eu-west-1"}
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['cache'\]"):
        tt.ckptstore_checkpoint(CheckpointManager.Config(), cache="/x")

    class OtherManager(CheckpointManager):  # torchtitan's TorchFT manager is one: it does more than storage
        @dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            replicas_of_mine: int = 1

    with pytest.raises(ValueError, match="replaces torchtitan's own CheckpointManager"):
        tt.ckptstore_checkpoint(OtherManager.Config())
    with pytest.raises(ValueError, match="need checkpoint.cache_dir"):
        tt.CkptStoreCheckpointManager.Config(write_back=True)


def test_repository_options_are_fields_of_torchtitans_command_line():
    import tyro
    from torchtitan.config.manager import ConfigManager, custom_registry

    ConfigManager()  # registers torchtitan's tyro rules
    args = ["--checkpoint.enable", "--checkpoint.folder", "s3://b/run", "--checkpoint.cache-dir", "/nvme",
            "--checkpoint.storage-options", "region_name", "eu-west-1", "--checkpoint.repo-options", "workers", "2"]
    cfg = tyro.cli(Root, args=args, default=Root(checkpoint=tt.CkptStoreCheckpointManager.Config()),
                   registry=custom_registry).checkpoint
    assert type(cfg) is tt.CkptStoreCheckpointManager.Config
    assert (cfg.cache_dir, cfg.storage_options, cfg.repo_options) == ("/nvme", {"region_name": "eu-west-1"},
                                                                     {"workers": 2})


@pytest.mark.slow  # two interpreters importing torch
def test_import_without_torchtitan_names_the_extra_and_ckptstore_imports_no_torchtitan():
    code = "import sys; sys.modules['torchtitan'] = None; import ckptstore.integrations.torchtitan"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode != 0 and "pip install 'ckptstore[torchtitan]'" in res.stderr
    ok = subprocess.run([sys.executable, "-c", "import ckptstore, ckptstore.integrations, ckptstore.dcp, sys; "
                         "assert not [m for m in sys.modules if m.startswith('torchtitan')]"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr


# ---------------------------------------------------------------- saves and loads
def test_each_save_is_a_step_and_a_new_job_resumes_from_the_newest(tmp_path):
    url = tmp_path / "run"
    a = job(url)
    for n in (1, 2, 3):
        a.step(n)
    want = weights(a.model)
    want_opt = {k: v.clone() for k, v in a.optimizers.state_dict().items() if torch.is_tensor(v)}
    a.manager.close()
    with ckptstore.open(str(url)) as repo:
        assert repo.steps() == [1, 2, 3]
        meta = repo.checkpoint(3).metadata[tt.METADATA_KEY]
        assert meta == {"format": 1, "step": 3, "hf": False, "model_only": False}
        assert {"weight", "bias", "train_state", "dataloader.pos"} <= set(repo.checkpoint(3).keys()) | {"train_state"}
    b = job(url, seed=1)
    assert not same(weights(b.model), want)
    assert b.manager.load() is True
    assert same(weights(b.model), want) and (b.train.step, b.data.pos) == (3, 30)
    got_opt = b.optimizers.state_dict()
    assert all(bits_equal(got_opt[k], v) for k, v in want_opt.items())
    assert tt.checkpoint_steps(url) == {1: 1, 2: 2, 3: 3} and b.manager._find_load_step() == 3
    b.manager.close()


def test_load_step_names_a_step_and_a_missing_one_says_what_there_is(tmp_path):
    a = job(tmp_path / "run")
    a.step(1)
    at1 = weights(a.model)
    a.step(2)
    a.manager.close()
    b = job(tmp_path / "run", seed=1)
    assert b.manager.load(step=1) and same(weights(b.model), at1) and b.train.step == 1
    with pytest.raises(FileNotFoundError, match=r"--checkpoint.load_step=9 not found: .* holds steps \[1, 2\]"):
        b.manager.load(step=9)
    b.manager.close()
    c = job(tmp_path / "nothing-here")
    with pytest.raises(FileNotFoundError, match="--checkpoint.load_step=2 not found: .* holds no checkpoint"):
        c.manager.load(step=2)
    assert c.manager.load() is False  # a fresh start
    c.manager.close()


def test_keep_latest_k_is_a_gc_policy_that_keeps_the_step_this_job_loaded(tmp_path, caplog):
    url = tmp_path / "run"
    a = job(url)
    for n in (1, 2, 3, 4):
        a.step(n)
    a.manager.close()
    b = job(url, keep_latest_k=2)
    b.manager.load(step=1)  # a rerun from an older step
    with caplog.at_level(logging.INFO):
        for n in (5, 6, 7):
            b.step(n)
        b.manager.close()  # waits for the retention runs it asked for
    with ckptstore.open(str(url)) as repo:
        assert repo.steps() == [1, 6, 7]  # the newest 2, and step 1, which this job loaded
        assert repo.verify().ok
    assert any("keep_latest_k=2: deleted steps" in r.getMessage() for r in caplog.records)


def test_saving_a_step_again_commits_a_new_step_and_moves_its_name(tmp_path, caplog):
    url = tmp_path / "run"
    a = job(url)
    for n in (2, 4, 6):
        a.step(n)
    a.manager.close()
    with ckptstore.open(str(url)) as repo:
        old4 = {k: repo.checkpoint(4).read(k) for k in ("weight", "bias")}
    b = job(url, keep_latest_k=2)
    b.manager.load(step=2)
    with torch.no_grad():
        b.model.bias.add_(1.0)  # this rerun takes another path from step 2
    with caplog.at_level(logging.WARNING):
        b.step(4)  # torchtitan's step 4 again, from another state
    new4 = weights(b.model)
    assert any("step-4 already exists" in r.getMessage() and "repository step 7" in r.getMessage()
               for r in caplog.records)
    b.manager.close()
    with ckptstore.open(str(url)) as repo:
        assert repo.names(tt.NAMESPACE) == {"step-4": 7}
        # keep 2: the new step 4 (7) and step 6; the step loaded (2); the earlier step 4 no longer counts
        assert repo.steps() == [2, 6, 7]
        assert repo.checkpoint(7).metadata[tt.METADATA_KEY]["step"] == 4
    assert tt.checkpoint_steps(url) == {2: 2, 4: 7, 6: 6}
    c = job(url, seed=3)
    assert c.manager.load(step=4) and same(weights(c.model), new4) and not same(weights(c.model), old4)
    assert c.manager.load() and c.train.step == 4  # the newest checkpoint is the most recent save
    c.manager.close()


def test_exclude_from_loading_and_initial_load_model_only_from_another_repository(tmp_path):
    a = job(tmp_path / "pretrain")
    a.step(5)
    want = weights(a.model)
    a.manager.close()
    b = job(tmp_path / "finetune", seed=1, initial_load_path=str(tmp_path / "pretrain" / "step-5"),
            initial_load_model_only=True)
    assert b.manager.load() and same(weights(b.model), want)
    assert (b.train.step, b.data.pos) == (0, 0)  # model only
    b.step(6)
    b.manager.close()
    c = job(tmp_path / "finetune", seed=2, exclude_from_loading=["dataloader"],
            initial_load_path=str(tmp_path / "pretrain" / "step-5"))
    assert c.manager.load() and c.train.step == 6 and c.data.pos == 0  # its own folder wins; dataloader excluded
    d = job(tmp_path / "other", seed=3, initial_load_path=str(tmp_path / "pretrain"))  # a repository: its newest
    assert d.manager.load() and same(weights(d.model), want)
    d.manager.close()
    with pytest.raises(ValueError, match=r"initial_load_path is invalid: .*step-4 \(the repository .* steps \[5\]"):
        job(tmp_path / "x", initial_load_path=str(tmp_path / "pretrain" / "step-4")).manager.load()
    c.manager.close()


def test_initial_load_path_and_old_step_folders_of_plain_dcp_load_as_torchtitan_does(tmp_path):
    import torch.distributed.checkpoint as dcp

    a = job(tmp_path / "x")
    a.step(3)
    state = a.manager._flattened_model_states_sd()
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp" / "step-3"))  # torchtitan's own layout
    want = weights(a.model)
    a.manager.close()
    b = job(tmp_path / "new", seed=1, initial_load_path=str(tmp_path / "dcp" / "step-3"), initial_load_model_only=False)
    assert b.manager.load() and same(weights(b.model), want) and b.train.step == 3
    b.manager.close()
    # a local checkpoint folder holding torchtitan's step folders (saved before ckptstore) resumes from them
    c = job(tmp_path / "dcp", seed=2)
    assert c.manager.load() and same(weights(c.model), want) and c.train.step == 3
    c.step(4)  # later saves are repository steps in the same folder
    c.manager.close()
    assert tt.checkpoint_steps(tmp_path / "dcp") == {4: 4}


@pytest.fixture
def one_rank():
    """A gloo process group of one rank (torchtitan's async modes make a group of their own)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_async_save_saves_a_copy_in_the_background_and_close_waits_for_it(tmp_path, one_rank, monkeypatch):
    release = threading.Event()

    class HeldWriter(CkptStoreWriter):
        def finish(self, metadata, results):
            release.wait()
            return super().finish(metadata, results)

    monkeypatch.setattr(tt, "CkptStoreWriter", HeldWriter)
    url = tmp_path / "run"
    a = job(url, async_mode="async")
    a.step(1)
    saved = weights(a.model)
    with torch.no_grad():
        a.model.weight.add_(1.0)  # training goes on while the save is in flight
    assert a.manager.save_future is not None and not a.manager.save_future.done()
    assert tt.checkpoint_steps(url) == {}
    closing = threading.Thread(target=a.manager.close)
    closing.start()
    closing.join(0.2)
    assert closing.is_alive()  # close() waits for the save in flight
    release.set()
    closing.join()
    assert tt.checkpoint_steps(url) == {1: 1}
    with ckptstore.open(str(url)) as repo:
        assert bits_equal(repo.checkpoint(1).read("weight"), saved["weight"])


def test_an_async_save_of_a_step_again_names_it_before_the_wait_returns(tmp_path, one_rank):
    url = tmp_path / "run"
    a = job(url)
    a.step(1)
    a.step(2)
    a.manager.close()
    b = job(url, async_mode="async")
    b.manager.load(step=1)
    with torch.no_grad():
        b.model.bias.add_(1.0)
    b.step(2)
    b.manager.maybe_wait_for_saving()  # the step is committed and named
    assert tt.checkpoint_steps(url) == {1: 1, 2: 3}
    want = weights(b.model)
    b.manager.close()
    c = job(url, seed=5)
    assert c.manager.load(step=2) and same(weights(c.model), want)
    c.manager.close()


def test_retention_of_one_job_runs_safely_while_another_jobs_save_is_in_flight(tmp_path, one_rank, monkeypatch):
    release = threading.Event()

    class HeldWriter(CkptStoreWriter):
        def finish(self, metadata, results):
            if self.step == 1:  # job a's save: its packs are written, its commit waits
                release.wait()
            return super().finish(metadata, results)

    monkeypatch.setattr(tt, "CkptStoreWriter", HeldWriter)
    url = tmp_path / "shared"
    a = job(url, async_mode="async")
    a.step(1)
    saved = weights(a.model)
    b = job(url, seed=1, keep_latest_k=2)
    for n in (10, 11, 12):
        b.step(n)
    b.manager.close()  # its retention ran GC while a's packs were uncommitted
    release.set()
    a.manager.close()
    with ckptstore.open(str(url)) as repo:
        assert repo.steps() == [1, 11, 12]
        assert repo.verify(read_data=True).ok
        assert bits_equal(repo.checkpoint(1).read("weight"), saved["weight"])


def test_async_with_pinned_memory_is_refused_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the mode is allowed")
    with pytest.raises(ValueError, match=r"no CUDA device .* --checkpoint.async_mode async"):
        job(tmp_path / "run", async_mode="async_with_pinned_mem")


class SwapAdapter:
    """A state-dict adapter like torchtitan's: Hugging Face names are ``model.<name>``."""

    fqn_to_index_mapping = None

    def to_hf(self, sd):
        return {f"model.{k}": v for k, v in sd.items()}

    def from_hf(self, sd):
        return {k.removeprefix("model."): v for k, v in sd.items()}


def test_last_save_model_only_in_export_dtype_and_in_hugging_face_names(tmp_path):
    from safetensors.torch import load_file

    url = tmp_path / "run"
    a = job(url, sd_adapter=SwapAdapter(), last_save_model_only=True, last_save_in_hf=True, export_dtype="bfloat16")
    a.step(1)
    a.manager.save(2, last_step=True)
    want = weights(a.model)
    a.manager.close()
    with ckptstore.open(str(url)) as repo:
        ckpt = repo.checkpoint(2)
        assert sorted(ckpt.keys()) == ["model.bias", "model.weight"]  # model only, Hugging Face names
        assert ckpt.metadata[tt.METADATA_KEY] == {"format": 1, "step": 2, "hf": True, "model_only": True}
    out = load_file(str(url / "step-2" / "model.safetensors"))
    assert {k: v.dtype for k, v in out.items()} == {"model.weight": torch.bfloat16, "model.bias": torch.bfloat16}
    assert bits_equal(out["model.weight"], want["weight"].to(torch.bfloat16))
    b = job(tmp_path / "other", seed=4, sd_adapter=SwapAdapter(), initial_load_path=str(url / "step-2"),
            initial_load_in_hf=True)
    assert b.manager.load()
    assert bits_equal(b.model.weight.detach(), want["weight"].to(torch.bfloat16).float())
    b.manager.close()


@pytest.mark.slow  # the moto server
def test_s3_through_the_aws_conventions_with_a_node_local_tier(tmp_path, s3, monkeypatch):
    opts = s3.storage_options
    monkeypatch.setenv("AWS_ENDPOINT_URL", opts["client_kwargs"]["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", opts["client_kwargs"]["region_name"])
    url = f"s3://{s3.bucket}/titan"
    a = job(url, cache_dir=str(tmp_path / "tier"), keep_latest_k=2)
    for n in (1, 2, 3):
        a.step(n)
    want = weights(a.model)
    a.manager.close()
    assert tt.checkpoint_steps(url) == {2: 2, 3: 3}
    assert any(p.is_file() for p in (tmp_path / "tier").rglob("*"))  # the tier kept what the saves uploaded
    b = job(url, seed=1)
    assert b.manager.load() and same(weights(b.model), want) and b.train.step == 3
    b.manager.close()


# ---------------------------------------------------------------- a real torchtitan run
@pytest.mark.slow
def test_llama3_debugmodel_on_two_cpu_ranks_resumes_exactly_from_s3(tmp_path, s3):
    """6 of 8 steps saving every 2 (stopped as if preempted), then a resume to 8: steps 7-8
    lose what an uninterrupted run loses, bit for bit; synchronous and async saves."""
    data, assets = W.make_assets(str(tmp_path))
    opts = s3.storage_options
    env = {
        "AWS_ENDPOINT_URL": opts["client_kwargs"]["endpoint_url"], "AWS_ACCESS_KEY_ID": opts["key"],
        "AWS_SECRET_ACCESS_KEY": opts["secret"], "AWS_DEFAULT_REGION": opts["client_kwargs"]["region_name"],
        "HF_DATASETS_CACHE": str(tmp_path / "hf-cache"),
    }
    base = W.base_args(data, assets, str(tmp_path / "dump"), steps=8)
    override = ["--override.imports", "ckptstore.integrations.torchtitan.ckptstore_checkpoint"]

    def ckpt(name, *extra):
        return base + override + ["--checkpoint.enable", "--checkpoint.folder", f"s3://{s3.bucket}/{name}",
                                  "--checkpoint.interval", "2", "--checkpoint.keep-latest-k", "2", *extra]

    phases = [
        {"name": "straight", "args": base},
        {"name": "sync-6", "args": ckpt("sync"), "stop": 6},
        {"name": "sync-8", "args": ckpt("sync")},
        {"name": "async-6", "args": ckpt("async", "--checkpoint.async-mode", "async"), "stop": 6},
        {"name": "async-8", "args": ckpt("async", "--checkpoint.async-mode", "async")},
    ]
    out = tmp_path / "out"
    out.mkdir()
    ports = [free_port() for _ in phases]
    spawn(W.run_phases, args=(2, ports, phases, env, str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    run = ranks[0]
    straight = run["straight"]["losses"]
    assert sorted(straight, key=int) == [str(n) for n in range(1, 9)]
    for mode in ("sync", "async"):
        first, resumed = run[f"{mode}-6"], run[f"{mode}-8"]
        assert first["manager"] == resumed["manager"] == "CkptStoreCheckpointManager"
        assert first["resumed_from"] is None and first["step"] == 6
        assert first["losses"] == {n: straight[n] for n in map(str, range(1, 7))}  # saving changes nothing
        assert resumed["resumed_from"] == 6 and resumed["step"] == 8
        assert resumed["losses"] == {"7": straight["7"], "8": straight["8"]}, mode
        with ckptstore.open(f"s3://{s3.bucket}/{mode}", storage_options=opts) as repo:
            # keep_latest_k=2 after each interval save (6 of 8 steps: 4 and 6); the last step's save
            # is not followed by one, as in torchtitan
            assert repo.steps() == [4, 6, 8], mode
            assert repo.checkpoint(8).metadata[tt.METADATA_KEY]["model_only"] is False


@pytest.mark.slow  # DCP starts a background process
def test_async_with_pinned_memory_saves_from_a_background_process(tmp_path, one_rank, monkeypatch):
    """The mode's path (torchtitan's stager, DCP's process-based upload of CkptStoreWriter), on CPU:
    pinned staging itself needs CUDA, so the stager here stages (in a thread) without pinning."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    unpinned = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                              use_non_blocking_copy=False)
    monkeypatch.setattr(tt._tt_dcp, "DefaultStager", lambda options: DefaultStager(unpinned))
    url = tmp_path / "run"
    a = job(url, async_mode="async_with_pinned_mem")
    a.step(1)
    saved = weights(a.model)
    assert a.manager.staging_future is not None and a.manager.save_future is not None
    a.manager.maybe_wait_for_staging()
    with torch.no_grad():
        a.model.weight.add_(1.0)
    a.manager.close()
    with ckptstore.open(str(url)) as repo:
        assert repo.steps() == [1] and bits_equal(repo.checkpoint(1).read("weight"), saved["weight"])
