"""DeepSpeed: ``engine.save_checkpoint``/``load_checkpoint`` through a ckptstore repository.

::

    import deepspeed
    from ckptstore.integrations import deepspeed as ckpt_ds

    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    ckpt_ds.attach(engine, "s3://bucket/run")
    engine.save_checkpoint("ckpt", tag="global_step1000")   # step 1000 in the repository
    engine.load_checkpoint("ckpt", tag="global_step1000")   # reads it back

How it plugs in: :func:`attach` sets ``engine.checkpoint_engine`` to a
:class:`CkptStoreCheckpointEngine` (DeepSpeed's ``CheckpointEngine``
interface: ``create``, ``save(state_dict, path)``, ``load(path,
map_location)``, ``commit``) and wraps ``engine.load_checkpoint``.

Save: ``save`` keeps each file's state dict (no copy); ``commit``, which
DeepSpeed calls on every rank once all of its files are handed over, saves
every rank's files as ONE step with ``torch.distributed.checkpoint`` and
:class:`ckptstore.dcp.CkptStoreWriter`: each rank uploads its own tensors
(deduplicated against the previous step), and rank 0 commits the step's
manifest with an exclusive create after every rank has written. A failure on
any rank leaves no step; saving a step that exists fails on every rank with
:class:`ckptstore.StepExistsError`. Non-tensor values (``LossScaler``,
``ZeroStageEnum``, fragment addresses, configs) are converted to JSON with
an explicit allow-list (:data:`CODECS`); nothing is pickled. Then each rank
writes a small JSON stub in place of each of its files, so ``save_dir``
holds only bookkeeping: DeepSpeed's ``latest`` and ``zero_to_fp32.py``, the
tag directory and the stubs.

Load: the wrapped ``load_checkpoint`` finds the step of the tag (the stubs,
else the tag's trailing integer, else the step whose metadata names the
tag), writes missing stubs (so a fresh machine needs only the URL and the
tag), and runs DeepSpeed's own ``load_checkpoint``, whose ``load`` calls
read each file back from the step. A ZeRO-3 step loads on a different
number of data-parallel ranks: the files each new rank asks for are
rebuilt from the stored partitions (full parameters read by range, then
re-partitioned), and DeepSpeed's stock loader consumes them.

The step number is the trailing integer of the tag (``global_step1000`` ->
1000), else ``engine.global_steps``.
"""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from collections import OrderedDict
from contextlib import contextmanager

try:
    import deepspeed as _deepspeed
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
except ImportError as _e:  # pragma: no cover - exercised with deepspeed hidden
    raise ImportError(
        "ckptstore.integrations.deepspeed needs DeepSpeed: pip install 'ckptstore[integrations]' "
        f"(or DS_BUILD_OPS=0 pip install deepspeed); importing it failed: {_e}"
    ) from _e

import torch
import torch.distributed as dist

import ckptstore

from ..errors import CkptStoreError, FormatError, StepNotFoundError
from .. import zero as F
from ._common import unwrap_checkpoint_exception

__all__ = ["attach", "CkptStoreCheckpointEngine", "CODECS", "step_for_tag", "consolidated_state_dict"]

STUB_FORMAT = "ckptstore.deepspeed.stub"
_STUB_MAX = 4096


# ============================================================== allow-list
def _attrs(obj) -> dict:
    return dict(vars(obj))


def _from_attrs(cls):
    def build(state):
        if not isinstance(state, dict):
            raise TypeError(f"{cls.__name__} state is not a dict")
        obj = cls.__new__(cls)
        obj.__dict__.update(state)
        return obj

    return build


#: The only DeepSpeed classes a stored file may hold, and how each becomes
#: JSON. ``LossScaler``/``DynamicLossScaler`` carry plain attributes (the
#: scale, counters, a dtype); ``ZeroStageEnum`` is an int enum;
#: ``fragment_address`` is a dataclass of two ints.
CODECS: dict[type, F.ClassCodec] = {
    c.cls: c
    for c in (
        F.ClassCodec("deepspeed.LossScaler", LossScaler, "obj", _attrs, _from_attrs(LossScaler)),
        F.ClassCodec("deepspeed.DynamicLossScaler", DynamicLossScaler, "obj", _attrs, _from_attrs(DynamicLossScaler)),
        F.ClassCodec("deepspeed.ZeroStageEnum", ZeroStageEnum, "enum", lambda e: int(e.value), ZeroStageEnum),
        F.ClassCodec(
            "deepspeed.fragment_address",
            fragment_address,
            "obj",
            lambda a: {"numel": int(a.numel), "start": int(a.start)},
            lambda s: fragment_address(numel=int(s["numel"]), start=int(s["start"])),
        ),
    )
}
_BY_NAME = {c.name: c for c in CODECS.values()}


def step_for_tag(tag: str, global_steps: int) -> int:
    """The step a DeepSpeed tag saves to: its trailing integer, else ``global_steps``."""
    m = re.search(r"(\d+)$", str(tag))
    return int(m.group(1)) if m else int(global_steps)


# ============================================================== engine
class CkptStoreCheckpointEngine(CheckpointEngine):
    """DeepSpeed ``CheckpointEngine`` that keeps checkpoint bytes in a ckptstore repository.

    Use :func:`attach` rather than building one directly.

    Parameters
    ----------
    url:
        Repository URL (``s3://bucket/prefix``, ``file:///path``, a path).
    engine:
        The ``DeepSpeedEngine`` it serves (for ``global_steps``, the ZeRO
        stage and, on a resharded load, the new partition layout).
    storage_options, **options:
        As for :func:`ckptstore.open` (``chunk_size``, ``workers``, ...).
    """

    def __init__(self, url: str | os.PathLike, engine=None, storage_options: dict | None = None, **options):
        super().__init__(None)
        self.name = "CkptStoreCheckpointEngine"
        self.url = os.fspath(url)
        self.engine = engine
        self.storage_options = storage_options
        self.options = options
        self._repo = None
        self._pending: dict | None = None
        self._loading_step: int | None = None
        self._stored: dict[int, F.StoredStep] = {}
        #: the StepInfo-like stats of this rank's part of the last save
        self.last_save: dict | None = None

    # -- plumbing
    @property
    def repo(self):
        if self._repo is None:
            self._repo = ckptstore.open(self.url, storage_options=self.storage_options, **self.options)
        return self._repo

    def close(self) -> None:
        if self._repo is not None:
            self._repo.close()
            self._repo = None

    def preserves_storage_sharing(self) -> bool:
        # DeepSpeed clones views before torch.save so a file does not carry
        # a whole flat buffer; ckptstore reads a view's own bytes, so the
        # copy is not needed.
        return False

    # -- save
    def create(self, info) -> None:
        step = step_for_tag(info.tag, getattr(self.engine, "global_steps", 0))
        self._pending = {"tag": str(info.tag), "save_dir": os.fspath(info.save_dir), "step": step, "files": {}}

    def save(self, state_dict, path: str) -> None:
        path = os.fspath(path)
        p = self._pending
        if p is None or os.path.dirname(os.path.abspath(path)) != os.path.abspath(os.path.join(p["save_dir"], p["tag"])):
            # Not a file of a checkpoint tag (save_16bit_model writes a
            # plain weights file into save_dir): DeepSpeed's own behaviour.
            torch.save(state_dict, path)
            return
        name = os.path.basename(path)
        if name in p["files"]:
            raise ValueError(f"DeepSpeed saved {name} twice in one checkpoint")
        p["files"][name] = state_dict

    def commit(self, info) -> bool:
        p, self._pending = self._pending, None
        if p is None:
            raise RuntimeError("CkptStoreCheckpointEngine.commit without create")
        # Every rank calls commit; whether this is a checkpoint (any rank
        # has a file of the tag) must be decided together, since the DCP
        # save below is collective.
        flat: dict[str, torch.Tensor] = {}
        error = None
        try:
            for name, sd in p["files"].items():
                tensors, structure = F.encode_file(name, sd, CODECS)
                flat.update(tensors)
                flat[F.structure_key(name)] = structure
        except (TypeError, ValueError) as e:
            error = e
        # An error on one rank must stop every rank before the collective
        # save, or the others would wait for it there.
        n, failed = _all_reduce_ints(len(p["files"]), int(error is not None))
        if failed:
            if error is not None:
                raise type(error)(f"DeepSpeed checkpoint step {p['step']}: nothing was saved: {error}") from None
            raise CkptStoreError(
                f"DeepSpeed checkpoint step {p['step']}: another rank could not encode its files; nothing was saved"
            )
        if n == 0:
            return True
        meta = {"deepspeed": self._step_meta(p["tag"])}
        self.last_save = _dcp_save(self.url, p["step"], flat, meta, self.storage_options, self.options)
        for name in p["files"]:
            _write_stub(os.path.join(p["save_dir"], p["tag"], name), self._stub(p["step"], p["tag"], name))
        return True

    def _step_meta(self, tag: str) -> dict:
        e = self.engine
        stage = int(e.zero_optimization_stage()) if e is not None else 0
        return {
            "format": F.FORMAT_VERSION,
            "tag": tag,
            "zero_stage": stage,
            "dp_world_size": int(getattr(e, "seq_dp_world_size", getattr(e, "dp_world_size", 1))) if e else 1,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "ds_version": getattr(_deepspeed, "__version__", "?"),
        }

    def _stub(self, step: int, tag: str, name: str) -> dict:
        return {"format": STUB_FORMAT, "version": 1, "url": self.repo.url, "step": step, "tag": tag, "file": name}

    # -- load
    def load(self, path: str, map_location=None):
        path = os.fspath(path)
        name = os.path.basename(path)
        stub = _read_stub(path)
        if stub is None and os.path.isfile(path):
            return _legacy_load(path, map_location)
        if stub is not None:
            if stub["url"] != self.repo.url:
                raise ValueError(
                    f"{path} points to step {stub['step']} of {stub['url']!r}, but this engine is attached to "
                    f"{self.repo.url!r}; attach the engine to that repository, or load another tag"
                )
            step = stub["step"]
        elif self._loading_step is not None:
            step = self._loading_step
        else:
            raise FileNotFoundError(f"{path}: no such DeepSpeed file, and no ckptstore step is being loaded")
        stored = self._stored_step(step)
        out = self._reshard(stored, name)
        if out is None:
            if name not in stored.files:
                raise FileNotFoundError(
                    f"{self.url}: step {step} (tag {stored.meta.get('tag')!r}) holds no DeepSpeed file {name!r}"
                )
            out = stored.read_file(name, _BY_NAME)
        return _map(out, map_location)

    def _stored_step(self, step: int) -> F.StoredStep:
        s = self._stored.get(step)
        if s is None:
            s = self._stored[step] = F.StoredStep(self.repo.checkpoint(step))
        return s

    def resolve_tag(self, load_dir: str, tag: str) -> int | None:
        """The committed step holding ``tag``, or None."""
        tag_dir = os.path.join(load_dir, str(tag))
        if os.path.isdir(tag_dir):
            for f in sorted(os.listdir(tag_dir)):
                stub = _read_stub(os.path.join(tag_dir, f))
                if stub is not None and stub["url"] == self.repo.url:
                    return stub["step"]
        steps = self.repo.steps()
        m = re.search(r"(\d+)$", str(tag))
        if m and int(m.group(1)) in steps:
            md = self.repo.manifest(int(m.group(1))).metadata
            if F.is_deepspeed_step(md) and md["deepspeed"].get("tag") == str(tag):
                return int(m.group(1))
        for s in reversed(steps):
            md = self.repo.manifest(s).metadata
            if F.is_deepspeed_step(md) and md["deepspeed"].get("tag") == str(tag):
                return s
        return None

    def latest_tag(self) -> str | None:
        for s in reversed(self.repo.steps()):
            md = self.repo.manifest(s).metadata
            if F.is_deepspeed_step(md):
                return md["deepspeed"].get("tag")
        return None

    def write_stubs(self, load_dir: str, tag: str, step: int) -> None:
        """Stubs for every file of the step, and for the files a resharded load asks for."""
        stored = self._stored_step(step)
        names = set(stored.files)
        if self._needs_reshard(stored):
            r = _dp_rank(self.engine)
            names.add(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        for name in sorted(names):
            path = os.path.join(load_dir, str(tag), name)
            if _read_stub(path) != self._stub(step, str(tag), name):
                _write_stub(path, self._stub(step, str(tag), name))

    @contextmanager
    def loading(self, step: int | None):
        prev, self._loading_step = self._loading_step, step
        try:
            yield
        finally:
            self._loading_step = prev

    # -- resharding (ZeRO-3)
    def _needs_reshard(self, stored: F.StoredStep) -> bool:
        if self.engine is None:
            return False
        saved = int(stored.meta.get("dp_world_size", 1))
        return saved != _dp_world(self.engine)

    def _reshard(self, stored: F.StoredStep, name: str):
        """The file ``name`` rebuilt for this engine's data-parallel size, or None if sizes match."""
        if not self._needs_reshard(stored):
            return None
        stage = int(stored.meta.get("zero_stage", 0))
        if stage != 3:
            raise NotImplementedError(
                f"{self.url}: step {stored.step} was saved by ZeRO stage {stage} on "
                f"{stored.meta.get('dp_world_size')} data-parallel ranks and this engine has {_dp_world(self.engine)}; "
                "ckptstore re-partitions ZeRO-3 steps only (DeepSpeed refuses a ZeRO-1/2 data-parallel change "
                "in runtime/engine.py:_load_zero_checkpoint). Export the consolidated weights with "
                "`ckptstore export` to start from them instead."
            )
        layout = F.ZeroLayout(stored)
        rank, world = _dp_rank(self.engine), _dp_world(self.engine)
        m = F.MODEL_RE.match(name)
        if m and m.group(1) is not None:
            return _reshard_model_file(stored, layout, rank, world)
        m = F.OPTIM_RE.match(name)
        if m:
            if int(m.group(2)) != rank:
                raise ValueError(f"rank {rank} asked for {name}; a resharded load serves each rank its own file")
            return _reshard_optim_file(stored, layout, self.engine, rank, world)
        raise FileNotFoundError(f"{self.url}: step {stored.step}: no resharded DeepSpeed file {name!r}")


# ============================================================== attach
def attach(engine, url: str | os.PathLike, storage_options: dict | None = None, **options) -> CkptStoreCheckpointEngine:
    """Route ``engine.save_checkpoint``/``load_checkpoint`` through the repository at ``url``.

    Call after ``deepspeed.initialize``, on every rank. Returns the
    :class:`CkptStoreCheckpointEngine` now set as ``engine.checkpoint_engine``.
    ``engine.load_checkpoint`` is wrapped (on this instance) to find the step
    of a tag, write its stubs and set up resharded loads; it takes the same
    arguments and returns what DeepSpeed returns.
    """
    ce = CkptStoreCheckpointEngine(url, engine=engine, storage_options=storage_options, **options)
    engine.checkpoint_engine = ce
    original = getattr(engine.load_checkpoint, "_ckptstore_original", engine.load_checkpoint)

    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        current = engine.checkpoint_engine
        if not isinstance(current, CkptStoreCheckpointEngine):
            return original(load_dir, tag, *args, **kwargs)
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if os.path.isfile(latest):
                with open(latest) as f:
                    tag = f.read().strip()
            else:
                tag = current.latest_tag()
                if tag is None:
                    return original(load_dir, None, *args, **kwargs)  # DeepSpeed warns and returns (None, None)
        step = current.resolve_tag(load_dir, tag)
        if step is None:
            return original(load_dir, tag, *args, **kwargs)  # a plain DeepSpeed checkpoint on disk, or nothing
        current.write_stubs(load_dir, tag, step)
        if dist.is_initialized():
            dist.barrier()
        with current.loading(step):
            return original(load_dir, tag, *args, **kwargs)

    load_checkpoint._ckptstore_original = original
    engine.load_checkpoint = load_checkpoint
    return ce


def consolidated_state_dict(url: str, step: int | None = None, storage_options: dict | None = None, **options) -> dict:
    """Full fp32 weights of a ZeRO step, by parameter name (what ``zero_to_fp32.py`` gives)."""
    with ckptstore.open(url, storage_options=storage_options, **options) as repo:
        step = repo.latest() if step is None else step
        if step is None:
            raise StepNotFoundError(f"{url}: the repository has no committed step")
        layout = F.ZeroLayout(F.StoredStep(repo.checkpoint(step)))
        return OrderedDict((name, read()) for name, _, _, read in layout.consolidated())


# ============================================================== helpers
def _dp_world(engine) -> int:
    opt = getattr(engine, "optimizer", None)
    group = getattr(opt, "dp_process_group", None)
    if group is not None and dist.is_initialized():
        return dist.get_world_size(group=group)
    return int(getattr(engine, "seq_dp_world_size", getattr(engine, "dp_world_size", 1)))


def _dp_rank(engine) -> int:
    opt = getattr(engine, "optimizer", None)
    group = getattr(opt, "dp_process_group", None)
    if group is not None and dist.is_initialized():
        return dist.get_rank(group=group)
    return dist.get_rank() if dist.is_initialized() else 0


def _all_reduce_ints(*values: int) -> list[int]:
    """Sum small integers over all ranks (the values themselves without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return [int(x) for x in t.tolist()]


def _dcp_save(url, step, flat, meta, storage_options, options) -> dict | None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ..dcp import CkptStoreWriter

    writer = CkptStoreWriter(url, step=step, storage_options=storage_options, metadata=meta, **options)
    try:
        dcp.save(flat, storage_writer=writer)
    except CheckpointException as e:
        raise unwrap_checkpoint_exception(e, f"DeepSpeed checkpoint step {step}") from None
    finally:
        writer.close()
    return writer.last_rank_stats


def _write_stub(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def _read_stub(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(_STUB_MAX + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    if len(raw) > _STUB_MAX or not raw.startswith(b"{"):
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != STUB_FORMAT:
        return None
    if type(doc.get("step")) is not int or not isinstance(doc.get("url"), str):
        raise FormatError(f"{path}: malformed ckptstore stub")
    return doc


def _legacy_load(path: str, map_location):
    """A DeepSpeed file on local disk (saved without ckptstore), read with torch's restricted loader."""
    safe = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
    with torch.serialization.safe_globals(safe):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except Exception as e:
            raise type(e)(
                f"{path}: torch.load(weights_only=True) with ckptstore's allow-list of DeepSpeed classes "
                f"refused this file: {e}"
            ) from None


def _map(obj, map_location):
    if map_location is None or callable(map_location):
        return obj
    dev = torch.device(map_location)
    if dev.type == "cpu":
        return obj

    def walk(v):
        if isinstance(v, torch.Tensor):
            return v.to(dev)
        if isinstance(v, dict):
            out = type(v)()
            for k, x in v.items():
                out[k] = walk(x)
            return out
        if isinstance(v, (list, tuple)):
            return type(v)(walk(x) for x in v)
        return v

    return walk(obj)


# -------------------------------------------------------------- ZeRO-3 re-partitioning
def _reshard_model_file(stored: F.StoredStep, layout: F.ZeroLayout, rank: int, world: int) -> dict:
    """Rank 0's model-states file with frozen partitions and the DP size of the new layout."""
    frozen_keys = {
        ref.key for ref in (layout.model0.get("frozen_param_fragments") or {}).values() if isinstance(ref, F.TensorRef)
    }
    sd = stored.read_file(layout.model_files[0], _BY_NAME, skip=frozen_keys)
    if layout.frozen:
        frags = OrderedDict()
        for name, shape in layout.frozen.items():
            numel = math.prod(shape)
            frags[name] = F.partition(
                lambda a, b, n=name: layout.read_frozen(n, a, b), numel, rank, world, layout._frozen_dtype(name)
            )
        sd["frozen_param_fragments"] = frags
    sd["dp_world_size"] = world
    return sd


def _reshard_optim_file(stored: F.StoredStep, layout: F.ZeroLayout, engine, rank: int, world: int) -> dict:
    """This rank's ZeRO-3 optimizer file for ``world`` ranks, built from the full stored state."""
    opt = engine.optimizer
    per_elem, other = layout.optimizer_state_keys()
    skip = set()
    for r in layout.optim:
        o = layout.optim[r]
        skip.update(ref.key for ref in o["fp32_flat_groups"])
        for st in o["optimizer_state_dict"]["state"].values():
            skip.update(st[k].key for k in per_elem)
    sd = stored.read_file(layout.optim_files[0], _BY_NAME, skip=skip)
    osd = sd["optimizer_state_dict"]
    saved_pgs = osd["optimizer_state_dict"]["param_groups"]
    live_pgs = opt.optimizer.param_groups
    if len(saved_pgs) != len(live_pgs):
        raise ValueError(
            f"step {stored.step} has {len(saved_pgs)} optimizer parameter groups, this engine {len(live_pgs)}"
        )
    names = engine.param_names
    groups = opt.fp16_groups
    sub_to_group = {g: int(opt.sub_group_to_group_id.get(g, 0)) for g in range(len(groups))}
    # torch's optimizer numbers the flat fp32 partitions group by group, in
    # sub-group order (stage3._set_fp32_optimizer_param_groups appends them so)
    order = [g for j in range(len(live_pgs)) for g in range(len(groups)) if sub_to_group[g] == j]
    index = {g: i for i, g in enumerate(order)}
    state0 = osd["optimizer_state_dict"]["state"][0] if osd["optimizer_state_dict"]["state"] else {}
    fp32_groups, state = [], {}
    for g, params in enumerate(groups):
        want = int(opt.fp32_partitioned_groups_flat[g].numel())
        parts = {k: [] for k in ["fp32", *per_elem]}
        for p in params:
            name = names.get(p)
            if name not in layout.slots:
                raise KeyError(f"step {stored.step} holds no trainable parameter {name!r} of this model")
            slot = layout.slots[name]
            if tuple(p.ds_shape) != slot.shape:
                raise ValueError(f"step {stored.step}: parameter {name!r} is {list(slot.shape)}, the model's {list(p.ds_shape)}")
            if p.partition_numel() != math.ceil(slot.numel / world):
                raise ValueError(f"parameter {name!r}: unexpected ZeRO-3 partition size {p.partition_numel()}")
            for k in parts:
                parts[k].append(
                    F.partition(lambda a, b, n=name, kk=k: layout.read_param(n, kk, a, b), slot.numel, rank, world, torch.float32)
                )
        flat = {k: (torch.cat(v) if v else torch.empty(0)) for k, v in parts.items()}
        if flat["fp32"].numel() != want:
            raise ValueError(f"sub-group {g}: rebuilt {flat['fp32'].numel()} elements, the engine holds {want}")
        fp32_groups.append(flat["fp32"])
        st = {k: flat[k] for k in per_elem}
        for k, v in other.items():
            val = state0.get(k, v)
            st[k] = val.clone() if isinstance(val, torch.Tensor) else val
        state[index[g]] = st
    new_pgs = []
    for j, pg in enumerate(saved_pgs):
        pg = dict(pg)
        pg["params"] = [index[g] for g in order if sub_to_group[g] == j]
        new_pgs.append(pg)
    osd["optimizer_state_dict"] = {"state": state, "param_groups": new_pgs}
    osd["fp32_flat_groups"] = fp32_groups
    osd["partition_count"] = world
    return sd

