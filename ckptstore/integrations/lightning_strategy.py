"""Lightning's ``ModelParallelStrategy`` with its distributed checkpoints in a ckptstore repository.

Imported through :mod:`ckptstore.integrations.lightning` (which re-exports
:class:`CkptStoreModelParallelStrategy`); names, stand-ins and conversions
are that module's.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from lightning.pytorch.strategies import ModelParallelStrategy

from ckptstore.tree import flatten, unflatten

from .lightning import (
    METADATA_KEY,
    NAMESPACE,
    CkptStoreCheckpointIO,
    _write_standin,
    checkpoint_name,
    default_convert,
    restore_values,
    to_storable,
)

#: DCP key under which the strategy stores the small tensors of the rest of
#: the checkpoint (callback scores and the like).
EXTRA_KEY = "lightning_extra"


class CkptStoreModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose distributed checkpoints go to a ckptstore repository.

    Lightning's strategy calls ``torch.distributed.checkpoint.save(state,
    checkpoint_id=path)`` into a local folder and ``torch.save``\\ s the rest
    of the checkpoint (loops, callbacks, hyper-parameters) as ``meta.pt``.
    This subclass saves the sharded model and optimizer states with
    :class:`~ckptstore.dcp.CkptStoreWriter` (every rank writes its shards),
    and the rest in the same step: its small tensors as replicated DCP
    items under ``lightning_extra``, its JSON structure in the step's
    metadata. Loading reads the model and optimizer shards with
    ``CkptStoreReader`` (any data-parallel size) and rebuilds the rest
    without unpickling. Checkpoints are named as for
    :class:`~ckptstore.integrations.lightning.CkptStoreCheckpointIO`, which
    also becomes the strategy's ``checkpoint_io`` (``ModelCheckpoint``
    rotation deletes steps); the path Lightning saves to gets a stand-in
    file (the shards are spread over the ranks, so no local copy is kept).

    Parameters
    ----------
    url:
        Repository URL.
    storage_options:
        As for :func:`ckptstore.open`.
    repo_options:
        Repository tunables for the repository, writer and reader.
    convert:
        As for :class:`CkptStoreCheckpointIO`.
    **kwargs:
        ``ModelParallelStrategy`` arguments. ``save_distributed_checkpoint``
        must stay True.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict | None = None,
        repo_options: dict | None = None,
        convert: Callable[[str, Any], Any] = default_convert,
        **kwargs,
    ):
        if not kwargs.get("save_distributed_checkpoint", True):
            raise ValueError(
                "CkptStoreModelParallelStrategy stores distributed checkpoints only; for a full state dict "
                "use ModelParallelStrategy(save_distributed_checkpoint=False) on one process's files"
            )
        super().__init__(**kwargs)
        self.url = os.fspath(url)
        self.storage_options = storage_options
        self.repo_options = dict(repo_options or {})
        self.checkpoint_io = CkptStoreCheckpointIO(
            self.url, local_files="stub", convert=convert, storage_options=storage_options, **self.repo_options
        )

    @property
    def _io(self) -> CkptStoreCheckpointIO:
        return self.checkpoint_io

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        import torch.distributed.checkpoint as dcp

        from ckptstore.dcp import CkptStoreWriter

        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        path = self.broadcast(os.fspath(filepath))
        io = self._io
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        restore: list = []
        rest = to_storable(rest, io.convert, restore)  # every rank: a refusal is raised everywhere
        repo = io.repository
        step = self.broadcast(io.save_step(checkpoint, path, repo) if self.global_rank == 0 else None)
        tree, extra = flatten(rest)
        state = {"state_dict": checkpoint.pop("state_dict")}
        for idx, osd in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{idx}"] = osd
        state[EXTRA_KEY] = extra
        meta = io.metadata(checkpoint, path, restore)
        meta[METADATA_KEY]["tree"] = tree
        meta[METADATA_KEY]["optimizers"] = sum(1 for k in state if k.startswith("optimizer_"))
        writer = CkptStoreWriter(
            self.url, step=step, storage_options=self.storage_options, metadata=meta, **self.repo_options
        )
        dcp.save(state, storage_writer=writer)
        if self.global_rank == 0:
            repo.set_name(NAMESPACE, checkpoint_name(path), step)
            _write_standin(path, repo.url, step, checkpoint_name(path))
        self.barrier("ckptstore_save")

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        from ckptstore.dcp import CkptStoreReader

        io = self._io
        path = self.broadcast(os.fspath(checkpoint_path))
        step = self.broadcast(io.resolve(path) if self.global_rank == 0 else None)
        ckpt = io.repository.checkpoint(step)
        meta = ckpt.metadata.get(METADATA_KEY)
        if not isinstance(meta, dict) or "tree" not in meta:
            raise ValueError(
                f"{io.repository.url}: step {step} was not saved by {type(self).__name__} "
                "(no distributed-checkpoint metadata)"
            )

        def reader():
            return CkptStoreReader(self.url, step=step, storage_options=self.storage_options, **self.repo_options)

        assert self.model is not None and self.lightning_module is not None
        module_state = {"state_dict": get_model_state_dict(self.model)}
        dcp.load(module_state, storage_reader=reader())
        self.model.load_state_dict(module_state["state_dict"], strict=self.lightning_module.strict_loading)
        if len(self.optimizers) != meta.get("optimizers", len(self.optimizers)) and self.optimizers:
            raise RuntimeError(
                f"step {step} holds {meta.get('optimizers')} optimizer state(s); {len(self.optimizers)} are configured"
            )
        options = StateDictOptions(cpu_offload=True)
        for idx, optim in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            osd = {key: get_optimizer_state_dict(self.model, optim)}
            dcp.load(osd, storage_reader=reader())
            set_optimizer_state_dict(self.model, optim, optim_state_dict=osd[key], options=options)
        rest = unflatten(meta["tree"], lambda k: ckpt.read(f"{EXTRA_KEY}.{k}"))
        return restore_values(rest, meta.get("restore"))
