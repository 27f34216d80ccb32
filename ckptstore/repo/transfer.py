"""Moving checkpoints in and out of a repository, and comparing steps.

- :func:`export_safetensors` / :func:`export_dcp`: one committed step to a
  ``.safetensors`` file or a ``torch.distributed.checkpoint`` directory.
- :func:`import_file`: a ``.safetensors`` file, a ``torch.save`` file
  (``weights_only`` loading only) or a DCP directory into a new step.
- :func:`copy`: steps from one repository to another, moving only the
  chunks the destination lacks, as stored (no recompression), with the tags
  and checkpoint names that point at them.
- :func:`diff`: what changed between two steps, from manifests alone.

Progress callbacks have the signature ``progress(what, done, total)``; a
``what`` ending in ``" bytes"`` counts bytes.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import pickle
import struct
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from ..format import manifest as _m
from . import zero
from .catalog import Catalog
from ..errors import CkptStoreError, FormatError, IntegrityError, StepNotFoundError
from ..format.layout import check_step, name_key, name_record, tag_key, tag_record
from ..format.chunk_table import TableBuilder
from ..format.manifest import ChunkRef, Manifest, Shard, TableRef, TensorEntry
from ..pipeline.pack_writer import PackWriter
from ..progress import Counter
from .reader import load_step, open_checkpoint
from .save import StepCommit, discard_uncommitted, flatten_for_save, pack_usage, save_step, write_segment
from ..format.tree import leaf_values, tree_keys, unflatten
from .verify import verify

MiB = 1 << 20
#: safetensors metadata key holding the step's non-tensor values (JSON).
SAFETENSORS_META_KEY = "ckptstore"
#: Export reads tensors larger than this in row blocks of about this size.
EXPORT_BLOCK_BYTES = 64 * MiB

Progress = Callable[[str, int, int], None]


def _noop(what: str, done: int, total: int) -> None:
    pass


# ==================================================================== safetensors
def _safetensors_dtypes() -> dict[torch.dtype, str]:
    """torch dtype -> safetensors dtype name, as the safetensors package defines them."""
    try:
        from safetensors.torch import _TYPES  # name -> torch dtype
    except ImportError:  # pragma: no cover - older/newer package layout
        _TYPES = {
            "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
            "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
            "F8_E5M2": torch.float8_e5m2,
        }
    return {dt: name for name, dt in _TYPES.items()}


def export_safetensors(
    repo: Catalog,
    step: int,
    out_path: str | os.PathLike,
    keys_glob: str | Sequence[str] | None = None,
    progress: Progress | None = None,
) -> dict:
    """Write one step as a ``.safetensors`` file.

    Tensors are assembled from their shards with range reads
    (:meth:`Checkpoint.read`) and written one at a time, in row blocks of
    about :data:`EXPORT_BLOCK_BYTES` for large tensors, so peak memory is
    about one block (or one row of a tensor whose rows are larger), not
    the checkpoint. The safetensors package can only serialize a dict of
    tensors held in memory at once, so the file is streamed here in the
    format the package defines (8-byte little-endian header length, JSON
    header with dtype names from ``safetensors.torch``, data back to back,
    header padded to 8 bytes); the finished file's header is then opened
    with ``safetensors.safe_open`` as a check. The file is written to a
    temporary name and renamed into place when complete.

    The string metadata holds ``"format": "pt"`` (as Hugging Face writes
    it, so its loaders accept the file). Non-tensor values of the state
    dict (and the step's metadata) go into it too, as JSON under the key
    ``"ckptstore"``: ``{"step", "metadata", "values": {dotted key: value},
    "tree"}`` (``tree`` only when every tensor is exported; it lets
    :func:`import_file` rebuild the nested state dict exactly).

    ``keys_glob`` (an ``fnmatch`` pattern, or several) selects tensors.
    A tensor of a dtype safetensors cannot hold (complex128, uint
    variants the package lacks, ...) raises ``TypeError`` naming it,
    before anything is written.

    Returns ``{"path", "step", "tensors", "bytes"}``: the file, the step, tensors written, data bytes.
    """
    progress = progress or _noop
    ckpt = open_checkpoint(repo, step)
    man = ckpt.manifest
    view = _consolidated_view(ckpt)
    keys, all_keys, entries, readers = _export_selection(ckpt, view, step, keys_glob)
    hbytes, total = _export_header(man, step, keys, all_keys, entries, consolidated=view is not None)
    if view is None:
        def blocks(k):
            return (ckpt.read(k, b) for b in _row_blocks(man.tensors[k]))
    else:
        def blocks(k):
            return [readers[k]()]
    _write_export(Path(out_path), hbytes, keys, blocks, total, step, progress)
    return {"path": str(out_path), "step": man.step, "tensors": len(keys), "bytes": total}


def _export_selection(ckpt, view, step: int, keys_glob):
    """The tensors an export writes: ``(keys, all_keys, {key: (dtype name, shape)}, {key: read})``."""
    man = ckpt.manifest
    readers: dict = {}
    if view is None:
        keys = all_keys = ckpt.keys()
        entries = {k: (man.tensors[k].dtype, man.tensors[k].shape) for k in keys}
    else:
        keys = all_keys = [name for name, *_ in view]
        entries = {name: (_m.dtype_name(dt), tuple(shape)) for name, dt, shape, _ in view}
        readers = {name: read for name, _, _, read in view}
    if keys_glob is not None:
        pats = [keys_glob] if isinstance(keys_glob, str) else list(keys_glob)
        keys = [k for k in keys if any(fnmatch.fnmatchcase(k, p) for p in pats)]
        if not keys:
            raise KeyError(f"step {step}: no tensor matches {', '.join(pats)}")
    return keys, all_keys, entries, readers


def _export_header(man, step: int, keys, all_keys, entries, consolidated: bool) -> tuple[bytes, int]:
    """The safetensors header of an export (padded to 8 bytes) and its data bytes; refuses what it cannot hold."""
    names = _safetensors_dtypes()
    header: dict[str, Any] = {}
    pos = 0
    for k in keys:
        dtype_name, shape = entries[k]
        dt = _m.DTYPES[dtype_name]
        if dt not in names:
            raise TypeError(
                f"step {step}: tensor {k!r} has dtype {dtype_name}, which safetensors cannot hold; "
                "leave it out with --keys, or export with --format dcp"
            )
        if k == "__metadata__":
            raise ValueError(f"step {step}: a tensor named '__metadata__' cannot be stored in safetensors")
        nbytes = _m.itemsize(dtype_name) * math.prod(shape)
        header[k] = {"dtype": names[dt], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    values = {k: v for k, (v, _) in leaf_values(man.tree).items()} if not consolidated else {}
    meta = {"step": man.step, "metadata": man.metadata, "values": values}
    if consolidated:
        meta["consolidated"] = "deepspeed"
    elif len(keys) == len(all_keys):
        meta["tree"] = man.tree
    # "format": "pt" is what Hugging Face's save_pretrained writes; its
    # loaders (transformers, accelerate's load_checkpoint_in_model) refuse
    # a file whose metadata lacks it.
    header["__metadata__"] = {
        "format": "pt",
        SAFETENSORS_META_KEY: json.dumps(meta, allow_nan=True, separators=(",", ":")),
    }
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)
    return hbytes, pos


def _write_export(out_path: Path, hbytes: bytes, keys, blocks, total: int, step: int, progress) -> None:
    """Stream the file to a temporary name, check it with ``safe_open``, rename it into place."""
    tmp = out_path.with_name(f".{out_path.name}.{uuid.uuid4().hex[:8]}.tmp")
    done = 0
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(hbytes)))
            f.write(hbytes)
            progress("export bytes", 0, total)
            for k in keys:
                for t in blocks(k):
                    if t.numel():
                        f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                        done += t.numel() * t.element_size()
                    del t
                    progress("export bytes", done, total)
            f.flush()
            os.fsync(f.fileno())
        if done != total:
            raise IntegrityError(f"export of step {step}: wrote {done} data bytes, expected {total}")
        from safetensors import safe_open

        with safe_open(str(tmp), framework="pt") as sf:  # the package checks header and sizes
            if set(sf.keys()) != set(keys):
                raise FormatError(f"export of step {step}: the written file does not list every tensor")
        os.replace(tmp, out_path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _consolidated_view(ckpt):
    """For a step whose tensors are partitions of the model (DeepSpeed ZeRO), the weights they make up.

    The export hook for stacks that save a partitioned layout: such a step
    is recognised by its metadata, and :mod:`ckptstore.repo.zero` (pure: it never
    imports DeepSpeed) yields ``(name, dtype, shape, read)`` per consolidated
    tensor. None for every other step.
    """
    md = ckpt.metadata
    if not (isinstance(md, dict) and isinstance(md.get("deepspeed"), dict)):
        return None
    return zero.consolidated(ckpt)


def _row_blocks(e: TensorEntry):
    """Indices covering a tensor in row blocks of about EXPORT_BLOCK_BYTES (of a tiled tensor:
    whole rows of its tiles, more where one row of tiles is larger)."""
    if len(e.shape) == 0 or e.nbytes <= EXPORT_BLOCK_BYTES or e.shape[0] <= 1:
        yield None
        return
    row = e.nbytes // e.shape[0]
    rows = max(1, EXPORT_BLOCK_BYTES // max(row, 1))
    if e.tile is not None and e.nshards == 1:  # whole rows of tiles: no tile is read for two blocks
        rows = max(1, rows // e.tile[0]) * e.tile[0]
    for r in range(0, e.shape[0], rows):
        yield (slice(r, min(r + rows, e.shape[0])),)


# ==================================================================== DCP export
def export_dcp(repo: Catalog, step: int, out_dir: str | os.PathLike) -> dict:
    """Write one step as a ``torch.distributed.checkpoint`` directory.

    The step is loaded into memory (``repo.load``: full tensors assembled
    from however many shards it has) and saved in this process with
    ``dcp.save(..., storage_writer=FileSystemWriter(out_dir))``, without a
    process group, so the directory is exactly what DCP itself writes and
    any number of ranks can load it with ``FileSystemReader`` (DCP
    reshards). Memory: the whole step. Non-tensor values are serialized
    by DCP itself (``torch.save``); plain JSON values load with
    ``weights_only``.
    """
    import torch.distributed.checkpoint as dcp

    sd = load_step(repo, step)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    out_dir.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(out_dir)), no_dist=True)
    n = sum(e.nbytes for e in repo.manifest(step).tensors.values())
    return {"path": str(out_dir), "step": step, "tensors": len(repo.manifest(step).tensors), "bytes": n}


# ==================================================================== import
def detect_format(path: str | os.PathLike) -> str:
    """``"dcp"`` (a directory with ``.metadata``), ``"safetensors"`` or ``"torch"``."""
    p = Path(path)
    if p.is_dir():
        if not (p / ".metadata").is_file():
            raise FormatError(f"{p}: a directory without a .metadata file is not a DCP checkpoint")
        return "dcp"
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file or directory")
    with open(p, "rb") as f:
        head = f.read(9)
    if p.suffix == ".safetensors":
        return "safetensors"
    if head[:2] == b"PK" or p.suffix in (".pt", ".pth", ".bin", ".ckpt"):
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    return "torch"


def read_file(path: str | os.PathLike, format: str | None = None) -> tuple[dict, dict]:
    """Load a file or DCP directory as ``(state_dict, metadata)`` without unsafe unpickling."""
    fmt = format or detect_format(path)
    if fmt == "safetensors":
        return _read_safetensors(path)
    if fmt == "torch":
        return _read_torch(path), {}
    if fmt == "dcp":
        return _read_dcp(path), {}
    raise ValueError(f"unknown format {fmt!r}; use safetensors, torch or dcp")


def import_file(
    repo: Catalog,
    path: str | os.PathLike,
    step: int,
    format: str | None = None,
    metadata: dict | None = None,
    base: int | str | None = "latest",
    progress=None,
):
    """Save a ``.safetensors`` file, a ``torch.save`` file or a DCP directory as step ``step``.

    The format is detected from the path (a directory is DCP; a
    ``.safetensors`` suffix or a safetensors header is safetensors;
    anything else is a ``torch.save`` file) unless ``format`` names it.

    - safetensors: read with ``safetensors.safe_open``. A file written by
      :func:`export_safetensors` gets its nested structure, plain values
      and metadata back from the ``"ckptstore"`` metadata entry; any other
      file becomes a flat dict of tensors, with its string metadata kept
      as the step's metadata.
    - torch.save: ``torch.load(path, weights_only=True, map_location="cpu")``
      only. A file holding anything but tensors and plain containers
      (a pickled model object, a custom class) is refused with
      :class:`FormatError`, and nothing is written.
    - DCP: the directory's ``.metadata`` is itself a pickle written by
      torch; it is read only by DCP's own ``FileSystemReader.read_metadata``
      (torch's reader, the same trust as ``dcp.load``), and the data is
      loaded through ``dcp.load`` with a planner that rebuilds the state
      dict from that metadata and loads non-tensor items with
      ``torch.load(weights_only=True)`` (DCP's default planner would use
      ``weights_only=False``).

    The whole state dict is held in memory, then ``repo.save`` writes it
    (``progress`` as for ``repo.save``: ``"save bytes"``).
    """
    sd, file_meta = read_file(path, format)
    meta = dict(file_meta)
    if metadata:
        meta.update(metadata)
    tree, tensors, step, meta = flatten_for_save(sd, step, meta)
    return save_step(repo, tree, tensors, step, meta, base, progress)


def _read_safetensors(path) -> tuple[dict, dict]:
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        raw_meta = f.metadata() or {}
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    if SAFETENSORS_META_KEY in raw_meta:
        try:
            meta = json.loads(raw_meta[SAFETENSORS_META_KEY])
        except ValueError:
            raise FormatError(f"{path}: the 'ckptstore' metadata entry is not valid JSON") from None
        tree = meta.get("tree")
        if isinstance(tree, dict):
            try:
                _m.check_tree(tree, tensors, "tree", 0)
            except FormatError:
                tree = None
            if tree is not None and set(tree_keys(tree)) == set(tensors):
                return unflatten(tree, tensors.__getitem__), dict(meta.get("metadata") or {})
        sd: dict = dict(tensors)
        for k, v in (meta.get("values") or {}).items():
            if k not in sd:
                sd[k] = v
        return sd, dict(meta.get("metadata") or {})
    return tensors, {k: v for k, v in raw_meta.items()}


def _read_torch(path) -> dict:
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise FormatError(
            f"{path}: refused: not loadable with weights_only=True; ckptstore loads torch.save files only "
            f"that way and never unpickles arbitrary objects. The file holds objects other than tensors and "
            f"plain containers (save model.state_dict() instead), or is not a torch.save file. "
            f"torch said: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
        ) from None
    except RuntimeError as e:
        if "mmap" in str(e):  # legacy (non-zip) format cannot be memory-mapped
            try:
                obj = torch.load(str(path), map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e2:
                raise FormatError(
                    f"{path}: refused: not loadable with weights_only=True: {str(e2).splitlines()[0]}"
                ) from None
        else:
            raise FormatError(f"{path}: not a torch.save file: {e}") from None
    if isinstance(obj, torch.Tensor):
        return {"tensor": obj}
    if not isinstance(obj, dict):
        raise FormatError(f"{path}: holds a {type(obj).__name__}, expected a state dict (a dict)")
    return _plain_containers(obj)


def _plain_containers(obj):
    """OrderedDicts -> dicts (torch state dicts are OrderedDicts)."""
    if isinstance(obj, dict):
        return {k: _plain_containers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain_containers(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_plain_containers(v) for v in obj)
    return obj


def _read_dcp(path) -> dict:
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class _WeightsOnlyPlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise FormatError(
                    f"{path}: item {read_item.dest_index.fqn!r} is not loadable with weights_only=True; "
                    f"refused: {str(e).splitlines()[0]}"
                ) from None
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    # As torch's own dcp_to_torch_save does: dcp.load would copy the (empty)
    # dict it is given, while _load_state_dict lets the planner fill ours.
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        _load_state_dict(sd, storage_reader=dcp.FileSystemReader(str(path)), planner=_WeightsOnlyPlanner(), no_dist=True)
    return _plain_containers(sd)


# ==================================================================== copy
@dataclass
class CopyResult:
    """What :func:`copy` did."""

    copied: list[int] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    chunks_copied: int = 0
    chunks_reused: int = 0
    bytes_copied: int = 0  # stored (compressed) chunk bytes moved
    raw_bytes_copied: int = 0
    packs: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: Tags this copy created or moved in the destination: name -> step.
    tags: dict[str, int] = field(default_factory=dict)
    #: Checkpoint names likewise: name space -> name -> step.
    names: dict[str, dict[str, int]] = field(default_factory=dict)
    #: ``"tag best"`` / ``"name lightning:last.ckpt"`` -> the step it pointed at in the destination before.
    moved: dict[str, int] = field(default_factory=dict)
    #: Tags and names of selected steps that were not copied: (label, why).
    refs_skipped: list[tuple[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "copied": self.copied,
            "skipped": [{"step": s, "reason": r} for s, r in self.skipped],
            "tags": self.tags,
            "names": self.names,
            "moved": self.moved,
            "refs_skipped": [{"ref": label, "reason": r} for label, r in self.refs_skipped],
            "chunks_copied": self.chunks_copied,
            "chunks_reused": self.chunks_reused,
            "bytes_copied": self.bytes_copied,
            "raw_bytes_copied": self.raw_bytes_copied,
            "packs": self.packs,
            "seconds": self.seconds,
        }


def _dst_index(dst: Catalog) -> tuple[dict[str, ChunkRef], dict[str, int]]:
    """Chunks of every committed destination manifest whose pack exists, by hash; pack sizes."""
    sizes = {pid: o.size for pid, o in dst.packs().items()}
    index: dict[str, ChunkRef] = {}
    for s in dst.steps():
        try:
            man = dst.manifest(s)
            refs = list(dst.tables.iter_chunks(man))
        except CkptStoreError:
            continue  # deleted meanwhile, or unreadable: not a dedup source
        for c in refs:
            if c.hash not in index and sizes.get(c.pack) == man.packs.get(c.pack):
                index[c.hash] = c
    return index, sizes


def copy(
    src: Catalog,
    dst: Catalog,
    steps: Iterable[int] | None = None,
    progress: Progress | None = None,
    verify_data: bool = False,
    batch_bytes: int = 64 * MiB,
) -> CopyResult:
    """Copy steps (default: all) from ``src`` to ``dst``, moving only chunks ``dst`` lacks.

    Chunk matching is by content hash: a chunk referenced by any committed
    destination manifest (and whose pack exists with the recorded size) is
    referenced again, not copied; so is a chunk this copy already wrote.
    Missing chunks are read from the source as stored (range reads through
    the source's chunk fetcher: coalesced per pack, following relocation
    records of repacked packs), decoded and checked against their hash, and
    written with their stored bytes unchanged (no recompression) to new
    destination packs. Each step is then committed with the commit protocol
    every writer follows (:class:`~ckptstore.repo.save.StepCommit`: lease, base-age
    check, exclusive create), with the source's tensors, tree, metadata, DCP
    section and creation time, and chunk locations in the destination.

    A step the destination already has is skipped with a note saying
    whether its content is identical. After each commit the step is
    verified in the destination (manifest and packs; with ``verify_data``
    every chunk is read back and hashed too); a problem raises
    :class:`IntegrityError`.

    Tags and checkpoint names (``refs/tags/``, ``refs/names/``) come with
    their steps: once a selected step is in the destination with the
    source's content (copied now, or found identical), each source tag and
    name pointing at it is written there (right after that step's commit,
    so a tagged copy is protected from GC from the start), moving a
    destination tag or name of the same name that pointed elsewhere
    (:attr:`CopyResult.moved`). A tag or name whose step is not copied (not
    selected, or different content in the destination) is not created;
    those of selected steps are listed in :attr:`CopyResult.refs_skipped`.
    Copying again finds every step and pointer in place and writes nothing.

    ``progress("copy bytes", done, total)`` counts stored bytes copied, as the destination acknowledges them.
    """
    progress = progress or _noop
    t0 = time.perf_counter()
    res = CopyResult()
    src.require_repository()  # before the destination is touched
    src_steps = src.steps()
    if steps is None:
        todo = src_steps
    else:
        todo = sorted({check_step(s) for s in steps})
        have = set(src_steps)
        missing = [s for s in todo if s not in have]
        if missing:
            raise StepNotFoundError(f"{src.url}: step(s) {missing} not committed")
    src_cfg = src.config()
    if not dst.config() and src_cfg:
        # A new destination inherits the source's write defaults, so later
        # saves into it cut chunks the same way and dedup against the copies.
        dst.adopt_defaults(src_cfg)
    dst.ensure_config()
    dst_steps = set(dst.steps())
    refs = _Refs(src, dst, set(todo), res)

    plans = []
    for s in todo:
        man = src.tables.resolve_all(src.manifest(s))
        if s in dst_steps:
            same = _content_key(man) == _content_key(dst.tables.resolve_all(dst.manifest(s)))
            res.skipped.append((s, "already in the destination" + (" (identical)" if same else " (different content!)")))
            if same:
                refs.point(s)
            else:
                refs.skip(s, f"step {s} has different content in the destination")
            continue
        plans.append(man)

    # The chunks copies reuse are read under a lease held for the whole
    # copy, and every commit's base-age check counts from that read.
    outer = dst.write_lease(plans[0].step if plans else 0)
    try:
        return _copy_steps(_CopyJob(src, dst, res, progress, verify_data, batch_bytes, t0, refs.point), plans)
    finally:
        dst.drop_lease(outer)


class _Refs:
    """The source's tags and checkpoint names of the steps a copy selected, written as their steps arrive."""

    def __init__(self, src: Catalog, dst: Catalog, selected: set[int], res: CopyResult):
        self.dst, self.res = dst, res
        self.by_step: dict[int, list[tuple[str, str, str]]] = {}  # step -> (kind, name space, name)
        for name, step in src.tags().items():
            if step in selected:
                self.by_step.setdefault(step, []).append(("tag", "", name))
        for ns, names in src.all_names().items():
            for name, step in names.items():
                if step in selected:
                    self.by_step.setdefault(step, []).append(("name", ns, name))
        self.have_tags = dst.tags() if self.by_step else {}
        self.have_names = dst.all_names() if self.by_step else {}

    def point(self, step: int) -> None:
        """Write the tags and names of ``step``, now in the destination, where they differ."""
        for kind, ns, name in self.by_step.get(step, ()):
            if kind == "tag":
                before = self.have_tags.get(name)
                if before != step:
                    self.dst.store.put(tag_key(name), tag_record(step))
                    self.res.tags[name] = step
            else:
                before = self.have_names.get(ns, {}).get(name)
                if before != step:
                    self.dst.store.put(name_key(ns, name), name_record(ns, name, step, self.dst.clock.time()))
                    self.res.names.setdefault(ns, {})[name] = step
            if before is not None and before != step:
                self.res.moved[_ref_label(kind, ns, name)] = before

    def skip(self, step: int, why: str) -> None:
        for kind, ns, name in self.by_step.get(step, ()):
            self.res.refs_skipped.append((_ref_label(kind, ns, name), why))


def _ref_label(kind: str, ns: str, name: str) -> str:
    return f"tag {name}" if kind == "tag" else f"name {ns}:{name}"


@dataclass
class _CopyJob:
    """What one ``cp`` copies between, and how: fixed for all its steps."""

    src: Catalog
    dst: Catalog
    res: CopyResult
    progress: Callable
    verify_data: bool
    batch_bytes: int
    t0: float
    on_copied: Callable[[int], None]  # a step is committed in the destination


def _copy_steps(job: _CopyJob, plans: list) -> CopyResult:
    src, dst, res, progress = job.src, job.dst, job.res, job.progress
    verify_data, batch_bytes, t0, on_copied = job.verify_data, job.batch_bytes, job.t0, job.on_copied
    index_read_at = dst.clock.monotonic()
    index, pack_sizes = _dst_index(dst)
    # Total bytes to move (upper bound for progress: chunks not yet in dst).
    seen = set(index)
    total = 0
    for man in plans:
        for c in man.chunk_refs():
            if c.hash not in seen:
                seen.add(c.hash)
                total += c.stored_len
    copied = Counter(progress, "copy bytes", total)  # stored bytes the destination acknowledged

    for man in plans:
        step = man.step
        commit = StepCommit(dst, step, base=None)
        writer = None
        segments: list[str] = []
        try:
            commit.begin(base_read_at=index_read_at)
            writer = PackWriter(dst.store, dst.runtime, dst.options, window=4,
                                on_acked=lambda raw, stored: copied.add(stored))
            try:
                new_refs = _copy_chunks(src, man, index, writer, batch_bytes, res)
                sealed = writer.finish()
            except BaseException:
                writer.abort()
                raise
            tensors = {}
            reused = 0
            builder = TableBuilder()
            used: list[ChunkRef] = []
            for k, e in man.tensors.items():
                shards = []
                for s in e.shards:
                    refs = []
                    for c in s.chunks:
                        r = new_refs.get(c.hash)
                        if r is None:
                            r = index[c.hash]
                            reused += 1
                        refs.append(r)
                    first, count = builder.extend(refs)
                    used += refs
                    shards.append(Shard(s.offsets, s.sizes, tuple(refs), TableRef(0, first, count)))
                tensors[k] = TensorEntry(e.key, e.dtype, e.shape, tuple(shards), tile=e.tile)
            segment = write_segment(dst, builder, written=segments)
            res.chunks_reused += reused
            stats = dict(man.stats)
            stats.update(
                {
                    "new_bytes": sum(r.raw_len for r in new_refs.values()),
                    "stored_bytes": sum(r.stored_len for r in new_refs.values()),
                    "pack_bytes": sum(sealed.values()),
                    "segment_bytes": segment.size,
                }
            )
            stats["reused_bytes"] = max(0, stats.get("logical_bytes", 0) - stats["new_bytes"])
            new_man = Manifest(
                step=step,
                created=man.created,
                tensors=tensors,
                tree=man.tree,
                packs={c.pack: 0 for c in used},
                metadata=man.metadata,
                base_step=None,
                stats=stats,
                dcp=man.dcp,
                segments=(segment,),
                pack_use=pack_usage(used, writer.counts),
            )
            new_man = commit.pack_sizes(new_man, sealed, known=pack_sizes)
            _m.from_json(_m.to_json(new_man), expect_step=step)  # strict validation before the commit
            commit.commit(new_man)
        except BaseException as e:
            # This step's new packs serve only its own commit (later steps reuse them once it is committed).
            if writer is not None and commit.uncommitted(e):
                writer.abort()
                discard_uncommitted(dst, step, e, list(writer.created), segments)
            raise
        finally:
            commit.end()
        index.update(new_refs)
        pack_sizes.update(sealed)
        res.packs.extend(sealed)
        report = verify(dst, step=step, read_data=verify_data)
        if not report.ok:
            raise IntegrityError(f"{dst.url}: step {step} was copied but does not verify:\n{report}")
        res.copied.append(step)
        on_copied(step)
    progress("copy bytes", total, total)
    res.seconds = time.perf_counter() - t0
    return res


def _copy_chunks(src: Catalog, man: Manifest, index, writer: PackWriter, batch_bytes: int,
                 res: CopyResult) -> dict[str, ChunkRef]:
    """Copy the chunks of ``man`` that ``index`` lacks, unique, in state-dict order."""
    need: list[ChunkRef] = []
    need_set = set()
    order = tree_keys(man.tree)
    in_tree = set(order)
    order += [k for k in man.tensors if k not in in_tree]  # DCP bytes items
    for k in order:
        for s in man.tensors[k].shards:
            for c in s.chunks:
                if c.hash not in index and c.hash not in need_set:
                    need_set.add(c.hash)
                    need.append(c)
    new_refs: dict[str, ChunkRef] = {}
    where = f"{src.url}: step {man.step}: "
    batch: list[ChunkRef] = []
    for n, c in enumerate(need):
        batch.append(c)
        if sum(r.stored_len for r in batch) < batch_bytes and n + 1 < len(need):
            continue
        stored: list = [None] * len(batch)

        def keep(i: int, raw, data) -> None:
            stored[i] = bytes(data)

        src.fetcher.fetch(batch, keep, lambda i: where)
        for r, data in zip(batch, stored):
            new_refs[r.hash] = writer.add(r.hash, r.codec, [data], r.raw_len)
            res.chunks_copied += 1
            res.bytes_copied += len(data)
            res.raw_bytes_copied += r.raw_len
        batch = []
    return new_refs


def _content_key(man: Manifest):
    return (
        man.tree,
        {k: (e.dtype, e.shape, [(s.offsets, s.sizes, [c.hash for c in s.chunks]) for s in e.shards])
         for k, e in man.tensors.items()},
    )


# ==================================================================== diff
def diff(repo: Catalog, step_a: int, step_b: int) -> dict:
    """Compare two steps from their manifests alone (chunk hashes; no tensor data is read).

    Returns ``{"a", "b", "added": [...], "removed": [...], "changed": [...],
    "unchanged": [...], "values": {"added", "removed", "changed"}}``:
    tensors are listed by key; a changed tensor is
    ``{"key", "reason", "chunks", "changed_chunks", "changed_bytes"}`` where
    ``reason`` is ``"dtype"``, ``"shape"``, ``"layout"`` (same dtype and
    shape, stored in other shards) or ``"data"``, and ``changed_chunks`` /
    ``changed_bytes`` count the chunks of step B's tensor (and their raw
    bytes) that step A's tensor does not hold at the same position (by
    content hash, anywhere in the tensor when the shard layouts differ).
    Added/removed tensors are ``{"key", "dtype", "shape", "bytes"}``.
    """
    ma, mb = repo.tables.resolve_all(repo.manifest(step_a)), repo.tables.resolve_all(repo.manifest(step_b))
    ka, kb = tree_keys(ma.tree), tree_keys(mb.tree)
    sa, sb = set(ka), set(kb)

    def desc(e: TensorEntry) -> dict:
        return {"key": e.key, "dtype": e.dtype, "shape": list(e.shape), "bytes": e.nbytes}

    out: dict[str, Any] = {
        "a": ma.step,
        "b": mb.step,
        "added": [desc(mb.tensors[k]) for k in kb if k not in sa],
        "removed": [desc(ma.tensors[k]) for k in ka if k not in sb],
        "changed": [],
        "unchanged": [],
    }
    for k in kb:
        if k not in sa:
            continue
        ea, eb = ma.tensors[k], mb.tensors[k]
        nchunks = sum(len(s.chunks) for s in eb.shards)
        if ea.dtype != eb.dtype or ea.shape != eb.shape:
            out["changed"].append(
                {"key": k, "reason": "dtype" if ea.dtype != eb.dtype else "shape",
                 "from": f"{ea.dtype}{list(ea.shape)}", "to": f"{eb.dtype}{list(eb.shape)}",
                 "chunks": nchunks, "changed_chunks": nchunks, "changed_bytes": eb.nbytes}
            )
            continue
        same_layout = ea.tile == eb.tile and len(ea.shards) == len(eb.shards) and all(
            x.offsets == y.offsets and x.sizes == y.sizes and [c.raw_len for c in x.chunks] == [c.raw_len for c in y.chunks]
            for x, y in zip(ea.shards, eb.shards)
        )
        if same_layout:
            diffs = [cb for x, y in zip(ea.shards, eb.shards) for ca, cb in zip(x.chunks, y.chunks) if ca.hash != cb.hash]
        else:
            have = {c.hash for s in ea.shards for c in s.chunks}
            diffs = [c for s in eb.shards for c in s.chunks if c.hash not in have]
        if not diffs and same_layout:
            out["unchanged"].append(k)
        else:
            out["changed"].append(
                {"key": k, "reason": "data" if same_layout else "layout", "chunks": nchunks,
                 "changed_chunks": len(diffs), "changed_bytes": sum(c.raw_len for c in diffs)}
            )
    va = {k: v for k, (v, _) in leaf_values(ma.tree).items()}
    vb = {k: v for k, (v, _) in leaf_values(mb.tree).items()}
    out["values"] = {
        "added": {k: vb[k] for k in vb if k not in va},
        "removed": {k: va[k] for k in va if k not in vb},
        "changed": {k: {"from": va[k], "to": vb[k]} for k in vb if k in va and _json(va[k]) != _json(vb[k])},
    }
    return out


def _json(v) -> str:
    return json.dumps(v, sort_keys=True, allow_nan=True)
