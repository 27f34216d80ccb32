"""How a DeepSpeed checkpoint is kept in one ckptstore step, and ZeRO consolidation.

This module is pure: it imports torch and ckptstore's read API, never
DeepSpeed, so ``ckptstore export`` of a DeepSpeed step works where
DeepSpeed is not installed. :mod:`ckptstore.integrations.deepspeed` (which
does import DeepSpeed) builds on it.

Layout of a step written by ``ckptstore.integrations.deepspeed``:

- every file DeepSpeed asked its checkpoint engine to save under
  ``save_dir/tag/`` (``mp_rank_00_model_states.pt``,
  ``zero_pp_rank_1_mp_rank_00_optim_states.pt``, ...) becomes one uint8
  tensor keyed by the bare file name, holding the UTF-8 JSON *structure*
  of the file's state dict, plus one tensor per tensor in it, keyed
  ``"<file>/<path>"`` (the path's dict keys and list indices joined by
  ``/``; a key that would repeat gets ``~N`` appended). Keys live only in
  the manifest; they never become object paths.
- the step's metadata holds ``{"deepspeed": {"format": 1, "tag", "zero_stage",
  "dp_world_size", "world_size", "ds_version"}}``, plus, for DeepSpeed's
  pipeline engine, ``"pipeline": {"stages", "parts"}`` (the layer
  boundaries of the stages); a pipeline step keeps its weights in
  ``layer_<index>-model_states.pt`` files (:func:`pipeline_weights`).

Structure nodes (each a one-key JSON object, except ``obj``/``enum``):
``{"t": KEY}`` a tensor; ``{"v": X}`` a JSON scalar; ``{"d": [[K, NODE], ...]}``
a dict and ``{"o": [...]}`` an ``OrderedDict`` (K a str or int); ``{"l": [...]}``
a list; ``{"u": [...]}`` a tuple; ``{"size": [...]}`` a ``torch.Size``;
``{"dtype": NAME}``; ``{"device": STR}``; ``{"enum": CLASS, "value": X}`` and
``{"obj": CLASS, "state": NODE}`` an instance of a class on an explicit
allow-list (:class:`ClassCodec`). Nothing is pickled, and decoding never
imports or instantiates a class that is not on the allow-list.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..format import manifest as _m
from ..errors import FormatError, UnsupportedLayoutError

FORMAT_VERSION = 1
STRUCTURE_FORMAT = "ckptstore.deepspeed.file"
MAX_DEPTH = 100

MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
#: A pipeline layer's file (``PipelineModule.ckpt_layer_path``): the layer's global index, then the
#: coordinates of the saving rank on the axes other than data and pipe (``model_01``), if any.
LAYER_RE = re.compile(r"^layer_(\d+)-(?:(.+)-)?model_states\.pt$")


@dataclass(frozen=True)
class ClassCodec:
    """One allow-listed class: how its instances become JSON and back.

    ``kind`` is ``"enum"`` (``to_state`` gives the member's value) or
    ``"obj"`` (``to_state`` gives plain values, tensors excluded).
    """

    name: str
    cls: type
    kind: str
    to_state: Callable[[Any], Any]
    from_state: Callable[[Any], Any]


@dataclass(frozen=True)
class Opaque:
    """An allow-listed object read without its class (pure consolidation)."""

    cls: str
    state: Any


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a stored file, not read."""

    key: str


def is_deepspeed_step(metadata: dict) -> bool:
    return isinstance(metadata, dict) and isinstance(metadata.get("deepspeed"), dict)


def structure_key(file: str) -> str:
    return file


def is_structure_key(key: str) -> bool:
    return "/" not in key


# ============================================================== encode
def encode_file(file: str, state: Any, codecs: dict[type, ClassCodec]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A DeepSpeed file's state dict -> (tensors by key, structure as a uint8 tensor).

    Raises ``TypeError`` naming the file and path of a value that is not a
    tensor, a JSON scalar, a container or an allow-listed object.
    """
    if "/" in file or not file:
        raise ValueError(f"DeepSpeed file name {file!r} must be a bare file name")
    tensors: dict[str, torch.Tensor] = {}

    def key_for(path) -> str:
        base = file + "/" + "/".join(str(p) for p in path)
        key, n = base, 1
        while key in tensors:
            key, n = f"{base}~{n}", n + 1
        return key

    def enc(v, path, depth):
        if depth > MAX_DEPTH:
            raise TypeError(f"{file}: {_path(path)} is nested more than {MAX_DEPTH} levels")
        if isinstance(v, torch.Tensor):
            if type(v) not in (torch.Tensor, torch.nn.Parameter):
                raise TypeError(f"{file}: {_path(path)} is a {type(v).__name__}; only plain tensors are stored")
            key = key_for(path)
            tensors[key] = v.detach()
            return {"t": key}
        if v is None or type(v) in (bool, int, float, str):
            return {"v": v}
        codec = codecs.get(type(v))
        if codec is not None:
            if codec.kind == "enum":
                return {"enum": codec.name, "value": codec.to_state(v)}
            return {"obj": codec.name, "state": enc_plain(codec.to_state(v), path, depth + 1)}
        if type(v) is torch.Size:
            return {"size": [int(x) for x in v]}
        if isinstance(v, torch.dtype):
            return {"dtype": _m.dtype_name(v)}
        if isinstance(v, torch.device):
            return {"device": str(v)}
        if type(v) in (dict, OrderedDict):
            items = []
            for k, x in v.items():
                if type(k) not in (str, int):
                    raise TypeError(f"{file}: {_path(path)} has a dict key {k!r} that is not a str or int")
                items.append([k, enc(x, path + (k,), depth + 1)])
            return {"o" if type(v) is OrderedDict else "d": items}
        if type(v) is list:
            return {"l": [enc(x, path + (i,), depth + 1) for i, x in enumerate(v)]}
        if type(v) is tuple:
            return {"u": [enc(x, path + (i,), depth + 1) for i, x in enumerate(v)]}
        if type(v).__module__ == "numpy" and hasattr(v, "item") and getattr(v, "shape", None) == ():
            return enc(v.item(), path, depth)  # a numpy scalar: its Python value
        raise TypeError(
            f"{file}: {_path(path)} is a {type(v).__module__}.{type(v).__qualname__}, which ckptstore does not "
            "store (tensors, JSON scalars, dicts, lists, tuples and an allow-list of DeepSpeed classes are stored)"
        )

    def enc_plain(v, path, depth):
        node = enc(v, path, depth)
        if _has_tensor(node):
            raise TypeError(f"{file}: {_path(path)}: an allow-listed object holds a tensor")
        return node

    root = enc(state, (), 0)
    doc = {"format": STRUCTURE_FORMAT, "version": FORMAT_VERSION, "file": file, "root": root}
    raw = json.dumps(doc, separators=(",", ":"), allow_nan=True).encode("utf-8")
    return tensors, torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _has_tensor(node) -> bool:
    if isinstance(node, dict):
        if "t" in node and len(node) == 1:
            return True
        return any(_has_tensor(x) for x in node.values())
    if isinstance(node, list):
        return any(_has_tensor(x) for x in node)
    return False


def _path(path) -> str:
    return "/".join(str(p) for p in path) or "<root>"


# ============================================================== decode
def parse_structure(raw: bytes, file: str) -> dict:
    """Validate the envelope of a stored structure; return its root node."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"DeepSpeed file {file!r}: its stored structure is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != STRUCTURE_FORMAT:
        raise FormatError(f"DeepSpeed file {file!r}: stored structure has no {STRUCTURE_FORMAT!r} header")
    ver = doc.get("version")
    if type(ver) is not int or ver > FORMAT_VERSION:
        raise FormatError(f"DeepSpeed file {file!r}: structure version {ver!r} is newer than this ckptstore reads")
    if doc.get("file") != file or "root" not in doc:
        raise FormatError(f"DeepSpeed file {file!r}: stored structure names file {doc.get('file')!r}")
    return doc["root"]


def decode(node, get_tensor: Callable[[str], Any], codecs: dict[str, ClassCodec] | None, file: str = "?"):
    """Rebuild a value from a structure node.

    ``codecs`` maps allow-listed class names to codecs; with None, objects
    come back as :class:`Opaque`. An unknown class name, or any malformed
    node, raises :class:`FormatError` naming the file and path.
    """

    def bad(path, why):
        raise FormatError(f"DeepSpeed file {file!r}: {_path(path)}: {why}")

    def dec(n, path, depth):
        if depth > MAX_DEPTH:
            bad(path, f"nested more than {MAX_DEPTH} levels")
        if not isinstance(n, dict) or not n:
            bad(path, "malformed structure node")
        if "enum" in n or "obj" in n:
            kind = "enum" if "enum" in n else "obj"
            name = n[kind]
            field = "value" if kind == "enum" else "state"
            if set(n) != {kind, field} or not isinstance(name, str):
                bad(path, "malformed object node")
            if codecs is None:
                return Opaque(name, n[field] if kind == "enum" else dec(n[field], path, depth + 1))
            codec = codecs.get(name)
            if codec is None or codec.kind != kind:
                bad(path, f"class {name!r} is not on ckptstore's allow-list of DeepSpeed classes")
            value = n[field] if kind == "enum" else dec(n[field], path, depth + 1)
            try:
                return codec.from_state(value)
            except (TypeError, ValueError, KeyError) as e:
                bad(path, f"cannot rebuild {name}: {e}")
        if len(n) != 1:
            bad(path, "malformed structure node")
        (kind, val), = n.items()
        if kind == "t":
            if not isinstance(val, str):
                bad(path, "tensor reference is not a string")
            return get_tensor(val)
        if kind == "v":
            if val is not None and type(val) not in (bool, int, float, str):
                bad(path, "value is not a JSON scalar")
            return val
        if kind in ("d", "o"):
            if not isinstance(val, list):
                bad(path, "dict node is not a list")
            out = OrderedDict() if kind == "o" else {}
            for item in val:
                if not (isinstance(item, list) and len(item) == 2 and type(item[0]) in (str, int)):
                    bad(path, "malformed dict item")
                out[item[0]] = dec(item[1], path + (item[0],), depth + 1)
            return out
        if kind in ("l", "u"):
            if not isinstance(val, list):
                bad(path, "list node is not a list")
            items = [dec(x, path + (i,), depth + 1) for i, x in enumerate(val)]
            return items if kind == "l" else tuple(items)
        if kind == "size":
            if not (isinstance(val, list) and all(type(x) is int and x >= 0 for x in val)):
                bad(path, "malformed torch.Size")
            return torch.Size(val)
        if kind == "dtype":
            if val not in _m.DTYPES:
                bad(path, f"unknown dtype {val!r}")
            return _m.DTYPES[val]
        if kind == "device":
            if not isinstance(val, str):
                bad(path, "malformed device")
            try:
                return torch.device(val)
            except RuntimeError as e:
                bad(path, str(e))
        bad(path, f"unknown node kind {kind!r}")

    return dec(node, (), 0)


# ============================================================== one step
class StoredStep:
    """The DeepSpeed files of one committed step (a :class:`ckptstore.Checkpoint`)."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        meta = ckpt.metadata.get("deepspeed") if isinstance(ckpt.metadata, dict) else None
        if not isinstance(meta, dict):
            raise FormatError(f"step {ckpt.step} was not saved through ckptstore.integrations.deepspeed")
        self.meta = meta
        self.files = sorted(k for k in ckpt.manifest.tensors if is_structure_key(k))
        self._structures: dict[str, Any] = {}

    @property
    def step(self) -> int:
        return self.ckpt.step

    def _tensor_meta_key(self, key: str):
        if key not in self.ckpt.manifest.tensors:
            raise FormatError(f"step {self.step}: DeepSpeed structure names tensor {key!r}, which the step lacks")
        return key

    def structure(self, file: str):
        """The file's state dict with :class:`TensorRef` for tensors and :class:`Opaque` objects."""
        if file not in self._structures:
            self._structures[file] = decode(self._root(file), lambda k: TensorRef(self._tensor_meta_key(k)), None, file)
        return self._structures[file]

    def _root(self, file: str):
        if file not in self.files:
            raise FileNotFoundError(f"step {self.step} holds no DeepSpeed file {file!r} (it has {self.files})")
        raw = self.ckpt.read(structure_key(file)).numpy().tobytes()
        return parse_structure(raw, file)

    def read_file(self, file: str, codecs: dict[str, ClassCodec], skip: set[str] = frozenset()):
        """Rebuild one file's state dict, its tensors read in full (those in ``skip`` left as :class:`TensorRef`)."""
        root = self._root(file)
        keys: list[str] = []
        decode(root, lambda k: keys.append(self._tensor_meta_key(k)), codecs, file)
        dests = {}
        for k in keys:
            if k not in skip:
                tm = self.ckpt.tensor_meta(k)
                dests[k] = torch.empty(tm.shape, dtype=tm.dtype)
        self.ckpt.read_many_into(dests)
        return decode(root, lambda k: dests[k] if k in dests else TensorRef(k), codecs, file)

    # -- which file is which
    def model_files(self) -> dict[int, str]:
        """dp rank -> model-states file (ZeRO-3: one per rank; otherwise rank 0 only)."""
        out = {}
        for f in self.files:
            m = MODEL_RE.match(f)
            if m:
                self._single_mp(f, m.group(2))
                out[int(m.group(1) or 0)] = f
        return out

    def optim_files(self) -> dict[int, str]:
        out = {}
        for f in self.files:
            m = OPTIM_RE.match(f)
            if m:
                self._single_mp(f, m.group(3))
                out[int(m.group(2))] = f
        return out

    def layer_files(self) -> dict[int, str]:
        """Pipeline layer index -> its file (``layer_03-model_states.pt``); empty for a step without pipeline.

        Raises :class:`UnsupportedLayoutError` for a layer saved in
        tensor-parallel slices (``layer_03-model_01-model_states.pt``):
        how the slices make up the layer depends on the model.
        """
        out = {}
        for f in self.files:
            m = LAYER_RE.match(f)
            if m:
                if m.group(2) is not None:
                    raise UnsupportedLayoutError(
                        f"step {self.step}: {f} is one tensor-parallel slice ({m.group(2)}) of pipeline layer "
                        f"{int(m.group(1))}; ckptstore consolidates pipeline steps without tensor parallelism only "
                        "(load the step with an attached engine of the saved layout instead)"
                    )
                out[int(m.group(1))] = f
        return out

    def is_pipeline(self) -> bool:
        """The step was saved by DeepSpeed's pipeline engine (it holds ``layer_*`` files)."""
        return any(LAYER_RE.match(f) for f in self.files)

    def model_parallel(self) -> bool:
        """The step holds files of several model-parallel ranks or pipeline layers (no ZeRO re-partitioning)."""
        if self.is_pipeline():
            return True
        for f in self.files:
            m, o = MODEL_RE.match(f), OPTIM_RE.match(f)
            if (m and int(m.group(2)) != 0) or (o and int(o.group(3)) != 0):
                return True
        return False

    def _single_mp(self, f: str, mp: str) -> None:
        if int(mp) != 0:
            raise UnsupportedLayoutError(
                f"step {self.step}: {f} belongs to model-parallel rank {int(mp)}; ckptstore consolidates and "
                "re-partitions DeepSpeed steps without tensor/pipeline parallelism only"
            )


# ============================================================== ZeRO layout
class VirtualFlat:
    """Several stored 1-d tensors read as their concatenation, by element range."""

    def __init__(self, ckpt, keys: list[str], cache: dict[str, torch.Tensor] | None = None):
        self.ckpt = ckpt
        self.keys = keys
        self.cache = {} if cache is None else cache  # key -> the whole tensor, read before (ZeroLayout.preload_fp32)
        self.starts = []
        n = 0
        for k in keys:
            tm = ckpt.tensor_meta(k)
            if len(tm.shape) != 1:
                raise FormatError(f"step {ckpt.step}: {k!r} should be a flat (1-d) tensor, it is {list(tm.shape)}")
            self.starts.append(n)
            n += tm.shape[0]
        self.numel = n
        self.dtype = ckpt.tensor_meta(keys[0]).dtype if keys else torch.float32

    def read(self, a: int, b: int) -> torch.Tensor:
        if not 0 <= a <= b <= self.numel:
            raise FormatError(f"step {self.ckpt.step}: range [{a}, {b}) outside flat tensors of {self.numel} elements")
        parts = []
        for k, s in zip(self.keys, self.starts):
            n = self.ckpt.tensor_meta(k).shape[0]
            lo, hi = max(a, s), min(b, s + n)
            if lo < hi:
                whole = self.cache.get(k)
                parts.append(whole[lo - s : hi - s] if whole is not None else self.ckpt.read(k, (slice(lo - s, hi - s),)))
        if not parts:
            return torch.empty(0, dtype=self.dtype)
        return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter's elements sit in a ZeRO step."""

    name: str
    shape: tuple[int, ...]
    offset: int  # ZeRO-3: into each rank's flat partition; ZeRO-1/2: into the group's flat buffer
    group: int  # ZeRO-1/2: the parameter group; ZeRO-3: the sub-group
    trainable: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ZeroLayout:
    """Reads full parameters (and per-element optimizer states) of a ZeRO step.

    Follows the layout DeepSpeed's own ``zero_to_fp32.py`` reads (DeepSpeed
    0.19): ZeRO-1/2 keep each parameter group as one flat fp32 buffer split
    evenly across data-parallel ranks (``single_partition_of_fp32_groups``),
    parameters back to back in ``param_shapes`` order plus alignment
    padding; ZeRO-3 partitions every parameter on its own
    (``ceil(numel / world)`` elements per rank, zero padded) and each rank
    concatenates its partitions per sub-group (``fp32_flat_groups``). Only
    the ranges a caller asks for are read (ranged GETs).
    """

    def __init__(self, stored: StoredStep):
        self.s = stored
        self.step = stored.step
        self.stage = int(stored.meta.get("zero_stage", 0))
        self.world = int(stored.meta.get("dp_world_size", 1))
        if self.stage not in (1, 2, 3):
            raise NotImplementedError(f"step {self.step}: ZeRO stage {self.stage} steps hold no partitioned state")
        models = stored.model_files()
        optims = stored.optim_files()
        if sorted(optims) != list(range(self.world)):
            raise FormatError(
                f"step {self.step}: expected optimizer files of dp ranks 0..{self.world - 1}, found ranks {sorted(optims)}"
            )
        want_models = list(range(self.world)) if self.stage == 3 else [0]
        if sorted(models) != want_models:
            raise FormatError(f"step {self.step}: expected model-states files of dp ranks {want_models}, found {sorted(models)}")
        self.model_files = models
        self.optim_files = optims
        self._flats: dict[tuple[int, str], VirtualFlat] = {}
        self._cache: dict[str, torch.Tensor] = {}
        self.model0 = stored.structure(models[0])
        self.optim = {r: stored.structure(f)["optimizer_state_dict"] for r, f in optims.items()}
        self.slots: dict[str, ParamSlot] = {}
        shapes = self.model0.get("param_shapes") or []
        if self.stage == 3:
            off = 0
            for g, group in enumerate(shapes):
                for name, shape in group.items():
                    slot = ParamSlot(name, tuple(shape), off, g, True)
                    self.slots[name] = slot
                    off += self._pn(slot.numel)
            flat = self._flat(0, "fp32")
            if off != flat.numel:
                raise FormatError(f"step {self.step}: ZeRO-3 partitions hold {flat.numel} elements, parameters need {off}")
        else:
            pads = self.optim[0].get("param_alignment_paddings")
            for g, group in enumerate(shapes):
                off = 0
                gp = pads[g] if pads is not None else [0] * len(group)
                for i, (name, shape) in enumerate(group.items()):
                    slot = ParamSlot(name, tuple(shape), off, g, True)
                    self.slots[name] = slot
                    off += slot.numel + gp[i]
        self.frozen: dict[str, tuple[int, ...]] = {
            k: tuple(v) for k, v in (self.model0.get("frozen_param_shapes") or {}).items()
        }

    def _pn(self, numel: int, world: int | None = None) -> int:
        return math.ceil(numel / (world or self.world))

    def preload_fp32(self) -> None:
        """Read every rank's fp32 partitions (and ZeRO-3 frozen fragments) whole, in one batch.

        For a reader of every parameter: each stored byte is fetched once,
        instead of once per parameter whose range shares its chunk. Holds
        the fp32 model in memory until this layout goes.
        """
        keys = []
        for r in range(self.world):
            groups = self.optim[r]["fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"]
            keys += [ref.key for ref in groups]
            if self.stage == 3 and self.frozen:
                frags = self.s.structure(self.model_files[r]).get("frozen_param_fragments") or {}
                keys += [ref.key for ref in frags.values() if isinstance(ref, TensorRef)]
        dests = {}
        for k in keys:
            if k not in self._cache:
                tm = self.s.ckpt.tensor_meta(k)
                dests[k] = torch.empty(tm.shape, dtype=tm.dtype)
        self.s.ckpt.read_many_into(dests)
        self._cache.update(dests)

    @property
    def elastic(self) -> bool:
        """ZeRO-1/2 saved with ``elastic_checkpoint``: per-group optimizer states without padding."""
        return self.stage != 3 and isinstance(self.optim[0].get("base_optimizer_state"), list)

    def state_of(self, rank: int, group: int) -> dict:
        """The base optimizer's state of one flat group of one rank (structure, tensors as refs)."""
        o = self.optim[rank]
        if self.stage == 3:
            return o["optimizer_state_dict"]["state"][group]
        base = o["base_optimizer_state"]
        return base[group] if isinstance(base, list) else base["state"][group]

    def fp32_ref(self, rank: int, group: int) -> TensorRef:
        o = self.optim[rank]
        return (o["fp32_flat_groups"] if self.stage == 3 else o["single_partition_of_fp32_groups"])[group]

    def _flat(self, rank: int, kind: str) -> VirtualFlat:
        """ZeRO-3: rank ``rank``'s flat fp32 partitions (``kind="fp32"``) or one optimizer state, all sub-groups."""
        groups = range(len(self.optim[rank]["fp32_flat_groups"]))
        refs = [self.fp32_ref(rank, g) if kind == "fp32" else self.state_of(rank, g)[kind] for g in groups]
        return VirtualFlat(self.s.ckpt, [r.key for r in refs], self._cache)

    def _group_flat(self, group: int, kind: str) -> VirtualFlat:
        """ZeRO-1/2: one parameter group's flat buffer across every rank.

        Ranks' partitions are saved without their alignment padding (fp32)
        or with it (rigid optimizer states); padding only ever ends a
        group's flat buffer, so either way the ranks' tensors put back to
        back hold every parameter at its offset.
        """
        key = (group, kind)
        flat = self._flats.get(key)
        if flat is None:
            refs = [self.fp32_ref(r, group) if kind == "fp32" else self.state_of(r, group)[kind] for r in range(self.world)]
            flat = self._flats[key] = VirtualFlat(self.s.ckpt, [ref.key for ref in refs], self._cache)
        return flat

    def read_param(self, name: str, kind: str = "fp32", a: int = 0, b: int | None = None) -> torch.Tensor:
        """Elements ``[a, b)`` of a trainable parameter (flattened), or of one of its optimizer states."""
        slot = self.slots[name]
        b = slot.numel if b is None else b
        if self.stage != 3:
            return self._group_flat(slot.group, kind).read(slot.offset + a, slot.offset + b)
        pn = self._pn(slot.numel)
        parts, e = [], a
        while e < b:
            k = e // pn
            hi = min(b, (k + 1) * pn)
            parts.append(self._flat(k, kind).read(slot.offset + e - k * pn, slot.offset + hi - k * pn))
            e = hi
        if not parts:
            return torch.empty(0, dtype=torch.float32)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def read_frozen(self, name: str, a: int = 0, b: int | None = None) -> torch.Tensor:
        """Elements ``[a, b)`` of a frozen parameter (flattened)."""
        numel = math.prod(self.frozen[name])
        b = numel if b is None else b
        if self.stage != 3:
            ref = self.model0["frozen_param_fragments"][name]
            return self.s.ckpt.read(ref.key).reshape(-1)[a:b]
        pn = self._pn(numel)
        parts, e = [], a
        while e < b:
            k = e // pn
            hi = min(b, (k + 1) * pn)
            ref = self.s.structure(self.model_files[k])["frozen_param_fragments"][name]
            parts.append(VirtualFlat(self.s.ckpt, [ref.key], self._cache).read(e - k * pn, hi - k * pn))
            e = hi
        if not parts:
            return torch.empty(0, dtype=torch.float32)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def optimizer_state_keys(self) -> tuple[list[str], dict[str, Any]]:
        """ZeRO-3: (per-element optimizer states, other per-group values) of the base optimizer.

        A state is per-element when every sub-group holds a tensor of it as
        long as that sub-group's fp32 partition (Adam's ``exp_avg``,
        ``exp_avg_sq``); anything else (``step``) is taken from rank 0's
        first sub-group.
        """
        base = self.optim[0]["optimizer_state_dict"]
        state = base["state"]
        fp32 = self.optim[0]["fp32_flat_groups"]
        if not state:
            return [], {}
        if sorted(state) != list(range(len(fp32))):
            raise FormatError(
                f"step {self.step}: the base optimizer holds state for {len(state)} flat groups, "
                f"ZeRO-3 saved {len(fp32)} sub-groups"
            )
        shape = lambda ref: tuple(self.s.ckpt.tensor_meta(ref.key).shape)  # noqa: E731
        per_elem, other = [], {}
        for k, v in state[0].items():
            if all(isinstance(state[g].get(k), TensorRef) and shape(state[g][k]) == shape(fp32[g]) for g in state):
                per_elem.append(k)
            else:
                other[k] = v
        return per_elem, other

    def group_state_keys(self, group: int) -> tuple[list[str], dict[str, Any]]:
        """ZeRO-1/2: (per-element optimizer states, other values) of one parameter group.

        Per-element, as DeepSpeed's own elastic restore decides it: on every
        rank a tensor as long as that rank's partition of the group (with
        its padding in a rigid checkpoint, without in an elastic one).
        Anything else (``step``) is rank 0's value.
        """
        first = self.state_of(0, group)
        shape = lambda ref: tuple(self.s.ckpt.tensor_meta(ref.key).shape)  # noqa: E731

        def partition_shape(r: int) -> tuple[int]:
            n = shape(self.fp32_ref(r, group))[0]
            if not self.elastic:
                n += int(self.optim[r]["group_paddings"][group])
            return (n,)

        per_elem, other = [], {}
        for k, v in first.items():
            if all(
                isinstance(self.state_of(r, group).get(k), TensorRef) and shape(self.state_of(r, group)[k]) == partition_shape(r)
                for r in range(self.world)
            ):
                per_elem.append(k)
            else:
                other[k] = v
        return per_elem, other

    def state_dtype(self, group: int, kind: str) -> torch.dtype:
        """The dtype of a ZeRO-1/2 group's fp32 partitions or per-element state."""
        ref = self.fp32_ref(0, group) if kind == "fp32" else self.state_of(0, group)[kind]
        return self.s.ckpt.tensor_meta(ref.key).dtype

    def partition_of(self, group: "FlatGroup", rank: int, kind: str = "fp32") -> torch.Tensor:
        """ZeRO-1/2: partition ``rank`` of a live layout's flat group, read from this step.

        ``partition_size`` elements, zero where the live layout pads (between
        parameters, and past the group's data). When the live group places
        the saved group's parameters at the saved offsets (the usual case:
        the layout within a group does not depend on the DP size), the
        partition is one range of the saved flat buffer; otherwise each
        parameter's piece is read on its own.
        """
        lo = rank * group.partition_size
        g = self._same_offsets(group)
        dtype = self.state_dtype(g if g is not None else self.slots[group.names[0]].group, kind) if group.names else torch.float32
        out = torch.zeros(group.partition_size, dtype=dtype)
        if g is not None:
            end = min(lo + group.partition_size, group.data_end)
            if end > lo:
                out[: end - lo] = self._group_flat(g, kind).read(lo, end)
            return out
        for name, at, n, a in group.fragments(rank):
            if name not in self.slots:
                raise KeyError(f"step {self.step} holds no trainable parameter {name!r}")
            out[at : at + n] = self.read_param(name, kind, a, a + n)
        return out

    def _same_offsets(self, group: "FlatGroup") -> int | None:
        """The saved group holding exactly ``group``'s parameters at its offsets, or None."""
        slots = [self.slots.get(n) for n in group.names]
        if not slots or any(s is None for s in slots) or len({s.group for s in slots}) != 1:
            return None
        g = slots[0].group
        saved = [s for s in self.slots.values() if s.group == g]
        if [s.name for s in saved] != list(group.names) or [s.offset for s in saved] != list(group.offsets):
            return None
        if [s.numel for s in saved] != list(group.numels):
            return None
        return g

    # -- consolidated weights (what zero_to_fp32.py writes)
    def consolidated(
        self, exclude_frozen: bool = False, float_buffers: bool = False
    ) -> list[tuple[str, torch.dtype, tuple[int, ...], Callable[[], torch.Tensor]]]:
        """(name, dtype, shape, read) for every buffer and parameter, full fp32 precision for parameters.

        In DeepSpeed's ``zero_to_fp32`` order: buffers (in the module's
        order), frozen parameters (unless ``exclude_frozen``), trainable
        parameters, then tied names, each sharing its target's ``read``.
        ``float_buffers``: floating-point buffers as fp32, as ``zero_to_fp32``
        gives them (otherwise as saved).
        """
        out = []
        module = self.model0.get("module") or {}
        buffer_names = set(self.model0.get("buffer_names") or [])
        for name, ref in module.items():
            if name in buffer_names and isinstance(ref, TensorRef):
                tm = self.s.ckpt.tensor_meta(ref.key)
                dtype = tm.dtype
                if float_buffers and dtype.is_floating_point:
                    dtype = torch.float32
                out.append((name, dtype, tuple(tm.shape), lambda k=ref.key, d=dtype: self.s.ckpt.read(k).to(d)))
        if not exclude_frozen:
            for name, shape in self.frozen.items():
                dtype = self._frozen_dtype(name)
                out.append((name, dtype, shape, lambda n=name, s=shape: self.read_frozen(n).reshape(s)))
        for name, slot in self.slots.items():
            out.append((name, torch.float32, slot.shape, lambda n=name, s=slot.shape: self.read_param(n).reshape(s)))
        return _with_tied(out, self.model0.get("shared_params") or {})

    def _frozen_dtype(self, name: str) -> torch.dtype:
        return self.s.ckpt.tensor_meta(self.model0["frozen_param_fragments"][name].key).dtype


def _with_tied(out: list, shared: dict) -> list:
    """``out`` plus an entry per tied name whose target is in it (same ``read``: one tensor for both)."""
    by_name = {e[0]: e for e in out}
    for alias, target in shared.items():
        if alias not in by_name and target in by_name:
            _, dt, sh, fn = by_name[target]
            out.append((alias, dt, sh, fn))
            by_name[alias] = out[-1]
    return out


@dataclass(frozen=True)
class FlatGroup:
    """One ZeRO-1/2 parameter group as a live optimizer lays it out on ``world`` ranks.

    Parameters sit back to back in a flat buffer (``names`` in buffer
    order, each at ``offsets[i]`` with ``numels[i]`` elements; any gap is
    alignment padding), which is padded at its end to ``world *
    partition_size`` elements and cut into ``world`` equal partitions.
    """

    names: tuple[str, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    partition_size: int
    world: int

    def __post_init__(self):
        if not (len(self.names) == len(self.offsets) == len(self.numels)):
            raise ValueError("FlatGroup: names, offsets and numels differ in length")
        if self.data_end > self.partition_size * self.world:
            raise ValueError(
                f"FlatGroup: parameters end at element {self.data_end}, past {self.world} partitions of {self.partition_size}"
            )

    @property
    def data_end(self) -> int:
        return self.offsets[-1] + self.numels[-1] if self.names else 0

    def padding(self, rank: int) -> int:
        """Elements at the end of partition ``rank`` past the group's data (DeepSpeed's ``groups_padding``)."""
        lo = rank * self.partition_size
        return min(self.partition_size, max(0, lo + self.partition_size - max(lo, self.data_end)))

    def fragments(self, rank: int) -> list[tuple[str, int, int, int]]:
        """(name, start in the partition, elements, start in the parameter) of each parameter piece in ``rank``'s partition."""
        lo, hi = rank * self.partition_size, (rank + 1) * self.partition_size
        out = []
        for name, off, n in zip(self.names, self.offsets, self.numels):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append((name, a - lo, b - a, a - off))
        return out


def partition(full_reader: Callable[[int, int], torch.Tensor], numel: int, rank: int, world: int, dtype) -> torch.Tensor:
    """ZeRO-3 partition ``rank`` of ``world`` of a parameter: ``ceil(numel/world)`` elements, zero padded."""
    pn = math.ceil(numel / world)
    a, b = min(rank * pn, numel), min((rank + 1) * pn, numel)
    out = torch.zeros(pn, dtype=dtype)
    if b > a:
        out[: b - a] = full_reader(a, b)
    return out


def consolidated(
    ckpt, exclude_frozen: bool = False, float_buffers: bool = False, pipeline: bool = True
) -> list[tuple[str, torch.dtype, tuple[int, ...], Callable[[], torch.Tensor]]]:
    """(name, dtype, shape, read) of the model weights a DeepSpeed step makes up.

    ZeRO-1/2/3: buffers, frozen parameters and every trainable parameter
    assembled from the fp32 master partitions (full precision, as
    ``zero_to_fp32.py`` gives them), tied names included (see
    :meth:`ZeroLayout.consolidated` for the options). Without ZeRO: the
    module state dict of the model-states file as saved.

    A pipeline step (``PipelineModule``, any ZeRO stage) keeps its weights
    in one file per layer, and its model-states files hold none: the
    weights are those files' tensors as saved, named
    ``<layer index>.<name>`` as a one-stage ``PipelineModule``'s
    ``state_dict`` names them (:func:`pipeline_weights`). With
    ``pipeline=False`` (DeepSpeed's ``zero_to_fp32``, which does not read
    pipeline checkpoints) such a step raises :class:`UnsupportedLayoutError`.
    """
    stored = StoredStep(ckpt)
    if stored.is_pipeline():
        if not pipeline:
            raise UnsupportedLayoutError(
                f"step {stored.step} was saved by DeepSpeed's pipeline engine (layer_*-model_states.pt files), "
                "which DeepSpeed's zero_to_fp32 does not read; `ckptstore export URL STEP OUT.safetensors` "
                "writes its layers' weights"
            )
        return pipeline_weights(stored)
    if int(stored.meta.get("zero_stage", 0)) in (1, 2, 3):
        return ZeroLayout(stored).consolidated(exclude_frozen=exclude_frozen, float_buffers=float_buffers)
    models = stored.model_files()
    if 0 not in models:
        raise FormatError(f"step {stored.step}: no model-states file of rank 0")
    module = stored.structure(models[0]).get("module")
    if not isinstance(module, dict):
        raise FormatError(f"step {stored.step}: {models[0]} holds no module state dict")
    out = []
    for name, ref in module.items():
        if isinstance(ref, TensorRef):
            tm = ckpt.tensor_meta(ref.key)
            out.append((name, tm.dtype, tuple(tm.shape), lambda k=ref.key: ckpt.read(k)))
    return out


def pipeline_weights(stored: StoredStep) -> list[tuple[str, torch.dtype, tuple[int, ...], Callable[[], torch.Tensor]]]:
    """(name, dtype, shape, read) of every tensor of a pipeline step's layer files, by layer index.

    ``PipelineModule.save_state_dict`` writes ``layer.state_dict()`` of
    each layer that has one to ``layer_<index>-model_states.pt`` (index in
    the whole model, whatever the stage count); a one-stage
    ``PipelineModule`` registers layer ``i`` as submodule ``"i"``, so its
    ``state_dict`` names that layer's tensors ``i.<name>``. A layer built
    from a ``TiedLayerSpec`` is saved under every index that uses it (the
    module itself names it ``tied_modules.<key>.<name>``).
    """
    out = []
    for idx, f in sorted(stored.layer_files().items()):
        sd = stored.structure(f)
        if not isinstance(sd, dict):
            raise FormatError(f"step {stored.step}: {f} does not hold a layer state dict")
        for name, ref in sd.items():
            if isinstance(ref, TensorRef):
                tm = stored.ckpt.tensor_meta(ref.key)
                out.append((f"{idx}.{name}", tm.dtype, tuple(tm.shape), lambda k=ref.key: stored.ckpt.read(k)))
    return out
