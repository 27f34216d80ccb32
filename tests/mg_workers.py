"""Process bodies for the Megatron-Core integration tests (gloo on 127.0.0.1, CPU only).

Expected values travel between processes as torch.save files in the test's
tmp dir (test scaffolding only; the store never holds a pickle).
"""

from __future__ import annotations

import os
import sys

import torch

IN, HID = 16, 32


def init(rank: int, world: int, port: int, tp: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return parallel_state


def shutdown():
    import torch.distributed as dist

    from megatron.core import parallel_state

    try:
        dist.barrier()
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    # as tests/ds_workers.shutdown: no interpreter finalization with gloo groups still referenced
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def layers(seed: int):
    """A column-parallel then a row-parallel linear layer (Megatron's TP pair)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=2, use_cpu_initialization=True,
                            params_dtype=torch.float32)
    col = ColumnParallelLinear(IN, HID, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                               gather_output=False)
    row = RowParallelLinear(HID, IN, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                            input_is_parallel=True, skip_bias_add=False)
    return col, row


def sharded(ps, col, row, extra):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    md = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    sd = {"col": col.sharded_state_dict(prefix="col.", metadata=md),
          "row": row.sharded_state_dict(prefix="row.", metadata=md)}
    tp_rank = ps.get_tensor_model_parallel_rank()
    # A ShardedObject replicated over TP: tensor-parallel rank 0 saves it, every rank loads it.
    sd["rng"] = ShardedObject("rng", extra, (1,), (0,), replica_id=tp_rank)
    sd["iteration"] = 5
    return sd


def full_weights(ps, col, row) -> dict:
    """The global tensors of both layers (gathered over the TP group)."""
    import torch.distributed as dist

    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group()

    def gather(t, dim):
        if tp == 1:
            return t.detach().clone()
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.detach().contiguous(), group=group)
        return torch.cat(parts, dim)

    return {"col.weight": gather(col.weight, 0), "col.bias": gather(col.bias, 0),
            "row.weight": gather(row.weight, 1), "row.bias": row.bias.detach().clone()}


def save_worker(rank, world, port, url, so, tmp):
    """TP=2 over 2 ranks: save step 5, then the same state as step 6 (which must upload no tensor bytes)."""
    from megatron.core import dist_checkpointing

    from ckptstore.integrations import megatron as cmg

    ps = init(rank, world, port, tp=world)
    col, row = layers(seed=0)
    x = torch.randn(4, IN)
    out, _ = row(col(x)[0])  # the layers run (gloo all-reduce) before the save
    extra = {"offset": torch.tensor([3, 7]), "name": "run", "ids": (1, 2)}
    want = full_weights(ps, col, row)
    for step in (5, 6):
        ckpt_dir = os.path.join(tmp, f"iter_{step:07d}")
        os.makedirs(ckpt_dir, exist_ok=True)
        strat = cmg.save_strategy(url, step, storage_options=so, chunk_size=4096)
        dist_checkpointing.save(sharded(ps, col, row, extra), ckpt_dir, sharded_strategy=strat)
        if step == 6:
            stats = strat.last_rank_stats
            assert stats["new_bytes"] == 0 and stats["reused_bytes"] == stats["logical_bytes"] > 0, stats
    if rank == 0:
        torch.save(want, os.path.join(tmp, "mg_expect.pt"))
    shutdown()


def load_worker(rank, world, port, url, so, tmp):
    """TP=1: the full layers load bit-exact from the TP=2 step, also by the directory's pointer."""
    from megatron.core import dist_checkpointing

    from ckptstore.integrations import megatron as cmg

    ps = init(rank, world, port, tp=world)
    want = torch.load(os.path.join(tmp, "mg_expect.pt"), weights_only=True)
    col, row = layers(seed=3)
    ckpt_dir = os.path.join(tmp, "iter_0000005")
    for strat in (cmg.load_strategy(url, step=5, storage_options=so), cmg.load_strategy(url, storage_options=so)):
        loaded = dist_checkpointing.load(sharded(ps, col, row, None), ckpt_dir, sharded_strategy=strat)
        got = {"col.weight": loaded["col"]["col.weight"], "col.bias": loaded["col"]["col.bias"],
               "row.weight": loaded["row"]["row.weight"], "row.bias": loaded["row"]["row.bias"]}
        for k, v in want.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        assert loaded["iteration"] == 5
        objs = loaded["rng"]
        assert objs["name"] == "run" and objs["ids"] == (1, 2) and torch.equal(objs["offset"], torch.tensor([3, 7])), objs
    shutdown()
