"""Imported by every Python process of a framework-suite run (``benchmarks/integrations/suites``).

``benchmarks.integrations.suites.run`` puts this folder first on ``PYTHONPATH``, so the
pytest process and every worker it starts (DeepSpeed's forkserver pool,
Lightning's ``ddp_spawn`` children) import it at start-up. It

- switches DeepSpeed's shared-memory comm op off (a ~75 s g++ build per
  process on CPU, the tests' own setting in ``tests/ds_workers.py``);
- gives ``DeepSpeedEngine`` back the ``sparse_tensor_module_names``
  attribute 0.19.5's tests compare and 0.19.8 dropped (an empty set, on
  both sides of a run);
- with ``CKPTSTORE_SUITE_DIR`` set (the ``--ckptstore`` side of a run),
  plugs ckptstore in the documented way when the framework is imported:
  every engine ``deepspeed.initialize`` returns gets
  ``ckptstore.integrations.deepspeed.attach(engine, url)``, and every
  Lightning ``Trainer`` without a ``CheckpointIO`` plugin gets
  ``plugins=[CkptStoreCheckpointIO(url)]`` (``local_files=`` from
  ``CKPTSTORE_SUITE_LOCAL_FILES`` when set), and every torchtitan
  ``CheckpointManager(config=...)`` is built as the override
  ``ckptstore.integrations.torchtitan.ckptstore_checkpoint`` builds it
  (a ``CkptStoreCheckpointManager``, its folder the repository).

For DeepSpeed and Lightning, ``url`` is one repository per test: ``file://$CKPTSTORE_SUITE_DIR/repos/<test>``,
the test's id read from ``$CKPTSTORE_SUITE_DIR/current``, which the pytest
plugin (``ckptstore_suite_plugin``) writes before each test. A file, not an
environment variable, because DeepSpeed's forkserver workers keep the
environment of the moment the server started.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_DIR = os.environ.get("CKPTSTORE_SUITE_DIR")


def _current_file() -> str:
    # Megatron's tests run as one pytest process per rank (CKPTSTORE_SUITE_RANK): one file each,
    # so a rank ahead of another never renames the other's repository
    rank = os.environ.get("CKPTSTORE_SUITE_RANK")
    return os.path.join(_DIR, "current" if rank is None else f"current.{rank}")


def suite_url() -> str:
    """The repository URL of the test running now."""
    try:
        with open(_current_file()) as f:
            slug = f.read().strip() or "no-test"
    except FileNotFoundError:
        slug = "no-test"
    return "file://" + os.path.join(_DIR, "repos", slug)


def _patch_deepspeed_ops(mod):
    mod.__compatible_ops__["deepspeed_shm_comm"] = False


def _patch_engine_compat(mod):
    # DeepSpeed 0.19.5's checkpoint tests compare engine.sparse_tensor_module_names
    # of the saved and the loaded engine (tests/unit/checkpoint/common.py);
    # 0.19.8 dropped the attribute. Both sides of a run get the same empty set.
    cls = mod.DeepSpeedEngine
    if not hasattr(cls, "sparse_tensor_module_names"):
        cls.sparse_tensor_module_names = property(lambda self: set())


def _patch_deepspeed(mod):
    original = mod.initialize
    if getattr(original, "_ckptstore_suite", False):
        return

    def initialize(*args, **kwargs):
        out = original(*args, **kwargs)
        from ckptstore.integrations import deepspeed as ckpt_ds

        ckpt_ds.attach(out[0], suite_url())
        return out

    initialize._ckptstore_suite = True
    mod.initialize = initialize


def _patch_trainer(mod):
    cls = mod.Trainer
    original = cls.__init__
    if getattr(original, "_ckptstore_suite", False):
        return

    def __init__(self, *args, **kwargs):
        from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

        from ckptstore.integrations.lightning import CkptStoreCheckpointIO

        plugins = kwargs.get("plugins")
        plugins = [] if plugins is None else (list(plugins) if isinstance(plugins, (list, tuple)) else [plugins])
        strategy = kwargs.get("strategy")
        has_io = any(isinstance(p, CheckpointIO) for p in plugins) or (
            getattr(strategy, "_checkpoint_io", None) is not None
        )
        if not has_io:
            options = {}
            if os.environ.get("CKPTSTORE_SUITE_LOCAL_FILES"):
                options["local_files"] = os.environ["CKPTSTORE_SUITE_LOCAL_FILES"]
            kwargs["plugins"] = [*plugins, CkptStoreCheckpointIO(suite_url(), **options)]
        original(self, *args, **kwargs)

    __init__._ckptstore_suite = True
    cls.__init__ = __init__


def _patch_titan_manager(mod):
    # The documented way is `--override.imports ckptstore.integrations.torchtitan.ckptstore_checkpoint`,
    # which makes torchtitan build a CkptStoreCheckpointManager from its CheckpointManager.Config.
    # The tests build CheckpointManager(config=...) themselves: each such construction makes a
    # CkptStoreCheckpointManager instead, which converts the config the way the override does.
    # (`CheckpointManager.__new__(CheckpointManager)`, with no config, stays torchtitan's.)
    cls = mod.CheckpointManager
    if getattr(cls.__new__, "_ckptstore_suite", False):
        return

    def __new__(c, *args, **kwargs):
        if c is cls and kwargs.get("config") is not None:
            from ckptstore.integrations.torchtitan import CkptStoreCheckpointManager

            return object.__new__(CkptStoreCheckpointManager)
        return object.__new__(c)

    __new__._ckptstore_suite = True
    cls.__new__ = __new__


_HOOKS = {"deepspeed.ops": [_patch_deepspeed_ops], "deepspeed.runtime.engine": [_patch_engine_compat]}
if _DIR:
    _HOOKS.setdefault("deepspeed", []).append(_patch_deepspeed)
    _HOOKS["lightning.pytorch.trainer.trainer"] = [_patch_trainer]
    _HOOKS["torchtitan.components.checkpointer.dcp"] = [_patch_titan_manager]

if os.environ.get("CKPTSTORE_SUITE_FRAMEWORK") == "megatron":
    # Megatron-Core's own tests on the CPU (both sides): see ckptstore_megatron_cpu
    from ckptstore_megatron_cpu import HOOKS as _MEGATRON_HOOKS

    for _name, _fns in _MEGATRON_HOOKS(bool(_DIR), suite_url).items():
        _HOOKS.setdefault(_name, []).extend(_fns)


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs the hooks of a module right after it is executed."""

    def find_spec(self, name, path=None, target=None):
        if name not in _HOOKS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self._wrap(spec)
        return spec

    @staticmethod
    def _wrap(spec):
        loader = spec.loader
        exec_module = loader.exec_module

        def run(module):
            exec_module(module)
            for hook in _HOOKS.get(spec.name, ()):
                hook(module)

        loader.exec_module = run


sys.meta_path.insert(0, _AfterImport())
