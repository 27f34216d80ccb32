"""Process bodies for the 2-rank Hugging Face and Lightning integration tests.

Spawned with torch.multiprocessing (gloo on 127.0.0.1); each writes what the
test checks as JSON into its result folder, so nothing is pickled back.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist


def _env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    torch.set_num_threads(1)


def _write(out: str, rank: int, doc: dict) -> None:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(doc, f)


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )


# ---------------------------------------------------------------- Hugging Face
def hf_tensor_parallel(rank: int, world: int, port: int, url: str, step: int, out: str) -> None:
    """from_pretrained(tp_plan="auto") over a lazy state dict: each rank reads its slices."""
    _env(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import ckptstore
        from ckptstore.integrations import hf
        from ckptstore.storage import open_store
        from ckptstore.storage.wrappers import CountingStore
        from transformers import LlamaForCausalLM

        store = CountingStore(open_store(url))
        repo = ckptstore.Repository(store)
        full = repo.load(step)
        ckpt = repo.checkpoint(step)
        stored = sum(ckpt.tensor_meta(k).stored_bytes for k in ckpt.keys())
        store.reset()
        lazy = hf.lazy_state_dict(repo, step)
        model = LlamaForCausalLM.from_pretrained(None, config=tiny_llama_config(), state_dict=lazy, tp_plan="auto")
        read = sum(e - s for key, s, e in store.reads if key.startswith("packs/"))
        mismatched, sharded = [], []
        for name, p in model.state_dict().items():
            local = p.to_local() if hasattr(p, "to_local") else p
            if hasattr(p, "placements") and any(pl.is_shard() for pl in p.placements):
                (dim,) = [pl.dim for pl in p.placements if pl.is_shard()]
                want = full[name].chunk(world, dim=dim)[rank]
                sharded.append(name)
            else:
                want = full[name]
            if not torch.equal(local.detach(), want):
                mismatched.append(name)
        _write(out, rank, {"read": read, "stored": stored, "mismatched": mismatched, "sharded": sharded})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def hf_fsdp_route(rank: int, world: int, port: int, url: str, tmp: str, out: str) -> None:
    """accelerate's own save_fsdp_model/optimizer and load_* (what Trainer calls) under the router."""
    _env(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin
        from accelerate.utils.fsdp_utils import (
            load_fsdp_model,
            load_fsdp_optimizer,
            save_fsdp_model,
            save_fsdp_optimizer,
        )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import ckptstore
        from ckptstore.integrations import hf

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
        acc = Accelerator(cpu=True)
        mesh = init_device_mesh("cpu", (world,))

        def build():
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
            for layer in (m[0], m[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(m, mesh=mesh)
            return m, torch.optim.AdamW(m.parameters(), lr=0.1)

        model, opt = build()
        torch.manual_seed(1 + rank)
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        output_dir = os.path.join(tmp, "out")
        ckpt_dir = os.path.join(output_dir, "checkpoint-7")
        with hf.route_fsdp_checkpoints(url, output_dir, chunk_size=4096):
            save_fsdp_model(plugin, acc, model, ckpt_dir)
            save_fsdp_optimizer(plugin, acc, opt, model, ckpt_dir)
        fresh, fresh_opt = build()
        with hf.route_fsdp_checkpoints(url, output_dir):
            load_fsdp_model(plugin, acc, fresh, ckpt_dir)
            load_fsdp_optimizer(plugin, acc, fresh_opt, fresh, ckpt_dir)
        bad = [k for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values())
               if not torch.equal(a.to_local(), b.to_local())]
        for p, q in zip(model.parameters(), fresh.parameters()):
            for k in ("exp_avg", "exp_avg_sq"):
                if not torch.equal(opt.state[p][k].to_local(), fresh_opt.state[q][k].to_local()):
                    bad.append(f"optimizer {k}")
        local_files = sorted(
            os.path.relpath(os.path.join(d, f), ckpt_dir) for d, _, fs in os.walk(ckpt_dir) for f in fs
        )
        dist.barrier()
        steps = {}
        for name in ("pytorch_model_fsdp_0", "optimizer_0"):
            with ckptstore.open(f"{url}/{name}") as repo:
                steps[name] = repo.steps()
        _write(out, rank, {"bad": bad, "local_files": local_files, "dirs": sorted(os.listdir(ckpt_dir)), "steps": steps})
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- Lightning
def lightning_model_parallel(rank: int, world: int, port: int, url: str, tmp: str, out: str) -> None:
    """CkptStoreModelParallelStrategy (FSDP2 over 2 ranks): save, resume, equal to an uninterrupted run."""
    _env(rank, world, port)
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    import ckptstore
    from ckptstore.integrations.lightning import CkptStoreModelParallelStrategy
    from lightning.pytorch.strategies import ModelParallelStrategy

    class Sharded(L.LightningModule):
        def __init__(self, width: int = 32):
            super().__init__()
            self.save_hyperparameters()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, i):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g))

    def trainer(strategy, epochs, checkpointing):
        cbs = [ModelCheckpoint(dirpath=os.path.join(tmp, "ckpts"), every_n_epochs=1, save_top_k=-1)] if checkpointing else []
        return L.Trainer(
            accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs, logger=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=cbs,
            enable_checkpointing=checkpointing, default_root_dir=tmp,
        )

    def params(module):
        return {k: v.full_tensor().tolist() for k, v in module.net.state_dict().items()}

    def loader():
        return DataLoader(data, batch_size=8, shuffle=False)

    strat = lambda: CkptStoreModelParallelStrategy(  # noqa: E731
        url, data_parallel_size=world, tensor_parallel_size=1, process_group_backend="gloo",
        repo_options={"chunk_size": 4096},
    )
    first = Sharded()
    trainer(strat(), 1, True).fit(first, loader())
    resumed = Sharded()
    trainer(strat(), 2, True).fit(resumed, loader(), ckpt_path=os.path.join(tmp, "elsewhere", "epoch=0-step=2.ckpt"))
    straight = Sharded()
    plain = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, process_group_backend="gloo")
    trainer(plain, 2, False).fit(straight, loader())
    with ckptstore.open(url) as repo:
        steps = repo.steps()
        meta = repo.checkpoint(steps[-1]).metadata["lightning"]
        keys = repo.checkpoint(steps[-1]).keys()
        names = repo.names("lightning")
    local = sorted(os.listdir(os.path.join(tmp, "ckpts")))
    _write(out, rank, {
        "resumed": params(resumed), "straight": params(straight), "steps": steps, "names": names,
        "path": meta["path"], "extra_keys": [k for k in keys if k.startswith("lightning_extra.")],
        "local": local, "local_max_bytes": max(os.path.getsize(os.path.join(tmp, "ckpts", f)) for f in local),
    })
