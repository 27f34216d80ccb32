"""Lightning adapters: a ``CheckpointIO`` and a ``ModelParallelStrategy`` over ckptstore.

- :class:`CkptStoreCheckpointIO` commits every checkpoint Lightning saves
  (``ModelCheckpoint``, ``trainer.save_checkpoint``) as a step of a
  repository under the checkpoint's file name, keeps the file Lightning
  expects at the path (the checkpoint itself, or a small stand-in), loads
  a name back for ``Trainer.fit(ckpt_path=...)`` from any machine, and
  turns ``ModelCheckpoint(save_top_k=...)`` rotation into deleting steps.
- :class:`CkptStoreModelParallelStrategy` is Lightning's ``ModelParallelStrategy`` (FSDP2 /
  tensor parallel) with its distributed checkpoints written by
  :class:`~ckptstore.dcp.CkptStoreWriter` and read by ``CkptStoreReader``.

Names. A checkpoint is known by its file name (the folder does not count):
the name is a record in the repository (name space ``lightning``) pointing
at the step that holds it. A save commits a new step (Lightning's
``global_step`` when that step is free, else one past the newest step), then
moves the name to it in one write, so saving a name again (``last.ckpt``
every epoch, a fresh run into the same folder) makes the name load the new
state while the older step stays for retention and GC. Repositories written
before names existed are read by the earlier rules (:meth:`CkptStoreCheckpointIO.resolve`).

Values that are neither tensors nor JSON values are refused with an error
naming them (no pickle), apart from the explicit conversions of
:func:`default_convert` and OmegaConf containers, which come back as
OmegaConf containers. See ``docs/integrations/lightning.md``.
"""

from __future__ import annotations

import contextlib
import enum
import os
import pathlib
import re
import threading
from collections.abc import Mapping
from typing import Any, Callable

try:
    import lightning.pytorch as pl  # noqa: F401
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.fabric.utilities.cloud_io import get_filesystem
    from lightning.pytorch.strategies import ModelParallelStrategy
except ImportError as e:  # tested in a subprocess where lightning cannot be imported
    raise ImportError(
        "ckptstore.integrations.lightning needs lightning (2.x): pip install 'ckptstore[integrations]'"
    ) from e

import numpy as np
import torch

import ckptstore
from ckptstore import Repository
from ckptstore.errors import StepNotFoundError
from ckptstore.format.tree import flatten, unflatten

from ._common import STANDIN_MAX, parse_standin, standin_bytes

#: Metadata key of every step written here.
METADATA_KEY = "lightning"
METADATA_FORMAT = 1
#: Name space of Lightning's checkpoint names in a repository.
NAMESPACE = "lightning"
#: ``local_files`` choices: the checkpoint file itself, or a stand-in.
LOCAL_FILES = ("full", "stub")
STANDIN_FORMAT = "ckptstore.lightning.standin"

_STEP_RE = re.compile(r"(?:^|[-_])step=(\d+)(?=$|[-_.=])")
_LAST_RE = re.compile(r"^last(-v\d+)?\.ckpt$")


def checkpoint_name(path) -> str:
    """The file name of a Lightning checkpoint path (what the mapping reads)."""
    name = os.path.basename(os.fspath(path).rstrip("/\\"))
    if not name:
        raise ValueError(f"checkpoint path {path!r} has no file name")
    return name


def name_step(name: str) -> int | None:
    """``N`` for a name containing ``step=N``, else None."""
    m = _STEP_RE.search(name)
    return int(m.group(1)) if m else None


def is_last_name(name: str) -> bool:
    """Whether ``name`` is ModelCheckpoint's ``last.ckpt`` (or ``last-vK.ckpt``)."""
    return bool(_LAST_RE.match(name))


# ---------------------------------------------------------------- conversions
def default_convert(path: str, value: Any) -> Any:
    """Explicit conversions of non-JSON values found in Lightning checkpoints.

    - ``pathlib.PurePath`` -> ``str``;
    - ``enum.Enum`` whose value is a JSON scalar -> that value (Lightning's
      own enums are ``str`` enums and compare equal to their value);
    - NumPy scalars -> the Python scalar (``.item()``).

    Anything else raises ``TypeError`` naming ``path`` and the type.
    (OmegaConf containers and classes are handled before ``convert`` is
    asked, and are restored on load.)
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


def _omegaconf():
    """The omegaconf module if it is already imported (a value of its types exists only then)."""
    import sys

    return sys.modules.get("omegaconf")


#: Restorable kinds: what a converted value was.
_OMEGA_KINDS = ("omegaconf.DictConfig", "omegaconf.ListConfig")


def _omega_kind(value) -> tuple[str, Any] | None:
    """(kind, plain value) for an OmegaConf container or class, else None."""
    oc = _omegaconf()
    if oc is None:
        return None
    if isinstance(value, (oc.DictConfig, oc.ListConfig)):
        kind = "omegaconf.DictConfig" if isinstance(value, oc.DictConfig) else "omegaconf.ListConfig"
        return kind, oc.OmegaConf.to_container(value, resolve=False)
    if value is oc.DictConfig or value is oc.ListConfig:
        return "type", f"omegaconf.{value.__name__}"
    return None


def to_storable(obj: Any, convert: Callable[[str, Any], Any] = default_convert, restore: list | None = None) -> Any:
    """A copy of a Lightning checkpoint dict holding only tensors and JSON values.

    Mappings become dicts (``AttributeDict``, ``OrderedDict``), lists and
    tuples stay lists and tuples. OmegaConf containers (``DictConfig``,
    ``ListConfig``, as Hydra users' ``hparams`` are) become plain
    containers, interpolations kept unresolved, and the classes themselves
    (Lightning's ``hparams_type``) their names; each such place is appended
    to ``restore`` as ``[keys, kind]`` so :func:`restore_values` rebuilds
    them. Any other non-JSON value goes through ``convert(path, value)``,
    whose result must be storable.
    """

    def walk(v, path, keys, depth):
        if depth > 100:
            raise TypeError(f"{path or '<root>'}: nested more than 100 levels")
        if isinstance(v, torch.Tensor) or v is None or type(v) in (bool, int, float, str):
            return v
        omega = _omega_kind(v)
        if omega is not None:
            kind, plain = omega
            if restore is not None:
                restore.append([list(keys), kind])
            return plain if kind == "type" else walk(plain, path, keys, depth + 1)
        if isinstance(v, Mapping):
            out = {}
            for k, x in v.items():
                if type(k) not in (str, int):
                    raise TypeError(f"{path}.{k!r}: dict keys must be str or int, got {type(k).__name__}")
                out[k] = walk(x, f"{path}.{k}" if path else str(k), (*keys, k), depth + 1)
            return out
        if isinstance(v, (list, tuple)):
            items = [walk(x, f"{path}[{i}]", (*keys, i), depth + 1) for i, x in enumerate(v)]
            return tuple(items) if isinstance(v, tuple) else items
        converted = convert(path, v)
        if converted is v:
            raise TypeError(f"convert returned the {type(v).__name__} at {path!r} unchanged")
        return walk(converted, path, keys, depth + 1)

    return walk(obj, "", (), 0)


def restore_values(ckpt: dict, restore) -> dict:
    """Rebuild the OmegaConf containers and classes :func:`to_storable` recorded (in place)."""
    if not restore:
        return ckpt
    try:
        import omegaconf as oc
    except ImportError:
        raise ImportError(
            "this checkpoint holds OmegaConf values (Hydra hparams); install omegaconf to load it"
        ) from None
    for keys, kind in restore:
        parent, last = None, None
        node = ckpt
        for k in keys:
            parent, last, node = node, k, node[k]
        if kind == "type":
            value = {"omegaconf.DictConfig": oc.DictConfig, "omegaconf.ListConfig": oc.ListConfig}[node]
        elif kind in _OMEGA_KINDS:
            value = oc.OmegaConf.create(node)
        else:
            raise ValueError(f"unknown stored conversion {kind!r}")
        if parent is None:
            return value
        parent[last] = value
    return ckpt


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


def _is_training_checkpoint(checkpoint: Mapping, name: str) -> bool:
    """A Lightning training checkpoint (a global step), not another dict saved through the IO.

    Lightning's ``ddp_spawn`` launcher hands rank 0's weights to the main
    process as ``<tmp>/.temp.ckpt`` (a module state dict, saved and removed
    through the IO); that is not a checkpoint of the run.
    """
    return type(checkpoint.get("global_step")) is int or name_step(name) is not None


# ---------------------------------------------------------------- CheckpointIO
class CkptStoreCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` committing each checkpoint as a step of one repository.

    ``Trainer(plugins=[CkptStoreCheckpointIO("s3://bucket/run")])``. Resume
    with ``trainer.fit(model, ckpt_path="epoch=0-step=100.ckpt")`` (any
    folder: the name is looked up in the repository) or ``"last.ckpt"``.

    Parameters
    ----------
    url:
        Repository URL, or an open :class:`~ckptstore.Repository` (not
        closed by ``teardown``).
    local_files:
        What is left at the path Lightning saves to. ``"full"`` (default):
        the checkpoint file exactly as Lightning's own ``TorchCheckpointIO``
        writes it, so ``ModelCheckpoint``'s bookkeeping, ``torch.load``,
        ``LightningModule.load_from_checkpoint`` and symlinks work on the
        folder as without ckptstore, while the repository keeps every
        checkpoint deduplicated, versioned and readable from any machine.
        ``"stub"``: a small stand-in file (``ModelCheckpoint``'s listing,
        versioning and rotation still work; ``torch.load`` of it fails with
        one line naming the repository and the step); no checkpoint byte is
        written locally.
    convert:
        ``convert(path, value)`` for values that are neither tensors nor
        JSON values; default :func:`default_convert`.
    storage_options, **open_options:
        As for :func:`ckptstore.open`.

    Attributes
    ----------
    last_info: :class:`~ckptstore.StepInfo` of the newest save (None if it committed nothing).
    """

    def __init__(
        self,
        url,
        *,
        local_files: str = "full",
        convert: Callable[[str, Any], Any] = default_convert,
        storage_options: dict | None = None,
        **open_options,
    ):
        if isinstance(url, Repository) and (storage_options or open_options):
            raise TypeError("storage_options and repository options apply only when a URL is given")
        if local_files not in LOCAL_FILES:
            raise ValueError(f"local_files must be one of {LOCAL_FILES}, got {local_files!r}")
        self.url = url
        self.local_files = local_files
        self.convert = convert
        self.storage_options = storage_options
        self.open_options = open_options
        self._repo = url if isinstance(url, Repository) else None
        self._torch_io = TorchCheckpointIO()
        self.last_info = None

    def __getstate__(self):
        # Lightning pickles its strategy (and this plugin) into ddp_spawn
        # children; a repository handle (threads, sockets) does not travel.
        if isinstance(self.url, Repository):
            raise TypeError("a CkptStoreCheckpointIO built on an open Repository cannot be sent to another process")
        state = dict(self.__dict__)
        state["_repo"] = None
        return state

    # -- the repository
    @property
    def repository(self) -> Repository:
        """A repository handle kept open until :meth:`teardown`."""
        if self._repo is None:
            self._repo = self._open()
        return self._repo

    def _open(self) -> Repository:
        return ckptstore.open(os.fspath(self.url), storage_options=self.storage_options, **self.open_options)

    @contextlib.contextmanager
    def session(self):
        """The open handle if there is one, else a handle for one operation, closed after it.

        Lightning calls ``teardown`` at the end of ``fit``/``validate``/...
        only; a save or load outside them (``trainer.save_checkpoint`` after
        ``fit``, a bare ``ModelCheckpoint`` call) leaves no thread running.
        """
        if self._repo is not None:
            yield self._repo
            return
        repo = self._open()
        try:
            yield repo
        finally:
            repo.close()

    @property
    def repo_url(self) -> str:
        return self.url.url if isinstance(self.url, Repository) else os.fspath(self.url)

    # -- names
    def resolve(self, path, repo: Repository | None = None) -> int:
        """The committed step a checkpoint path names (``StepNotFoundError`` if none)."""
        if repo is None:
            with self.session() as repo:
                return self.resolve(path, repo)
        step = self._lookup(path, repo)
        if step is None:
            raise StepNotFoundError(f"{repo.url}: no checkpoint named {checkpoint_name(path)!r} was saved")
        return step

    def _lookup(self, path, repo: Repository) -> int | None:
        """The step for ``path``: its name record, a symlink's target, a stand-in, then the pre-name rules."""
        name = checkpoint_name(path)
        local = os.fspath(path)
        step = repo.name_step(NAMESPACE, name)
        if step is not None:
            if step not in repo.steps():
                if _is_file(local) and _read_standin(local) is None:
                    return None  # the file Lightning wrote is still there: it is read instead
                raise StepNotFoundError(
                    f"{repo.url}: checkpoint {name!r} was saved as step {step}, which has been deleted since"
                )
            return step
        if os.path.islink(local):  # ModelCheckpoint(save_last="link") links last.ckpt to a saved file
            target = os.path.join(os.path.dirname(local), os.readlink(local))
            if checkpoint_name(target) != name:
                return self._lookup(target, repo)
        standin = _read_standin(local)
        if standin is not None and standin.get("url") == repo.url and standin.get("step") in repo.steps():
            return standin["step"]
        if repo.names(NAMESPACE):
            return None  # written with names: a name without a record was never saved
        return _legacy_step(name, repo)

    # -- saving
    def save_step(self, checkpoint: Mapping, path, repo: Repository) -> int:
        """The step a save of ``checkpoint`` to ``path`` commits: the global step if free, else the next free one."""
        gs = checkpoint.get("global_step")
        step = gs if type(gs) is int else name_step(checkpoint_name(path))
        return repo.free_step(step)

    def metadata(self, checkpoint: Mapping, path, restore: list | None = None) -> dict:
        meta = {
            "format": METADATA_FORMAT,
            "path": checkpoint_name(path),
            "global_step": checkpoint.get("global_step"),
            "epoch": checkpoint.get("epoch"),
            "lightning": checkpoint.get("pytorch-lightning_version"),
        }
        if restore:
            meta["restore"] = restore
        return {METADATA_KEY: meta}

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        name = checkpoint_name(path)
        if not _is_training_checkpoint(checkpoint, name):
            self.last_info = None
            self._torch_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        if storage_options is not None and self.local_files == "stub":
            raise TypeError(
                "CkptStoreCheckpointIO.save_checkpoint does not take storage_options; "
                "pass them to CkptStoreCheckpointIO(url, storage_options=...)"
            )
        restore: list = []
        state = to_storable(checkpoint, self.convert, restore)  # refuses before anything is written
        local = None
        if self.local_files == "full":
            if storage_options is not None:
                # Lightning's own IO judges them (TorchCheckpointIO refuses any)
                # before the repository changes.
                self._torch_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
            else:
                # Lightning's file is written while the step is committed (both
                # only read the tensors): the save costs the slower of the two.
                local = _Background(lambda: self._torch_io.save_checkpoint(checkpoint, path, storage_options=None))
        try:
            with self.session() as repo:
                step = self.save_step(checkpoint, path, repo)
                self.last_info = repo.save(state, step=step, metadata=self.metadata(checkpoint, path, restore))
                if local is not None:
                    local.result()
                repo.set_name(NAMESPACE, name, step)
                if self.local_files == "stub":
                    _write_standin(path, repo.url, step, name)
        except BaseException:
            if self.local_files == "full":
                if local is not None:
                    local.wait()
                # The file must not stand for a state the repository did not take.
                self._torch_io.remove_checkpoint(path)
            raise

    # -- loading
    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the step ``path`` names; a local checkpoint file not in the repository is read with ``weights_only=True``."""
        if map_location is not None and not isinstance(map_location, (str, torch.device)) and not callable(map_location):
            raise TypeError("CkptStoreCheckpointIO.load_checkpoint takes map_location as a device, a function or None")
        with self.session() as repo:
            step = self._lookup(path, repo)
            if step is not None:
                ckpt = repo.load(step)
                meta = repo.checkpoint(step).metadata.get(METADATA_KEY)
                restore_values(ckpt, meta.get("restore") if isinstance(meta, dict) else None)
                if map_location is None or callable(map_location):
                    return ckpt
                return _move(ckpt, map_location)
        local = os.fspath(path)
        doc = _read_standin(local)
        if doc is not None:
            raise StepNotFoundError(
                f"{local} stands for step {doc.get('step')} of {doc.get('url')!r}, which this CkptStoreCheckpointIO "
                f"({self.repo_url!r}) does not hold; use a CkptStoreCheckpointIO on that repository"
            )
        if _is_file(local):
            # A checkpoint file Lightning or torch wrote (not through ckptstore): read
            # it as Lightning would, but never with the unrestricted unpickler.
            return self._torch_io.load_checkpoint(path, map_location=map_location, weights_only=True)
        raise FileNotFoundError(
            f"Checkpoint file not found: {path} (no file there, and no checkpoint of that name in {self.repo_url})"
        )

    def remove_checkpoint(self, path) -> None:
        """Remove the file at ``path`` and the checkpoint it names; its step is deleted unless another name uses it."""
        name = checkpoint_name(path)
        local = os.fspath(path)
        with self.session() as repo:
            step = repo.name_step(NAMESPACE, name)
            if step is None and not is_last_name(name) and not os.path.islink(local):
                step = _legacy_step(name, repo, newest_for_last=False)
            elif step is not None:
                repo.drop_name(NAMESPACE, name)
            if step is not None and step in repo.steps() and step not in repo.names(NAMESPACE).values():
                repo.delete(step)
        if self.local_files == "stub" and _read_standin(local) is not None:
            os.unlink(local)
        else:
            self._torch_io.remove_checkpoint(path)

    def teardown(self) -> None:
        if self._repo is not None and not isinstance(self.url, Repository):
            self._repo.close()
            self._repo = None


# ---------------------------------------------------------------- helpers
class _Background:
    """``fn()`` on a thread of its own; :meth:`result` waits and raises what it raised."""

    def __init__(self, fn):
        self._error: BaseException | None = None

        def run():
            try:
                fn()
            except BaseException as e:  # handed to the caller by result()
                self._error = e

        self._thread = threading.Thread(target=run, name="ckptstore-lightning-file", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _legacy_step(name: str, repo: Repository, newest_for_last: bool = True) -> int | None:
    """The rules of repositories written before names: ``step=N`` is N, ``last`` the newest, else the recorded name."""
    steps = repo.steps()
    if not steps:
        return None
    n = name_step(name)
    if n is not None:
        return n if n in steps else None
    if is_last_name(name):
        return steps[-1] if newest_for_last else None
    for s in reversed(steps):
        meta = repo.checkpoint(s).metadata.get(METADATA_KEY)
        if isinstance(meta, dict) and meta.get("path") == name:
            return s
    return None


def _write_standin(path, url: str, step: int, name: str) -> None:
    message = (
        f"{name} is a ckptstore stand-in for step {step} of {url}; load it with "
        f"Trainer(plugins=[CkptStoreCheckpointIO({url!r})]) or CkptStoreCheckpointIO(...).load_checkpoint, "
        f"or write a file with `ckptstore export {url} {step} OUT.safetensors` (weights only)"
    )
    record = {"format": STANDIN_FORMAT, "version": 1, "url": url, "step": step, "name": name}
    fs = get_filesystem(path)
    fs.makedirs(os.path.dirname(os.fspath(path)), exist_ok=True)
    with fs.open(os.fspath(path), "wb") as f:
        f.write(standin_bytes(message, record))


def _is_file(path: str) -> bool:
    try:
        return bool(get_filesystem(path).isfile(path))
    except OSError:
        return False


def _read_standin(path: str) -> dict | None:
    """A stand-in's record (ours), or None for anything else (missing, a checkpoint file, a directory)."""
    try:
        with get_filesystem(path).open(path, "rb") as f:
            raw = f.read(STANDIN_MAX + 1)
    except (OSError, ValueError):
        return None
    doc = parse_standin(raw)
    if doc is None or doc.get("format") != STANDIN_FORMAT or type(doc.get("step")) is not int:
        return None
    return doc


# ---------------------------------------------------------------- ModelParallelStrategy
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


__all__ = [
    "CkptStoreCheckpointIO",
    "CkptStoreModelParallelStrategy",
    "checkpoint_name",
    "name_step",
    "is_last_name",
    "default_convert",
    "to_storable",
    "restore_values",
    "METADATA_KEY",
    "NAMESPACE",
]
