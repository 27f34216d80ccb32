"""Megatron-Core's own ``tests/unit_tests/dist_checkpointing`` on the CPU, as written and with ckptstore.

Imported by ``sitecustomize`` when ``CKPTSTORE_SUITE_FRAMEWORK=megatron``
(``run.py megatron``), in every Python process of the run: the pytest
process of each rank and the workers Megatron's ``AsyncCallsQueue`` starts
(forked, or spawned for the persistent worker).

Both sides get the same small CUDA shim (the tests are written for one GPU
per rank and NCCL):

- ``init_process_group``/``new_group`` with ``backend="nccl"`` use gloo, with a
  timeout of at most ``CKPTSTORE_SUITE_PG_TIMEOUT`` seconds (45) instead of
  30 minutes, so a rank left alone by a failed peer fails the test instead of
  the run; a group of ranks and options already made is returned again (Megatron
  makes ~30 groups per test and never destroys them; each gloo group keeps
  threads);
- ``torch.cuda.set_device``, ``synchronize``, ``empty_cache`` do nothing,
  ``current_device()`` is ``"cpu"``, ``device_count()`` is the number of
  ranks (``Utils`` takes ``rank % device_count()``);
- ``Tensor.cuda()`` and ``Module.cuda()`` return the tensor/module as it is;
- ``megatron.core.utils.is_te_min_version`` is False without Transformer
  Engine (a GPU package not installed here; the tests' autouse ``set_env``
  fixture compares its version, ``None``, and raised ``TypeError`` in every
  test);
- ``typing.override`` is ``typing_extensions.override`` on Python 3.11
  (Megatron-LM 0.19's training package, which its tests import, uses the
  3.12 name; megatron-core 0.19.2 declares Python >= 3.12);
- the CUDA RNG state calls of Megatron's ``CudaRNGStatesTracker``
  (``get_rng_state``/``set_rng_state``, ``manual_seed``) use the CPU
  generator.

The ckptstore side (``CKPTSTORE_SUITE_DIR`` set) makes ckptstore's
strategies Megatron's defaults, the way a user who never names a strategy
gets them: every ``dist_checkpointing.save`` without a strategy (or with
``("torch_dist", 1)``), every ``get_default_save_sharded_strategy()`` and, on
0.16, every ``get_default_strategy(SAVE_SHARDED, "torch_dist", ...)`` gets
``ckpt_mg.save_strategy(url)`` of the test's own repository; every load
without a strategy of a folder saved through ckptstore gets
``ckpt_mg.load_strategy`` of the repository its ``ckptstore.json`` names
(0.16: also ``get_default_strategy(LOAD_SHARDED, "ckptstore", ...)``).
A strategy a test builds itself (``TorchDistSaveShardedStrategy(...)``)
stays Megatron's. The tests' checkpoint folders are not named ``iter_N``:
each save into such a folder takes the next step of the test's repository
(a counter of this process; every rank makes the same saves in the same
order), as ``step=`` would.
"""

from __future__ import annotations

import inspect
import json
import os
from datetime import timedelta
from pathlib import Path

#: under the 60 s of the tests' rendezvous: a rank stuck in a collective its peer left gives up
#: before the peer, already in the next test, stops waiting for it
_PG_TIMEOUT = float(os.environ.get("CKPTSTORE_SUITE_PG_TIMEOUT") or 45)


# ------------------------------------------------------------------ the CUDA shim (both sides)
def _patch_torch(torch):
    if getattr(torch, "_ckptstore_cpu_shim", False):
        return
    torch._ckptstore_cpu_shim = True
    cuda = torch.cuda
    world = int(os.environ.get("WORLD_SIZE") or 1)
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.memory.empty_cache = cuda.empty_cache
    cuda.current_device = lambda: "cpu"
    cuda.device_count = lambda: max(1, world)
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None

    def tensor_cuda(self, *a, **k):
        return self

    def module_cuda(self, *a, **k):
        return self

    torch.Tensor.cuda = tensor_cuda
    torch.nn.Module.cuda = module_cuda


def _patch_mcore_utils(mod):
    original = mod.is_te_min_version
    if getattr(original, "_ckptstore_cpu_shim", False):
        return

    def is_te_min_version(version, check_equality=True):
        if mod.get_te_version() is None:
            return False
        return original(version, check_equality)

    is_te_min_version._ckptstore_cpu_shim = True
    mod.is_te_min_version = is_te_min_version


def _gloo(kwargs, args, pos):
    """``backend`` (keyword, or positional ``pos``) nccl -> gloo; a default timeout."""
    args = list(args)
    if len(args) > pos and isinstance(args[pos], str) and "nccl" in args[pos]:
        args[pos] = "gloo"
    b = kwargs.get("backend")
    if isinstance(b, str) and "nccl" in b:
        kwargs["backend"] = "gloo"
    kwargs.pop("pg_options", None)
    cap = timedelta(seconds=_PG_TIMEOUT)
    # Megatron passes its own (30 minutes: distributed_timeout_minutes); capped, or a rank its peer
    # left in a broadcast waits there half an hour while the peer runs the next tests
    at = 1 if pos == 2 else 2  # new_group(ranks, timeout, ...), init_process_group(backend, init_method, timeout, ...)
    if len(args) > at:
        args[at] = min(args[at] or cap, cap)
    else:
        kwargs["timeout"] = min(kwargs.get("timeout") or cap, cap)
    return args, kwargs


def _patch_c10d(c10d):
    if getattr(c10d.init_process_group, "_ckptstore_cpu_shim", False):
        return
    init, new_group, destroy = c10d.init_process_group, c10d.new_group, c10d.destroy_process_group
    # Megatron's initialize_model_parallel makes some 30 groups per test and never destroys them;
    # each gloo group keeps threads of its own (5,000 threads per rank a third into the run, the
    # machine crawling): a group of the same ranks and options is made once per default group.
    # Every rank makes the same calls in the same order, so every rank gets the same groups.
    groups: dict = {}

    def init_process_group(*args, **kwargs):
        args, kwargs = _gloo(kwargs, args, 0)
        kwargs.pop("device_id", None)
        groups.clear()
        return init(*args, **kwargs)

    def new_group_(*args, **kwargs):
        args, kwargs = _gloo(kwargs, args, 2)  # new_group(ranks, timeout, backend, pg_options, ...)
        ranks = kwargs.get("ranks", args[0] if args else None)
        opts = {k: v for k, v in kwargs.items() if k not in ("ranks", "group_desc")}
        key = (None if ranks is None else tuple(ranks), tuple(map(repr, args[1:])), repr(sorted(opts.items())))
        if key not in groups:
            groups[key] = new_group(*args, **kwargs)
        return groups[key]

    def destroy_process_group(group=None):
        if group is None:
            groups.clear()
        else:
            for k in [k for k, g in groups.items() if g is group]:
                del groups[k]
        return destroy(group)

    for f in (init_process_group, new_group_, destroy_process_group):
        f._ckptstore_cpu_shim = True
    c10d.init_process_group, c10d.new_group = init_process_group, new_group_
    c10d.destroy_process_group = destroy_process_group
    import torch.distributed as dist

    dist.init_process_group, dist.new_group = init_process_group, new_group_
    dist.destroy_process_group = destroy_process_group


# ------------------------------------------------------------------ ckptstore's strategies as the defaults
_STEPS: dict[str, int] = {}
_SAVE_CLASS = None


def _save_strategy(url: str):
    """ckptstore's save strategy of the repository ``url``; a folder not named ``iter_N`` gets the next step."""
    global _SAVE_CLASS
    if _SAVE_CLASS is None:
        from ckptstore.integrations import megatron as ckpt_mg

        class SuiteSaveStrategy(ckpt_mg.CkptStoreSaveStrategy):
            # made through ckpt_mg.save_strategy(url); only the step of a folder not named iter_N is the run's
            def step_for(self, checkpoint_dir) -> int:
                try:
                    step = super().step_for(checkpoint_dir)
                except ValueError:
                    step = _STEPS.get(self.url, 0) + 1
                _STEPS[self.url] = max(step, _STEPS.get(self.url, 0))
                return step

        _SAVE_CLASS = SuiteSaveStrategy
    return _SAVE_CLASS(url)


def _ckptstore_folder(checkpoint_dir) -> dict | None:
    """The pointer of a folder saved through ckptstore's strategy, else None."""
    try:
        cfg = json.loads((Path(checkpoint_dir) / "metadata.json").read_text())
        doc = json.loads((Path(checkpoint_dir) / "ckptstore.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    if not isinstance(cfg, dict) or cfg.get("sharded_backend") != "ckptstore" or not isinstance(doc, dict):
        return None
    return doc


def _load_strategy(checkpoint_dir, suite_url):
    from ckptstore.integrations import megatron as ckpt_mg

    doc = _ckptstore_folder(checkpoint_dir) if checkpoint_dir is not None else None
    return ckpt_mg.load_strategy(doc["url"] if doc and doc.get("url") else suite_url())


def _is_default(strategy, backend: str) -> bool:
    return strategy is None or (isinstance(strategy, tuple) and strategy and strategy[0] == backend)


def _wrap_entry(fn, name, choose):
    """``fn`` with its ``sharded_strategy`` argument chosen by ``choose(bound arguments)`` when the caller gave none."""
    sig = inspect.signature(fn)

    def wrapper(*args, **kwargs):
        ba = sig.bind_partial(*args, **kwargs)
        strategy = choose(ba.arguments)
        if strategy is not None:
            ba.arguments["sharded_strategy"] = strategy
        return fn(*ba.args, **ba.kwargs)

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = fn.__doc__
    wrapper.__wrapped__ = fn
    wrapper._ckptstore_suite = True
    return wrapper


def _patch_serialization(mod, suite_url):
    if getattr(mod.save, "_ckptstore_suite", False):
        return

    def save_choice(a):
        return _save_strategy(suite_url()) if _is_default(a.get("sharded_strategy"), "torch_dist") else None

    def load_choice(a):
        d = a.get("checkpoint_dir")
        if _is_default(a.get("sharded_strategy"), "ckptstore") and d is not None and _ckptstore_folder(d):
            return _load_strategy(d, suite_url)
        return None

    mod.save = _wrap_entry(mod.save, "save", save_choice)
    for name in ("load", "load_tensors_metadata", "load_sharded_metadata"):
        if hasattr(mod, name):
            setattr(mod, name, _wrap_entry(getattr(mod, name), name, load_choice))

    default_save = mod.get_default_save_sharded_strategy

    def get_default_save_sharded_strategy(backend="torch_dist", *args, **kwargs):
        if backend == "torch_dist":
            return _save_strategy(suite_url())
        return default_save(backend, *args, **kwargs)

    default_load = mod.get_default_load_sharded_strategy

    def get_default_load_sharded_strategy(checkpoint_dir=None, *args, **kwargs):
        if checkpoint_dir is not None and _ckptstore_folder(checkpoint_dir):
            return _load_strategy(checkpoint_dir, suite_url)
        return default_load(checkpoint_dir, *args, **kwargs)

    mod.get_default_save_sharded_strategy = get_default_save_sharded_strategy
    mod.get_default_load_sharded_strategy = get_default_load_sharded_strategy


def _patch_strategy_registry(mod, suite_url):
    """0.16: the backend registry (``get_default_strategy``) behind tuples, ``None`` and folders' backends."""
    original = getattr(mod, "get_default_strategy", None)
    if original is None or getattr(original, "_ckptstore_suite", False):
        return

    def get_default_strategy(action, backend, version):
        if action == mod.StrategyAction.SAVE_SHARDED and backend == "torch_dist":
            return _save_strategy(suite_url())
        if action == mod.StrategyAction.LOAD_SHARDED and backend == "ckptstore":
            return _load_strategy(None, suite_url)
        return original(action, backend, version)

    get_default_strategy._ckptstore_suite = True
    mod.get_default_strategy = get_default_strategy


def HOOKS(ckptstore_side: bool, suite_url) -> dict:
    """Module name -> functions run right after the module is imported."""
    import typing

    if not hasattr(typing, "override"):
        try:
            import typing_extensions

            typing.override = typing_extensions.override
        except ImportError:
            pass
    hooks = {
        "torch": [_patch_torch],
        "torch.distributed.distributed_c10d": [_patch_c10d],
        "megatron.core.utils": [_patch_mcore_utils],
    }
    if ckptstore_side:
        hooks["megatron.core.dist_checkpointing.strategies.base"] = [lambda m: _patch_strategy_registry(m, suite_url)]
        hooks["megatron.core.dist_checkpointing.serialization"] = [lambda m: _patch_serialization(m, suite_url)]
    return hooks
