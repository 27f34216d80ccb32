"""Megatron-Core: ``dist_checkpointing`` strategies that keep sharded tensors in a ckptstore repository.

::

    from megatron.core import dist_checkpointing
    from ckptstore.integrations import megatron as ckpt_mg

    sharded_sd = model.sharded_state_dict()
    dist_checkpointing.save(sharded_sd, "ckpt/iter_0001000",
                            sharded_strategy=ckpt_mg.save_strategy("s3://bucket/run", step=1000))
    state = dist_checkpointing.load(model.sharded_state_dict(), "ckpt/iter_0001000",
                                    sharded_strategy=ckpt_mg.load_strategy("s3://bucket/run", step=1000))

The strategies subclass Megatron's ``TorchDistSaveShardedStrategy`` and
``TorchDistLoadShardedStrategy``: Megatron's translation of its
``ShardedTensor``/``ShardedObject`` into torch.distributed.checkpoint items
and its planners (``MCoreSavePlanner``, ``MCoreLoadPlanner`` with global
shape validation) are kept; ``dcp.save``/``dcp.load`` run with
:class:`ckptstore.dcp.CkptStoreWriter`/:class:`~ckptstore.dcp.CkptStoreReader`
instead of Megatron's file system writer, so no CUDA call is made (the stock
strategy calls ``torch.cuda.synchronize()`` and puts a tensor on the CUDA
device in ``state_dict_saver.py``). Every rank writes its own shards; rank 0
commits the step after all ranks have written, and a failure anywhere leaves
no step. Loading at another tensor- or pipeline-parallel layout is DCP's
resharding: Megatron's ``sharded_state_dict`` names every shard by its place
in the whole model (layers numbered across pipeline stages), see
docs/integrations/megatron.md.

``checkpoint_dir`` stays a local directory: Megatron writes
``metadata.json`` (the backend, here ``"ckptstore"``) and ``common.pt``
(rank 0's non-sharded state, with Megatron's own ``torch.save``) there, and
the save strategy adds ``ckptstore.json`` naming the repository and step,
which ``load_strategy(url)`` without a step reads.

``ShardedObject`` values are bytes Megatron serialized with ``torch.save``;
ckptstore stores them opaquely and they are loaded with
``torch.load(weights_only=True)`` and ckptstore's allowlist
(:mod:`ckptstore.format.unpickle`: NumPy arrays and RNG states such as Megatron's
``rng_state``, ``datetime`` values, dataclasses of plain values; a custom
class is refused with an error naming it), never with an unrestricted
unpickler.

Supported: Megatron-Core 0.16.x (tested: 0.16.1, the newest release that
installs on Python 3.11; 0.17 needs Python 3.12). The strategies use
Megatron's module-level helpers of ``dist_checkpointing/strategies/torch.py``
(``_replace_state_dict_keys_with_sharded_keys``, ``mcore_to_pyt_state_dict``
and their inverses), which are not public API and may change in another
minor release.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from pathlib import Path

try:
    import megatron.core as _mcore
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner,
        MCoreSavePlanner,
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
        _replace_sharded_keys_with_state_dict_keys,
        _replace_state_dict_keys_with_sharded_keys,
        _restore_dict_types,
        _unwrap_pyt_sharded_tensor,
        mcore_to_pyt_state_dict,
    )
except ImportError as _e:  # pragma: no cover - exercised with megatron hidden
    raise ImportError(
        "ckptstore.integrations.megatron needs Megatron-Core 0.16: pip install 'ckptstore[integrations]' "
        f"(or pip install 'megatron-core>=0.16,<0.17'); importing it failed: {_e}"
    ) from _e

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException

from ..dcp import CkptStoreReader, CkptStoreWriter
from ..errors import FormatError
from ..format.unpickle import load_safe
from ._common import unwrap_checkpoint_exception

__all__ = ["save_strategy", "load_strategy", "CkptStoreSaveStrategy", "CkptStoreLoadStrategy", "BACKEND"]

#: The backend name Megatron records in ``metadata.json``.
BACKEND = "ckptstore"
VERSION = 1
POINTER = "ckptstore.json"
POINTER_FORMAT = "ckptstore.megatron.pointer"


def save_strategy(url: str | os.PathLike, step: int, storage_options: dict | None = None, **options):
    """A ``dist_checkpointing.save`` strategy that commits step ``step`` of the repository at ``url``.

    ``metadata=`` (a JSON dict stored with the step), ``base=`` and
    repository options (``chunk_size``, ...) go to
    :class:`ckptstore.dcp.CkptStoreWriter`. Use a new strategy per save.
    """
    return CkptStoreSaveStrategy(url, step, storage_options=storage_options, **options)


def load_strategy(url: str | os.PathLike, step: int | None = None, storage_options: dict | None = None, **options):
    """A ``dist_checkpointing.load`` strategy reading a step of the repository at ``url``.

    Without ``step``: the step named by ``checkpoint_dir/ckptstore.json``
    (written by the save), else the newest committed step.
    """
    return CkptStoreLoadStrategy(url, step, storage_options=storage_options, **options)


class CkptStoreSaveStrategy(TorchDistSaveShardedStrategy):
    """Megatron's torch_dist save path, writing through :class:`~ckptstore.dcp.CkptStoreWriter`."""

    def __init__(self, url, step: int, storage_options: dict | None = None, keep_only_main_replica: bool = True,
                 metadata: dict | None = None, **options):
        super().__init__(BACKEND, VERSION, keep_only_main_replica=keep_only_main_replica)
        self.url = os.fspath(url)
        self.step = step
        self.storage_options = storage_options
        self.metadata = dict(metadata or {})
        self.options = options
        #: this rank's byte counts of the last save (uploaded, reused, ...)
        self.last_rank_stats: dict | None = None

    def can_handle_sharded_objects(self):
        return True

    def async_save(self, sharded_state_dict, checkpoint_dir):
        raise CheckpointingException(
            "ckptstore's Megatron strategy saves synchronously (its commit is a collective step); "
            "call dist_checkpointing.save(..., async_sharded_save=False)"
        )

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        pyt_state_dict = mcore_to_pyt_state_dict(sd, False)
        meta = dict(self.metadata)
        meta["megatron"] = {"format": VERSION, "mcore_version": getattr(_mcore, "__version__", "?")}
        writer = CkptStoreWriter(self.url, step=self.step, storage_options=self.storage_options, metadata=meta,
                                 **self.options)
        try:
            dcp.save(
                pyt_state_dict,
                storage_writer=writer,
                planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                         flatten_state_dict=False),
            )
        except CheckpointException as e:
            raise unwrap_checkpoint_exception(e, f"Megatron checkpoint step {self.step}") from None
        finally:
            writer.close()
        self.last_rank_stats = writer.last_rank_stats
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            _write_json(Path(checkpoint_dir) / POINTER, {"format": POINTER_FORMAT, "version": 1,
                                                         "url": _repo_url(self.url, self.storage_options),
                                                         "step": self.step})


class _SafeLoadPlanner(MCoreLoadPlanner):
    """Megatron's load planner, loading ShardedObject bytes through ckptstore's allowlist (restricted)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = load_safe(value.getvalue(), f"ShardedObject {read_item.dest_index.fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class CkptStoreLoadStrategy(TorchDistLoadShardedStrategy):
    """Megatron's torch_dist load path, reading through :class:`~ckptstore.dcp.CkptStoreReader`."""

    def __init__(self, url, step: int | None = None, storage_options: dict | None = None, **options):
        super().__init__()
        self.url = os.fspath(url)
        self.step = step
        self.storage_options = storage_options
        self.options = options

    def can_handle_sharded_objects(self):
        return True

    def check_backend_compatibility(self, loaded_backend):
        if loaded_backend != BACKEND:
            raise CheckpointingException(
                f"this checkpoint directory was saved with the {loaded_backend!r} backend; "
                f"ckptstore's load strategy reads checkpoints saved with ckptstore's save strategy ({BACKEND!r})"
            )

    def check_version_compatibility(self, loaded_version):
        if int(loaded_version) > VERSION:
            raise CheckpointingException(
                f"checkpoint saved by ckptstore Megatron strategy version {loaded_version}; this one reads {VERSION}"
            )

    def _step_for(self, checkpoint_dir) -> int | None:
        if self.step is not None:
            return self.step
        ptr = Path(checkpoint_dir) / POINTER
        try:
            doc = json.loads(ptr.read_text())
        except FileNotFoundError:
            return None  # the reader picks the newest step (rank 0 decides for all)
        except ValueError as e:
            raise FormatError(f"{ptr}: not JSON: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT or type(doc.get("step")) is not int:
            raise FormatError(f"{ptr}: not a ckptstore pointer")
        if doc.get("url") != _repo_url(self.url, self.storage_options):
            raise ValueError(
                f"{ptr} names step {doc['step']} of {doc.get('url')!r}, not of {self.url!r}; "
                "pass step= explicitly to read this repository"
            )
        return doc["step"]

    def _reader(self, checkpoint_dir) -> CkptStoreReader:
        return CkptStoreReader(self.url, step=self._step_for(checkpoint_dir), storage_options=self.storage_options,
                               **self.options)

    def load(self, sharded_state_dict, checkpoint_dir):
        # As TorchDistLoadShardedStrategy.load, with ckptstore's reader and bytes loaded weights_only.
        flexible = [t for t in nested_values(sharded_state_dict)
                    if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
        mismatch_ok = {t.key: t for t in nested_values(sharded_state_dict)
                       if isinstance(t, ShardedTensor) and t.allow_shape_mismatch}
        orig = sharded_state_dict
        sd, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        pyt_state_dict = mcore_to_pyt_state_dict(sd, True)
        reader = self._reader(checkpoint_dir)
        try:
            dcp.load(
                pyt_state_dict,
                storage_reader=reader,
                planner=_SafeLoadPlanner(shapes_validation_sharded_tensors=flexible,
                                         allow_shape_mismatch_sharded_tensors=mismatch_ok),
            )
        except CheckpointException as e:
            raise unwrap_checkpoint_exception(e, f"Megatron checkpoint load from {self.url}") from None
        finally:
            reader.close()
        mcore_state_dict = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        mcore_state_dict = _replace_sharded_keys_with_state_dict_keys(mcore_state_dict, flat_mapping, rename_mapping)
        _restore_dict_types(mcore_state_dict, orig)
        return mcore_state_dict

    def _metadata(self, checkpoint_dir):
        # Megatron may ask for metadata on one rank only: pick the step here
        # rather than through the reader's broadcast.
        step = self._step_for(checkpoint_dir)
        if step is None:
            import ckptstore

            with ckptstore.open(self.url, storage_options=self.storage_options) as repo:
                step = repo.latest()
        reader = CkptStoreReader(self.url, step=step, storage_options=self.storage_options, **self.options)
        try:
            return reader.read_metadata()
        finally:
            reader.close()

    def load_tensors_metadata(self, checkpoint_dir, metadata=None):
        return super().load_tensors_metadata(checkpoint_dir, metadata or self._metadata(checkpoint_dir))

    def load_sharded_metadata(self, checkpoint_dir):
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        metadata = self._metadata(checkpoint_dir)
        out = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                obj = ShardedObject.empty_from_unique_key(key)
                out[obj.unique_key] = obj
        out.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return out

    def remove_sharded_tensors(self, checkpoint_dir, key_prefix):
        raise NotImplementedError("ckptstore steps are immutable; save a new step without those tensors")


def _repo_url(url: str, storage_options) -> str:
    """The repository's own spelling of ``url`` (``/x`` and ``file:///x`` name one repository)."""
    import ckptstore

    with ckptstore.open(url, storage_options=storage_options) as repo:
        return repo.url


def _write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)
