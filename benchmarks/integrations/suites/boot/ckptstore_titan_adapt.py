"""pytest plugin of the torchtitan suite's ckptstore side: the two adaptations of its tests.

torchtitan's ``tests/unit_tests/test_checkpoint.py`` stands in for DCP with
mocks (``mock.patch.object(dist_checkpoint, "save"/"load")`` whose side
effects ``torch.save`` a file into the step folder, or only check the keys)
and checks the step folders on disk. With ckptstore plugged in, the
manager hands DCP a :class:`~ckptstore.dcp.CkptStoreWriter` or
``CkptStoreReader``, and the checkpoint folder is a repository. Only the
mocks and the folder listings are adapted; every other line, and every
assertion, runs as written:

1. **The mocks of ``dcp.save`` and ``dcp.load``.** When the manager passes
   one of ckptstore's writers or readers to a mocked ``dcp.save`` or
   ``dcp.load``, the real function runs first with it (the step is
   committed to, or read from, the repository), then the test's side
   effect runs as written, given only the keyword arguments it accepts
   (``fake_load(states, checkpoint_id=None)`` has no ``storage_reader``).
   The mock records the call with every argument, as before.
2. **The step-folder listings.** ``os.listdir(self.test_folder)`` (3
   places, in ``test_save_and_purge_keeps_last_k_checkpoints`` and
   ``test_nonzero_rank_does_not_purge_or_save``) lists the repository's
   checkpoints as ``step-N`` names
   (:func:`ckptstore.integrations.torchtitan.checkpoint_steps`), which is
   what torchtitan's folder of step folders shows.

The second is a change of the test's source, made on import (the file on
disk is untouched); the count of each replacement is checked, so a
different version of the file fails loudly instead of running unadapted.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
from unittest import mock

#: (text in the test file, replacement, times it must occur)
SOURCE_ADAPTATIONS = [
    ("os.listdir(self.test_folder)", "_ckptstore_step_folders(self.test_folder)", 3),
]

HELPER = '''

def _ckptstore_step_folders(folder):
    """torchtitan's step folders, as a ckptstore repository holds them (the suite's adaptation 2)."""
    from ckptstore.integrations.torchtitan import checkpoint_steps

    return [f"step-{n}" for n in sorted(checkpoint_steps(folder))]
'''

_REAL: dict[str, object] = {}


def adapted_source(text: str) -> str:
    for old, new, count in SOURCE_ADAPTATIONS:
        found = text.count(old)
        if found != count:
            raise RuntimeError(f"torchtitan suite adaptation: {old!r} occurs {found} times, expected {count}")
        text = text.replace(old, new)
    return text + HELPER


class _Loader(importlib.machinery.SourceFileLoader):
    def source_to_code(self, data, path, *, _optimize=-1):
        return compile(adapted_source(data.decode("utf-8")), path, "exec", dont_inherit=True, optimize=_optimize)

    def get_code(self, fullname):  # no bytecode cache: the adapted source is compiled every time
        return self.source_to_code(self.get_data(self.get_filename(fullname)), self.get_filename(fullname))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.rpartition(".")[2] != "test_checkpoint":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or not (spec.origin or "").endswith("unit_tests/test_checkpoint.py"):
            return spec
        return importlib.util.spec_from_file_location(name, spec.origin, loader=_Loader(name, spec.origin))


def _accepted(fn, kwargs: dict) -> dict:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _patch_mocks() -> None:
    import torch.distributed.checkpoint as dist_checkpoint

    from ckptstore.dcp import CkptStoreReader, CkptStoreWriter

    _REAL.update(save=dist_checkpoint.save, load=dist_checkpoint.load)
    enter = mock._patch.__enter__

    def __enter__(self):
        new = enter(self)
        if self.getter() is dist_checkpoint and self.attribute in ("save", "load"):
            new.__dict__["_ckptstore_dcp"] = self.attribute
        return new

    execute = mock.CallableMixin._execute_mock_call

    def _execute_mock_call(self, /, *args, **kwargs):
        kind = self.__dict__.get("_ckptstore_dcp")
        io = kwargs.get("storage_writer" if kind == "save" else "storage_reader") if kind else None
        if isinstance(io, (CkptStoreWriter, CkptStoreReader)):
            _REAL[kind](*args, **kwargs)
            effect = self.side_effect
            if callable(effect) and not isinstance(effect, mock.Mock):
                kwargs = _accepted(effect, kwargs)
        return execute(self, *args, **kwargs)

    mock._patch.__enter__ = __enter__
    mock.CallableMixin._execute_mock_call = _execute_mock_call


def pytest_configure(config):
    _patch_mocks()
    sys.meta_path.insert(0, _Finder())
