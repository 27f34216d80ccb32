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
manifest with an exclusive create after every rank has written. The step
is the tag's trailing integer (``global_step1000`` -> 1000), else
``engine.global_steps``, when that step is free, else one past the newest
(rank 0 picks it, every rank agrees before the collective save); once it
is committed, rank 0 points the checkpoint name ``("deepspeed", tag)`` at
it. So a tag saved again loads the new state, as in DeepSpeed, and no
committed step is rewritten. A failure on any rank leaves no step.
Non-tensor values (``LossScaler``, ``ZeroStageEnum``, fragment addresses,
configs) are converted to JSON with an explicit allow-list
(:data:`CODECS`); nothing is pickled. Each rank then writes a stub in place
of each of its files (:mod:`.deepspeed_tools`), so ``save_dir`` holds only
bookkeeping: DeepSpeed's ``latest``, ckptstore's ``zero_to_fp32.py``, the
tag directory and the stubs.

Load: the wrapped ``load_checkpoint`` finds the step of the tag (its
name, else the stubs, else the tag's trailing integer or metadata), writes
missing stubs (so a fresh machine needs only the URL and the tag), and runs
DeepSpeed's own ``load_checkpoint`` with that step set as the one being
loaded: the engine's ``load`` reads each file back from it, and DeepSpeed's
ZeRO-3 consolidation (``load_module_only``, ``load_optimizer_states=False``)
is served from it. On another data-parallel size, ZeRO-3 steps (and
ZeRO-1/2 steps with ``reshard=True``) are re-partitioned
(:mod:`.deepspeed_reshard`): the files each new rank asks for are rebuilt
from range reads of the stored partitions, and DeepSpeed's stock loader
consumes them.

Pipeline engines (``PipelineModule``) save one file per layer, numbered in
the whole model, which load on any stage count; their optimizer states
belong to the saved stages, and loading them into another partition is
refused (:meth:`CkptStoreCheckpointEngine.check_pipeline`).
"""

from __future__ import annotations

import inspect
import os
import re
from collections import OrderedDict

try:
    import deepspeed as _deepspeed
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.pipe.module import PipelineModule
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.runtime.zero.utils import ZeRORuntimeException
    from deepspeed.utils.tensor_fragment import fragment_address
except ImportError as _e:  # pragma: no cover - exercised with deepspeed hidden
    raise ImportError(
        "ckptstore.integrations.deepspeed needs DeepSpeed: pip install 'ckptstore[integrations]' "
        f"(or DS_BUILD_OPS=0 pip install deepspeed); importing it failed: {_e}"
    ) from _e

import torch
import torch.distributed as dist

import ckptstore

from ..repo import zero
from ..errors import CkptStoreError, StepNotFoundError
from . import deepspeed_reshard as R
from . import deepspeed_tools as T
from ._common import unwrap_checkpoint_exception

__all__ = ["attach", "CkptStoreCheckpointEngine", "CODECS", "step_for_tag", "consolidated_state_dict"]

STUB_FORMAT = T.STUB_FORMAT
NAMESPACE = T.NAMESPACE
RESHARD_HINT = "pass reshard=True to ckptstore.integrations.deepspeed.attach to re-partition"
NO_RESHARD_HINT = (
    "this step holds pipeline or model-parallel files, which ckptstore does not re-partition either; "
    "load it on the saved data-parallel size, or without optimizer states (load_optimizer_states=False)"
)


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
CODECS: dict[type, zero.ClassCodec] = {
    c.cls: c
    for c in (
        zero.ClassCodec("deepspeed.LossScaler", LossScaler, "obj", _attrs, _from_attrs(LossScaler)),
        zero.ClassCodec("deepspeed.DynamicLossScaler", DynamicLossScaler, "obj", _attrs, _from_attrs(DynamicLossScaler)),
        zero.ClassCodec("deepspeed.ZeroStageEnum", ZeroStageEnum, "enum", lambda e: int(e.value), ZeroStageEnum),
        zero.ClassCodec(
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
    """The step a DeepSpeed tag prefers: its trailing integer, else ``global_steps``.

    The save takes this step if it is free, else one past the newest
    committed step (a tag saved again, or another tag ending in the same
    number); the tag's checkpoint name then points at it.
    """
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
    reshard:
        Loading a ZeRO step on another data-parallel size (see :func:`attach`).
    """

    def __init__(
        self,
        url: str | os.PathLike,
        engine=None,
        storage_options: dict | None = None,
        reshard: bool | None = None,
        **options,
    ):
        super().__init__(None)
        if reshard not in (None, True, False):
            raise ValueError(f"reshard must be None, True or False, not {reshard!r}")
        self.name = "CkptStoreCheckpointEngine"
        self.url = os.fspath(url)
        self.engine = engine
        self.storage_options = storage_options
        self.options = options
        self.reshard = reshard
        self._repo = None
        self._pending: dict | None = None
        self._stored: dict[int, zero.StoredStep] = {}
        self._layouts: dict[int, zero.ZeroLayout] = {}
        #: the StepInfo-like stats of this rank's part of the last save, and the step it went to
        self.last_save: dict | None = None
        self.last_step: int | None = None

    # -- plumbing
    @property
    def repo(self):
        if self._repo is None:
            self._repo = ckptstore.open(self.url, storage_options=self.storage_options, **self.options)
            T.remember_options(self._repo.url, self.storage_options, self.options)
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
        preferred = step_for_tag(info.tag, getattr(self.engine, "global_steps", 0))
        self._pending = {"tag": str(info.tag), "save_dir": os.fspath(info.save_dir), "preferred": preferred, "files": {}}

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
        tag = p["tag"]
        # Every rank calls commit, and the DCP save below is collective: whether
        # there is anything to save, whether every rank can, and the step all
        # ranks save to are agreed first (one all-reduce), so that one rank's
        # failure stops every rank instead of leaving the others waiting.
        flat, error = self._encode(p["files"])
        chosen = 0
        if error is None and _global_rank() == 0:
            try:
                chosen = self.repo.free_step(p["preferred"])
            except Exception as e:  # the store: every rank must hear of it
                error = e
        n, failed, step = _all_reduce_ints(len(p["files"]), int(error is not None), chosen)
        if failed:
            if error is not None:
                raise type(error)(f"DeepSpeed checkpoint tag {tag!r}: nothing was saved: {error}") from None
            raise CkptStoreError(f"DeepSpeed checkpoint tag {tag!r}: another rank failed before saving; nothing was saved")
        if n == 0:
            return True
        meta = {"deepspeed": self._step_meta(tag)}
        self.last_save = _dcp_save(self.url, step, flat, meta, self.storage_options, self.options)
        self.last_step = step
        # The step is committed; rank 0 moves the tag's name to it (one PUT), and
        # every rank learns the outcome before save_checkpoint returns.
        error = None
        if _global_rank() == 0:
            try:
                self.repo.set_name(NAMESPACE, tag, step)
            except ValueError:
                pass  # a tag that cannot be a checkpoint name (a '/' in it) is found by its stubs and metadata
            except Exception as e:
                error = e
        for name in p["files"]:
            T.write_stub(os.path.join(p["save_dir"], tag, name), T.stub_record(self.repo.url, step, tag, name))
        (failed,) = _all_reduce_ints(int(error is not None))
        if failed:
            what = f"DeepSpeed checkpoint tag {tag!r}: step {step} was committed, but naming it failed"
            raise type(error)(f"{what}: {error}") if error is not None else CkptStoreError(f"{what} on rank 0")
        return True

    def _encode(self, files: dict) -> tuple[dict[str, torch.Tensor], Exception | None]:
        flat: dict[str, torch.Tensor] = {}
        try:
            for name, sd in files.items():
                tensors, structure = zero.encode_file(name, sd, CODECS)
                flat.update(tensors)
                flat[zero.structure_key(name)] = structure
        except (TypeError, ValueError) as e:
            return flat, e
        return flat, None

    def _step_meta(self, tag: str) -> dict:
        e = self.engine
        stage = int(e.zero_optimization_stage()) if e is not None else 0
        return {
            "format": zero.FORMAT_VERSION,
            "tag": tag,
            "zero_stage": stage,
            "dp_world_size": int(getattr(e, "seq_dp_world_size", getattr(e, "dp_world_size", 1))) if e else 1,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "ds_version": getattr(_deepspeed, "__version__", "?"),
            **({"pipeline": pipe} if (pipe := _pipeline_layout(e)) else {}),
        }

    # -- load
    def load(self, path: str, map_location=None):
        path = os.fspath(path)
        name = os.path.basename(path)
        loading = T.LOADING.get()
        if loading is not None and loading.owner is self:
            stored = loading.stored  # the step the wrapped load_checkpoint resolved, whatever stubs say
        else:
            stub = T.read_stub(path)
            if stub is None:
                if os.path.isfile(path):
                    return _legacy_load(path, map_location)
                raise FileNotFoundError(f"{path}: no such DeepSpeed file, and no ckptstore step is being loaded")
            if stub["url"] != self.repo.url:
                raise ValueError(
                    f"{path} points to step {stub['step']} of {stub['url']!r}, but this engine is attached to "
                    f"{self.repo.url!r}; attach the engine to that repository, or load another tag"
                )
            stored = self._stored_step(stub["step"])
        out = self._reshard(stored, name)
        if out is None:
            if name not in stored.files:
                raise FileNotFoundError(
                    f"{self.url}: step {stored.step} (tag {stored.meta.get('tag')!r}) holds no DeepSpeed file {name!r}"
                )
            out = stored.read_file(name, _BY_NAME)
        return _map(out, map_location)

    def _stored_step(self, step: int) -> zero.StoredStep:
        s = self._stored.get(step)
        if s is None:
            s = self._stored[step] = zero.StoredStep(self.repo.checkpoint(step))
        return s

    def resolve_tag(self, load_dir: str, tag: str) -> int | None:
        """The committed step holding ``tag``; None for a plain DeepSpeed folder or an unknown tag.

        In order: a tag folder of DeepSpeed's own files (saved without
        ckptstore) is not a step; the tag's checkpoint name; the stubs in
        the tag folder; the step numbered as the tag's trailing integer
        whose metadata names the tag; the newest step whose metadata names
        it (steps saved before names existed load by these last three).
        """
        tag = str(tag)
        tag_dir = os.path.join(load_dir, tag)
        if _has_plain_files(tag_dir):
            return None
        try:
            named = self.repo.name_step(NAMESPACE, tag)
        except ValueError:
            named = None  # not a valid checkpoint name: never named
        steps = self.repo.steps()
        if named is not None:
            if named not in steps:
                raise StepNotFoundError(
                    f"{self.repo.url}: DeepSpeed tag {tag!r} names step {named}, which is no longer in the "
                    "repository (deleted by `ckptstore rm` or gc); load another tag"
                )
            return named
        if os.path.isdir(tag_dir):
            for f in sorted(os.listdir(tag_dir)):
                stub = T.read_stub(os.path.join(tag_dir, f))
                if stub is not None and stub["url"] == self.repo.url and stub["step"] in steps:
                    return stub["step"]
        m = re.search(r"(\d+)$", tag)
        candidates = ([int(m.group(1))] if m and int(m.group(1)) in steps else []) + list(reversed(steps))
        for s in candidates:
            md = self.repo.manifest(s).metadata
            if zero.is_deepspeed_step(md) and md["deepspeed"].get("tag") == tag:
                return s
        return None

    def latest_tag(self) -> str | None:
        for s in reversed(self.repo.steps()):
            md = self.repo.manifest(s).metadata
            if zero.is_deepspeed_step(md):
                return md["deepspeed"].get("tag")
        return None

    def write_stubs(self, load_dir: str, tag: str, step: int) -> None:
        """Stubs for every file of the step, and for this rank's model file of a resharded ZeRO-3 load.

        A file that is not a stub is never overwritten.
        """
        stored = self._stored_step(step)
        names = set(stored.files)
        if self.rebuilds(stored) and int(stored.meta.get("zero_stage", 0)) == 3:
            names.add(f"zero_pp_rank_{_dp_rank(self.engine)}_mp_rank_00_model_states.pt")
        for name in sorted(names):
            path = os.path.join(load_dir, str(tag), name)
            doc = T.stub_record(self.repo.url, step, str(tag), name)
            existing = T.read_stub(path)
            if existing is None and os.path.exists(path):
                continue
            if existing != doc:
                T.write_stub(path, doc)

    # -- another data-parallel size
    def dp_mismatch(self, stored: zero.StoredStep) -> bool:
        """The step was saved by ZeRO on another data-parallel size than this engine's."""
        if self.engine is None or int(stored.meta.get("zero_stage", 0)) not in (1, 2, 3):
            return False
        return int(stored.meta.get("dp_world_size", 1)) != _dp_world(self.engine)

    def rebuilds(self, stored: zero.StoredStep) -> bool:
        """Whether this engine re-partitions the step (``reshard``: None -> ZeRO-3 only)."""
        if not self.dp_mismatch(stored) or stored.model_parallel():
            return False  # a pipeline / model-parallel step is served as saved: DeepSpeed decides
        if self.reshard is None:
            return int(stored.meta.get("zero_stage", 0)) == 3
        return self.reshard

    def check_pipeline(self, stored: zero.StoredStep, tag: str, loads_optimizer: bool) -> None:
        """Refuse to load a pipeline step's optimizer states into stages that hold other layers.

        Each stage's optimizer states (``mp_rank_NN`` and ZeRO files) belong
        to the parameters of the layers that stage held when saving. With
        another stage count or partition, DeepSpeed hands stage 0's states to
        every stage: ``Optimizer.load_state_dict`` then fails on a parameter
        count that differs, or takes the states of other layers when the
        counts happen to agree. The layers themselves load on any partition
        (``layer_*`` files are numbered in the whole model).
        """
        saved = stored.meta.get("pipeline")
        live = _pipeline_layout(self.engine)
        if not (loads_optimizer and isinstance(saved, dict) and live) or saved.get("parts") == live["parts"]:
            return
        raise ValueError(
            f"DeepSpeed tag {tag!r} (step {stored.step} of {self.repo.url}) was saved by a pipeline of "
            f"{saved.get('stages')} stage(s) with layer boundaries {saved.get('parts')}; this engine's pipeline has "
            f"{live['stages']} stage(s) with boundaries {live['parts']}. Each stage's optimizer states belong to the "
            "layers it held when saving, so they cannot be loaded here; load the weights, learning-rate scheduler "
            "and counters with load_checkpoint(..., load_optimizer_states=False), or the weights only with "
            "load_module_only=True"
        )

    def _layout(self, stored: zero.StoredStep) -> zero.ZeroLayout:
        layout = self._layouts.get(stored.step)
        if layout is None:
            layout = self._layouts[stored.step] = zero.ZeroLayout(stored)
        return layout

    def _reshard(self, stored: zero.StoredStep, name: str):
        """The file ``name`` rebuilt for this engine's data-parallel size; None to serve it as saved."""
        if not self.rebuilds(stored):
            return None
        stage = int(stored.meta.get("zero_stage", 0))
        rank, world = _dp_rank(self.engine), _dp_world(self.engine)
        model, optim = zero.MODEL_RE.match(name), zero.OPTIM_RE.match(name)
        try:
            layout = self._layout(stored)
            if stage == 3 and model and model.group(1) is not None:
                return R.zero3_model_file(stored, layout, rank, world, _BY_NAME)
            if stage == 3 and optim:
                if int(optim.group(2)) != rank:
                    raise ValueError(f"rank {rank} asked for {name}; a resharded ZeRO-3 load serves each rank its own file")
                return R.zero3_optim_file(stored, layout, self.engine, rank, world, _BY_NAME)
            if stage != 3 and model and model.group(1) is None:
                return R.zero12_model_file(stored, layout, world, _BY_NAME)
            if stage != 3 and optim:
                return R.zero12_optim_file(stored, layout, self.engine, int(optim.group(2)), _BY_NAME)
        except NotImplementedError as e:
            raise ZeRORuntimeException(
                f"The checkpoint being loaded used a DP world size of {stored.meta.get('dp_world_size')} but the "
                f"current world size is {world}; ckptstore cannot re-partition step {stored.step} of {self.repo.url}: {e}"
            ) from None
        return None


# ============================================================== attach
def attach(
    engine, url: str | os.PathLike, storage_options: dict | None = None, reshard: bool | None = None, **options
) -> CkptStoreCheckpointEngine:
    """Route ``engine.save_checkpoint``/``load_checkpoint`` through the repository at ``url``.

    Call after ``deepspeed.initialize``, on every rank. Returns the
    :class:`CkptStoreCheckpointEngine` now set as ``engine.checkpoint_engine``.
    ``engine.load_checkpoint`` is wrapped (on this instance) to find the step
    of a tag, write its stubs and set up resharded loads; it takes the same
    arguments and returns what DeepSpeed returns. The ``zero_to_fp32.py``
    DeepSpeed copies into the save folder is ckptstore's (same arguments,
    same output, read from the repository).

    ``reshard`` decides what a ZeRO step saved on another data-parallel
    size does when optimizer states are loaded: ``None`` (default) ZeRO-3
    steps are re-partitioned, ZeRO-1/2 steps behave as DeepSpeed (which
    raises ``ZeRORuntimeException``); ``True`` both are re-partitioned;
    ``False`` both behave as DeepSpeed. Without optimizer states
    (``load_optimizer_states=False``, ``load_module_only=True``) any ZeRO
    step loads on any DP size.
    """
    ce = CkptStoreCheckpointEngine(url, engine=engine, storage_options=storage_options, reshard=reshard, **options)
    engine.checkpoint_engine = ce
    T.install()
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
        stored = current._stored_step(step)
        current.check_pipeline(stored, tag, _loads_optimizer(engine, original, load_dir, tag, args, kwargs))
        current.write_stubs(load_dir, tag, step)
        if dist.is_initialized():
            dist.barrier()
        token = T.LOADING.set(T.Loading(current, step, stored))
        try:
            return original(load_dir, tag, *args, **kwargs)
        except ZeRORuntimeException as e:
            if current.dp_mismatch(stored) and not current.rebuilds(stored):
                hint = NO_RESHARD_HINT if stored.model_parallel() else RESHARD_HINT
                raise ZeRORuntimeException(f"{e} (ckptstore: {hint})") from None
            raise
        finally:
            T.LOADING.reset(token)

    load_checkpoint._ckptstore_original = original
    engine.load_checkpoint = load_checkpoint

    copy_original = getattr(engine._copy_recovery_script, "_ckptstore_original", engine._copy_recovery_script)

    def copy_recovery_script(save_path):
        copy_original(save_path)
        if isinstance(engine.checkpoint_engine, CkptStoreCheckpointEngine):
            T.write_script(save_path)

    copy_recovery_script._ckptstore_original = copy_original
    engine._copy_recovery_script = copy_recovery_script
    return ce


def consolidated_state_dict(url: str, step: int | None = None, storage_options: dict | None = None, **options) -> dict:
    """Full fp32 weights of a ZeRO step, by parameter name (what ``zero_to_fp32.py`` gives)."""
    with ckptstore.open(url, storage_options=storage_options, **options) as repo:
        step = repo.latest() if step is None else step
        if step is None:
            raise StepNotFoundError(f"{url}: the repository has no committed step")
        layout = zero.ZeroLayout(zero.StoredStep(repo.checkpoint(step)))
        return OrderedDict((name, read()) for name, _, _, read in layout.consolidated())


# ============================================================== helpers
def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


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


def _pipeline_layout(engine) -> dict | None:
    """The stage count and layer boundaries of the engine's ``PipelineModule``; None without one."""
    module = getattr(engine, "module", None)
    if not isinstance(module, PipelineModule):
        return None
    return {"stages": int(module.num_stages), "parts": [int(p) for p in module.parts]}


def _loads_optimizer(engine, load_checkpoint, load_dir, tag, args, kwargs) -> bool:
    """Whether DeepSpeed's ``load_checkpoint`` called with these arguments loads optimizer states."""
    try:
        bound = inspect.signature(load_checkpoint).bind(load_dir, tag, *args, **kwargs)
    except TypeError:
        return False  # DeepSpeed raises its own error for these arguments
    bound.apply_defaults()
    a = bound.arguments
    return (
        getattr(engine, "optimizer", None) is not None
        and bool(a.get("load_optimizer_states", True))
        and not a.get("load_module_only", False)
    )


def _has_plain_files(tag_dir: str) -> bool:
    """The tag folder holds DeepSpeed model-states files that are not ckptstore stubs."""
    if not os.path.isdir(tag_dir):
        return False
    for f in os.listdir(tag_dir):
        path = os.path.join(tag_dir, f)
        if f.endswith("_model_states.pt") and os.path.isfile(path) and T.read_stub(path) is None:
            return True
    return False


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


T.install()
