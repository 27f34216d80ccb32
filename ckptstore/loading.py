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
"""

from __future__ import annotations

import concurrent.futures as cf
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
    device: torch.device | None = None
    in_place: bool = False
    result: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


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
    return a.dtype == b.dtype and a.shape == b.shape and [
        (s.offsets, s.sizes, [c.hash for c in s.chunks]) for s in a.shards
    ] == [(s.offsets, s.sizes, [c.hash for c in s.chunks]) for s in b.shards]


class ModuleLoader:
    """The body of :func:`load_module` (see there); ``run()`` does the load.

    ``staging_cls`` builds the staging buffers (tests pass a subclass that
    defers its copies, as an accelerator's asynchronous copies would).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        checkpoint: Checkpoint,
        *,
        device_map=None,
        prefix: str = "",
        strict: bool = True,
        progress: bool = False,
        staging_bytes: int | None = None,
        staging_cls: type[StagingBuffers] = StagingBuffers,
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

    # -- checks (no data read, nothing changed)
    def _title(self) -> str:
        p = f", prefix {self.prefix!r}" if self.prefix else ""
        return (f"Error(s) in loading state_dict for {type(self.module).__name__} "
                f"from {self.ckpt.repo.url} step {self.ckpt.step}{p}")

    def plan(self) -> tuple[list[_Group], IncompatibleKeys]:
        groups = _module_tensors(self.module)
        ckpt, pre = self.ckpt, self.prefix
        stored = [k[len(pre):] for k in ckpt.keys() if k.startswith(pre)]
        known = {n for g in groups for n in g.names}
        unexpected = [k for k in stored if k not in known]
        missing = []
        for g in groups:
            present = [n for n in g.names if pre + n in ckpt]
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
            e = ckpt.entry(g.key)
            name = g.key[len(pre):]
            t = g.tensor
            for other in g.names:
                if pre + other != g.key and pre + other in ckpt and not _same_stored(
                        ckpt.resolved(g.key), ckpt.resolved(pre + other)):
                    errors.append(f'tied tensors "{name}" and "{other}" (one tensor in the module) '
                                  "are stored with different values.")
            if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
                errors.append(f"{name} is a {type(t).__name__}; load_module fills plain dense tensors "
                              "(use ckptstore.dcp.CkptStoreReader for DTensor and sharded state).")
                continue
            if tuple(t.shape) != e.shape:
                errors.append(f"size mismatch for {name}: copying a param with shape {torch.Size(e.shape)} from "
                              f"checkpoint, the shape in current model is {t.shape}.")
                continue
            if not castable(_m.DTYPES[e.dtype], t.dtype):
                errors.append(f"dtype mismatch for {name}: the checkpoint holds {e.dtype}, the module "
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
            g.in_place = not t.is_meta and t.device == dev
        if errors:
            raise RuntimeError(self._title() + ":\n\t" + "\n\t".join(errors))
        return groups, IncompatibleKeys(missing, unexpected)

    # -- reading
    def _direct(self, g: _Group) -> bool:
        """Decoded chunks can land in ``g``'s destination itself."""
        stored = _m.DTYPES[self.ckpt.entry(g.key).dtype]
        if g.device.type != "cpu" or g.tensor.dtype != stored:
            return False
        return writable_in_place(g.tensor) if g.in_place else True

    def _dest(self, g: _Group) -> torch.Tensor:
        if g.in_place:
            return g.tensor.detach()
        return torch.empty(g.tensor.shape, dtype=g.tensor.dtype, device=g.device)

    def _units(self, todo: list[_Group]) -> list[list[_Group]]:
        """Consecutive direct tensors in batches of about one range request (their chunks
        coalesce into few GETs); every other tensor alone."""
        units: list[list[_Group]] = []
        batch: list[_Group] = []
        size = 0
        limit = self.ckpt.repo.options.max_request
        for g in todo:
            if not self._direct(g):
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
        if len(unit) == 1 and not self._direct(unit[0]):
            g = unit[0]
            dest = self._dest(g)
            reader.read_into(g.key, dest, on_bytes=tick)
            g.result = dest
            return
        dests = {g.key: self._dest(g) for g in unit}
        self.ckpt.read_many_into(dests)
        for g in unit:
            g.result = dests[g.key]
        tick(sum(g.nbytes for g in unit))

    def run(self) -> IncompatibleKeys:
        groups, incompatible = self.plan()
        todo = [g for g in groups if g.key is not None]
        # the read order is the stored order: chunks of neighbouring tensors sit together in packs
        order = {k: i for i, k in enumerate(self.ckpt.keys())}
        todo.sort(key=lambda g: order[g.key])
        units = self._units(todo)
        if any(not self._direct(g) for g in todo):
            pin = torch.cuda.is_available() and any(g.device.type == "cuda" for g in todo)
            self.ckpt.prefetch([g.key for g in todo])  # every chunk table this load needs, in one batch
            room, chunk = self.ckpt.largest_chunks(g.key for g in todo)
            self.staging = make_staging(self.ckpt, pin=pin, staging_bytes=self.staging_bytes, room=room,
                                        chunk=chunk, cls=self.staging_cls)
        bar = None
        if self.progress:
            bar = byte_bar(sum(g.nbytes for g in todo), f"load step {self.ckpt.step}")
        lock = threading.Lock()

        def tick(n: int) -> None:
            if bar is not None:
                with lock:
                    bar.update(n)

        reader = TensorReader(self.ckpt, self.staging)
        workers = self.ckpt.repo.options.tensor_workers
        try:
            with cf.ThreadPoolExecutor(workers, thread_name_prefix="ckpt-load") as pool:
                futures = [pool.submit(self._run_unit, u, reader, tick) for u in units]
                try:
                    for f in cf.as_completed(futures):
                        f.result()
                except BaseException:
                    for f in futures:
                        f.cancel()
                    raise
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
    **open_options,
) -> IncompatibleKeys:
    """Fill ``module``'s parameters and persistent buffers from a step, each on its device.

    The module may be built on the ``meta`` device (``with torch.device("meta"):``);
    every tensor is materialized where ``device_map`` places it and read
    straight there: a CPU tensor of the stored dtype receives the decoded
    chunks in its own memory, any other destination (CUDA, another dtype)
    gets them block by block through reusable staging buffers (pinned for
    CUDA, copied with ``non_blocking``), so host memory beyond the tensors
    kept on the CPU stays within the repository's read budget (half of
    ``max_inflight_bytes``). Several tensors are read at once
    (``tensor_workers``), their chunks fetched and decoded on the handle's
    pools while earlier blocks are being copied to their devices.

    Parameters
    ----------
    module:
        The module to fill.
    url:
        Repository URL (as :func:`ckptstore.open`), or an open
        :class:`~ckptstore.Repository` (used as is, not closed).
    step:
        Step to read; default the newest committed step.
    device_map:
        Module-name prefixes to devices (``"cpu"``, ``"cuda:1"``, an int
        for a CUDA index, a ``torch.device``), as accelerate's: the longest
        prefix matching a tensor's name at a ``.`` boundary wins, ``""`` is
        the default; a single device stands for ``{"": device}``. Without a
        map a tensor stays where it is, and a ``meta`` one goes to the CPU.
        Tied tensors (one object under several names) must map to one device.
    prefix:
        Stored keys are ``prefix + name`` (``"model."`` selects the model of
        a step that also holds optimizer state).
    strict:
        As for ``Module.load_state_dict``: missing and unexpected keys raise
        ``RuntimeError`` (in its format, naming every key) before anything is
        read; with False they are returned and missing tensors are left as
        they are (on ``meta`` if they were).
    storage_options, **open_options:
        As for :func:`ckptstore.open` (when ``url`` is a URL).
    progress:
        Show a ``tqdm`` bar of the bytes filled (in the units of
        :mod:`ckptstore.progress`).
    staging_bytes:
        Total size of the staging buffers (default 64 MiB, at most a quarter
        of the read budget). They are reserved in the read budget, as much of
        them as leaves room for the largest range request; a larger size
        given here is allocated all the same, the excess on top of the budget.

    Returns
    -------
    IncompatibleKeys(missing_keys, unexpected_keys), like ``load_state_dict``.

    Notes
    -----
    Tied weights (one ``Parameter`` object under several names) are read
    once and stay one object. Values are cast between floating dtypes (and
    between complex ones) like DCP's reader; other dtype mismatches, shape
    mismatches and unknown devices raise before anything is read, as do
    tied names stored with different values. Non-persistent buffers are
    left alone. New tensors are assigned to the module only once every read
    succeeded; tensors already on their device (not ``meta``) are filled in
    place, so a read error part way leaves those partly written.
    """
    repo, ckpt, owned = resolve_checkpoint(url, step, storage_options, open_options)
    try:
        return ModuleLoader(module, ckpt, device_map=device_map, prefix=prefix, strict=strict,
                            progress=progress, staging_bytes=staging_bytes).run()
    finally:
        if owned:
            repo.close()


__all__ = [
    "load_module",
    "IncompatibleKeys",
    "TensorReader",
    "StagingBuffers",
    "plan_blocks",
    "resolve_checkpoint",
    "make_staging",
    "staging_sizes",
]
