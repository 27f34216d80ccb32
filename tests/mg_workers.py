"""Process bodies for the Megatron-Core integration tests (gloo on 127.0.0.1, CPU only).

Expected values travel between processes as torch.save files in the test's
tmp dir (test scaffolding only; the store never holds a pickle).
"""

from __future__ import annotations

import os
import sys

import torch

IN, HID = 16, 32


def init(rank: int, world: int, port: int, tp: int, pp: int = 1):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
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
    sd["rng"] = ShardedObject("rng", extra, (1,), (0,), replica_id=tp_rank + 2 * ps.get_data_parallel_rank())
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


# ------------------------------------------------------------------ GPT, tensor x pipeline parallel
GPT_LAYERS, GPT_HIDDEN, GPT_VOCAB, GPT_SEQ = 4, 16, 64, 8
#: ``sharded_state_dict`` metadata of the two layer numberings: a layer axis prepended to each
#: layer tensor (global shape (layers, ...), the stage's layers at their global offsets; the default),
#: and one key per layer holding its global number (``decoder.layers.2.mlp...``).
NUMBERINGS = {"offsets": {}, "per_layer": {"non_homogeneous_layers": True}}


def gpt(ps, seed: int):
    """A GPT (local layer spec, tied embeddings) for this rank's tensor- and pipeline-parallel position.

    Megatron ties the last stage's output layer to the first stage's word
    embeddings with an all-reduce over the embedding group after moving the
    weight to the GPU (``LanguageModule.setup_embeddings_and_output_layer``
    calls ``weight.data.cuda()``); on CPU, test scaffolding makes that
    ``.cuda()`` a no-op for the model's construction only, and gloo does the
    all-reduce.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=GPT_LAYERS, hidden_size=GPT_HIDDEN, num_attention_heads=4,
                            use_cpu_initialization=True, pipeline_dtype=torch.float32,
                            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                            pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size())
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=GPT_VOCAB,
                        max_sequence_length=GPT_SEQ, share_embeddings_and_output_weights=True,
                        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    finally:
        torch.Tensor.cuda = cuda


def gpt_sharded(ps, model, numbering: str):
    md = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True), **NUMBERINGS[numbering]}
    return model.sharded_state_dict(metadata=md)


def global_value(key: str, shape) -> torch.Tensor:
    """The value every test model holds in global tensor ``key`` (seeded by the key, whatever the layout)."""
    import zlib

    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))


def sharded_tensors(sd) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [v for v in nested_values(sd) if isinstance(v, ShardedTensor)]


def fs_save_strategy():
    """Megatron's torch_dist save (its translation and MCoreSavePlanner) over torch's FileSystemWriter.

    Megatron's stock torch_dist save cannot run on CPU
    (``filesystem_async.py:preload_tensors`` calls ``torch.cuda.synchronize()``);
    this is the same format, which Megatron's stock torch_dist load strategy reads.
    """
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class FsSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            dcp.save(mcore_to_pyt_state_dict(sd, False), storage_writer=dcp.FileSystemWriter(str(checkpoint_dir)),
                     planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                              flatten_state_dict=False))

    return FsSave("torch_dist", 1)


def tp_pp_worker(rank, world, port, url, tmp, targets):
    """TP2 x PP2 saves (each numbering: a ckptstore step and a torch_dist folder), then every target loads both.

    The saved model holds :func:`global_value` in every global tensor; a
    target (tp, pp) layout on the same 4 ranks (data-parallel replicas make
    up the rest) builds a model from another seed, loads, and must hold
    exactly those values in every shard, as Megatron's own torch_dist load
    of the folder gives them.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    from ckptstore.integrations import megatron as cmg

    ps = init(rank, world, port, tp=2, pp=2)
    model = gpt(ps, seed=0)
    with torch.no_grad():
        for st in sharded_tensors(gpt_sharded(ps, model, "offsets")):
            st.data.copy_(global_value(st.key, st.global_shape)[st.global_slice()])
    dirs = {}
    for step, numbering in enumerate(NUMBERINGS, start=1):
        ck, stock = os.path.join(tmp, f"{numbering}-ck"), os.path.join(tmp, f"{numbering}-torch_dist")
        os.makedirs(ck, exist_ok=True)
        os.makedirs(stock, exist_ok=True)
        dist_checkpointing.save(gpt_sharded(ps, model, numbering), ck, sharded_strategy=cmg.save_strategy(url, step))
        dist_checkpointing.save(gpt_sharded(ps, model, numbering), stock, sharded_strategy=fs_save_strategy())
        dirs[numbering] = (step, ck, stock)
    ps.destroy_model_parallel()

    for tp, pp in targets:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        for numbering, (step, ck, stock) in dirs.items():
            loaded = {}
            for side, strat, d in (("ckptstore", cmg.load_strategy(url, step), ck),
                                   ("torch_dist", TorchDistLoadShardedStrategy(), stock)):
                m = gpt(ps, seed=5)
                state = dist_checkpointing.load(gpt_sharded(ps, m, numbering), d, sharded_strategy=strat)
                m.load_state_dict(state)
                n = 0  # checked through the offsets view, in which the saved model got its values
                for st in sharded_tensors(gpt_sharded(ps, m, "offsets")):
                    want = global_value(st.key, st.global_shape)[st.global_slice()]
                    assert torch.equal(st.data, want), (side, numbering, (tp, pp), st.key)
                    n += 1
                assert n > 0
                loaded[side] = {k: v.detach().clone() for k, v in m.state_dict().items() if torch.is_tensor(v)}
            a, b = loaded["ckptstore"], loaded["torch_dist"]
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (numbering, tp, pp)
        ps.destroy_model_parallel()
    shutdown()


# ------------------------------------------------------------------ async saves (Megatron's AsyncCallsQueue)
def _cpu_cuda_calls():
    # Megatron's async queue makes CUDA calls even for CPU state: flag tensors on
    # torch.cuda.current_device(), torch.cuda.synchronize() before forking, and
    # torch.cuda.set_device() in the persistent worker. On the CPU: the CPU, no-ops.
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.device_count = lambda: 1


def cuda_shim():
    """:func:`_cpu_cuda_calls` here and in Megatron's persistent worker (spawned: it starts through
    :func:`_shimmed_async_loop`, which makes the same calls first)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    _cpu_cuda_calls()
    PersistentAsyncCaller.async_loop = staticmethod(_shimmed_async_loop)


def _shimmed_async_loop(*args, **kwargs):
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    _cpu_cuda_calls()
    return PersistentAsyncCaller.async_loop(*args, **kwargs)  # a fresh process: Megatron's own loop


def save_kwargs() -> dict:
    """``dist_checkpointing.save`` arguments of an async save at this Megatron version (0.17+: async_strategy)."""
    import inspect

    from megatron.core import dist_checkpointing

    kw = {"async_sharded_save": True}
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        kw["async_strategy"] = "mcore"
    return kw


def _files(root) -> set:
    out = set()
    for d, _, names in os.walk(root):
        out.update(os.path.relpath(os.path.join(d, n), root) for n in names)
    return {f for f in out if not f.startswith("leases")}


def _load_check(ps, url, ckpt_dir, step, want):
    from megatron.core import dist_checkpointing

    from ckptstore.integrations import megatron as cmg

    col, row = layers(seed=9)
    loaded = dist_checkpointing.load(sharded(ps, col, row, None), ckpt_dir, sharded_strategy=cmg.load_strategy(url))
    got = {"col.weight": loaded["col"]["col.weight"], "row.weight": loaded["row"]["row.weight"],
           "col.bias": loaded["col"]["col.bias"], "row.bias": loaded["row"]["row.bias"]}
    mine = local_weights(ps, want)
    for k, v in mine.items():
        assert torch.equal(got[k], v), (step, k)
    assert loaded["iteration"] == 5 and loaded["rng"]["name"] == "run", loaded.keys()
    # the folder holds Megatron's metadata.json and ckptstore's pointer (0.16: and Megatron's common.pt);
    # 0.17+ reads its common state (iteration, ...) from the repository, through ckptstore's reader
    assert set(os.listdir(ckpt_dir)) - {"common.pt"} == {"metadata.json", "ckptstore.json"}, os.listdir(ckpt_dir)


def local_weights(ps, full: dict) -> dict:
    """This TP rank's slices of :func:`full_weights`."""
    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return {"col.weight": full["col.weight"].chunk(tp, 0)[r], "col.bias": full["col.bias"].chunk(tp, 0)[r],
            "row.weight": full["row.weight"].chunk(tp, 1)[r], "row.bias": full["row.bias"]}


def async_worker(rank, world, port, tmp, modes):
    """:func:`_async_run` for each worker in ``modes`` ("persistent", "temporal"), each with its own
    repository (``file://<tmp>/<mode>/repo``), in one pair of ranks."""
    ps = init(rank, world, port, tp=world)
    cuda_shim()
    for mode in modes:
        d = os.path.join(tmp, mode)
        os.makedirs(d, exist_ok=True)
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=world)
        _async_run(ps, rank, f"file://{d}/repo", d, mode == "persistent")
    shutdown()


def _async_run(ps, rank, url, tmp, persistent):
    """Async saves at TP=2 through Megatron's AsyncCallsQueue (temporal or persistent worker).

    Step 10: training changes the weights right after scheduling; the step
    holds the values at the call and is committed only by finalize. Step 20
    (the same strategy, its step from the folder name) is in flight while a
    synchronous save commits step 15; both load back. Temporal worker only
    (patches reach a forked worker): step 30 fails on rank 1's worker, raises
    on both ranks and leaves nothing; step 40's workers are killed mid-upload:
    no step, the newest stays 20.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    import ckptstore
    from ckptstore.integrations import megatron as cmg

    q = AsyncCallsQueue(persistent=persistent)
    col, row = layers(seed=0)
    extra = {"offset": torch.tensor([3, 7]), "name": "run", "ids": (1, 2)}
    strat = cmg.save_strategy(url, chunk_size=4096)  # one strategy for every save; steps from the folders

    def folder(step):
        d = os.path.join(tmp, f"iter_{step:07d}")
        os.makedirs(d, exist_ok=True)
        return d

    def steps():
        with ckptstore.open(url) as repo:
            return repo.steps()

    want10 = full_weights(ps, col, row)
    req = dist_checkpointing.save(sharded(ps, col, row, extra), folder(10), sharded_strategy=strat, **save_kwargs())
    q.schedule_async_request(req)
    with torch.no_grad():  # training goes on while the upload runs
        col.weight.add_(1.0)
        row.weight.mul_(-1.0)
    assert 10 not in steps()  # committed by finalize only
    assert q.maybe_finalize_async_calls(blocking=True) == [0]
    assert steps() == [10]
    _load_check(ps, url, folder(10), 10, want10)

    want20 = full_weights(ps, col, row)
    req = dist_checkpointing.save(sharded(ps, col, row, extra), folder(20), sharded_strategy=strat, **save_kwargs())
    q.schedule_async_request(req)
    with torch.no_grad():
        col.weight.add_(1.0)
    want15 = full_weights(ps, col, row)
    dist_checkpointing.save(sharded(ps, col, row, extra), folder(15), sharded_strategy=cmg.save_strategy(url))
    q.maybe_finalize_async_calls(blocking=True)
    assert steps() == [10, 15, 20]
    _load_check(ps, url, folder(20), 20, want20)
    _load_check(ps, url, folder(15), 15, want15)

    if not persistent:
        _async_failures(ps, rank, url, tmp, q, strat, col, row, extra, folder, steps)
        _fully_parallel(ps, url, q, extra, folder)
    q.close()


def _fully_parallel(ps, url, q, extra, folder):
    """TP=1 on 2 ranks (2 data-parallel replicas): Megatron's FullyParallelSaveStrategyWrapper splits
    the writes between the replicas, synchronously (step 50) and async (step 60)."""
    from megatron.core import dist_checkpointing

    from ckptstore.integrations import megatron as cmg

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    col, row = layers(seed=4)
    want = full_weights(ps, col, row)
    strat = cmg.fully_parallel_save_strategy(url)
    dist_checkpointing.save(sharded(ps, col, row, extra), folder(50), sharded_strategy=strat)
    req = dist_checkpointing.save(sharded(ps, col, row, extra), folder(60), sharded_strategy=strat, **save_kwargs())
    q.schedule_async_request(req)
    q.maybe_finalize_async_calls(blocking=True)
    for step in (50, 60):
        _load_check(ps, url, folder(step), step, want)


def _async_failures(ps, rank, url, tmp, q, strat, col, row, extra, folder, steps):
    import time

    import pytest
    from megatron.core import dist_checkpointing

    import ckptstore.dcp.writer as dcp_writer
    from ckptstore.integrations import megatron as cmg

    repo_dir = url[len("file://"):]
    before = _files(repo_dir)
    # step 30: rank 1's worker (forked: it inherits this patch) fails mid-upload
    if rank == 1:
        real_add = dcp_writer.ChunkWriter.add

        def failing_add(self, t, **kwargs):
            raise OSError("injected: the store refused a pack upload")

        dcp_writer.ChunkWriter.add = failing_add
    req = dist_checkpointing.save(sharded(ps, col, row, extra), folder(30), sharded_strategy=strat, **save_kwargs())
    q.schedule_async_request(req)  # forks the worker, patched
    if rank == 1:
        dcp_writer.ChunkWriter.add = real_add
    with pytest.raises(cmg.AsyncSaveError, match=r"rank 1: OSError: injected: the store refused"):
        q.maybe_finalize_async_calls(blocking=True)
    assert steps() == [10, 15, 20]
    torch.distributed.barrier()
    assert _files(repo_dir) == before, _files(repo_dir) ^ before  # rank 0's uploads removed too

    # step 40: every worker killed mid-upload (after its packs, before its chunk table)
    marker = os.path.join(tmp, f"blocked-{rank}")
    real_segment = dcp_writer.write_segment

    def blocking_segment(*a, **k):
        open(marker, "w").close()
        time.sleep(600)

    dcp_writer.write_segment = blocking_segment
    req = dist_checkpointing.save(sharded(ps, col, row, extra), folder(40), sharded_strategy=strat, **save_kwargs())
    q.schedule_async_request(req)
    dcp_writer.write_segment = real_segment
    deadline = time.monotonic() + 120
    while not os.path.exists(marker):
        assert time.monotonic() < deadline, "the worker never reached its chunk table"
        time.sleep(0.05)
    q.async_calls[0].async_caller.process.kill()
    with pytest.raises(cmg.AsyncSaveError, match="killed or died"):
        q.maybe_finalize_async_calls(blocking=True)
    assert steps() == [10, 15, 20]
    col2, row2 = layers(seed=11)
    state = dist_checkpointing.load(sharded(ps, col2, row2, None), folder(20), sharded_strategy=cmg.load_strategy(url))
    assert state["iteration"] == 5


# ------------------------------------------------------------------ errors: Megatron's types
def errors_worker(rank, world, port, tmp):
    """A load of a key the checkpoint lacks raises torch's CheckpointException, as Megatron's own strategy
    does (Megatron's tests and callers catch it); a ckptstore failure (the step exists) keeps its type."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from torch.distributed.checkpoint import CheckpointException

    from ckptstore.errors import StepExistsError
    from ckptstore.integrations import megatron as cmg

    init(rank, world, port, tp=1)
    url = f"file://{tmp}/repo"
    ckpt_dir = os.path.join(tmp, "ckpt")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    torch.distributed.barrier()
    sh = ShardedTensor.from_rank_offsets("keyA", torch.arange(8.0), replica_id=rank)
    dist_checkpointing.save({"a": sh}, ckpt_dir, sharded_strategy=cmg.save_strategy(url, step=1))
    try:
        dist_checkpointing.save({"a": sh}, ckpt_dir, sharded_strategy=cmg.save_strategy(url, step=1))
    except StepExistsError as e:
        assert "step 1" in str(e), e
    else:
        raise AssertionError("a second save of step 1 did not raise StepExistsError")
    other = ShardedTensor.from_rank_offsets("different_key", torch.zeros(8), replica_id=rank)
    try:
        dist_checkpointing.load({"a": other}, ckpt_dir, sharded_strategy=cmg.load_strategy(url))
    except CheckpointException as e:
        assert "different_key" in str(e), e
    else:
        raise AssertionError("a load of a missing key did not raise")
    shutdown()
