"""DeepSpeed's own readers of a checkpoint folder, served from a ckptstore repository.

A folder saved through :func:`ckptstore.integrations.deepspeed.attach`
holds stubs where DeepSpeed wrote its files (see :func:`stub_record`).
DeepSpeed has three readers that open those files with ``torch.load``
instead of asking the engine's ``CheckpointEngine``; each is sent to the
repository here, and left as it is for anything else:

- ``deepspeed.runtime.engine.get_fp32_state_dict_from_zero_checkpoint``,
  which ``DeepSpeedEngine._load_checkpoint`` calls under ZeRO-3 when
  optimizer states are not loaded (``load_module_only=True``,
  ``load_optimizer_states=False``). While an attached engine loads a step
  (:data:`LOADING`, set by the wrapped ``load_checkpoint``), it returns the
  consolidated weights of that step; otherwise DeepSpeed's own function
  runs.
- ``deepspeed.utils.zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint``,
  through which ``get_fp32_state_dict_from_zero_checkpoint``,
  ``convert_zero_checkpoint_to_fp32_state_dict``,
  ``convert_zero_checkpoint_to_state_dict`` and
  ``load_state_dict_from_zero_checkpoint`` read a tag folder: a folder of
  stubs is read from the repository they name; a folder of DeepSpeed
  files goes to DeepSpeed's own code.
- the ``zero_to_fp32.py`` DeepSpeed copies into every save folder: an
  attached engine writes :data:`SCRIPT` there instead, which takes the
  same arguments and runs DeepSpeed's own conversion with these readers
  installed (:func:`zero_to_fp32_main`).

:func:`install` puts the first two in place, once per process;
importing :mod:`ckptstore.integrations.deepspeed` calls it.
"""

from __future__ import annotations

import argparse
import contextvars
import glob
import json
import os
import shlex
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

import ckptstore

from ..repo import zero
from ..errors import FormatError
from ._common import parse_standin, standin_bytes

__all__ = ["install", "stub_record", "read_stub", "write_stub", "zero_to_fp32_main", "SCRIPT", "LOADING"]

STUB_FORMAT = "ckptstore.deepspeed.stub"
STUB_VERSION = 2
NAMESPACE = "deepspeed"
_STUB_V1_MAX = 4096


# ============================================================== stubs
def stub_record(url: str, step: int, tag: str, file: str) -> dict:
    """What a stub says: the file it stands for is ``file`` of DeepSpeed tag ``tag``, kept in ``step`` of ``url``."""
    return {"format": STUB_FORMAT, "version": STUB_VERSION, "url": url, "step": int(step), "tag": str(tag), "file": file}


def stub_message(doc: dict) -> str:
    """The one line ``torch.load`` of a stub raises."""
    url, step = doc["url"], doc["step"]
    return (
        f"ckptstore stub, not a torch file: DeepSpeed file {doc.get('file')!r} of tag {doc.get('tag')!r} is kept in "
        f"step {step} of the ckptstore repository {url}; load it with an engine attached by "
        f"ckptstore.integrations.deepspeed.attach(engine, {url!r}), or write the consolidated weights with: "
        f"ckptstore export {shlex.quote(url)} {step} model.safetensors"
    )


def write_stub(path: str, doc: dict) -> None:
    """Write a stub in place of a DeepSpeed file (temp file, then rename)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "wb") as f:
        f.write(standin_bytes(stub_message(doc), doc))
    os.replace(tmp, path)


def read_stub(path: str) -> dict | None:
    """The record of the stub at ``path``; None if there is no file there or it is not a stub.

    Reads both stub versions: 2 (two hand-built pickle values that make
    ``torch.load`` fail with :func:`stub_message`, then the JSON record,
    parsed here byte by byte, never unpickled) and 1 (the JSON record
    alone). A stub whose record is malformed raises :class:`FormatError`.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(64 * 1024 + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    if raw.startswith(b"{"):
        if len(raw) > _STUB_V1_MAX:
            return None
        try:
            doc = json.loads(raw)
        except ValueError:
            return None
    else:
        doc = parse_standin(raw)
    if not isinstance(doc, dict) or doc.get("format") != STUB_FORMAT:
        return None
    if (
        type(doc.get("version")) is not int
        or doc["version"] > STUB_VERSION
        or type(doc.get("step")) is not int
        or doc["step"] < 0
        or not isinstance(doc.get("url"), str)
    ):
        raise FormatError(f"{path}: malformed ckptstore stub (format {STUB_FORMAT!r}, version {doc.get('version')!r})")
    return doc


# ============================================================== the step being loaded
@dataclass(frozen=True)
class Loading:
    """An attached engine's load in progress: which engine, which step."""

    owner: object  # the CkptStoreCheckpointEngine
    step: int
    stored: zero.StoredStep


#: Set by the wrapped ``engine.load_checkpoint`` for the duration of DeepSpeed's own load.
LOADING: contextvars.ContextVar[Loading | None] = contextvars.ContextVar("ckptstore_deepspeed_loading", default=None)

#: repository URL -> (storage_options, options) of the engines attached in this process,
#: so a folder of stubs naming that repository opens it the same way
_OPENED: dict[str, tuple[dict | None, dict]] = {}


def remember_options(url: str, storage_options: dict | None, options: dict) -> None:
    _OPENED[url] = (storage_options, dict(options))


# ============================================================== lazy weights
class RepoTensor:
    """One consolidated weight, read from the repository on :meth:`contiguous`.

    The protocol of DeepSpeed's lazy ``GatheredTensor`` (``shape``,
    ``dtype``, ``contiguous()``), which ``zero_to_fp32.to_torch_tensor``
    and ``convert_zero_checkpoint_to_state_dict`` use, so a large model is
    read one shard at a time. Tied names share one object.
    """

    def __init__(self, source, shape: tuple[int, ...], dtype: torch.dtype, read):
        self._source = source  # keeps the repository handle open while this weight may be read
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._read = read

    def numel(self) -> int:
        return self.shape.numel()

    def contiguous(self) -> torch.Tensor:
        return self._read().reshape(self.shape).contiguous()

    def __repr__(self) -> str:
        return f"RepoTensor(shape={list(self.shape)}, dtype={self.dtype})"


class _Source:
    """A repository handle for :class:`RepoTensor` s, closed once none of them is left (or at exit)."""

    def __init__(self, url: str):
        storage_options, options = _OPENED.get(url, (None, {}))
        self.repo = ckptstore.open(url, storage_options=storage_options, **options)
        weakref.finalize(self, self.repo.close)


def weights(stored: zero.StoredStep, exclude_frozen: bool, source=None, preload: bool = False) -> OrderedDict:
    """The consolidated weights of a step as DeepSpeed's ``zero_to_fp32`` returns them (lazy)."""
    if preload and int(stored.meta.get("zero_stage", 0)) in (1, 2, 3) and not stored.is_pipeline():
        layout = zero.ZeroLayout(stored)
        layout.preload_fp32()
        entries = layout.consolidated(exclude_frozen=exclude_frozen, float_buffers=True)
    else:
        entries = zero.consolidated(stored.ckpt, exclude_frozen=exclude_frozen, float_buffers=True, pipeline=False)
    out: OrderedDict = OrderedDict()
    made = {}
    for name, dtype, shape, read in entries:
        t = made.get(id(read))
        if t is None:
            t = made[id(read)] = RepoTensor(source, shape, dtype, read)
        out[name] = t
    return out


def _to_tensors(lazy: OrderedDict) -> OrderedDict:
    from deepspeed.utils import zero_to_fp32 as z

    return z.to_torch_tensor(lazy)


# ============================================================== the dispatchers
def _folder_step(folder: str) -> tuple[str, int] | None:
    """(url, step) of a tag folder of ckptstore stubs, or None when it holds none."""
    stubs = {}
    for path in glob.glob(os.path.join(glob.escape(folder), "*_states.pt")):
        doc = read_stub(path)
        if doc is not None:
            stubs[os.path.basename(path)] = doc
    if not stubs:
        return None
    urls = {d["url"] for d in stubs.values()}
    if len(urls) > 1:
        raise FormatError(f"{folder}: stubs name more than one ckptstore repository: {sorted(urls)}")
    url = urls.pop()
    steps = {d["step"] for d in stubs.values()}
    if len(steps) == 1:
        return url, steps.pop()
    # The tag was saved again with other files: the name, else rank 0's model file, says which step.
    storage_options, options = _OPENED.get(url, (None, {}))
    with ckptstore.open(url, storage_options=storage_options, **options) as repo:
        try:
            named = repo.name_step(NAMESPACE, os.path.basename(os.path.normpath(folder)))
        except ValueError:
            named = None
    if named in steps:
        return url, named
    for f in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if f in stubs:
            return url, stubs[f]["step"]
    return url, max(steps)


_ORIGINALS: dict[str, object] = {}


def _folder_fp32(ds_checkpoint_dir, exclude_frozen_parameters):
    found = _folder_step(os.fspath(ds_checkpoint_dir))
    if found is None:
        return _ORIGINALS["folder"](ds_checkpoint_dir, exclude_frozen_parameters)
    url, step = found
    print(f"Processing zero checkpoint '{ds_checkpoint_dir}': ckptstore step {step} of {url}")
    source = _Source(url)
    return weights(zero.StoredStep(source.repo.checkpoint(step)), bool(exclude_frozen_parameters), source)


def _engine_fp32(checkpoint_dir, tag=None, exclude_frozen_parameters=False, lazy_mode=False):
    loading = LOADING.get()
    if loading is None:
        return _ORIGINALS["engine"](
            checkpoint_dir, tag=tag, exclude_frozen_parameters=exclude_frozen_parameters, lazy_mode=lazy_mode
        )
    # The step being loaded, whatever `latest` in checkpoint_dir says (DeepSpeed reads `latest` here).
    lazy = weights(loading.stored, bool(exclude_frozen_parameters), preload=not lazy_mode)
    return lazy if lazy_mode else _to_tensors(lazy)


def install() -> None:
    """Send DeepSpeed's folder readers of stub folders (and of the step being loaded) to the repository. Idempotent."""
    import deepspeed.runtime.engine as ds_engine
    from deepspeed.utils import zero_to_fp32 as z

    if getattr(z._get_fp32_state_dict_from_zero_checkpoint, "_ckptstore", False):
        return
    _ORIGINALS["folder"] = z._get_fp32_state_dict_from_zero_checkpoint
    _ORIGINALS["engine"] = ds_engine.get_fp32_state_dict_from_zero_checkpoint
    _folder_fp32._ckptstore = True
    _engine_fp32._ckptstore = True
    z._get_fp32_state_dict_from_zero_checkpoint = _folder_fp32
    ds_engine.get_fp32_state_dict_from_zero_checkpoint = _engine_fp32


# ============================================================== zero_to_fp32.py
#: What an attached engine writes as ``zero_to_fp32.py`` into a save folder.
SCRIPT = '''#!/usr/bin/env python
"""zero_to_fp32.py, written by ckptstore in place of DeepSpeed's copy.

This folder's checkpoint files are ckptstore stubs: the bytes are in the
ckptstore repository each stub names. Run as DeepSpeed's script is run,

    python zero_to_fp32.py . output_dir/ [--safe_serialization] [-t TAG] ...

it takes DeepSpeed's arguments and writes the same files, with DeepSpeed's
own conversion code, reading the weights from the repository (a tag folder
of DeepSpeed files is converted from its files, as DeepSpeed does).
Imported as a module (zero_to_torch.py does), it is DeepSpeed's
deepspeed.utils.zero_to_fp32 with ckptstore's reader installed.
"""
import sys

try:
    from ckptstore.integrations.deepspeed_tools import zero_to_fp32_main, zero_to_fp32_module
except ImportError as e:
    import importlib
    import runpy

    if __name__ == "__main__":
        print(f"zero_to_fp32.py: ckptstore is not importable ({e}); running DeepSpeed's own zero_to_fp32",
              file=sys.stderr)
        runpy.run_module("deepspeed.utils.zero_to_fp32", run_name="__main__", alter_sys=True)
    else:
        sys.modules[__name__] = importlib.import_module("deepspeed.utils.zero_to_fp32")
else:
    if __name__ == "__main__":
        sys.exit(zero_to_fp32_main())
    sys.modules[__name__] = zero_to_fp32_module()
'''


def write_script(save_dir: str) -> None:
    """Put :data:`SCRIPT` in ``save_dir/zero_to_fp32.py`` (executable, as DeepSpeed leaves its copy)."""
    path = os.path.join(save_dir, "zero_to_fp32.py")
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "w") as f:
        f.write(SCRIPT)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)


def zero_to_fp32_module():
    """DeepSpeed's ``deepspeed.utils.zero_to_fp32`` with :func:`install` done."""
    from deepspeed.utils import zero_to_fp32 as z

    install()
    return z


def zero_to_fp32_main(argv: list[str] | None = None) -> int:
    """``zero_to_fp32.py``'s command line (DeepSpeed 0.19's arguments), converting through :func:`install`."""
    z = zero_to_fp32_module()
    parser = argparse.ArgumentParser(
        description="Consolidate a DeepSpeed ZeRO checkpoint (ckptstore stubs or DeepSpeed files) into fp32 weights."
    )
    parser.add_argument("checkpoint_dir", type=str, help="path to the desired checkpoint folder, e.g., path/checkpoint-12")
    parser.add_argument("output_dir", type=str, help="directory to the pytorch fp32 state_dict output files")
    parser.add_argument("--max_shard_size", type=str, default="5GB", help="the maximum size of one output shard")
    parser.add_argument("--safe_serialization", default=False, action="store_true", help="write safetensors files")
    parser.add_argument("-t", "--tag", type=str, default=None, help="checkpoint tag, e.g., global_step1")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="exclude frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="enable debug")
    args = parser.parse_args(argv)
    z.debug = args.debug
    z.convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )
    return 0

