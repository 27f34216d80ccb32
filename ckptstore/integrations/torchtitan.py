"""torchtitan: its checkpoints as the steps of a ckptstore repository, with one flag.

::

    torchrun ... -m torchtitan.train --module llama3 --config llama3_8b \\
        --override.imports ckptstore.integrations.torchtitan.ckptstore_checkpoint \\
        --checkpoint.enable --checkpoint.folder s3://bucket/run

How it plugs in: torchtitan 0.3.0 swaps a component through an
``@override`` factory named in ``--override.imports``.
:func:`ckptstore_checkpoint` replaces the config of torchtitan's own
``CheckpointManager`` by a :class:`CkptStoreCheckpointManager.Config` (every
field copied, plus the repository options), whose ``build`` makes a
:class:`CkptStoreCheckpointManager`: torchtitan's ``CheckpointManager``
(save interval, first-step and last-step saves, ``load_only``,
``exclude_from_loading``, ``initial_load_*``, ``last_save_model_only``,
``export_dtype``, async modes, the state it saves) whose storage is the
repository at ``checkpoint.folder``:

- every save is step N of the repository, written by
  :class:`~ckptstore.dcp.CkptStoreWriter` (dedup against the previous step,
  compression, one atomic commit); ``async_mode="async"`` through
  ``dcp.async_save`` on torchtitan's gloo group;
- the newest checkpoint comes from the repository's catalog (one listing by
  rank 0, shared with the other ranks), ``load_step=N`` names a step, and
  loads read through :class:`~ckptstore.dcp.CkptStoreReader`;
- ``keep_latest_k`` is a retention policy: after each save, rank 0 runs
  ckptstore's GC on a thread of its own (safe with concurrent savers; the
  step this job loaded is kept);
- ``last_save_in_hf`` commits the last step under the Hugging Face names of
  torchtitan's state-dict adapter and exports it to ``model.safetensors``
  (``ckptstore export``).

Saving a step that exists (a rerun from an older ``load_step``) commits the
new state as a step of its own (one past the newest) and points the
checkpoint name ``step-N`` at it (name space ``torchtitan``), as the
Lightning and DeepSpeed integrations do: ``load_step=N`` and the newest
checkpoint then load the new state, the earlier state stays until
retention removes it, and the log says so. See
``docs/integrations/torchtitan.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from typing import Any

try:
    from torchtitan.components.checkpointer import dcp as _tt_dcp
    from torchtitan.components.checkpointer.base import MODEL
    from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager
    from torchtitan.config import derive, override
    from torchtitan.tools import filesystem as _tt_fs
except ImportError as _e:  # tested in a subprocess where torchtitan cannot be imported
    raise ImportError(
        "ckptstore.integrations.torchtitan needs torchtitan 0.3: pip install 'ckptstore[torchtitan]' "
        f"(importing it failed: {_e})"
    ) from _e

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import ckptstore
from ckptstore.dcp import CkptStoreReader, CkptStoreWriter, split_checkpoint_id
from ckptstore.errors import CkptStoreError

__all__ = [
    "CkptStoreCheckpointManager",
    "ckptstore_checkpoint",
    "checkpoint_steps",
    "METADATA_KEY",
    "NAMESPACE",
]

#: Metadata key of every step this integration commits.
METADATA_KEY = "torchtitan"
METADATA_FORMAT = 1
#: Name space of the checkpoint names (``step-N``) of steps saved again.
NAMESPACE = "torchtitan"


def _log():
    # torchtitan's checkpointer logger, looked up on its module (as its own code does)
    return _tt_dcp.logger


def _name(step: int) -> str:
    return f"step-{step}"


def _step_of_name(name: str) -> int | None:
    head, _, tail = name.partition("-")
    return int(tail) if head == "step" and tail.isdigit() else None


# ---------------------------------------------------------------- checkpoints of a repository
def _checkpoint_map(steps: list[int], names: dict[str, int]) -> dict[int, int]:
    """torchtitan step -> repository step, from the committed steps and the ``step-N`` names.

    A step is torchtitan's step N of the same number unless a name says
    otherwise: a name ``step-N`` points at the step that holds N when N was
    saved again (the step numbered N then holds the earlier state and no
    longer counts), and a step a name points at holds that name's N.
    """
    committed = set(steps)
    named = {}
    for name, s in names.items():
        n = _step_of_name(name)
        if n is not None and s in committed:
            named[n] = s
    targets = set(named.values())
    out = {s: s for s in steps if s not in targets and s not in named}
    out.update(named)
    return out


def checkpoint_steps(url, storage_options: dict | None = None, repo=None) -> dict[int, int]:
    """The checkpoints a repository holds for torchtitan: ``{torchtitan step: repository step}``.

    What a listing of torchtitan's ``step-N`` folders shows, for a
    repository: usually each committed step as itself; a step saved again
    (see the module docstring) under the number torchtitan gave it.
    """
    if repo is None:
        with ckptstore.open(os.fspath(url), storage_options=storage_options) as r:
            return checkpoint_steps(url, repo=r)
    steps = repo.steps()
    names = repo.names(NAMESPACE) if steps else {}
    return _checkpoint_map(steps, names)


# ---------------------------------------------------------------- the override
@override(target=CheckpointManager.Config, description="torchtitan checkpoints in a ckptstore repository")
def ckptstore_checkpoint(cfg: CheckpointManager.Config, **options) -> "CkptStoreCheckpointManager.Config":
    """The override ``--override.imports ckptstore.integrations.torchtitan.ckptstore_checkpoint`` applies.

    Every field of torchtitan's ``CheckpointManager.Config`` is kept;
    ``options`` (from ``'...ckptstore_checkpoint={"cache_dir": "/nvme"}'``
    on the command line) set the fields :class:`CkptStoreCheckpointManager.Config`
    adds. Another checkpoint manager's config (torchtitan's TorchFT one,
    say) is refused: its manager does more than storage.
    """
    ours = CkptStoreCheckpointManager.Config
    if not isinstance(cfg, ours) and type(cfg) is not CheckpointManager.Config:
        raise ValueError(
            f"ckptstore_checkpoint replaces torchtitan's own CheckpointManager; this job's checkpoint config is a "
            f"{type(cfg).__module__}.{type(cfg).__qualname__}, whose manager does more than store checkpoints. "
            "Drop the override, or give that manager a storage writer of its own"
        )
    known = {f.name for f in fields(ours)} - {f.name for f in fields(CheckpointManager.Config)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"ckptstore_checkpoint: unknown option(s) {unknown}; known: {sorted(known)}")
    return derive(cfg, ours, **options)


# ---------------------------------------------------------------- the manager
class CkptStoreCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` storing its checkpoints as steps of a ckptstore repository.

    Built by torchtitan from :class:`Config` (``--override.imports
    ckptstore.integrations.torchtitan.ckptstore_checkpoint``, or a
    config registry function that sets ``checkpoint=CkptStoreCheckpointManager.Config(...)``).
    ``checkpoint.folder`` (joined to ``dump_folder`` when relative, as
    torchtitan does) is the repository URL. A ``CheckpointManager.Config``
    given directly is taken as :func:`ckptstore_checkpoint` converts it.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        storage_options: dict[str, str] = field(default_factory=dict)
        """Backend options of the repository, as for ``ckptstore.open`` (S3: ``endpoint_url``,
        ``region_name``...; credentials come from the AWS conventions otherwise)."""

        cache_dir: str | None = None
        """A node-local tier shared by the node's ranks (``docs/tier.md``)."""

        cache_size: str | None = None
        """The tier's budget, ``"200GB"`` or bytes."""

        write_back: bool = False
        """With ``cache_dir``: a save returns once durable in the tier; the upload continues."""

        replicas: int = 0
        """1: copy each save's new packs to another node's tier (needs ``cache_dir``)."""

        repo_options: dict[str, int | float | str] = field(default_factory=dict)
        """Repository tunables (``chunk_size``, ``workers``, ``grace``...)."""

        hf_folder: str | None = None
        """Where ``last_save_in_hf`` writes ``step-N/model.safetensors``: default the checkpoint
        folder when it is a local path, else ``<dump_folder>/hf``."""

        def __post_init__(self) -> None:
            # torchtitan refuses last_save_in_hf with a remote folder (its HF
            # writer is local-only); here the safetensors file comes from the
            # repository through ckptstore export, wherever it is.
            hf, self.last_save_in_hf = self.last_save_in_hf, False
            try:
                CheckpointManager.Config.__post_init__(self)
            finally:
                self.last_save_in_hf = hf
            if hf and not self.last_save_model_only:
                raise ValueError("last_save_in_hf requires last_save_model_only=True.")
            if isinstance(self.replicas, bool) or self.replicas not in (0, 1):
                raise ValueError(f"checkpoint.replicas must be 0 or 1, got {self.replicas!r}")
            if (self.write_back or self.replicas) and not self.cache_dir:
                raise ValueError("checkpoint.write_back and checkpoint.replicas need checkpoint.cache_dir")
            if self.hf_folder and _tt_fs.is_remote(self.hf_folder):
                raise ValueError(f"checkpoint.hf_folder must be a local path (the safetensors file is written there), "
                                 f"got {self.hf_folder!r}")

    def __init__(self, config, **kwargs) -> None:
        if type(config) is CheckpointManager.Config:
            config = ckptstore_checkpoint(config)
        if not isinstance(config, CkptStoreCheckpointManager.Config):
            raise TypeError(f"CkptStoreCheckpointManager needs a CkptStoreCheckpointManager.Config, got {type(config)}")
        self._retention = None
        self._writers: list[CkptStoreWriter] = []
        self._inflight: Future | None = None
        pinned = config.async_mode.lower() == AsyncMode.ASYNC_WITH_PINNED_MEM.value
        if config.enable and pinned and not torch.cuda.is_available():
            raise ValueError(
                "checkpoint.async_mode='async_with_pinned_mem' stages CUDA tensors into pinned host memory and saves "
                "from another process; this process has no CUDA device (torch.cuda.is_available() is False). "
                "Use --checkpoint.async_mode async (a copy in host memory, saved from a thread) on CPU"
            )
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        if self.purge_thread is not None:  # torchtitan's purge thread deletes step folders: GC does it here
            self.purge_queue.put(None)
            self.purge_thread.join()
            self.purge_thread = None
        self.url = self.folder
        self._options = _repo_options(config)
        self._storage_options = dict(config.storage_options) or None
        self._hf_folder = config.hf_folder
        self._base_folder = kwargs.get("base_folder", "")
        self._loaded_step: int | None = None
        self._load_ids: dict[str, tuple[str, int]] = {}
        self._lock = threading.Lock()
        self._catalog = None
        self._distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._leader = not self._distributed or dist.get_rank() == 0
        # rank 0's catalog answers (the newest step, the step a save takes) go to every
        # rank over a gloo group of their own, so no rank waits on an accelerator stream
        self._coord = dist.new_group(backend="gloo") if self._distributed else None
        if self.keep_latest_k > 0 and self._leader:
            self._retention = _Retention(self._open, self.keep_latest_k)
        _log().info(f"Checkpoints go to the ckptstore repository {self.url}")

    # -- repository handles
    def _open(self):
        return ckptstore.open(self.url, storage_options=self._storage_options, **self._catalog_options())

    def _catalog_options(self) -> dict:
        return {k: v for k, v in self._options.items() if k not in ("write_back", "replicas")}

    def catalog(self):
        """Rank 0's handle on the repository (catalog questions; opened on first use)."""
        with self._lock:
            if self._catalog is None:
                self._catalog = self._open()
            return self._catalog

    def _shared(self, fn):
        """``fn()`` on rank 0 only; its JSON result (or its error) on every rank."""
        if not self._distributed:
            return fn()
        if dist.get_rank() == 0:
            try:
                value = fn()
            except Exception as e:
                _broadcast_json({"error": [type(e).__name__, str(e)]}, self._coord)
                raise
            _broadcast_json({"ok": value}, self._coord)
            return value
        doc = _broadcast_json(None, self._coord)
        if "error" in doc:
            kind, msg = doc["error"]
            if kind in _REMOTE_ERRORS:
                raise _REMOTE_ERRORS[kind](msg)
            raise CkptStoreError(f"rank 0: {kind}: {msg}")
        return doc["ok"]

    # -- saving
    @torch.no_grad()
    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        """Commit ``state_dict`` as the step ``checkpoint_id`` (``<folder>/step-N``) names (see the class)."""
        _, train_step = split_checkpoint_id(checkpoint_id)
        if train_step is None:
            raise ValueError(f"checkpoint id {checkpoint_id!r} names no step (expected .../step-N)")
        self._close_writers()
        if to_hf:
            assert self.sd_adapter is not None, "sd_adapter is required for to_hf=True"
            state_dict = self.sd_adapter.to_hf(state_dict)
        step = self._shared(lambda: self._claim(train_step))
        model_only = MODEL not in self.states or not any(k in state_dict for k in self.states if k != MODEL)
        meta = {METADATA_KEY: {"format": METADATA_FORMAT, "step": train_step, "hf": bool(to_hf),
                               "model_only": bool(model_only)}}
        writer = CkptStoreWriter(
            self.url, step=step, storage_options=self._storage_options, metadata=meta,
            process_group=self.pg if async_mode == AsyncMode.ASYNC else None, **self._options,
        )
        self._writers.append(writer)
        cid = f"{self.url.rstrip('/')}/step-{step}"
        if async_mode in (AsyncMode.ASYNC, AsyncMode.ASYNC_WITH_PINNED_MEM):
            ret = self._async_save(state_dict, writer, cid, async_mode, train_step, step)
        else:
            dcp.save(state_dict, storage_writer=writer, checkpoint_id=cid)
            if step != train_step:
                self._shared(lambda: self._name(train_step, step))
            if to_hf:
                self._shared(lambda: self._export_hf(train_step, step))
            ret = None
        if enable_garbage_collection:
            from torchtitan.tools.utils import GarbageCollection

            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def _async_save(self, state_dict, writer, cid: str, async_mode, train_step: int, step: int):
        """``dcp.async_save`` of one step; the future torchtitan waits on ends once the step is committed
        (and, for a step saved again, named); retention runs after it."""
        pinned = async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
        extra = {}
        if pinned:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            extra = {"async_checkpointer_type": AsyncCheckpointerType.PROCESS, "async_stager": self.stager}
        ret = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=cid, process_group=self.pg, **extra)
        fut = ret.upload_completion if pinned else ret
        if step != train_step:
            fut = _then(fut, lambda: self._name(train_step, step))
            ret = AsyncSaveResponse(staging_completion=ret.staging_completion, upload_completion=fut) if pinned else fut
        with self._lock:
            self._inflight = fut
        fut.add_done_callback(self._async_done)
        return ret

    def _async_done(self, fut: Future) -> None:
        """An async save ended (on DCP's thread): ask for retention if it committed."""
        with self._lock:
            if self._inflight is fut:
                self._inflight = None
        if fut.cancelled() or fut.exception() is not None:
            return  # maybe_wait_for_saving and close() raise its error
        if self._retention is not None and self._should_purge():
            self._retention.request(self._loaded_step)

    def _claim(self, train_step: int) -> int:
        """The repository step a save of torchtitan's step ``train_step`` commits (rank 0)."""
        repo = self.catalog()
        step = repo.free_step(train_step)
        if step != train_step:
            _log().warning(
                f"Checkpoint step-{train_step} already exists in {self.url} (saved earlier, e.g. by a run this one "
                f"restarted from an older step); committed steps are never overwritten, so this save becomes "
                f"repository step {step} and the name step-{train_step} moves to it once committed: "
                f"--checkpoint.load_step={train_step} and the newest checkpoint load the new state, and the earlier "
                f"step {train_step} stays until keep_latest_k or `ckptstore gc` removes it."
            )
        return step

    def _name(self, train_step: int, step: int) -> None:
        """Point the name ``step-N`` at the step that holds torchtitan's step N (rank 0, after the commit)."""
        if self._leader:
            self.catalog().set_name(NAMESPACE, _name(train_step), step)
            _log().info(f"Checkpoint step-{train_step} is repository step {step} of {self.url}")

    def _should_purge(self) -> bool:
        try:
            rank = dist.get_rank()
        except (ValueError, RuntimeError):  # no process group: one process
            rank = 0
        return self.keep_latest_k > 0 and rank == 0

    def _purge_stale_checkpoints(self) -> None:
        # an async save asks for retention once its step is committed (_async_done)
        if self._inflight is None and self._retention is not None and self._should_purge():
            self._retention.request(self._loaded_step)

    def _export_hf(self, train_step: int, step: int) -> str:
        folder = self._hf_folder
        if not folder:
            folder = self.url if not _tt_fs.is_remote(self.url) else os.path.join(self._base_folder, "hf")
        out_dir = os.path.join(folder, _name(train_step))
        os.makedirs(out_dir, exist_ok=True)
        out = os.path.join(out_dir, "model.safetensors")
        self.catalog().export(step, out)
        _log().info(f"Exported step-{train_step} (repository step {step}) in Hugging Face names to {out}")
        return out

    def _close_writers(self) -> None:
        """Release the writers of earlier saves, all finished by now (each waits for its replicas)."""
        for w in self._writers:
            w.close()
        self._writers = []

    # -- loading
    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        plan = self._shared(lambda: self._plan_load(step))
        kind = plan["kind"]
        model_only = from_hf = from_quantized = False
        if kind == "fresh":
            _log().info("No checkpoint was provided, this is a fresh start.")
            return False
        if plan.get("initial"):
            model_only, from_hf, from_quantized = (
                self.initial_load_model_only, self.initial_load_in_hf, self.initial_load_in_hf_quantized)
        else:
            model_only = plan["train_step"] == 0
        checkpoint_id = plan["id"]
        if kind == "repo":
            self._load_ids[checkpoint_id] = (plan["url"], plan["step"])
            if plan["url"] == self.url:
                self._loaded_step = plan["step"]
        _log().info(f"Loading the checkpoint from {checkpoint_id}.")
        begin = time.monotonic()
        states = self._states_to_load(model_only)
        self.dcp_load(states, checkpoint_id=checkpoint_id, from_hf=from_hf, from_quantized=from_quantized)
        from torchtitan.tools.utils import GarbageCollection

        GarbageCollection.collect("GC collection for checkpoint loading.")
        _log().info(f"Finished loading the checkpoint in {time.monotonic() - begin:.2f} seconds.")
        return True

    def _plan_load(self, step: int) -> dict:
        """What to load (rank 0): a repository step, a plain DCP folder (or HF assets), or nothing."""
        repo = self.catalog()
        steps = repo.steps()  # the job's one listing of the steps (and of the names, if any)
        ckpts = _checkpoint_map(steps, repo.names(NAMESPACE) if steps else {})
        legacy = self._legacy_steps() if not ckpts else {}
        if step != -1:
            if step in ckpts:
                return self._repo_plan(self.url, ckpts[step], step)
            if step in legacy:
                return {"kind": "dcp", "id": legacy[step], "train_step": step}
            held = sorted(ckpts) or sorted(legacy)
            raise FileNotFoundError(
                f"--checkpoint.load_step={step} not found: the checkpoint folder {self.url} "
                + (f"holds steps {held}" if held else "holds no checkpoint")
            )
        if ckpts:
            newest = steps[-1]  # the most recent save (a step saved again is one past the newest)
            train_step = next((n for n, s in ckpts.items() if s == newest), newest)
            return self._repo_plan(self.url, newest, train_step)
        if legacy:
            n = max(legacy)
            return {"kind": "dcp", "id": legacy[n], "train_step": n}
        return self._initial_plan()

    def _repo_plan(self, url: str, step: int, train_step: int) -> dict:
        return {"kind": "repo", "url": url, "step": step, "train_step": train_step,
                "id": f"{url.rstrip('/')}/step-{step}"}

    def _legacy_steps(self) -> dict[int, str]:
        """torchtitan's own ``step-N`` DCP folders in a local checkpoint folder (a run that saved before ckptstore)."""
        if _tt_fs.is_remote(self.url) or not os.path.isdir(self.url):
            return {}
        out = {}
        for entry in os.listdir(self.url):
            n = _step_of_name(entry)
            path = os.path.join(self.url, entry)
            if n is not None and (os.path.isfile(os.path.join(path, ".metadata"))
                                  or os.path.isfile(os.path.join(path, "model.safetensors.index.json"))):
                out[n] = path
        return out

    def _initial_plan(self) -> dict:
        path = self.initial_load_path
        if not path and self.initial_load_in_hf:  # torchtitan's own rule: the model's Hugging Face assets
            assets = getattr(self.sd_adapter, "hf_assets_path", None)
            if not assets:
                raise ValueError("checkpoint.initial_load_in_hf without initial_load_path needs the model's "
                                 "hf_assets_path (a folder of safetensors files)")
            if not _tt_fs.isdir(assets):
                raise ValueError(
                    "model.hf_assets_path is being used to load HF weights but the path is not valid. Either make "
                    "sure hf_assets_path is correct or provide a valid checkpoint.initial_load_path"
                )
            return {"kind": "dcp", "id": assets, "initial": True}
        if not path:
            return {"kind": "fresh"}
        url, step = split_checkpoint_id(path)
        try:
            repo = ckptstore.open(url, storage_options=self._storage_options)
        except ImportError:  # no client for that store here: not a repository this process can read
            repo = None
        with repo or contextlib.nullcontext():
            if repo is not None and repo.exists():
                ckpts = checkpoint_steps(url, repo=repo)
                if step is None and ckpts:  # a repository: its most recent save
                    n, s = max(ckpts.items(), key=lambda kv: kv[1])
                    return {**self._repo_plan(url, s, n), "initial": True}
                if step in ckpts:
                    return {**self._repo_plan(url, ckpts[step], step), "initial": True}
                raise ValueError(
                    f"Checkpoint.initial_load_path is invalid: {path} (the repository at {url} holds "
                    + (f"steps {sorted(ckpts)})" if ckpts else "no step)")
                )
        if not _tt_fs.isdir(path):
            raise ValueError(f"Checkpoint.initial_load_path is invalid: {path}")
        return {"kind": "dcp", "id": path, "initial": True}

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized) -> None:
        """Load a repository step through ``CkptStoreReader``; a plain DCP folder as torchtitan does."""
        target = self._load_ids.get(checkpoint_id)
        if target is None:
            return super().dcp_load(state_dict, checkpoint_id=checkpoint_id, from_hf=from_hf,
                                    from_quantized=from_quantized)
        url, step = target
        reader = CkptStoreReader(url, step=step, storage_options=self._storage_options, **self._catalog_options())
        try:
            if from_hf:
                assert self.sd_adapter is not None, "loading Hugging Face names needs the model's sd_adapter"
                hf_state_dict = self.sd_adapter.to_hf(state_dict)
                dcp.load(hf_state_dict, storage_reader=reader, checkpoint_id=checkpoint_id)
                self.states[MODEL].load_state_dict(self.sd_adapter.from_hf(hf_state_dict))
            else:
                dcp.load(state_dict, storage_reader=reader, checkpoint_id=checkpoint_id)
                if MODEL in self.states:
                    self.states[MODEL].load_state_dict(state_dict)
        finally:
            reader.close()

    def _find_load_step(self, folder: str = "") -> int:
        """torchtitan's newest step in ``folder`` (this repository by default), or -1."""
        folder = folder or self.url
        ckpts = checkpoint_steps(folder, self._storage_options)
        return max(ckpts) if ckpts else -1

    # -- waiting and closing
    def _close(self) -> None:
        """Wait for a save in flight and for retention; flush write-back and replicas; release everything."""
        errors = []
        if getattr(self, "save_future", None) is not None:
            try:
                self.save_future.result()
            except Exception as e:  # noqa: BLE001 - reported after the rest is released
                errors.append(e)
            self.save_future = None
        options = getattr(self, "_options", {})
        if getattr(self, "_writers", None) and (options.get("write_back") or options.get("replicas")):
            try:
                self._writers[-1].flush()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        for w in getattr(self, "_writers", []):
            w.close()
        self._writers = []
        if getattr(self, "_retention", None) is not None:
            self._retention.close()
            self._retention = None
        if getattr(self, "_catalog", None) is not None:
            self._catalog.close()
            self._catalog = None
        super()._close()
        if errors:
            raise errors[0]


#: Errors rank 0 reports that the other ranks raise as the same built-in type.
_REMOTE_ERRORS = {"FileNotFoundError": FileNotFoundError, "ValueError": ValueError, "TypeError": TypeError}


def _broadcast_json(doc, group):
    """Rank 0's JSON document on every rank of ``group`` (a gloo group): a length, then UTF-8 bytes; no pickle."""
    if dist.get_rank() == 0:
        data = json.dumps(doc).encode("utf-8")
        n = torch.tensor([len(data)], dtype=torch.int64)
    else:
        n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, src=0, group=group)
    if dist.get_rank() == 0:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    return doc if dist.get_rank() == 0 else json.loads(bytes(buf.tolist()).decode("utf-8"))


def _then(fut: Future, fn) -> Future:
    """A future that ends when ``fut`` has and ``fn()`` has run after it (its error, or ``fut``'s)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            f.result()
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            out.set_exception(e)
        else:
            out.set_result(None)

    fut.add_done_callback(done)
    return out


def _repo_options(config) -> dict:
    out = dict(config.repo_options)
    for name in ("cache_dir", "cache_size"):
        if getattr(config, name):
            out[name] = getattr(config, name)
    if config.write_back:
        out["write_back"] = True
    if config.replicas:
        out["replicas"] = config.replicas
    return out


class _Retention:
    """``keep_latest_k`` as a retention policy: ckptstore's GC on rank 0's thread, once per request.

    Keeps the newest ``keep`` checkpoints (a step whose torchtitan step was
    saved again later no longer counts), the step this job loaded, and every
    tagged step; GC's own rules keep the newest step and protect savers in
    flight. A failed run is logged and the next request runs again, as
    torchtitan's purge thread does.
    """

    def __init__(self, open_repo, keep: int):
        self.keep = keep
        self._open = open_repo
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ckptstore-titan-retention", daemon=True)
        self._thread.start()

    def request(self, protect: int | None) -> None:
        self._queue.put(("gc", protect))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        repo = None
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                while not self._queue.empty():  # requests that piled up: one run serves them
                    nxt = self._queue.get()
                    if nxt is None:
                        self._queue.put(None)
                        break
                    item = nxt
                try:
                    repo = repo or self._open()
                    self.run_once(repo, item[1])
                except Exception as e:  # noqa: BLE001 - logged; the next save asks again
                    _log().warning(f"ckptstore retention (keep_latest_k={self.keep}) failed: {type(e).__name__}: {e}")
        finally:
            if repo is not None:
                repo.close()

    def run_once(self, repo, protect: int | None) -> list[int]:
        """One GC run; returns the steps it deleted."""
        begin = time.monotonic()
        steps = repo.steps()
        names = repo.names(NAMESPACE)
        ckpts = _checkpoint_map(steps, names)
        current = sorted(ckpts.values())
        keep = set(current[-self.keep:])
        if protect is not None:
            keep.add(protect)
        result = repo.plan_gc(keep_steps=sorted(keep & set(steps)), keep_tags=True).execute()
        left = set(repo.steps())
        for name, s in names.items():
            if s not in left:
                repo.drop_name(NAMESPACE, name)
        if result.deleted_steps:
            _log().info(
                f"keep_latest_k={self.keep}: deleted steps {result.deleted_steps} of {repo.url} "
                f"(kept {sorted(left)}) in {time.monotonic() - begin:.2f} seconds."
            )
        return list(result.deleted_steps)
