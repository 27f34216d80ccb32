"""Lightning adapters: a ``CheckpointIO`` and a ``ModelParallelStrategy`` over ckptstore.

- :class:`CkptStoreCheckpointIO` stores every checkpoint Lightning saves
  (``ModelCheckpoint``, ``trainer.save_checkpoint``) as one step of a
  repository, loads them back for ``Trainer.fit(ckpt_path=...)`` and turns
  ``ModelCheckpoint(save_top_k=...)`` rotation into ``repo.delete``.
- :class:`CkptStoreModelParallelStrategy` is Lightning's ``ModelParallelStrategy``
  (FSDP2 / tensor parallel) with its distributed checkpoints written by
  :class:`~ckptstore.dcp.CkptStoreWriter` and read by ``CkptStoreReader``.

How a checkpoint path maps to a step (only the file name counts; the folder
is ignored):

1. a name containing ``step=N`` (Lightning's default ``epoch=E-step=N.ckpt``
   and any ``ModelCheckpoint(filename=...)`` with ``{step}``) is step ``N``;
2. ``last.ckpt`` (``last-vK.ckpt``) is the newest committed step. Saving it
   writes step ``global_step`` unless that step is committed already (the
   same training state was just saved under its step name); then nothing
   is written;
3. any other name is saved as step ``global_step`` and found again by the
   name recorded in the step's metadata.

Saving a name again (``last.ckpt`` at a later step) replaces the earlier
step saved under that name, as Lightning's own IO overwrites the file.
Values that are neither tensors nor JSON values are refused with an error
naming them (no pickle), apart from the explicit conversions listed in
:func:`default_convert`. See ``docs/integrations.md``.
"""

from __future__ import annotations

import enum
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any, Callable

try:
    import lightning.pytorch as pl  # noqa: F401
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.strategies import ModelParallelStrategy
except ImportError as e:  # tested in a subprocess where lightning cannot be imported
    raise ImportError(
        "ckptstore.integrations.lightning needs lightning (2.x): pip install 'ckptstore[integrations]'"
    ) from e

import numpy as np
import torch

import ckptstore
from ckptstore.errors import StepExistsError, StepNotFoundError
from ckptstore import Repository
from ckptstore.tree import flatten, unflatten

#: Metadata key of every step written here; ``path`` is the file name.
METADATA_KEY = "lightning"
METADATA_FORMAT = 1
#: DCP key under which the strategy stores the small tensors of the rest of
#: the checkpoint (callback scores and the like).
EXTRA_KEY = "lightning_extra"

_STEP_RE = re.compile(r"(?:^|[-_])step=(\d+)(?=$|[-_.=])")
_LAST_RE = re.compile(r"^last(-v\d+)?\.ckpt$")


def checkpoint_name(path) -> str:
    """The file name of a Lightning checkpoint path (what the mapping reads)."""
    name = os.path.basename(os.fspath(path).rstrip("/\\"))
    if not name:
        raise ValueError(f"checkpoint path {path!r} has no file name")
    return name


def name_step(name: str) -> int | None:
    """``N`` for a name containing ``step=N`` (rule 1), else None."""
    m = _STEP_RE.search(name)
    return int(m.group(1)) if m else None


def is_last_name(name: str) -> bool:
    """Whether ``name`` is ModelCheckpoint's ``last.ckpt`` (or ``last-vK.ckpt``), rule 2."""
    return bool(_LAST_RE.match(name))


# ---------------------------------------------------------------- conversions
def default_convert(path: str, value: Any) -> Any:
    """Explicit conversions of non-JSON values found in Lightning checkpoints.

    - ``pathlib.PurePath`` -> ``str``;
    - ``enum.Enum`` whose value is a JSON scalar -> that value (Lightning's
      own enums are ``str`` enums and compare equal to their value);
    - NumPy scalars -> the Python scalar (``.item()``).

    Anything else raises ``TypeError`` naming ``path`` and the type.
    """
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, enum.Enum) and isinstance(value.value, (str, int, float, bool)):
        return value.value
    if isinstance(value, np.generic) and isinstance(value.item(), (bool, int, float, str)):
        return value.item()
    raise TypeError(
        f"Lightning checkpoint value {path!r} is a {type(value).__module__}.{type(value).__qualname__}; "
        "ckptstore stores only tensors and JSON values (it never pickles). Leave it out of the "
        "checkpoint (e.g. save_hyperparameters(ignore=[...])) or pass "
        "CkptStoreCheckpointIO(convert=fn) returning a JSON value for it"
    )


def to_storable(obj: Any, convert: Callable[[str, Any], Any] = default_convert) -> Any:
    """A copy of a Lightning checkpoint dict holding only tensors and JSON values.

    Mappings become dicts (``AttributeDict``, ``OrderedDict``), lists and
    tuples stay lists and tuples; any other non-JSON value goes through
    ``convert(path, value)``, whose result must be storable.
    """

    def walk(v, path, depth):
        if depth > 100:
            raise TypeError(f"{path or '<root>'}: nested more than 100 levels")
        if isinstance(v, torch.Tensor) or v is None or type(v) in (bool, int, float, str):
            return v
        if isinstance(v, Mapping):
            out = {}
            for k, x in v.items():
                if type(k) not in (str, int):
                    raise TypeError(f"{path}.{k!r}: dict keys must be str or int, got {type(k).__name__}")
                out[k] = walk(x, f"{path}.{k}" if path else str(k), depth + 1)
            return out
        if isinstance(v, (list, tuple)):
            items = [walk(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
            return tuple(items) if isinstance(v, tuple) else items
        converted = convert(path, v)
        if converted is v:
            raise TypeError(f"convert returned the {type(v).__name__} at {path!r} unchanged")
        return walk(converted, path, depth + 1)

    return walk(obj, "", 0)


def _move(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_move(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_move(v, device) for v in obj)
    return obj


# ---------------------------------------------------------------- CheckpointIO
class CkptStoreCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` storing each checkpoint as a step of one repository.

    ``Trainer(plugins=[CkptStoreCheckpointIO("s3://bucket/run")])``. Paths
    map to steps as the module docstring says; resume with
    ``trainer.fit(model, ckpt_path="epoch=0-step=100.ckpt")`` (any folder)
    or ``ckpt_path="last.ckpt"`` (the newest step). Lightning's
    ``ckpt_path="last"`` looks for local files and finds none here.

    Parameters
    ----------
    url:
        Repository URL, or an open :class:`~ckptstore.Repository` (not
        closed by ``teardown``).
    convert:
        ``convert(path, value)`` for values that are neither tensors nor
        JSON values; default :func:`default_convert`.
    storage_options, **open_options:
        As for :func:`ckptstore.open`.

    Attributes
    ----------
    last_info: :class:`~ckptstore.StepInfo` of the newest save (None if it wrote nothing).
    """

    def __init__(
        self,
        url,
        *,
        convert: Callable[[str, Any], Any] = default_convert,
        storage_options: dict | None = None,
        **open_options,
    ):
        if isinstance(url, Repository) and (storage_options or open_options):
            raise TypeError("storage_options and repository options apply only when a URL is given")
        self.url = url
        self.convert = convert
        self.storage_options = storage_options
        self.open_options = open_options
        self._repo = url if isinstance(url, Repository) else None
        self.last_info = None

    @property
    def repository(self) -> Repository:
        if self._repo is None:
            self._repo = ckptstore.open(os.fspath(self.url), storage_options=self.storage_options, **self.open_options)
        return self._repo

    # -- mapping
    def _recorded_name(self, step: int) -> str | None:
        meta = self.repository.checkpoint(step).metadata.get(METADATA_KEY)
        return meta.get("path") if isinstance(meta, dict) else None

    def _steps_named(self, name: str) -> list[int]:
        return [s for s in self.repository.steps() if self._recorded_name(s) == name]

    def resolve(self, path) -> int:
        """The committed step a checkpoint path names (``StepNotFoundError`` if none)."""
        name = checkpoint_name(path)
        repo = self.repository
        step = name_step(name)
        if step is not None:
            if step not in repo.steps():
                raise StepNotFoundError(f"{repo.url}: checkpoint {name!r} is step {step}, which is not committed")
            return step
        if is_last_name(name):
            step = repo.latest()
            if step is None:
                raise StepNotFoundError(f"{repo.url}: checkpoint {name!r} is the newest step; the repository has none")
            return step
        named = self._steps_named(name)
        if not named:
            raise StepNotFoundError(
                f"{repo.url}: no step was saved as {name!r} (names without 'step=N' are found by the "
                "name recorded when they were saved)"
            )
        return named[-1]

    def save_step(self, checkpoint: Mapping, path) -> int | None:
        """The step a save of ``checkpoint`` to ``path`` writes (None: nothing to write)."""
        name = checkpoint_name(path)
        step = name_step(name)
        if step is not None:
            return step
        gs = checkpoint.get("global_step")
        if type(gs) is not int:
            raise ValueError(f"checkpoint {name!r} has no integer 'global_step' and its name no 'step=N'")
        if is_last_name(name) and gs in self.repository.steps():
            return None
        return gs

    def metadata(self, checkpoint: Mapping, path) -> dict:
        return {
            METADATA_KEY: {
                "format": METADATA_FORMAT,
                "path": checkpoint_name(path),
                "global_step": checkpoint.get("global_step"),
                "epoch": checkpoint.get("epoch"),
                "lightning": checkpoint.get("pytorch-lightning_version"),
            }
        }

    def replace_older(self, path, step: int | None) -> None:
        """Delete earlier steps saved under ``path``'s name (a save overwrites the file)."""
        name = checkpoint_name(path)
        if name_step(name) is not None:
            return
        for s in self._steps_named(name):
            if step is None or s < step:
                self.repository.delete(s)

    # -- CheckpointIO
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "CkptStoreCheckpointIO.save_checkpoint does not take storage_options; "
                "pass them to CkptStoreCheckpointIO(url, storage_options=...)"
            )
        state = to_storable(checkpoint, self.convert)
        step = self.save_step(checkpoint, path)
        if step is None:
            self.last_info = None
            self.replace_older(path, self.repository.latest())
            return
        try:
            self.last_info = self.repository.save(state, step=step, metadata=self.metadata(checkpoint, path))
        except StepExistsError:
            raise StepExistsError(
                f"{self.repository.url}: cannot save {checkpoint_name(path)!r} as step {step}: the step is "
                f"already committed (saved as {self._recorded_name(step)!r}); give each checkpoint of one "
                "step a single name, e.g. ModelCheckpoint(filename='{epoch}-{step}')"
            ) from None
        self.replace_older(path, step)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the step ``path`` names. ``weights_only`` is moot: nothing is unpickled."""
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise TypeError("CkptStoreCheckpointIO.load_checkpoint takes map_location as a device or None")
        ckpt = self.repository.load(self.resolve(path))
        return ckpt if map_location is None else _move(ckpt, map_location)

    def remove_checkpoint(self, path) -> None:
        """``repo.delete`` of the step ``path`` names; ``last.ckpt`` and missing steps are left alone."""
        name = checkpoint_name(path)
        if is_last_name(name):
            return
        try:
            step = self.resolve(path)
        except StepNotFoundError:
            return
        self.repository.delete(step)

    def teardown(self) -> None:
        if self._repo is not None and not isinstance(self.url, Repository):
            self._repo.close()
            self._repo = None


# ---------------------------------------------------------------- ModelParallelStrategy
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
    without unpickling. Paths map to steps as for
    :class:`CkptStoreCheckpointIO`, which also becomes the strategy's
    ``checkpoint_io`` (``ModelCheckpoint`` rotation deletes steps).

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
            self.url, convert=convert, storage_options=storage_options, **self.repo_options
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
        rest = to_storable(rest, io.convert)  # every rank: a refusal is raised everywhere
        step = self.broadcast(io.save_step(checkpoint, path) if self.global_rank == 0 else None)
        if step is None:
            if self.global_rank == 0:
                io.replace_older(path, io.repository.latest())
            self.barrier("ckptstore_save_last")
            return
        tree, extra = flatten(rest)
        state = {"state_dict": checkpoint.pop("state_dict")}
        for idx, osd in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{idx}"] = osd
        state[EXTRA_KEY] = extra
        meta = io.metadata(checkpoint, path)
        meta[METADATA_KEY]["tree"] = tree
        meta[METADATA_KEY]["optimizers"] = sum(1 for k in state if k.startswith("optimizer_"))
        writer = CkptStoreWriter(
            self.url, step=step, storage_options=self.storage_options, metadata=meta, **self.repo_options
        )
        dcp.save(state, storage_writer=writer)
        if self.global_rank == 0:
            io.replace_older(path, step)
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
        return unflatten(meta["tree"], lambda k: ckpt.read(f"{EXTRA_KEY}.{k}"))


__all__ = [
    "CkptStoreCheckpointIO",
    "CkptStoreModelParallelStrategy",
    "checkpoint_name",
    "name_step",
    "is_last_name",
    "default_convert",
    "to_storable",
    "METADATA_KEY",
]
