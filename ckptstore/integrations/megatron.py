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

Supported: Megatron-Core 0.16.x to 0.19.x (tested: 0.16.1, the newest
release that installs on Python 3.11 as declared, and 0.19.2, whose cp311
wheel runs on 3.11 though it declares 3.12). From 0.17 Megatron keeps the
common state as a ``common_state`` ShardedObject and reads it with a stock
``FileSystemReader`` of the folder: importing this module points that
reader, for folders saved through ckptstore only, at the step the folder's
``ckptstore.json`` names. The strategies use Megatron's module-level helpers
of ``dist_checkpointing/strategies/torch.py``
(``_replace_state_dict_keys_with_sharded_keys``, ``mcore_to_pyt_state_dict``
and their inverses), which are not public API and may change in another
minor release.

Async saves (``dist_checkpointing.save(..., async_sharded_save=True)`` and
Megatron's ``AsyncCallsQueue``, either worker): see
:mod:`ckptstore.integrations.megatron_async`.
"""

from __future__ import annotations

import io
import json
import os
import re
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
        "ckptstore.integrations.megatron needs Megatron-Core 0.16 to 0.19: pip install 'ckptstore[integrations]' "
        f"(or pip install 'megatron-core>=0.16,<0.20'); importing it failed: {_e}"
    ) from _e

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException

from ..dcp import CkptStoreReader, CkptStoreWriter
from ..errors import CkptStoreError, FormatError
from ..format.unpickle import load_safe
from ._common import unwrap_checkpoint_exception
from .megatron_async import AsyncSaveError

__all__ = ["save_strategy", "load_strategy", "fully_parallel_save_strategy", "install", "AsyncSaveError", "CkptStoreSaveStrategy", "CkptStoreLoadStrategy", "BACKEND"]

#: The backend name Megatron records in ``metadata.json``.
BACKEND = "ckptstore"
VERSION = 1
POINTER = "ckptstore.json"
POINTER_FORMAT = "ckptstore.megatron.pointer"


def save_strategy(url: str | os.PathLike, step: int | None = None, storage_options: dict | None = None, **options):
    """A ``dist_checkpointing.save`` strategy that commits a step of the repository at ``url``.

    ``step``: the step every save of this strategy commits; None (the
    default): each save takes its step from the checkpoint folder's name,
    ``iter_0001000`` -> 1000, as Megatron-LM names them, so one strategy
    serves every save of a run. ``metadata=`` (a JSON dict stored with the
    step), ``base=`` and repository options (``chunk_size``, ...) go to
    :class:`ckptstore.dcp.CkptStoreWriter`. ``replicas`` and
    ``write_back`` are refused by async saves.
    """
    return CkptStoreSaveStrategy(url, step, storage_options=storage_options, **options)


def fully_parallel_save_strategy(url: str | os.PathLike, step: int | None = None, parallelization_group=None,
                                 storage_options: dict | None = None, **options):
    """:func:`save_strategy` inside Megatron's ``FullyParallelSaveStrategyWrapper`` (the DP ranks split the writes).

    The wrapper records ckptstore's backend in ``metadata.json`` (from
    0.17 it records ``"torch_dist"`` unless told otherwise, and the load
    would then refuse the folder).
    """
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    inner = save_strategy(url, step, storage_options=storage_options, **options)
    if _wrapper_takes_backend():
        return FullyParallelSaveStrategyWrapper(inner, parallelization_group, backend=BACKEND, version=VERSION)
    return FullyParallelSaveStrategyWrapper(inner, parallelization_group)


def load_strategy(url: str | os.PathLike, step: int | None = None, storage_options: dict | None = None, **options):
    """A ``dist_checkpointing.load`` strategy reading a step of the repository at ``url``.

    Without ``step``: the step named by ``checkpoint_dir/ckptstore.json``
    (written by the save), else the newest committed step.
    """
    return CkptStoreLoadStrategy(url, step, storage_options=storage_options, **options)


class CkptStoreSaveStrategy(TorchDistSaveShardedStrategy):
    """Megatron's torch_dist save path, writing through :class:`~ckptstore.dcp.CkptStoreWriter`."""

    def __init__(self, url, step: int | None = None, storage_options: dict | None = None,
                 keep_only_main_replica: bool = True, metadata: dict | None = None, **options):
        super().__init__(BACKEND, VERSION, keep_only_main_replica=keep_only_main_replica)
        self.url = os.fspath(url)
        self.step = step
        self.storage_options = storage_options
        self.metadata = dict(metadata or {})
        self.options = options
        #: this rank's byte counts of the last synchronous save (uploaded, reused, ...)
        self.last_rank_stats: dict | None = None
        self._snapshot = None  # host buffers of async saves, reused (megatron_async.Snapshot)
        _remember_options(self.url, storage_options, options)

    def can_handle_sharded_objects(self):
        return True

    def step_for(self, checkpoint_dir) -> int:
        """The step a save into ``checkpoint_dir`` commits: ``step=``, else the folder's ``iter_N``."""
        if self.step is not None:
            return self.step
        m = re.fullmatch(r"iter_(\d+)", Path(checkpoint_dir).name)
        if m is None:
            raise ValueError(
                f"ckptstore's Megatron save strategy was made without step= and the checkpoint folder "
                f"{os.fspath(checkpoint_dir)!r} is not named iter_<step> (as Megatron-LM names them): "
                "pass step= to save_strategy"
            )
        return int(m.group(1))

    def _translate(self, sharded_state_dict):
        sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        return mcore_to_pyt_state_dict(sd, False)

    def _planner(self):
        return MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False)

    def _step_metadata(self) -> dict:
        meta = dict(self.metadata)
        meta["megatron"] = {"format": VERSION, "mcore_version": getattr(_mcore, "__version__", "?")}
        return meta

    def _write_pointer(self, checkpoint_dir, step: int) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            _write_json(Path(checkpoint_dir) / POINTER, {"format": POINTER_FORMAT, "version": 1,
                                                         "url": _repo_url(self.url, self.storage_options),
                                                         "step": step})

    def async_save(self, sharded_state_dict, checkpoint_dir, async_strategy: str = "mcore"):
        """Plan, claim the step and snapshot this rank's state now; return Megatron's ``AsyncRequest``.

        Its ``async_fn`` uploads this rank's share in Megatron's worker (no
        collective); its ``finalize_fn`` commits the step on every rank, or
        raises on every rank if any rank's upload failed (then nothing is
        committed and the step's uploads are removed). See
        :mod:`ckptstore.integrations.megatron_async`.
        """
        from . import megatron_async as A

        request_cls = _async_request_class(async_strategy)
        for name in ("replicas", "write_back"):
            if self.options.get(name):
                raise CheckpointingException(
                    f"ckptstore's Megatron strategy: {name}= is not supported by async saves (its background "
                    f"work would outlive Megatron's worker process); save synchronously or drop {name}="
                )
        step = self.step_for(checkpoint_dir)
        if self._snapshot is None:
            self._snapshot = A.Snapshot()
        writer = A._DeferredWriter(self.url, step=step, storage_options=self.storage_options,
                                   metadata=self._step_metadata(), snapshot=self._snapshot, **self.options)
        try:
            dcp.save(self._translate(sharded_state_dict), storage_writer=writer, planner=self._planner())
        except CheckpointException as e:
            writer.close()
            raise _dcp_error(e, f"Megatron checkpoint step {step}") from None
        except BaseException:
            writer.close()
            raise
        job = writer.job
        rank = dist.get_rank() if dist.is_initialized() else 0
        path = A.result_path(step, rank)
        upload = A.Upload(writer.url, self.storage_options, dict(self.options), step, job["rank"], job["base_step"],
                          job["shared"], job["items"], job["data"], path)
        writer.job = None
        fin = A.Finalize(writer, path, on_commit=lambda: self._write_pointer(checkpoint_dir, step))
        return request_cls(upload, (), [fin])

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        step = self.step_for(checkpoint_dir)
        writer = CkptStoreWriter(self.url, step=step, storage_options=self.storage_options,
                                 metadata=self._step_metadata(), **self.options)
        try:
            dcp.save(self._translate(sharded_state_dict), storage_writer=writer, planner=self._planner())
        except CheckpointException as e:
            raise _dcp_error(e, f"Megatron checkpoint step {step}") from None
        finally:
            writer.close()
        self.last_rank_stats = writer.last_rank_stats
        self._write_pointer(checkpoint_dir, step)


def _load_bytes_safely(planner, read_item, value: io.BytesIO) -> None:
    """A planner's ``load_bytes``, through ckptstore's allowlist instead of an unrestricted ``torch.load``."""
    obj = load_safe(value.getvalue(), f"ShardedObject {read_item.dest_index.fqn!r}")
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], obj)
    else:
        planner.state_dict[read_item.dest_index.fqn] = obj


class _SafeLoadPlanner(MCoreLoadPlanner):
    """Megatron's load planner, loading ShardedObject bytes through ckptstore's allowlist (restricted)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        _load_bytes_safely(self, read_item, value)


class CkptStoreLoadStrategy(TorchDistLoadShardedStrategy):
    """Megatron's torch_dist load path, reading through :class:`~ckptstore.dcp.CkptStoreReader`."""

    def __init__(self, url, step: int | None = None, storage_options: dict | None = None, **options):
        super().__init__()
        self.url = os.fspath(url)
        self.step = step
        self.storage_options = storage_options
        self.options = options
        _remember_options(self.url, storage_options, options)

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

    def load(self, sharded_state_dict, checkpoint_dir, async_strategy: str | None = None):
        # As TorchDistLoadShardedStrategy.load, with ckptstore's reader and bytes loaded weights_only.
        # async_strategy (0.17+: how the checkpoint was saved) changes nothing in what ckptstore reads.
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
            raise _dcp_error(e, f"Megatron checkpoint load from {self.url}") from None
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


# ------------------------------------------------------------------ Megatron-LM's training loop
def install(url: str | os.PathLike, storage_options: dict | None = None, **options) -> None:
    """Route Megatron-LM's own ``save_checkpoint``/``load_checkpoint`` through the repository at ``url``.

    Call once per process, after importing Megatron-LM and before
    ``pretrain`` (or any ``megatron.training.checkpointing`` call), with
    ``--ckpt-format torch_dist`` (Megatron-LM's default distributed format).
    The strategies Megatron-LM makes in ``megatron.training.checkpointing``
    (0.16: ``get_default_save_sharded_strategy`` and
    ``get_default_load_sharded_strategy``; 0.17+: ``TorchDistSaveShardedStrategy``
    and ``TorchDistLoadShardedStrategy``; ``FullyParallelSaveStrategyWrapper``
    with ``--ckpt-fully-parallel-save``) become ckptstore's: every save's
    step is its folder's iteration (``iter_0001000``), synchronous or
    ``--async-save`` (Megatron-LM's own queue and ``maybe_finalize_async_save``
    commit it), and every load reads the step its folder's pointer names.
    Megatron-LM keeps its tracker file (``latest_checkpointed_iteration.txt``)
    and the small per-iteration folders under ``--save``.
    """
    import megatron.training.checkpointing as C

    url = os.fspath(url)

    def save_factory(*args, **kwargs):
        return CkptStoreSaveStrategy(url, None, storage_options=storage_options, **options)

    def load_factory(*args, **kwargs):
        return CkptStoreLoadStrategy(url, None, storage_options=storage_options, **options)

    for name, factory in (("get_default_save_sharded_strategy", save_factory),
                          ("TorchDistSaveShardedStrategy", save_factory),
                          ("get_default_load_sharded_strategy", load_factory),
                          ("TorchDistLoadShardedStrategy", load_factory)):
        if hasattr(C, name):
            setattr(C, name, factory)
    try:  # 0.16: what dist_checkpointing picks for a folder by its metadata.json (load_common_state_dict...)
        from megatron.core.dist_checkpointing.strategies import base as _base

        _base.register_default_strategy(_base.StrategyAction.LOAD_SHARDED, BACKEND, VERSION, load_factory())
        _base.register_default_strategy(_base.StrategyAction.SAVE_SHARDED, BACKEND, VERSION, save_factory())
    except (ImportError, AttributeError):  # 0.17+ has no registry: the common-state reader hook serves
        pass
    if hasattr(C, "FullyParallelSaveStrategyWrapper"):
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        def fully_parallel(strategy, group=None, do_cache_distribution=False, **kwargs):
            if isinstance(strategy, CkptStoreSaveStrategy) and _wrapper_takes_backend():
                kwargs.update(backend=BACKEND, version=VERSION)
            return FullyParallelSaveStrategyWrapper(strategy, group, do_cache_distribution, **kwargs)

        C.FullyParallelSaveStrategyWrapper = fully_parallel


def _dcp_error(e: CheckpointException, what: str) -> BaseException:
    """What a failed ``dcp.save``/``dcp.load`` of a strategy raises.

    A failure of ckptstore's (a :class:`~ckptstore.errors.CkptStoreError` on
    some rank: storage, a step that exists, ...) is that rank's own error,
    its type kept. Anything else failed in Megatron's planners or DCP (a key
    the checkpoint lacks, a global shape that differs) and stays torch's
    ``CheckpointException``, as Megatron's own strategies raise it: callers
    and Megatron's tests catch ``(CheckpointingException, CheckpointException)``.
    """
    failures = getattr(e, "failures", None) or {}
    for item in failures.values():
        exc = item[0] if isinstance(item, tuple) else item
        if isinstance(exc, CkptStoreError):
            return unwrap_checkpoint_exception(e, what)
    return e


def _wrapper_takes_backend() -> bool:
    import inspect

    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return "backend" in inspect.signature(FullyParallelSaveStrategyWrapper.__init__).parameters


# ------------------------------------------------------------------ Megatron 0.17+: async requests, common state
def _async_request_class(async_strategy: str | None):
    """The ``AsyncRequest`` of the queue that will run an async save: Megatron's (``"mcore"``) or NVRx's."""
    if async_strategy in (None, "mcore"):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        return AsyncRequest
    if async_strategy == "nvrx":
        try:
            from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
        except ImportError as e:
            raise CheckpointingException(
                "async_strategy='nvrx' needs nvidia-resiliency-ext, which is not importable here "
                f"({e}); pass async_strategy='mcore' (Megatron's AsyncCallsQueue)"
            ) from None
        return AsyncRequest
    raise CheckpointingException(f"async_strategy {async_strategy!r} is not supported: 'mcore' or 'nvrx'")


#: storage options and repository options by repository URL, from every strategy made in this
#: process: what the common-state reader of a ckptstore folder opens the repository with.
_OPTIONS: dict[str, tuple] = {}


def _remember_options(url: str, storage_options, options: dict) -> None:
    _OPTIONS[url] = (storage_options, {k: v for k, v in options.items() if k not in ("metadata", "base", "replicas")})


def _options_for(repo_url: str) -> tuple:
    if repo_url in _OPTIONS:
        return _OPTIONS[repo_url]
    for url, (so, options) in list(_OPTIONS.items()):
        if _repo_url(url, so) == repo_url:
            return so, options
    return None, {}


def _pointer_of(checkpoint_dir) -> dict | None:
    """The ckptstore pointer of a Megatron checkpoint folder saved by ckptstore's strategy, else None."""
    try:
        cfg = json.loads((Path(checkpoint_dir) / "metadata.json").read_text())
        doc = json.loads((Path(checkpoint_dir) / POINTER).read_text())
    except (OSError, ValueError, TypeError):
        return None
    if not isinstance(cfg, dict) or cfg.get("sharded_backend") != BACKEND:
        return None
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT or type(doc.get("step")) is not int:
        raise FormatError(f"{Path(checkpoint_dir) / POINTER}: not a ckptstore pointer")
    return doc


class _CommonStateReader(CkptStoreReader):
    """What Megatron 0.17+ reads a folder's common state with (``no_dist``), from the repository.

    ShardedObject bytes load through ckptstore's allowlist, not the
    unrestricted ``torch.load`` of DCP's default planner.
    """

    def read_data(self, plan, planner):
        return super().read_data(plan, _SafeBytesPlanner(planner))


class _SafeBytesPlanner:
    def __init__(self, planner):
        self._planner = planner

    def __getattr__(self, name):
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value):
        _load_bytes_safely(self._planner, read_item, value)


def _common_state_reader_hook():
    """Megatron 0.17+ keeps the common state as a ShardedObject it reads with a stock ``FileSystemReader``
    of the folder (``serialization.load_common_state_dict``): for a folder saved through ckptstore, a
    reader of the step the folder's pointer names; any other folder, Megatron's own reader."""
    from megatron.core.dist_checkpointing import serialization

    original = getattr(serialization, "_get_filesystem_reader", None)
    if original is None or getattr(original, "_ckptstore", False):
        return

    def _get_filesystem_reader(checkpoint_dir, *args, **kwargs):
        doc = _pointer_of(checkpoint_dir)
        if doc is None:
            return original(checkpoint_dir, *args, **kwargs)
        so, options = _options_for(doc["url"])
        return _CommonStateReader(doc["url"], step=doc["step"], storage_options=so, **options)

    _get_filesystem_reader._ckptstore = True
    serialization._get_filesystem_reader = _get_filesystem_reader


_common_state_reader_hook()


def _repo_url(url: str, storage_options) -> str:
    """The repository's own spelling of ``url`` (``/x`` and ``file:///x`` name one repository)."""
    import ckptstore

    with ckptstore.open(url, storage_options=storage_options) as repo:
        return repo.url


def _write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)
