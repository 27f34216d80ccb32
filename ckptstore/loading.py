"""Restore by parts: fill a module tensor by tensor, each onto its device.

:func:`load_module` materializes a module built on the ``meta`` device (or
refills one that exists) from a committed step, reading every tensor
through the repository's one :class:`~ckptstore.pipeline.fetch.ChunkFetcher`, so
host memory beyond the tensors that stay on the CPU is bounded by the
handle's read budget.

Tensors are read by :class:`~ckptstore.pipeline.staging.TensorReader` (the
reading path it shares with ``Repository.load(into=...)`` and
``ckptstore.integrations.hf.lazy_state_dict``): decoded in place where the
destination allows it, else block by block through
:class:`~ckptstore.pipeline.staging.StagingBuffers`. Those names are importable
from here too.

With a tensor-parallel plan (:mod:`ckptstore.pipeline.tp_plan`) each tensor
is read as this rank's slice only. :class:`PlainModuleLoader` fills a module
from plain safetensors objects (:mod:`ckptstore.repo.plain`) instead of a
repository's step, with the same checks and the same plan.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .format import manifest as _m
from .progress import byte_bar
from .repo.reader import Checkpoint
from .repo.repository import Repository
from .repo.repository import open as _open_repo
from .pipeline.staging import (  # noqa: F401 - re-exported: the reading path's names, as before it moved
    STAGING_ALIGN,
    STAGING_BYTES,
    Block,
    StagingBuffers,
    TensorReader,
    make_staging,
    plan_blocks,
    staging_sizes,
)
from .pipeline.tensors import castable, writable_in_place
from .pipeline.tp_plan import TPPlan, TPPlanError
from .repo.plain import PLAIN_SOURCES, SafetensorsObject, SafetensorsShards, is_safetensors_url, open_safetensors


# ---------------------------------------------------------------- opening
def resolve_checkpoint(url, step: int | None, storage_options: dict | None, open_options: dict):
    """``(repository, checkpoint, owned)`` for a URL or an open :class:`Repository`.

    ``step`` None means the newest committed step. A repository passed in is
    used as is and ``owned`` is False (the caller must not close it);
    ``storage_options`` and ``open_options`` then must be empty.
    """
    if isinstance(url, Repository):
        if storage_options or open_options:
            raise TypeError("storage_options and repository options apply only when a URL is given")
        repo, owned = url, False
    else:
        repo, owned = _open_repo(os.fspath(url), storage_options=storage_options, **open_options), True
    try:
        if step is None:
            step = repo.newest_step()
        return repo, repo.checkpoint(step), owned
    except BaseException:
        if owned:
            repo.close()
        raise


# ---------------------------------------------------------------- load_module
class IncompatibleKeys(NamedTuple):
    """What :func:`load_module` did not match, as ``Module.load_state_dict`` returns it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass
class _Group:
    """One tensor object of the module and every name it has (tied weights share one)."""

    tensor: torch.Tensor
    is_param: bool
    names: list[str] = field(default_factory=list)
    owners: list[tuple[torch.nn.Module, str]] = field(default_factory=list)
    key: str | None = None  # the stored key it is read from
    index: tuple | None = None  # this tensor-parallel rank's slice of it (None: all of it)
    shape: tuple[int, ...] | None = None  # the shape it is read into (the slice's)
    device: torch.device | None = None
    in_place: bool = False
    result: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape if self.shape is not None else self.tensor.shape) * self.tensor.element_size()


def _module_tensors(module: torch.nn.Module) -> list[_Group]:
    """Parameters and persistent buffers, in ``state_dict`` order, grouped by identity."""
    groups: dict[int, _Group] = {}
    for mname, m in module.named_modules(remove_duplicate=False):
        pre = mname + "." if mname else ""
        for name, p in m._parameters.items():
            if p is None:
                continue
            g = groups.setdefault(id(p), _Group(p, True))
            g.names.append(pre + name)
            g.owners.append((m, name))
        for name, b in m._buffers.items():
            if b is None or name in m._non_persistent_buffers_set:
                continue
            g = groups.setdefault(id(b), _Group(b, False))
            g.names.append(pre + name)
            g.owners.append((m, name))
    return list(groups.values())


def _parse_device(value, where: str) -> torch.device:
    if isinstance(value, bool):
        raise ValueError(f"device_map[{where!r}] = {value!r} is not a device")
    if isinstance(value, int):
        value = f"cuda:{value}"
    if isinstance(value, str) and value in ("disk", "meta", "auto", "balanced", "balanced_low_0", "sequential"):
        raise ValueError(
            f"device_map[{where!r}] = {value!r}: load_module places every tensor on 'cpu' or an "
            "accelerator ('cuda:N'); it neither offloads to disk nor infers a map (build one with "
            "accelerate.infer_auto_device_map)"
        )
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device_map[{where!r}] = {value!r} is not a device: {e}") from None
    if dev.type == "meta":
        raise ValueError(f"device_map[{where!r}] = 'meta': load_module materializes tensors")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device_map[{where!r}] = {value!r}, but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device_map[{where!r}] = {value!r}, but there are {torch.cuda.device_count()} CUDA devices")
    return dev


class _DeviceMap:
    """Module-name prefixes to devices; the longest prefix matching at a ``.`` boundary wins."""

    def __init__(self, device_map):
        if device_map is None:
            self.entries = None
            return
        if not isinstance(device_map, dict):
            device_map = {"": device_map}
        self.entries = {}
        for k, v in device_map.items():
            if not isinstance(k, str):
                raise TypeError(f"device_map keys are module names (str), got {k!r}")
            self.entries[k] = _parse_device(v, k)

    def lookup(self, name: str) -> torch.device | None:
        """The device for tensor ``name``; None without a map; KeyError when nothing matches."""
        if self.entries is None:
            return None
        best = None
        for k in self.entries:
            if k == "" or name == k or name.startswith(k + "."):
                if best is None or len(k) > len(best):
                    best = k
        if best is None:
            raise KeyError(name)
        return self.entries[best]


def _same_stored(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tile == b.tile and [
        (s.offsets, s.sizes, [c.hash for c in s.chunks]) for s in a.shards
    ] == [(s.offsets, s.sizes, [c.hash for c in s.chunks]) for s in b.shards]


class ModuleLoader:
    """The body of :func:`load_module` (see there) for a repository's step; ``run()`` does the load.

    ``staging_cls`` builds the staging buffers (tests pass a subclass that
    defers its copies, as an accelerator's asynchronous copies would).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        checkpoint: Checkpoint | SafetensorsObject | SafetensorsShards,
        *,
        device_map=None,
        prefix: str = "",
        strict: bool = True,
        progress: bool = False,
        staging_bytes: int | None = None,
        staging_cls: type[StagingBuffers] = StagingBuffers,
        tp_plan=None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        self.module = module
        self.ckpt = checkpoint
        self.device_map = _DeviceMap(device_map)
        self.prefix = prefix
        self.strict = strict
        self.progress = progress
        self.staging_bytes = staging_bytes
        self.staging_cls = staging_cls
        self.staging: StagingBuffers | None = None
        if tp_plan is None and (tp_size != 1 or tp_rank != 0):
            raise TPPlanError(f"tp_rank={tp_rank}, tp_size={tp_size} without a tp_plan: say how each tensor is split")
        self.tp = TPPlan(tp_plan, tp_rank, tp_size) if tp_plan is not None else None

    # -- what the source holds (a repository step here; PlainModuleLoader: a safetensors object)
    def _source(self) -> str:
        return f"{self.ckpt.repo.url} step {self.ckpt.step}"

    def _bar_title(self) -> str:
        return f"load step {self.ckpt.step}"

    def _keys(self) -> list[str]:
        return self.ckpt.keys()

    def _has(self, key: str) -> bool:
        return key in self.ckpt

    def _stored(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        e = self.ckpt.entry(key)
        return _m.DTYPES[e.dtype], tuple(e.shape)

    def _same(self, a: str, b: str) -> bool:
        return _same_stored(self.ckpt.resolved(a), self.ckpt.resolved(b))

    # -- checks (no data read, nothing changed)
    def _title(self) -> str:
        p = f", prefix {self.prefix!r}" if self.prefix else ""
        return f"Error(s) in loading state_dict for {type(self.module).__name__} from {self._source()}{p}"

    def _check_tp(self, groups: list[_Group]) -> None:
        if self.tp is None:
            return
        names = [n for g in groups for n in g.names]
        names += [m for m, _ in self.module.named_modules(remove_duplicate=False) if m]
        unmatched = self.tp.unmatched(names)
        if unmatched:
            raise TPPlanError(f"tp_plan entries {unmatched} match no parameter, buffer or module of "
                              f"{type(self.module).__name__} (names look like {names[0]!r})")

    def _split(self, g: _Group, name: str, shape: tuple[int, ...]) -> str | None:
        """Set ``g.index``/``g.shape`` (this rank's slice); an error message, or None."""
        g.shape = shape
        if self.tp is None:
            return None
        splits = {n: self.tp.split(n, shape) for n in g.names}
        if len({s.dim for s in splits.values()}) > 1:
            return (f"tied tensors {', '.join(g.names)} (one tensor in the module) are split differently by "
                    f"tp_plan ({', '.join(f'{n}: dim {s.dim}' for n, s in splits.items())}).")
        split = splits[g.names[0]]
        g.index = split.index(shape, self.tp.rank, self.tp.size)
        g.shape = split.local_shape(shape, self.tp.size)
        return None

    def plan(self) -> tuple[list[_Group], IncompatibleKeys]:
        groups = _module_tensors(self.module)
        self._check_tp(groups)
        pre = self.prefix
        stored = [k[len(pre):] for k in self._keys() if k.startswith(pre)]
        known = {n for g in groups for n in g.names}
        unexpected = [k for k in stored if k not in known]
        missing = []
        for g in groups:
            present = [n for n in g.names if self._has(pre + n)]
            if present:
                g.key = pre + present[0]
            else:
                missing.extend(g.names)
        errors = []
        if self.strict:
            if missing:
                errors.append("Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
            if unexpected:
                errors.append("Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
        for g in groups:
            if g.key is None:
                continue
            dtype, shape = self._stored(g.key)
            name = g.key[len(pre):]
            t = g.tensor
            for other in g.names:
                if pre + other != g.key and self._has(pre + other) and not self._same(g.key, pre + other):
                    errors.append(f'tied tensors "{name}" and "{other}" (one tensor in the module) '
                                  "are stored with different values.")
            if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
                errors.append(f"{name} is a {type(t).__name__}; load_module fills plain dense tensors "
                              "(use ckptstore.dcp.CkptStoreReader for DTensor and sharded state).")
                continue
            problem = self._split(g, name, shape)
            if problem is not None:
                errors.append(problem)
                continue
            if tuple(t.shape) != g.shape and not (t.is_meta and tuple(t.shape) == shape):
                rank = "" if self.tp is None else (f" (tensor-parallel rank {self.tp.rank} of {self.tp.size} "
                                                   f"reads {torch.Size(g.shape)} of it)")
                errors.append(f"size mismatch for {name}: copying a param with shape {torch.Size(shape)} from "
                              f"checkpoint{rank}, the shape in current model is {t.shape}.")
                continue
            if not castable(dtype, t.dtype):
                errors.append(f"dtype mismatch for {name}: the checkpoint holds "
                              f"{str(dtype).removeprefix('torch.')}, the module "
                              f"{str(t.dtype).removeprefix('torch.')} (values are cast only between floating "
                              "dtypes, or between complex dtypes).")
                continue
            try:
                devices = {self.device_map.lookup(n) for n in g.names}
            except KeyError as ex:
                errors.append(f"device_map has no entry for {ex.args[0]} (nor a default \"\").")
                continue
            if len(devices) > 1:
                errors.append(f"tied tensors {', '.join(g.names)} are mapped to different devices "
                              f"({', '.join(sorted(str(d) for d in devices))}); map them to one.")
                continue
            (dev,) = devices
            if dev is None:
                dev = torch.device("cpu") if t.is_meta else t.device
            g.device = dev
            g.in_place = not t.is_meta and t.device == dev and tuple(t.shape) == g.shape
        if errors:
            raise RuntimeError(self._title() + ":\n\t" + "\n\t".join(errors))
        return groups, IncompatibleKeys(missing, unexpected)

    # -- reading
    def _direct(self, g: _Group) -> bool:
        """Bytes can land in ``g``'s destination itself."""
        if g.device.type != "cpu" or g.tensor.dtype != self._stored(g.key)[0]:
            return False
        return writable_in_place(g.tensor) if g.in_place else True

    def _dest(self, g: _Group) -> torch.Tensor:
        if g.in_place:
            return g.tensor.detach()
        return torch.empty(g.shape, dtype=g.tensor.dtype, device=g.device)

    def _units(self, todo: list[_Group]) -> list[list[_Group]]:
        """Consecutive direct whole tensors in batches of about one range request (their chunks
        coalesce into few GETs); every other tensor (a slice, staged) alone."""
        units: list[list[_Group]] = []
        batch: list[_Group] = []
        size = 0
        limit = self.ckpt.repo.options.max_request
        for g in todo:
            if not self._direct(g) or g.index is not None:
                if batch:
                    units.append(batch)
                    batch, size = [], 0
                units.append([g])
                continue
            if batch and size + g.nbytes > limit:
                units.append(batch)
                batch, size = [], 0
            batch.append(g)
            size += g.nbytes
        if batch:
            units.append(batch)
        return units

    def _run_unit(self, unit: list[_Group], reader: TensorReader, tick) -> None:
        if len(unit) == 1 and (not self._direct(unit[0]) or unit[0].index is not None):
            g = unit[0]
            dest = self._dest(g)
            reader.read_into(g.key, dest, g.index, on_bytes=tick)
            g.result = dest
            return
        dests = {g.key: self._dest(g) for g in unit}
        self.ckpt.read_many_into(dests)
        for g in unit:
            g.result = dests[g.key]
        tick(sum(g.nbytes for g in unit))

    def _pin(self, todo: list[_Group]) -> bool:
        return torch.cuda.is_available() and any(g.device.type == "cuda" for g in todo)

    def _read_all(self, todo: list[_Group], tick) -> None:
        """Fill ``g.result`` of every group (the repository's reading path)."""
        units = self._units(todo)
        if any(not self._direct(g) for g in todo):
            self.ckpt.prefetch([g.key for g in todo])  # every chunk table this load needs, in one batch
            room, chunk = self.ckpt.largest_chunks([g.key for g in todo], None)
            self.staging = make_staging(self.ckpt, pin=self._pin(todo), staging_bytes=self.staging_bytes, room=room,
                                        chunk=chunk, cls=self.staging_cls)
        reader = TensorReader(self.ckpt, self.staging)
        _map(self._run_unit, [(u, reader, tick) for u in units], self.ckpt.repo.options.tensor_workers)

    def run(self) -> IncompatibleKeys:
        groups, incompatible = self.plan()
        todo = [g for g in groups if g.key is not None]
        # the read order is the stored order: neighbouring tensors' bytes sit together
        order = {k: i for i, k in enumerate(self._keys())}
        todo.sort(key=lambda g: order[g.key])
        bar = None
        if self.progress:
            bar = byte_bar(sum(g.nbytes for g in todo), self._bar_title())
        lock = threading.Lock()

        def tick(n: int) -> None:
            if bar is not None:
                with lock:
                    bar.update(n)

        try:
            self._read_all(todo, tick)
            if self.staging is not None:
                self.staging.synchronize()
        finally:
            if self.staging is not None:
                self.staging.close()
            if bar is not None:
                bar.close()
        # Only now, with every tensor read, does the module change (in-place
        # tensors excepted: they were written as they were read).
        for g in todo:
            if g.in_place:
                continue
            if g.is_param:
                old = g.tensor
                new = torch.nn.Parameter(g.result, requires_grad=old.requires_grad)
                new.__dict__.update(old.__dict__)
            else:
                new = g.result
            for m, name in g.owners:
                (m._parameters if g.is_param else m._buffers)[name] = new
        return incompatible


def _map(fn, calls: list[tuple], workers: int) -> None:
    """``fn(*args)`` for every ``args`` of ``calls`` on ``workers`` threads; the first error cancels the rest."""
    with cf.ThreadPoolExecutor(workers, thread_name_prefix="ckpt-load") as pool:
        futures = [pool.submit(fn, *args) for args in calls]
        try:
            for f in cf.as_completed(futures):
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise


class PlainModuleLoader(ModuleLoader):
    """:func:`load_module` from a plain :class:`~ckptstore.repo.plain.SafetensorsObject`.

    Each tensor (or this rank's slice of it) is read from its own byte
    range: straight into a CPU destination of the stored dtype, else
    through one set of staging buffers (pinned for CUDA). Not hash-checked.
    Tied names: the first one present is read (safetensors keeps one copy).
    """

    #: Tensors read at once.
    workers = 8

    def _source(self) -> str:
        return self.ckpt.url

    def _bar_title(self) -> str:
        return f"load {self.ckpt.key}"

    def _stored(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        t = self.ckpt.tensor(key)
        return t.dtype, t.shape

    def _same(self, a: str, b: str) -> bool:
        return self._stored(a) == self._stored(b)

    def _read_one(self, g: _Group, tick) -> None:
        dest = self._dest(g)
        self.ckpt.read_into(g.key, dest, g.index, on_bytes=tick, staging=self.staging)
        g.result = dest

    def _read_all(self, todo: list[_Group], tick) -> None:
        if any(not self._direct(g) or g.index is not None for g in todo):
            total = self.staging_bytes or min(STAGING_BYTES, self.ckpt.staging_bytes)
            slots = self.workers + 2
            self.staging = self.staging_cls(max(STAGING_ALIGN, total // slots // STAGING_ALIGN * STAGING_ALIGN),
                                            slots, pin=self._pin(todo))
        _map(self._read_one, [(g, tick) for g in todo], self.workers)


def load_module(
    module: torch.nn.Module,
    url,
    step: int | None = None,
    *,
    device_map=None,
    prefix: str = "",
    strict: bool = True,
    storage_options: dict | None = None,
    progress: bool = False,
    staging_bytes: int | None = None,
    tp_plan=None,
    tp_rank: int = 0,
    tp_size: int = 1,
    **open_options,
) -> IncompatibleKeys:
    """Fill ``module``'s parameters and persistent buffers from a step (or a plain
    ``.safetensors`` object), each on its device, optionally only one tensor-parallel rank's slices.

    The module may be built on the ``meta`` device (``with torch.device("meta"):``); every
    tensor is materialized where ``device_map`` places it and read straight there: a CPU
    tensor of the stored dtype receives the decoded chunks in its own memory, any other
    destination (CUDA, another dtype) gets them block by block through reusable staging
    buffers (pinned for CUDA, copied with ``non_blocking``), so host memory beyond the
    tensors kept on the CPU stays within the repository's read budget (half of
    ``max_inflight_bytes``). Several tensors are read at once (``tensor_workers``), their
    chunks fetched and decoded on the handle's pools while earlier blocks are being copied
    to their devices.

    Parameters
    ----------
    module:
        The module to fill.
    url:
        Repository URL (as :func:`ckptstore.open`), or an open :class:`~ckptstore.Repository`
        (used as is, not closed); or a URL ending in ``.safetensors`` naming one plain
        safetensors object (``s3://bucket/llama/model.safetensors``), or an open
        :class:`~ckptstore.SafetensorsObject`: its header is read with one ranged GET and
        each tensor (or slice) from its own byte range. Those reads are **not hash-checked**
        (``ckptstore import`` gives the checked format); ``**open_options`` then are
        :class:`~ckptstore.SafetensorsObject`'s (``piece_bytes``, ``workers``).
    step:
        Step to read; default the newest committed step (None for a safetensors object).
    device_map:
        Module-name prefixes to devices (``"cpu"``, ``"cuda:1"``, an int for a CUDA index, a
        ``torch.device``), as accelerate's: the longest prefix matching a tensor's name at a
        ``.`` boundary wins, ``""`` is the default; a single device stands for ``{"": device}``.
        Without a map a tensor stays where it is, and a ``meta`` one goes to the CPU. Tied
        tensors (one object under several names) must map to one device.
    prefix:
        Stored keys are ``prefix + name`` (``"model."`` selects the model of a step that also
        holds optimizer state).
    strict:
        As for ``Module.load_state_dict``: missing and unexpected keys raise ``RuntimeError``
        (in its format, naming every key) before anything is read; with False they are
        returned and missing tensors are left as they are (on ``meta`` if they were).
    storage_options, **open_options:
        As for :func:`ckptstore.open` (when ``url`` is a URL).
    progress:
        Show a ``tqdm`` bar of the bytes filled (in the units of :mod:`ckptstore.progress`).
    staging_bytes:
        Total size of the staging buffers (default 64 MiB, at most a quarter of the read
        budget). They are reserved in the read budget, as much of them as leaves room for the
        largest range request; a larger size given here is allocated all the same, the excess
        on top of the budget.
    tp_plan, tp_rank, tp_size:
        Tensor-parallel loading: ``tp_plan`` maps parameter or module names (``*`` for one
        name component, as Hugging Face's ``model.tp_plan``) to a split dimension (int), None /
        ``"replicated"``, or a Hugging Face style (``"colwise"``: weight and bias along dim 0;
        ``"rowwise"``: weight along its last dim, bias replicated; see
        :mod:`ckptstore.pipeline.tp_plan` for every name). Rank ``tp_rank`` of ``tp_size``
        reads only its contiguous ``1/tp_size`` block of each split tensor (tensors no entry
        names are read whole). The module's tensor may have the slice's shape, or the stored
        shape on ``meta`` (it is then replaced by the slice). An entry that names nothing, a
        dimension the tensor lacks or one ``tp_size`` does not divide raise
        :class:`~ckptstore.pipeline.tp_plan.TPPlanError` (a ``ValueError``) before anything
        is read.

    Returns
    -------
    IncompatibleKeys(missing_keys, unexpected_keys), like ``load_state_dict``.

    Notes
    -----
    Tied weights (one ``Parameter`` object under several names) are read once and stay one
    object. Values are cast between floating dtypes (and between complex ones) like DCP's
    reader; other dtype mismatches, shape mismatches and unknown devices raise before
    anything is read, as do tied names stored with different values. Non-persistent buffers
    are left alone. New tensors are assigned to the module only once every read succeeded;
    tensors already on their device (not ``meta``) are filled in place, so a read error part
    way leaves those partly written.
    """
    kw = dict(device_map=device_map, prefix=prefix, strict=strict, progress=progress,
              staging_bytes=staging_bytes, tp_plan=tp_plan, tp_rank=tp_rank, tp_size=tp_size)
    return _load_module(module, url, step, storage_options, open_options, kw)


def _load_module(module, url, step, storage_options, open_options, kw) -> IncompatibleKeys:
    """:func:`load_module` past its arguments: a plain safetensors source, else a repository's step."""
    if isinstance(url, PLAIN_SOURCES) or is_safetensors_url(url):
        if step is not None:
            raise TypeError(f"step={step}: a plain safetensors object has no steps")
        if isinstance(url, PLAIN_SOURCES):
            if storage_options or open_options:
                raise TypeError("storage_options and open options apply only when a URL is given")
            return PlainModuleLoader(module, url, **kw).run()
        with open_safetensors(url, storage_options, **open_options) as obj:
            return PlainModuleLoader(module, obj, **kw).run()
    repo, ckpt, owned = resolve_checkpoint(url, step, storage_options, open_options)
    try:
        return ModuleLoader(module, ckpt, **kw).run()
    finally:
        if owned:
            repo.close()


__all__ = [
    "load_module",
    "SafetensorsObject",
    "SafetensorsShards",
    "PLAIN_SOURCES",
    "is_safetensors_url",
    "open_safetensors",
    "TPPlanError",
    "IncompatibleKeys",
    "TensorReader",
    "StagingBuffers",
    "plan_blocks",
    "resolve_checkpoint",
    "make_staging",
    "staging_sizes",
]
