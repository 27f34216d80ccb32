"""Hugging Face adapters: lazy state dicts, a ``Trainer`` callback, FSDP routing.

- :func:`lazy_state_dict` gives ``from_pretrained(None, config=cfg,
  state_dict=...)`` values that read their bytes only when transformers
  indexes them (whole tensors, or the slices tensor-parallel loading asks
  for), through :meth:`ckptstore.Checkpoint.read`.
- :class:`CkptStoreCallback` saves model, optimizer, scheduler, RNG and
  trainer state as one step on every ``Trainer`` save;
  :func:`restore_checkpoint_dir` turns such a step back into a directory
  ``Trainer.train(resume_from_checkpoint=...)`` resumes from.
- :func:`route_fsdp_checkpoints` sends accelerate's sharded FSDP saves and
  loads (``SHARDED_STATE_DICT``) to :class:`~ckptstore.dcp.CkptStoreWriter`
  and :class:`~ckptstore.dcp.CkptStoreReader`.

See ``docs/integrations/hf.md``. Needs transformers (and accelerate for the
Trainer): ``pip install 'ckptstore[integrations]'``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

try:
    import transformers  # noqa: F401
    from transformers import TrainerCallback
except ImportError as e:  # tested in a subprocess where transformers cannot be imported
    raise ImportError(
        "ckptstore.integrations.hf needs transformers (and accelerate for Trainer): "
        "pip install 'ckptstore[integrations]'"
    ) from e

import numpy as np
import torch

import ckptstore
from ckptstore.errors import StepNotFoundError
from ckptstore import Checkpoint, Repository, SafetensorsObject, TensorMeta
from ckptstore.loading import PLAIN_SOURCES, TensorReader, is_safetensors_url, open_safetensors, resolve_checkpoint

#: Key of the step metadata written by :class:`CkptStoreCallback`.
METADATA_KEY = "hf_trainer"
#: Format of that metadata (bumped if the state-dict layout changes).
METADATA_FORMAT = 1
#: Where each part of the Trainer state sits in a step saved by the callback.
MODEL, OPTIMIZER, SCHEDULER, RNG, TRAINER_STATE = "model", "optimizer", "scheduler", "rng", "trainer_state"

# The dtype names safetensors' slices report from get_dtype(); transformers
# compares them by prefix ("F", "BF" = floating point).
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        _SAFETENSORS_DTYPES[getattr(torch, _name)] = _code


def _open(url, storage_options, open_options) -> tuple[Repository, bool]:
    """``(repository, owned)``: a Repository passed in is used as is and not closed."""
    if isinstance(url, Repository):
        if storage_options or open_options:
            raise TypeError("storage_options and repository options apply only when a URL is given")
        return url, False
    return ckptstore.open(os.fspath(url), storage_options=storage_options, **open_options), True


# ---------------------------------------------------------------- lazy state dict
class LazyTensor:
    """One stored tensor whose bytes are read only when it is indexed.

    Quacks like the slice objects safetensors hands ``from_pretrained``:
    ``get_shape()``, ``get_dtype()``, ``dtype``, ``shape``,
    ``is_floating_point()``, and ``t[index]`` returning a ``torch.Tensor``
    for ints, slices and ``...`` (``t[...]`` is the whole tensor). Each
    index reads only the chunks covering it, through
    :class:`ckptstore.loading.TensorReader`, the reading path
    :func:`ckptstore.load_module` uses too.
    """

    __slots__ = ("_reader", "key", "_meta")

    def __init__(self, source: Checkpoint | TensorReader | SafetensorsObject, key: str, meta: TensorMeta | None = None):
        self._reader = source if isinstance(source, (TensorReader,) + PLAIN_SOURCES) else TensorReader(source)
        self.key = key
        self._meta = meta or (_plain_meta(source, key) if isinstance(source, PLAIN_SOURCES)
                              else self._reader.checkpoint.tensor_meta(key))

    @property
    def dtype(self) -> torch.dtype:
        return self._meta.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._meta.shape)

    @property
    def ndim(self) -> int:
        return len(self._meta.shape)

    @property
    def nbytes(self) -> int:
        return self._meta.nbytes

    def numel(self) -> int:
        return self.shape.numel()

    def dim(self) -> int:
        return self.ndim

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def get_shape(self) -> list[int]:
        return list(self._meta.shape)

    def get_dtype(self) -> str:
        return _SAFETENSORS_DTYPES.get(self.dtype, str(self.dtype).removeprefix("torch."))

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def __len__(self) -> int:
        if not self._meta.shape:
            raise TypeError("len() of a 0-d tensor")
        return self._meta.shape[0]

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._reader.read(self.key, index)

    def materialize(self, device=None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor (``t[...]``), optionally read straight onto ``device`` as ``dtype``."""
        return self._reader.read(self.key, device=device, dtype=dtype)

    def __repr__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        where = (f"url={self._reader.url!r}" if isinstance(self._reader, PLAIN_SOURCES)
                 else f"step={self._reader.step}")
        return f"LazyTensor({self.key!r}, {dt}{list(self._meta.shape)}, {where})"


def _plain_meta(obj, key: str) -> TensorMeta:
    t = obj.tensor(key)
    return TensorMeta(key=key, dtype=t.dtype, shape=t.shape, shards=(((0,) * len(t.shape), t.shape),),
                      nbytes=t.nbytes, stored_bytes=t.nbytes, chunks=0)


class LazyStateDict(dict):
    """``key -> LazyTensor`` for one step (a plain ``dict`` subclass).

    Attributes
    ----------
    checkpoint: the :class:`~ckptstore.Checkpoint` the values read from
        (None when they read from a plain safetensors object).
    step: its step number (None for a safetensors object).
    plain: the :class:`~ckptstore.SafetensorsObject` (or ``SafetensorsShards``) the values read from, or None.
    prefix: the stored key prefix stripped from every key.

    ``close()`` (or ``with``) closes the repository (or object) when this object opened it.
    """

    def __init__(self, items, checkpoint: Checkpoint | SafetensorsObject, prefix: str, owned: bool):
        super().__init__(items)
        self.plain = checkpoint if isinstance(checkpoint, PLAIN_SOURCES) else None
        self.checkpoint = None if self.plain is not None else checkpoint
        self.step = None if self.plain is not None else checkpoint.step
        self.prefix = prefix
        self._owned = owned

    def close(self) -> None:
        if self._owned:
            self._owned = False
            if self.plain is not None:
                self.plain.close()
            else:
                self.checkpoint.repo.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def lazy_state_dict(
    url,
    step: int | None = None,
    *,
    prefix: str | None = None,
    storage_options: dict | None = None,
    **open_options,
) -> LazyStateDict:
    """A state dict of :class:`LazyTensor` values for ``from_pretrained``.

    ``AutoModel.from_pretrained(None, config=cfg, state_dict=lazy_state_dict(url))``
    builds the model on the meta device and fills each parameter from its
    stored tensor as transformers asks for it (with ``device_map``, onto its
    device; with tensor parallelism, only the local slice is read). Keys the
    model does not use are never read.

    ``url`` may also name a plain ``.safetensors`` object
    (``s3://bucket/llama/model.safetensors``; or be an open
    :class:`~ckptstore.SafetensorsObject`): its header is read with one
    ranged GET, and each value reads only its own byte range (a slice along
    dim 0 only its rows). Those reads are **not hash-checked**; import the
    file (``ckptstore import``) for checked reads.

    Parameters
    ----------
    url:
        Repository URL (as :func:`ckptstore.open`), or an open
        :class:`~ckptstore.Repository` (not closed by this object), or a
        safetensors object's URL (``**open_options``: those of
        :class:`~ckptstore.SafetensorsObject`).
    step:
        Step to read; default the newest committed step.
    prefix:
        Only stored keys starting with ``prefix`` are listed, with the
        prefix removed. Default: ``"model."`` for a step saved by
        :class:`CkptStoreCallback` (which also holds optimizer state),
        else ``""`` (every stored tensor).
    storage_options, **open_options:
        As for :func:`ckptstore.open`.
    """
    if isinstance(url, PLAIN_SOURCES) or is_safetensors_url(url):
        return _plain_state_dict(url, step, prefix, storage_options, open_options)
    repo, ckpt, owned = resolve_checkpoint(url, step, storage_options, open_options)
    try:
        if prefix is None:
            prefix = MODEL + "." if METADATA_KEY in ckpt.metadata else ""
        reader = TensorReader(ckpt)
        items = {}
        for key in ckpt.keys():
            if key.startswith(prefix):
                items[key[len(prefix):]] = LazyTensor(reader, key)
        if not items:
            raise KeyError(f"{repo.url}: step {ckpt.step} has no tensor whose key starts with {prefix!r}")
        return LazyStateDict(items, ckpt, prefix, owned)
    except BaseException:
        if owned:
            repo.close()
        raise


def _plain_state_dict(url, step, prefix, storage_options, open_options) -> LazyStateDict:
    if step is not None:
        raise TypeError(f"step={step}: a plain safetensors object has no steps")
    if isinstance(url, PLAIN_SOURCES):
        if storage_options or open_options:
            raise TypeError("storage_options and open options apply only when a URL is given")
        obj, owned = url, False
    else:
        obj, owned = open_safetensors(url, storage_options, **open_options), True
    try:
        prefix = prefix or ""
        items = {k[len(prefix):]: LazyTensor(obj, k) for k in obj.keys() if k.startswith(prefix)}
        if not items:
            raise KeyError(f"{obj.url} has no tensor whose key starts with {prefix!r}")
        return LazyStateDict(items, obj, prefix, owned)
    except BaseException:
        if owned:
            obj.close()
        raise


# ---------------------------------------------------------------- Trainer callback
def _rng_state(world_size: int) -> dict:
    """The RNG states Trainer's own ``rng_state.pth`` holds, as tensors and JSON values."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss_next": gauss},
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.random.get_rng_state_all() if world_size > 1 else torch.cuda.random.get_rng_state()
    return out


def _rng_for_trainer(saved: dict) -> dict:
    """Inverse of :func:`_rng_state`: the object Trainer's ``_load_rng_state`` reads."""
    py, npy = saved["python"], saved["numpy"]
    out = {
        "python": (py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]),
        "numpy": (
            npy["kind"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        ),
        "cpu": saved["cpu"],
    }
    if "cuda" in saved:
        out["cuda"] = saved["cuda"]
    return out


def _refuse_sharded(args) -> None:
    if getattr(args, "fsdp", None):  # [] / "" unless FSDP is on
        raise RuntimeError(
            "CkptStoreCallback saves a full state dict from one process; under FSDP use "
            "ckptstore.integrations.hf.route_fsdp_checkpoints (docs/integrations/hf.md)"
        )
    if getattr(args, "deepspeed", None):
        raise RuntimeError(
            "CkptStoreCallback does not save DeepSpeed engines; use ckptstore.integrations.deepspeed.attach"
        )


class CkptStoreCallback(TrainerCallback):
    """Save the Trainer's state to a ckptstore repository on every ``on_save``.

    Trainer fires ``on_save`` right after writing its own ``checkpoint-N``
    folder; the callback then commits step ``N = state.global_step`` with,
    as one state dict:

    - ``model``: ``model.state_dict()`` (tensors keyed ``model.<name>``);
    - ``optimizer``: ``optimizer.state_dict()`` (unless ``save_optimizer=False``);
    - ``scheduler``: ``lr_scheduler.state_dict()`` (plain JSON values);
    - ``rng``: the Python, NumPy, torch (and CUDA) RNG states of process 0;
    - ``trainer_state``: ``TrainerState`` as Trainer's ``trainer_state.json``.

    Frozen parameters upload nothing after the first save (dedup against
    the previous step). Resume with :func:`restore_checkpoint_dir`.

    Parameters
    ----------
    url:
        Repository URL, or an open :class:`~ckptstore.Repository`.
    save_optimizer:
        Also save optimizer and scheduler state (needed to resume).
    blocking:
        If False, the save is staged and uploaded in the background while
        training goes on; the next save and ``on_train_end`` wait for it
        (and raise its error, if any).
    prune_local:
        After the step is committed, delete the ``checkpoint-N`` folder
        Trainer wrote for it, so local disk holds one checkpoint at a time.
        Refused with ``load_best_model_at_end`` (Trainer reloads from
        those folders).
    metadata:
        JSON dict stored with every step (next to the callback's own).
    storage_options, **open_options:
        As for :func:`ckptstore.open`.

    Attributes
    ----------
    last_info: the :class:`~ckptstore.StepInfo` of the newest committed save.
    """

    def __init__(
        self,
        url,
        *,
        save_optimizer: bool = True,
        blocking: bool = True,
        prune_local: bool = False,
        metadata: dict | None = None,
        storage_options: dict | None = None,
        **open_options,
    ):
        self.url = url
        self.save_optimizer = save_optimizer
        self.blocking = blocking
        self.prune_local = prune_local
        self.metadata = dict(metadata or {})
        self._storage_options = storage_options
        self._open_options = open_options
        self._repo: Repository | None = None
        self._owned = False
        self._pending = None  # (future, folder to prune or None)
        self.last_info = None

    @property
    def repository(self) -> Repository:
        if self._repo is None:
            self._repo, self._owned = _open(self.url, self._storage_options, self._open_options)
        return self._repo

    def on_train_begin(self, args, state, control, **kwargs):
        _refuse_sharded(args)
        if self.prune_local and args.load_best_model_at_end:
            raise ValueError("CkptStoreCallback(prune_local=True) cannot be used with load_best_model_at_end=True")

    def on_save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if not state.is_world_process_zero:
            return
        _refuse_sharded(args)
        self.wait()
        if model is None:
            raise RuntimeError("on_save was called without the model; CkptStoreCallback needs Trainer's callback kwargs")
        step = int(state.global_step)
        sd: dict[str, Any] = {MODEL: model.state_dict()}
        if self.save_optimizer and optimizer is not None:
            sd[OPTIMIZER] = optimizer.state_dict()
            if lr_scheduler is not None:
                sd[SCHEDULER] = lr_scheduler.state_dict()
        sd[RNG] = _rng_state(args.world_size)
        # As Trainer's save_to_json writes trainer_state.json (a JSON round trip
        # also turns any tuple into a list, as the file would).
        sd[TRAINER_STATE] = json.loads(json.dumps(dataclasses.asdict(state)))
        meta = dict(self.metadata)
        meta[METADATA_KEY] = {
            "format": METADATA_FORMAT,
            "global_step": step,
            "epoch": state.epoch,
            "world_size": args.world_size,
            "transformers": transformers.__version__,
            "model_class": type(model).__name__,
        }
        folder = os.path.join(args.output_dir, f"checkpoint-{step}") if self.prune_local else None
        if self.blocking:
            self.last_info = self.repository.save(sd, step=step, metadata=meta)
            self._prune(folder)
        else:
            self._pending = (self.repository.save(sd, step=step, metadata=meta, blocking=False), folder)

    def wait(self):
        """Wait for a background save; returns its StepInfo (None if none was pending)."""
        if self._pending is None:
            return None
        fut, folder = self._pending
        self._pending = None
        self.last_info = fut.result()
        self._prune(folder)
        return self.last_info

    @staticmethod
    def _prune(folder: str | None) -> None:
        if folder and os.path.isdir(folder):
            shutil.rmtree(folder)

    def on_train_end(self, args, state, control, **kwargs):
        self.wait()

    def close(self) -> None:
        """Wait for a pending save and close the repository if the callback opened it."""
        try:
            self.wait()
        finally:
            if self._repo is not None and self._owned:
                self._repo.close()
            self._repo = None


def restore_checkpoint_dir(
    url,
    directory,
    step: int | None = None,
    *,
    storage_options: dict | None = None,
    **open_options,
) -> str:
    """Write a step saved by :class:`CkptStoreCallback` as a Trainer checkpoint folder.

    Creates ``directory/checkpoint-<step>`` with ``model.safetensors``,
    ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth`` and
    ``trainer_state.json``, the files ``Trainer.train(resume_from_checkpoint=...)``
    reads, so Trainer's own resume logic (data skipping, RNG, schedule)
    continues the run exactly where the step left off. Returns the folder.

    The ``.pt`` files are written with ``torch.save`` from tensors and JSON
    values ckptstore read; Trainer loads them with ``weights_only=True``.
    The folder must not exist yet. In a multi-process job, call it on one
    process per machine (e.g. local rank 0, then a barrier) before
    ``train``; only process 0's RNG state was saved.
    """
    repo, owned = _open(url, storage_options, open_options)
    try:
        if step is None:
            step = repo.latest()
            if step is None:
                raise StepNotFoundError(f"{repo.url}: the repository has no committed step")
        ckpt = repo.checkpoint(step)
        meta = ckpt.metadata.get(METADATA_KEY)
        if not isinstance(meta, dict):
            raise ValueError(f"{repo.url}: step {step} was not saved by CkptStoreCallback (no {METADATA_KEY!r} metadata)")
        if meta.get("format") != METADATA_FORMAT:
            raise ValueError(f"{repo.url}: step {step} has hf_trainer format {meta.get('format')!r}; this version reads {METADATA_FORMAT}")
        out = Path(directory) / f"checkpoint-{step}"
        if out.exists():
            raise FileExistsError(f"{out} exists; restore into a new directory")
        sd = repo.load(step)
        from safetensors.torch import save_file

        out.mkdir(parents=True)
        save_file(sd[MODEL], str(out / "model.safetensors"), metadata={"format": "pt"})
        if OPTIMIZER in sd:
            torch.save(sd[OPTIMIZER], out / "optimizer.pt")
        if SCHEDULER in sd:
            torch.save(sd[SCHEDULER], out / "scheduler.pt")
        if RNG in sd:
            name = "rng_state.pth" if meta.get("world_size", 1) <= 1 else "rng_state_0.pth"
            torch.save(_rng_for_trainer(sd[RNG]), out / name)
        (out / "trainer_state.json").write_text(json.dumps(sd[TRAINER_STATE], indent=2, sort_keys=True) + "\n")
        return str(out)
    finally:
        if owned:
            repo.close()


# ---------------------------------------------------------------- FSDP routing
_FSDP_DIR = re.compile(r"^(pytorch_model_fsdp|optimizer)_\d+$")
_CKPT_DIR = re.compile(r"^checkpoint-(\d+)$")


def fsdp_target(path, output_dir, url: str) -> tuple[str, int] | None:
    """Where :func:`route_fsdp_checkpoints` sends one DCP folder of accelerate's.

    ``<output_dir>/.../checkpoint-<N>/<name>`` with ``name`` one of
    ``pytorch_model_fsdp_<i>`` (model) or ``optimizer_<i>`` maps to step
    ``N`` of the repository ``<url>/<name>``; any other path to None.
    """
    p = Path(os.path.abspath(os.fspath(path)))
    root = Path(os.path.abspath(os.fspath(output_dir)))
    if root != p and root not in p.parents:
        return None
    m = _CKPT_DIR.match(p.parent.name)
    if not _FSDP_DIR.match(p.name) or m is None:
        return None
    return f"{str(url).rstrip('/')}/{p.name}", int(m.group(1))


@contextlib.contextmanager
def route_fsdp_checkpoints(url: str, output_dir, *, storage_options: dict | None = None, **options):
    """Route accelerate's sharded FSDP checkpoints through ckptstore's DCP backend.

    accelerate writes ``SHARDED_STATE_DICT`` checkpoints with a hard-coded
    ``torch.distributed.checkpoint.FileSystemWriter(ckpt_dir)`` (and reads
    them with ``FileSystemReader``) in ``accelerate.utils.fsdp_utils``
    ``save_fsdp_model``/``save_fsdp_optimizer``/``load_fsdp_model``/
    ``load_fsdp_optimizer``, which Trainer calls for each ``checkpoint-N``.
    Inside this context, those two names of ``torch.distributed.checkpoint``
    build :class:`~ckptstore.dcp.CkptStoreWriter`/``CkptStoreReader`` for
    every folder :func:`fsdp_target` maps (model and optimizer land in
    ``<url>/pytorch_model_fsdp_0`` and ``<url>/optimizer_0``, step ``N``);
    every other path gets torch's own class. Local ``checkpoint-N`` folders
    keep Trainer's small files (``trainer_state.json``, ``scheduler.pt``,
    RNG) and the empty folders accelerate creates, which Trainer's resume
    checks for.

    The names are patched process-wide while the context is open (enter it
    on every rank around ``trainer.train()``); they are restored on exit.
    ``options`` are passed to the writer and reader (repository tunables).
    """
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import CkptStoreReader, CkptStoreWriter

    real_writer, real_reader = dcp.FileSystemWriter, dcp.FileSystemReader

    def writer(path, *args, **kwargs):
        t = fsdp_target(path, output_dir, url)
        if t is None:
            return real_writer(path, *args, **kwargs)
        return CkptStoreWriter(t[0], step=t[1], storage_options=storage_options, **options)

    def reader(path, *args, **kwargs):
        t = fsdp_target(path, output_dir, url)
        if t is None:
            return real_reader(path, *args, **kwargs)
        return CkptStoreReader(t[0], step=t[1], storage_options=storage_options, **options)

    dcp.FileSystemWriter, dcp.FileSystemReader = writer, reader
    try:
        yield
    finally:
        dcp.FileSystemWriter, dcp.FileSystemReader = real_writer, real_reader


__all__ = [
    "LazyTensor",
    "LazyStateDict",
    "lazy_state_dict",
    "CkptStoreCallback",
    "restore_checkpoint_dir",
    "route_fsdp_checkpoints",
    "fsdp_target",
    "METADATA_KEY",
]
