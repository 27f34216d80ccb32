"""Restore by parts: fill a module tensor by tensor, each onto its device.

:func:`load_module` materializes a module built on the ``meta`` device (or
refills one that exists) from a committed step, reading every tensor
through the repository's one :class:`~ckptstore.fetch.ChunkFetcher`, so
host memory beyond the tensors that stay on the CPU is bounded by the
handle's read budget.

The reading path, shared with ``ckptstore.integrations.hf.lazy_state_dict``:

- :class:`TensorReader` reads a stored tensor, or a slice of it, into a
  destination tensor (or a new one on a device). A contiguous CPU
  destination of the stored dtype receives the decoded chunks directly;
  any other (an accelerator, another dtype, a non-contiguous tensor) gets
  them block by block through :class:`StagingBuffers`.
- :class:`StagingBuffers` is a fixed set of reusable host buffers (pinned
  when a CUDA destination is served). Each block is decoded into a free
  buffer, copied to its destination (``non_blocking`` to CUDA, an event
  recorded after the copy), and the buffer is reused only after that
  event completed.
- :func:`plan_blocks` (pure) cuts a box into blocks that fit one buffer,
  each a contiguous byte run of the stored tensor, so chunks decode
  straight into the buffer.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from . import manifest as _m
from . import planner as _plan
from .errors import StepNotFoundError
from .reader import Checkpoint
from .repository import Repository
from .repository import open as _open_repo
from .tensors import castable, writable_in_place

MiB = 1 << 20

#: Default total size of the staging buffers (at most a quarter of the
#: read budget, and never more than leaves room for the largest request).
STAGING_BYTES = 64 * MiB
#: Staging buffers are cut in multiples of this.
STAGING_ALIGN = 4096


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
            step = repo.latest()
            if step is None:
                raise StepNotFoundError(f"{repo.url}: the repository has no committed step")
        return repo, repo.checkpoint(step), owned
    except BaseException:
        if owned:
            repo.close()
        raise


# ---------------------------------------------------------------- blocks (pure)
@dataclass(frozen=True)
class Block:
    """One piece of a read: ``box`` in stored coordinates, ``out`` (slices) in the result's."""

    box: _plan.Box
    out: tuple[slice, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return _plan.box_shape(self.box)


def plan_blocks(shape: Sequence[int], itemsize: int, box: _plan.Box, limit: int) -> Iterator[Block]:
    """Cut ``box`` of a tensor of ``shape`` into blocks of at most ``limit`` bytes.

    Blocks run along the first dimension ``d`` whose rows (``shape[d+1:]``,
    full) fit ``limit``: a block fixes one selected index of each dimension
    before ``d``, takes several selected indices of ``d`` and the box of the
    dimensions after it. Where the box is whole along the dimensions after
    ``d`` with steps of 1 (a whole tensor, as :func:`load_module` reads),
    every block is one contiguous byte run of the stored tensor. The span of
    stored rows a block touches is at most ``limit`` bytes too (a reader
    buffering whole rows for a strided box stays within it), except when one
    element exceeds ``limit``.
    """
    nd = len(shape)
    if nd == 0 or any(_plan.box_len(b) == 0 for b in box):
        yield Block(tuple(box), tuple(slice(None) for _ in box))
        return
    row = [itemsize * math.prod(shape[k + 1 :]) for k in range(nd)]
    d = next((k for k in range(nd) if row[k] <= limit), nd - 1)
    start, _, step = box[d]
    n = _plan.box_len(box[d])
    # k selected indices with step s span (k - 1) * s + 1 rows of row[d] bytes
    k = max(1, (limit // row[d] - 1) // step + 1)
    outer = [range(_plan.box_len(b)) for b in box[:d]]

    def rec(dim: int, fixed: list[int]) -> Iterator[list[int]]:
        if dim == d:
            yield fixed
            return
        for j in outer[dim]:
            yield from rec(dim + 1, fixed + [j])

    for js in rec(0, []):
        lead = tuple((box[i][0] + j * box[i][2], box[i][0] + j * box[i][2] + 1, 1) for i, j in enumerate(js))
        lead_out = tuple(slice(j, j + 1) for j in js)
        for j0 in range(0, n, k):
            j1 = min(n, j0 + k)
            sub = (start + j0 * step, start + (j1 - 1) * step + 1, step)
            yield Block(lead + (sub,) + tuple(box[d + 1 :]), lead_out + (slice(j0, j1),) + (slice(None),) * (nd - d - 1))


# ---------------------------------------------------------------- staging
class _Slot:
    __slots__ = ("buf", "event")

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.event = None  # the last copy out of this buffer, not yet known complete

    def view(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        n = math.prod(shape) * dtype.itemsize
        return self.buf[:n].view(dtype).view(tuple(shape))


class StagingBuffers:
    """``slots`` reusable host buffers of ``slot_bytes`` each (allocated on first use).

    Parameters
    ----------
    slot_bytes, slots:
        Size and number of buffers: at most ``slot_bytes * slots`` bytes
        exist at once.
    pin:
        Allocate pinned (page-locked) memory, so copies to CUDA run
        asynchronously.
    budget, room:
        A :class:`~ckptstore.runtime.ByteBudget` to reserve the buffers'
        bytes in for as long as they live (:meth:`close` gives them back),
        so the staging memory comes out of the read budget instead of on top
        of it; ``room`` is the largest request the reads will make, which
        the reservation leaves free (see :meth:`ByteBudget.reserve`; a
        budget too small for both holds only what fits).

    Attributes
    ----------
    allocated_bytes: bytes of buffers allocated so far.
    max_in_use: the most buffers held at once.
    charged: bytes reserved in ``budget``.
    """

    def __init__(self, slot_bytes: int, slots: int, *, pin: bool = False, budget=None, room: int = 0):
        if slot_bytes < 1 or slots < 1:
            raise ValueError("staging needs at least one buffer of at least one byte")
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.pin = pin
        self.allocated_bytes = 0
        self.max_in_use = 0
        self._free: list[_Slot] = []
        self._all: list[_Slot] = []
        self._in_use = 0
        self._cv = threading.Condition()
        self._budget = budget
        self._room = room
        self.charged = budget.reserve(slot_bytes * slots, room) if budget is not None else 0

    @property
    def capacity(self) -> int:
        return self.slot_bytes * self.slots

    def acquire(self) -> _Slot:
        """A free buffer; waits for one, and for the last copy out of it."""
        with self._cv:
            while not self._free and len(self._all) >= self.slots:
                self._cv.wait()
            if self._free:
                slot = self._free.pop()
            else:
                slot = _Slot(torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self.pin))
                self._all.append(slot)
                self.allocated_bytes += self.slot_bytes
            self._in_use += 1
            self.max_in_use = max(self.max_in_use, self._in_use)
        if slot.event is not None:
            slot.event.synchronize()
            slot.event = None
        return slot

    def release(self, slot: _Slot, event=None) -> None:
        """Return a buffer; ``event`` (``synchronize()``) completes the copy still reading it."""
        slot.event = event
        with self._cv:
            self._in_use -= 1
            self._free.append(slot)
            self._cv.notify()

    def transfer(self, src: torch.Tensor, dst: torch.Tensor):
        """Copy a staged block ``src`` into ``dst``; returns an event to wait on, or None.

        To CUDA the copy is queued on the destination device's current
        stream (``non_blocking``: the host does not wait), and an event
        recorded after it. A cast happens on the device (the block goes over
        in the stored dtype). Elsewhere the copy is synchronous.
        """
        if dst.device.type == "cuda":
            with torch.cuda.device(dst.device):
                if dst.dtype != src.dtype:
                    tmp = torch.empty(src.shape, dtype=src.dtype, device=dst.device)
                    tmp.copy_(src, non_blocking=True)
                    dst.copy_(tmp)
                else:
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(dst.device))
            return event
        dst.copy_(src)
        return None

    def copy_out(self, slot: _Slot, src: torch.Tensor, dst: torch.Tensor) -> None:
        """:meth:`transfer` ``src`` (a view of ``slot``) into ``dst``, then release the slot."""
        try:
            event = self.transfer(src, dst)
        except BaseException:
            self.release(slot)
            raise
        self.release(slot, event)

    def synchronize(self) -> None:
        """Wait for every copy out of the buffers."""
        for slot in list(self._all):
            ev = slot.event
            if ev is not None:
                ev.synchronize()
                slot.event = None

    def close(self) -> None:
        """Wait for every copy, drop the buffers, give the budget back."""
        try:
            self.synchronize()
        finally:
            self._free.clear()
            self._all.clear()
            if self.charged:
                charged, self.charged = self.charged, 0
                self._budget.unreserve(charged, self._room)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def staging_sizes(ckpt: Checkpoint, staging_bytes: int | None = None, room: int = 0) -> tuple[int, int, int]:
    """``(slot_bytes, slots, room)`` of the staging buffers for reads of ``ckpt``.

    Total size: ``staging_bytes``, default :data:`STAGING_BYTES` but at most
    a quarter of the handle's read budget; cut into ``tensor_workers + 2``
    buffers (one per tensor being read, two more for copies in flight).
    ``room``: the largest range request the reads may make (the largest
    chunk given, or ``max_request``), which their reservation in the read
    budget leaves free.
    """
    o = ckpt.repo.options
    limit = ckpt.repo.runtime.read_budget().limit
    slots = o.tensor_workers + 2
    total = staging_bytes if staging_bytes is not None else min(STAGING_BYTES, limit // 4)
    slot_bytes = max(STAGING_ALIGN, total // slots // STAGING_ALIGN * STAGING_ALIGN)
    return slot_bytes, slots, max(room, o.max_request)


def make_staging(ckpt: Checkpoint, *, pin: bool, staging_bytes: int | None = None, room: int = 0,
                 cls: type[StagingBuffers] = StagingBuffers) -> StagingBuffers:
    """Staging buffers sized by :func:`staging_sizes`, reserved in ``ckpt``'s read budget."""
    slot_bytes, slots, room = staging_sizes(ckpt, staging_bytes, room)
    return cls(slot_bytes, slots, pin=pin, budget=ckpt.repo.runtime.read_budget(), room=room)


def _largest_chunk(entries) -> int:
    return max((c.stored_len for e in entries for s in e.shards for c in s.chunks), default=0)


# ---------------------------------------------------------------- reading
class TensorReader:
    """Reads stored tensors, or slices of them, into tensors on any device.

    The one reading path of :func:`load_module` and of
    ``ckptstore.integrations.hf.lazy_state_dict``.

    Parameters
    ----------
    checkpoint:
        The step to read.
    staging:
        Buffers for destinations that cannot take decoded bytes directly;
        default: a small set made for each such read (and closed after it).
    """

    def __init__(self, checkpoint: Checkpoint, staging: StagingBuffers | None = None):
        self.checkpoint = checkpoint
        self.staging = staging

    @property
    def step(self) -> int:
        return self.checkpoint.step

    def _where(self, key: str) -> str:
        return f"{self.checkpoint.repo.url}: step {self.checkpoint.step}: tensor {key!r}"

    def read(self, key: str, index: Any = None, *, device=None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new tensor holding ``key`` (or its slice ``index``) on ``device`` (default CPU).

        ``dtype`` (default: the stored one) may be another floating (or
        complex) dtype; values are cast like ``Tensor.copy_``.
        """
        e = self.checkpoint.entry(key)
        box, squeeze = _plan.normalize_index(index, e.shape)
        shape = [n for d, n in enumerate(_plan.box_shape(box)) if d not in squeeze]
        out = torch.empty(shape, dtype=dtype or _m.DTYPES[e.dtype], device=device if device is not None else "cpu")
        return self._read(e, box, squeeze, out, None)

    def read_into(self, key: str, dest: torch.Tensor, index: Any = None,
                  on_bytes: Callable[[int], None] | None = None) -> torch.Tensor:
        """Fill ``dest`` (any device; the shape of the tensor, or of its slice ``index``).

        ``on_bytes(n)`` is called as parts of ``dest`` (``n`` bytes of it)
        are filled. Returns ``dest``.
        """
        e = self.checkpoint.entry(key)
        box, squeeze = _plan.normalize_index(index, e.shape)
        return self._read(e, box, squeeze, dest, on_bytes)

    def _read(self, e, box, squeeze, dest: torch.Tensor, on_bytes) -> torch.Tensor:
        stored = _m.DTYPES[e.dtype]
        want = tuple(n for d, n in enumerate(_plan.box_shape(box)) if d not in squeeze)
        if tuple(dest.shape) != want or not castable(stored, dest.dtype):
            raise ValueError(
                f"{self._where(e.key)} is {e.dtype}{list(e.shape)}; the destination of "
                f"{list(want)} is {str(dest.dtype).removeprefix('torch.')}{list(dest.shape)}"
                + ("" if tuple(dest.shape) != want else
                   " (values are cast only between floating dtypes, or between complex dtypes)")
            )
        target = dest.detach()
        for d in squeeze:  # views: the squeezed dims back as size-1 dims
            target = target.unsqueeze(d)
        if writable_in_place(target) and target.dtype == stored:
            self.checkpoint.read_box(e, box, target)
        elif target.numel():
            self._staged(e, box, target, on_bytes)
            return dest
        if on_bytes is not None:
            on_bytes(dest.numel() * dest.element_size())
        return dest

    def _staged(self, e, box, target: torch.Tensor, on_bytes) -> None:
        staging, own = self.staging, False
        if staging is None:
            limit = self.checkpoint.repo.runtime.read_budget().limit
            staging = make_staging(self.checkpoint, pin=target.device.type == "cuda" and torch.cuda.is_available(),
                                   staging_bytes=min(16 * MiB, limit // 4),
                                   room=self.checkpoint.largest_chunk(e.key, self.checkpoint.meeting(e, box)))
            own = True
        try:
            stored = _m.DTYPES[e.dtype]
            per = target.element_size()
            for blk in plan_blocks(e.shape, stored.itemsize, box, staging.slot_bytes):
                slot = staging.acquire()
                try:
                    view = slot.view(stored, blk.shape)
                    self.checkpoint.read_box(e, blk.box, view)
                except BaseException:
                    staging.release(slot)
                    raise
                staging.copy_out(slot, view, target[blk.out])
                if on_bytes is not None:
                    on_bytes(view.numel() * per)
        finally:
            if own:
                staging.close()


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
            room = _largest_chunk(self.ckpt.resolved(g.key) for g in todo)
            self.staging = make_staging(self.ckpt, pin=pin, staging_bytes=self.staging_bytes, room=room,
                                        cls=self.staging_cls)
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=sum(g.nbytes for g in todo), unit="B", unit_scale=True, unit_divisor=1024,
                       desc=f"load step {self.ckpt.step}")
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
        Show a ``tqdm`` bar of the bytes filled.
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
