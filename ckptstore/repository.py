"""The checkpoint repository: save and load pipelines, dedup, commit.

Objects under the repository root (see ``docs/format.md``)::

    config.json                    format version and write defaults
    packs/<id[:2]>/<id>.pack       immutable packs of compressed chunks
    manifests/<step:020d>.json     one per committed step, written last
    refs/tags/<name>               tag -> step (mutable)

Save: tensors are cut into chunks (memoryviews over the tensors' own
memory, no serialized copy), hashed and compressed on a thread pool,
appended in state-dict order to packs streamed part by part through
parallel multipart uploads, then the manifest is created with put-if-absent.
Load: a read plan maps the wanted slice to chunks and the chunks to
coalesced byte ranges, fetched concurrently, verified and decoded straight
into the destination tensor.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import math
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from . import codec as _codec
from . import manifest as _m
from . import pack as _pack
from . import planner as _plan
from .errors import (
    FormatError,
    IntegrityError,
    MissingDataError,
    ObjectExistsError,
    ObjectNotFoundError,
    StepExistsError,
    StaleBaseError,
    StepNotFoundError,
    StorageError,
)
from .manifest import ChunkRef, Manifest, Shard, TensorEntry
from .storage.base import MIN_PART_SIZE, BufferPool, ObjectStore, ParallelUploader
from .tree import flatten, tree_keys, unflatten

MiB = 1 << 20
LEASE_PREFIX = "leases/"
TOMBSTONE_PREFIX = "tombstones/"
TOMBSTONE_FORMAT = "ckptstore.tombstone"
DEFAULT_GRACE = 2 * 3600.0
CONFIG_KEY = "config.json"
MANIFEST_PREFIX = "manifests/"
PACK_PREFIX = "packs/"
TAG_PREFIX = "refs/tags/"
CONFIG_FORMAT = "ckptstore.config"
MAX_STEP = 10**19 - 1
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def safety_margin(grace: float) -> float:
    """Slack between a saver's own deadline and GC's: clock skew, listing delay."""
    return min(0.1 * grace, 300.0)


def manifest_key(step: int) -> str:
    return f"{MANIFEST_PREFIX}{step:020d}.json"


def pack_key(pack_id: str) -> str:
    return f"{PACK_PREFIX}{pack_id[:2]}/{pack_id}.pack"


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= int(step) <= MAX_STEP:
        raise ValueError(f"step must be an integer in [0, {MAX_STEP}], got {step!r}")
    return int(step)


@dataclass(frozen=True)
class StepInfo:
    """What one save did.

    Attributes
    ----------
    step: the step number committed.
    logical_bytes: raw bytes of every tensor in the state dict.
    uploaded_bytes: bytes written to the store (packs, manifest).
    reused_bytes: raw bytes referenced from chunks already stored.
    new_bytes: raw bytes of chunks stored for the first time.
    stored_bytes: compressed size of those new chunks.
    compression_ratio: ``new_bytes / stored_bytes`` (1.0 when nothing new).
    seconds: wall time of the save.
    """

    step: int
    logical_bytes: int
    uploaded_bytes: int
    reused_bytes: int
    new_bytes: int
    stored_bytes: int
    compression_ratio: float
    seconds: float
    tensors: int
    new_chunks: int
    reused_chunks: int
    packs: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class TensorMeta:
    """Shape and placement of one stored tensor."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    shards: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (offsets, sizes)
    nbytes: int
    stored_bytes: int
    chunks: int


#: I/O threads and largest range request for stores that are not remote
#: (unless given explicitly).
LOCAL_IO_WORKERS = 4
LOCAL_MAX_REQUEST = 8 * MiB


@dataclass
class RepoOptions:
    """Tunables of a repository handle; every limit is named here.

    chunk_size: raw bytes per chunk (dedup and range-read granularity).
    pack_size: target bytes per pack object.
    part_size: multipart part size (S3: at least 5 MiB).
    workers: threads hashing and compressing.
    io_workers: concurrent requests (parts in flight, ranged GETs); at
        most ``LOCAL_IO_WORKERS`` (4) on a local or memory store unless given.
    max_inflight_bytes: memory budget for chunks and parts in flight.
    packs_in_flight: sealed packs still uploading while the next fills.
    level: zstd level.
    codec: "zstd" or "raw".
    coalesce_gap: merge range reads of one pack separated by at most this.
    max_request: largest single ranged GET (at most ``LOCAL_MAX_REQUEST``,
        8 MiB, on a local or memory store unless given).
    tensor_workers: tensors loaded at once by ``load``.
    grace: GC grace period in seconds, recorded in the config of a new
        repository (the repository's recorded value wins otherwise).
    """

    chunk_size: int = 4 * MiB
    pack_size: int = 256 * MiB
    part_size: int = 16 * MiB
    workers: int = max(2, min(8, os.cpu_count() or 2))
    io_workers: int = 16
    max_inflight_bytes: int = 512 * MiB
    packs_in_flight: int = 2
    level: int = _codec.DEFAULT_LEVEL
    codec: str = "zstd"
    coalesce_gap: int = 1 * MiB
    max_request: int = 32 * MiB
    tensor_workers: int = 4
    grace: float = DEFAULT_GRACE

    def check(self) -> None:
        if self.chunk_size < 4096 or self.chunk_size > _m.MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_size must be in [4096, {_m.MAX_CHUNK_BYTES}], got {self.chunk_size}")
        if self.part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} (S3's minimum), got {self.part_size}")
        if not (self.grace >= 0):
            raise ValueError("grace must be a non-negative number of seconds")
        if self.pack_size < 1:
            raise ValueError("pack_size must be positive")
        if self.codec not in _codec.CODECS:
            raise ValueError(f"codec must be one of {_codec.CODECS}, got {self.codec!r}")
        for name in ("workers", "io_workers", "packs_in_flight", "tensor_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a tensor's data, copying only when it must."""
    t = t.detach()
    if t.device.type != "cpu":
        t = _to_host(t)
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _to_host(t: torch.Tensor, slice_bytes: int = 64 * MiB) -> torch.Tensor:
    """Copy a device tensor to host memory through a pinned buffer in slices."""
    t = t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    if t.numel() == 0:
        return out
    src = t.reshape(-1).view(torch.uint8)
    dst = out.reshape(-1).view(torch.uint8)
    n = src.numel()
    pinned = torch.empty(min(n, slice_bytes), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    for off in range(0, n, slice_bytes):
        m = min(slice_bytes, n - off)
        pinned[:m].copy_(src[off : off + m], non_blocking=False)
        dst[off : off + m].copy_(pinned[:m])
    return out


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """Writable uint8 NumPy view of a contiguous CPU tensor."""
    if t.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


MAX_RELOCATION_HOPS = 8
RELOCATION_PREFIX = "relocations/"
RELOCATION_FORMAT = "ckptstore.relocation"


def relocation_key(pack_id: str) -> str:
    return f"{RELOCATION_PREFIX}{pack_id[:2]}/{pack_id}.json"


def parse_relocation(raw: bytes, pack_id: str) -> dict[str, ChunkRef]:
    """Parse a relocation record: chunk hash -> new location, strictly validated."""
    if len(raw) > _m.MAX_MANIFEST_BYTES:
        raise FormatError(f"relocation record of pack {pack_id} is too large")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise FormatError(f"relocation record of pack {pack_id} is not valid JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != RELOCATION_FORMAT or doc.get("pack") != pack_id:
        raise FormatError(f"relocation record of pack {pack_id} is malformed")
    _m.check_version(doc.get("version"), f"relocation record of pack {pack_id}")
    chunks = doc.get("chunks")
    if not isinstance(chunks, dict):
        raise FormatError(f"relocation record of pack {pack_id}: 'chunks' must be an object")
    out = {}
    for h, loc in chunks.items():
        if not _codec.is_hash(h) or not isinstance(loc, list) or len(loc) != 5:
            raise FormatError(f"relocation record of pack {pack_id}: bad entry for {h!r:.70}")
        pid, off, slen, rlen, cod = loc
        if (
            not _m.is_pack_id(pid)
            or any(type(x) is not int or x < 0 for x in (off, slen, rlen))
            or cod not in _codec.CODECS
            or (cod == "raw" and slen != rlen)
        ):
            raise FormatError(f"relocation record of pack {pack_id}: bad location for chunk {h[:16]}")
        out[h] = ChunkRef(h, pid, off, slen, rlen, cod)
    return out


def _writable_in_place(t: torch.Tensor) -> bool:
    """Chunks can be copied straight into ``t``'s memory."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


class RelocationTables:
    """Relocation records of one repository, each read at most once.

    Unreadable records count as absent (``verify`` and GC report what they
    cannot find; they do not stop on a damaged record).
    """

    def __init__(self, repo: "Repository"):
        self.repo = repo
        self._tables: dict[str, dict[str, ChunkRef] | None] = {}

    def table(self, pack_id: str) -> dict[str, ChunkRef] | None:
        if pack_id not in self._tables:
            try:
                self._tables[pack_id] = self.repo._relocation(pack_id)
            except FormatError:
                self._tables[pack_id] = None
        return self._tables[pack_id]

    def chain(self, ref: ChunkRef, present, recorded=None) -> list[ChunkRef]:
        """``ref`` and every location relocation records move it to, in order.

        Stops at a pack in ``present``, at a pack without a record (only
        packs in ``recorded`` are looked up, when given), or after
        :data:`MAX_RELOCATION_HOPS`. The chunk is found when the last
        element's pack is in ``present``.
        """
        out = [ref]
        for _ in range(MAX_RELOCATION_HOPS):
            if ref.pack in present or (recorded is not None and ref.pack not in recorded):
                break
            table = self.table(ref.pack)
            if not table or ref.hash not in table:
                break
            ref = table[ref.hash]
            out.append(ref)
        return out


def _in_buffer(piece, buf: bytearray) -> bool:
    """Whether ``piece`` (a buffer) points into ``buf``'s memory."""
    if not isinstance(piece, (memoryview, np.ndarray)):
        return False
    a = np.frombuffer(buf, dtype=np.uint8)
    return np.may_share_memory(np.asarray(piece), a)


def _copy_sink(view: np.ndarray, start: int):
    def sink(raw) -> None:
        n = len(raw)
        view[start : start + n] = np.frombuffer(raw, dtype=np.uint8, count=n)

    return sink


def _name(key, i: int) -> str:
    """The tensor a fetched item belongs to (``key`` is one name, or one per item)."""
    return key[i] if isinstance(key, list) else key


class _ByteBudget:
    """A counting limit on bytes in flight; one oversize request may pass alone."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._cv = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cv:
            while self.used and self.used + n > self.limit:
                self._cv.wait()
            self.used += n

    def release(self, n: int) -> None:
        with self._cv:
            self.used -= n
            self._cv.notify_all()


class PackVanishedError(ObjectNotFoundError):
    """A pack this save uploaded is gone before the commit."""


class Repository:
    """A checkpoint repository on one object store. Thread-safe for reads.

    Create with :func:`ckptstore.open`.
    """

    def __init__(self, store: ObjectStore, **options):
        self.store = store
        self.url = store.url
        self._explicit = set(options)
        self.options = RepoOptions(**options)
        self.options.check()
        if not getattr(store, "remote", False):
            # A local directory gains nothing from 16 threads and 32 MiB
            # requests, and each thread's malloc arena keeps its freed
            # request buffers: loading 4 GiB peaked at +627 MiB RSS with the
            # remote defaults, +64 MiB with these (and ran faster); see
            # docs/performance.md. Explicit options win.
            if "io_workers" not in self._explicit:
                self.options.io_workers = min(self.options.io_workers, LOCAL_IO_WORKERS)
            if "max_request" not in self._explicit:
                self.options.max_request = min(self.options.max_request, LOCAL_MAX_REQUEST)
        self._config: dict | None = None
        self._cpu_pool: cf.ThreadPoolExecutor | None = None
        self._io_pool: cf.ThreadPoolExecutor | None = None
        self._seal_pool: cf.ThreadPoolExecutor | None = None
        self._async_pool: cf.ThreadPoolExecutor | None = None
        self._tensor_pool: cf.ThreadPoolExecutor | None = None
        self._buffer_pools: dict[str, BufferPool] = {}
        self._budget = None
        self._staging: dict[str, torch.Tensor] = {}
        self._async_last: cf.Future | None = None
        self._pool_lock = threading.Lock()
        self._manifest_cache: dict[int, Manifest] = {}

    # ------------------------------------------------------------ plumbing
    def _pools(self):
        with self._pool_lock:
            if self._cpu_pool is None:
                o = self.options
                self._cpu_pool = cf.ThreadPoolExecutor(o.workers, thread_name_prefix="ckpt-cpu")
                self._io_pool = cf.ThreadPoolExecutor(o.io_workers, thread_name_prefix="ckpt-io")
                self._seal_pool = cf.ThreadPoolExecutor(o.packs_in_flight + 1, thread_name_prefix="ckpt-seal")
            return self._cpu_pool, self._io_pool, self._seal_pool

    def _read_budget(self) -> "_ByteBudget":
        with self._pool_lock:
            if self._budget is None:
                self._budget = _ByteBudget(max(self.options.max_request, self.options.max_inflight_bytes // 2))
            return self._budget

    def _buffers(self, name: str, size: int, keep: int) -> BufferPool:
        """The repository's pool ``name`` of reusable ``size``-byte buffers.

        Saves share them: ``"parts"`` (multipart part buffers) and
        ``"scratch"`` (chunk-sized byte planes). A pool is rebuilt when its
        size changes (the repository's config can set ``chunk_size``).
        """
        with self._pool_lock:
            pool = self._buffer_pools.get(name)
            if pool is None or pool.size != size:
                pool = self._buffer_pools[name] = BufferPool(size, keep=keep)
            return pool

    def close(self) -> None:
        """Wait for async saves, stop worker threads and close the store."""
        for p in (self._async_pool, self._tensor_pool, self._seal_pool, self._cpu_pool, self._io_pool):
            if p is not None:
                p.shutdown(wait=True)
        self._async_pool = self._tensor_pool = self._seal_pool = self._cpu_pool = self._io_pool = None
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"Repository({self.url!r})"

    def config(self) -> dict:
        """The repository's config object ({} until the first save)."""
        if self._config is None:
            try:
                raw = self.store.get(CONFIG_KEY)
            except ObjectNotFoundError:
                return {}
            self._config = _parse_config(raw, self.url)
            self._apply_config(self._config)
        return self._config

    def _apply_config(self, cfg: dict) -> None:
        for name in ("chunk_size", "pack_size", "codec", "level"):
            if name not in self._explicit and name in cfg:
                setattr(self.options, name, cfg[name])
        self.options.check()

    def _ensure_config(self) -> None:
        if self.config():
            return
        o = self.options
        cfg = {
            "format": CONFIG_FORMAT,
            "version": list(_m.VERSION),
            "hash": _codec.HASH_NAME,
            "chunk_size": o.chunk_size,
            "pack_size": o.pack_size,
            "codec": o.codec,
            "level": o.level,
            "grace": o.grace,
            "created": time.time(),
        }
        try:
            self.store.put_if_absent(CONFIG_KEY, json.dumps(cfg, indent=1).encode())
        except ObjectExistsError:
            pass  # another writer created it first: use theirs
        self._config = None
        self.config()

    # ------------------------------------------------------------ steps
    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        out = []
        for info in self.store.list(MANIFEST_PREFIX):
            name = info.key[len(MANIFEST_PREFIX) :]
            if len(name) == 25 and name.endswith(".json") and name[:20].isdigit():
                out.append(int(name[:20]))
        return sorted(out)

    def latest(self) -> int | None:
        """The newest committed step, or None in an empty repository."""
        s = self.steps()
        return s[-1] if s else None

    def manifest(self, step: int) -> Manifest:
        """Parse and return one step's manifest (cached; manifests are immutable)."""
        step = _check_step(step)
        m = self._manifest_cache.get(step)
        if m is not None:
            return m
        key = manifest_key(step)
        try:
            info = self.store.head(key)
            if info.size > _m.MAX_MANIFEST_BYTES:
                raise FormatError(f"{self.url}: step {step}: manifest is {info.size} bytes, over the limit")
            raw = self.store.get(key)
        except ObjectNotFoundError:
            raise StepNotFoundError(f"{self.url}: step {step} is not committed") from None
        try:
            m = _m.from_json(raw, expect_step=step)
        except FormatError as e:
            raise type(e)(f"{self.url}: step {step}: {e}") from None
        self._manifest_cache[step] = m
        return m

    def _relocation(self, pack_id: str) -> dict[str, ChunkRef] | None:
        """The relocation record of a repacked pack, or None."""
        try:
            raw = self.store.get(relocation_key(pack_id))
        except ObjectNotFoundError:
            return None
        return parse_relocation(raw, pack_id)

    def checkpoint(self, step: int) -> "Checkpoint":
        """A read view of one committed step."""
        return Checkpoint(self, self.manifest(step))

    def delete(self, step: int) -> None:
        """Delete one step; its packs are reclaimed by GC.

        A tombstone holding the manifest is written first, so packs the step
        referenced stay protected from GC while a saver that read it as its
        dedup base may still commit (``docs/gc.md``).
        """
        step = _check_step(step)
        key = manifest_key(step)
        try:
            raw = self.store.get(key)
        except ObjectNotFoundError:
            raise StepNotFoundError(f"{self.url}: step {step} is not committed") from None
        tomb = {
            "format": TOMBSTONE_FORMAT,
            "version": list(_m.VERSION),
            "step": step,
            "deleted_at": time.time(),
            "manifest": raw.decode("utf-8", errors="replace"),
        }
        self.store.put(f"{TOMBSTONE_PREFIX}{step:020d}-{uuid.uuid4().hex[:8]}.json", json.dumps(tomb).encode())
        self.store.delete(key)
        self._manifest_cache.pop(step, None)

    # ------------------------------------------------------------ tags
    def tag(self, step: int, name: str) -> None:
        """Point tag ``name`` at a committed step (replacing an earlier target)."""
        step = _check_step(step)
        if not isinstance(name, str) or not _TAG_RE.match(name):
            raise ValueError(f"invalid tag name {name!r}: use letters, digits, '.', '_', '-' (max 128)")
        if step not in self.steps():
            raise StepNotFoundError(f"{self.url}: step {step} is not committed")
        self.store.put(TAG_PREFIX + name, json.dumps({"step": step}).encode())

    def tags(self) -> dict[str, int]:
        """Tag name -> step."""
        out = {}
        for info in self.store.list(TAG_PREFIX):
            name = info.key[len(TAG_PREFIX) :]
            try:
                doc = json.loads(self.store.get(info.key))
                out[name] = _check_step(doc["step"])
            except (ObjectNotFoundError, ValueError, KeyError, TypeError):
                continue
        return out

    # ------------------------------------------------------------ save
    def save(
        self,
        state_dict: Mapping,
        step: int,
        metadata: dict | None = None,
        blocking: bool = True,
        base: int | str | None = "latest",
    ):
        """Save a state dict as a new committed step.

        Parameters
        ----------
        state_dict:
            Nested dicts/lists/tuples of tensors and plain JSON values.
        step:
            Step number; saving a step that exists raises
            :class:`StepExistsError` and changes nothing.
        metadata:
            JSON-serializable dict stored with the step.
        blocking:
            If False, copy the tensors to host memory, then return a
            ``concurrent.futures.Future`` resolving to the :class:`StepInfo`;
            the caller may modify its tensors as soon as this returns.
        base:
            Dedup base: ``"latest"`` (default), a step number, or None.

        Returns
        -------
        StepInfo, or Future[StepInfo] when ``blocking=False``.
        """
        step = _check_step(step)
        tree, tensors = flatten(state_dict)
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict):
            raise TypeError("metadata must be a dict of JSON values")
        try:
            json.dumps(metadata, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise TypeError(f"metadata is not JSON-serializable: {e}") from None
        if not blocking:
            staged = self._stage_all(tensors)
            with self._pool_lock:
                if self._async_pool is None:
                    self._async_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="ckpt-async")
                fut = self._async_pool.submit(self._save, tree, staged, step, metadata, base)
                self._async_last = fut
            return fut
        return self._save(tree, tensors, step, metadata, base)

    def _stage_all(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host copies for an async save, reusing the previous save's buffers.

        A fresh allocation pays a page fault per page on first touch (about
        2 s per GiB measured here); copying into buffers already touched runs
        at memory speed. Buffers are reused only once the async save that
        used them has finished; otherwise fresh ones are allocated.
        """
        last = self._async_last
        pool = self._staging if (last is None or last.done()) else {}
        staged = {}
        for k, t in tensors.items():
            buf = pool.get(k)
            src = t.detach()
            if (
                buf is not None
                and src.device.type == "cpu"
                and buf.shape == src.shape
                and buf.dtype == src.dtype
            ):
                buf.copy_(src.resolve_conj().resolve_neg())
                staged[k] = buf
            else:
                staged[k] = _stage(t)
        self._staging = staged
        return staged

    def _save(self, tree, tensors: dict[str, torch.Tensor], step, metadata, base) -> StepInfo:
        t0 = time.perf_counter()
        if self.store.exists(manifest_key(step)):
            raise StepExistsError(f"{self.url}: step {step} already exists; nothing was written")
        self._ensure_config()
        # The lease goes up before the dedup base is read (see docs/gc.md).
        lease = self._write_lease(step)
        try:
            base_step, base_refs = self._dedup_base(base)
            writer = _SaveWriter(self, base_refs)
            entries: dict[str, tuple[torch.Tensor, list]] = {}
            try:
                for key in tree_keys(tree):
                    t = tensors[key]
                    entries[key] = (t, writer.add(t))
                packs = writer.finish()
            except PackVanishedError as e:
                writer.abort()
                self._check_base_age(step, t0)  # a slow save: say so
                raise StorageError(str(e)) from None
            except BaseException:
                writer.abort()
                raise
            return self._finish_save(step, tree, metadata, base_step, writer, entries, packs, t0)
        finally:
            self._drop_lease(lease)

    def _finish_save(self, step, tree, metadata, base_step, writer, entries, packs, t0) -> StepInfo:
        te = {}
        for key, (t, refs) in entries.items():
            shape = tuple(t.shape)
            te[key] = TensorEntry(key, _m.dtype_name(t.dtype), shape, (Shard((0,) * len(shape), shape, tuple(refs)),))
        stats = writer.stats(packs)
        man = Manifest(
            step=step,
            created=time.time(),
            tensors=te,
            tree=tree,
            packs={c.pack: 0 for r in te.values() for s in r.shards for c in s.chunks},
            metadata=metadata,
            base_step=base_step,
            stats=stats,
        )
        man = self._resolve_pack_sizes(man, packs)
        self._check_base_age(step, t0)
        body = self._commit(man)
        secs = time.perf_counter() - t0
        return StepInfo(
            step=step,
            logical_bytes=writer.logical,
            uploaded_bytes=sum(packs.values()) + len(body),
            reused_bytes=writer.reused,
            new_bytes=writer.new_raw,
            stored_bytes=writer.new_stored,
            compression_ratio=(writer.new_raw / writer.new_stored) if writer.new_stored else 1.0,
            seconds=secs,
            tensors=len(te),
            new_chunks=writer.new_chunks,
            reused_chunks=writer.reused_chunks,
            packs=len(packs),
        )

    def _dedup_base(self, base) -> tuple[int | None, dict[str, ChunkRef]]:
        """The dedup base step and its chunks by hash."""
        base_step = self.latest() if base == "latest" else (None if base is None else _check_step(base))
        refs: dict[str, ChunkRef] = {}
        if base_step is not None:
            for c in self.manifest(base_step).chunk_refs():
                refs.setdefault(c.hash, c)
        return base_step, refs

    # ------------------------------------------------------------ GC protocol (docs/gc.md)
    def grace(self) -> float:
        """Seconds an unreferenced object must age before GC may delete it."""
        cfg = self.config()
        if "grace" in self._explicit or "grace" not in cfg:
            return float(self.options.grace)
        return float(cfg["grace"])

    def _write_lease(self, step: int) -> str:
        key = f"{LEASE_PREFIX}{uuid.uuid4().hex}.json"
        doc = {"step": step, "started": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
        self.store.put(key, json.dumps(doc).encode())
        return key

    def _drop_lease(self, key: str | None) -> None:
        if key is None:
            return
        try:
            self.store.delete(key)
        except Exception:
            pass  # a stale lease only delays GC; it expires after the grace period

    def _check_base_age(self, step: int, t0: float) -> None:
        """Invariant 5: refuse to commit once the dedup base may have been collected.

        ``t0`` (``perf_counter``) was taken before the dedup base was read. GC
        keeps the packs of a deleted step for the grace period after the
        deletion; a save that outlived ``grace - margin`` since reading its
        base can no longer rely on that.
        """
        grace = self.grace()
        margin = safety_margin(grace)
        age = time.perf_counter() - t0
        if age > grace - margin:
            raise StaleBaseError(
                f"{self.url}: step {step}: this save read its dedup base {age:.3g} s ago, longer than the "
                f"repository's GC grace period ({grace:.3g} s) less the safety margin ({margin:.3g} s); "
                "chunks it reuses may have been collected, so it does not commit. Save again, or raise "
                "the grace period (ckptstore.open(..., grace=SECONDS) on an empty repository)."
            )

    def _commit(self, man: Manifest) -> bytes:
        """Create the step's manifest (exclusive create): the step now exists."""
        body = _m.to_json(man)
        try:
            self.store.put_if_absent(manifest_key(man.step), body)
        except ObjectExistsError:
            # A retried create whose first response was lost finds its own
            # manifest: accept it if it is byte-identical, refuse otherwise.
            try:
                stored = self.store.get(manifest_key(man.step))
            except ObjectNotFoundError:
                stored = None
            if stored == body:
                self._manifest_cache[man.step] = man
                return body
            raise StepExistsError(
                f"{self.url}: step {man.step} was committed by another writer during this save; "
                "this save's packs are unreferenced and will be reclaimed by gc"
            ) from None
        self._manifest_cache[man.step] = man
        return body

    def _resolve_pack_sizes(self, man: Manifest, new_packs: dict[str, int]) -> Manifest:
        sizes = {}
        base = self._manifest_cache.get(man.base_step) if man.base_step is not None else None
        for pid in man.packs:
            if pid in new_packs:
                sizes[pid] = new_packs[pid]
            elif base is not None and pid in base.packs:
                sizes[pid] = base.packs[pid]
            else:
                sizes[pid] = self.store.head(pack_key(pid)).size
        return Manifest(**{**man.__dict__, "packs": sizes})

    # ------------------------------------------------------------ load
    def load(self, step: int | None = None, into: Mapping | None = None) -> dict:
        """Load a step (default: the latest) as a state dict.

        With ``into``, tensors are read in place into the given state dict's
        tensors (same keys, shapes and dtypes) without a second full copy,
        plain values are replaced, and ``into`` is returned.
        """
        if step is None:
            step = self.latest()
            if step is None:
                raise StepNotFoundError(f"{self.url}: the repository has no committed step")
        ckpt = self.checkpoint(step)
        if into is None:
            keys = ckpt.keys()
            tensors = {}
            for k in keys:
                e = ckpt.manifest.tensors[k]
                tensors[k] = torch.empty(e.shape, dtype=_m.DTYPES[e.dtype])
            ckpt.read_many_into(tensors)
            return unflatten(ckpt.manifest.tree, tensors.__getitem__)
        _, dest = flatten(into)
        missing = [k for k in dest if k not in ckpt.manifest.tensors]
        if missing:
            raise KeyError(f"step {step} has no tensor(s) {missing[:5]} present in `into`")
        ckpt.read_many_into(dest)
        _replace_values(into, ckpt.manifest.tree)
        return into

    def _map_tensors(self, fn, keys: list[str]) -> list:
        """Run ``fn(key)`` for several tensors at once (each fans out to the I/O pool)."""
        with self._pool_lock:
            if self._tensor_pool is None:
                self._tensor_pool = cf.ThreadPoolExecutor(
                    self.options.tensor_workers, thread_name_prefix="ckpt-tensor"
                )
        futures = [self._tensor_pool.submit(fn, k) for k in keys]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    # ------------------------------------------------------------ gc, verify
    def plan_gc(self, **kwargs):
        """Plan retention and garbage collection; see :func:`ckptstore.gc.plan_gc`."""
        from .gc import plan_gc

        return plan_gc(self, **kwargs)

    def verify(self, step: int | None = None, read_data: bool = False, progress=None):
        """Check manifests, packs and (with ``read_data``) every chunk; see :mod:`ckptstore.verify`."""
        from .verify import verify

        return verify(self, step=step, read_data=read_data, progress=progress)

    # ------------------------------------------------------------ transfer (see ckptstore.transfer)
    def export(self, step: int, out, format: str = "safetensors", keys=None, progress=None) -> dict:
        """Write a step as a ``.safetensors`` file or (``format="dcp"``) a DCP directory."""
        from . import transfer

        if format == "safetensors":
            return transfer.export_safetensors(self, step, out, keys_glob=keys, progress=progress)
        if format == "dcp":
            if keys is not None:
                raise ValueError("keys selects tensors only for safetensors export")
            return transfer.export_dcp(self, step, out)
        raise ValueError(f"unknown export format {format!r}; use 'safetensors' or 'dcp'")

    def import_(self, path, step: int, **kwargs):
        """Save a .safetensors file, torch.save file or DCP directory as ``step``; see :func:`ckptstore.transfer.import_file`."""
        from .transfer import import_file

        return import_file(self, path, step, **kwargs)

    def copy_to(self, dst: "Repository", steps=None, **kwargs):
        """Copy steps to another repository, moving only chunks it lacks; see :func:`ckptstore.transfer.copy`."""
        from .transfer import copy

        return copy(self, dst, steps=steps, **kwargs)

    def diff(self, a: int, b: int) -> dict:
        """Tensors added, removed, changed and unchanged from step ``a`` to ``b``, from manifests only."""
        from .transfer import diff

        return diff(self, a, b)

    # ------------------------------------------------------------ stats
    def stats(self) -> dict:
        """Space accounting: stored and referenced bytes, dead bytes in partly used packs, ratios."""
        from .gc import space_accounting

        return space_accounting(self)


def _parse_config(raw: bytes, url: str) -> dict:
    try:
        cfg = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise FormatError(f"{url}/{CONFIG_KEY} is not valid JSON") from None
    if not isinstance(cfg, dict) or cfg.get("format") != CONFIG_FORMAT:
        raise FormatError(f"{url}/{CONFIG_KEY} is not a ckptstore config")
    _m.check_version(cfg.get("version"), f"{url}/{CONFIG_KEY}")
    g = cfg.get("grace", DEFAULT_GRACE)
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not g >= 0:
        raise FormatError(f"{url}/{CONFIG_KEY}: 'grace' must be a non-negative number of seconds")
    if cfg.get("hash") != _codec.HASH_NAME:
        raise FormatError(f"{url}: repository uses hash {cfg.get('hash')!r}; this version knows only blake3")
    return cfg


def _stage(t: torch.Tensor) -> torch.Tensor:
    """Host copy of a tensor for async save (the caller may mutate the original)."""
    t = t.detach()
    if t.device.type != "cpu":
        return _to_host(t)
    return t.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)


def _replace_values(into, tree) -> None:
    """Copy plain values from the stored tree into ``into`` (tensors stay)."""
    ((kind, val),) = tree.items()
    if kind != "d" or not isinstance(into, dict):
        return
    for k, node in val:
        ((nk, nv),) = node.items()
        if nk == "v":
            into[k] = nv
        elif nk == "d" and isinstance(into.get(k), dict):
            _replace_values(into[k], node)


# ==================================================================== save
class _SaveWriter:
    """Ordered chunk pipeline: hash+compress in parallel, append in order."""

    def __init__(self, repo: Repository, base_refs: dict[str, ChunkRef]):
        self.repo = repo
        self.o = repo.options
        self.cpu, self.io, self.seal = repo._pools()
        self.base = base_refs
        self.written: dict[str, ChunkRef] = {}
        self.pending: collections.deque = collections.deque()
        self.pending_bytes = 0
        o = self.o
        # Budget split: a quarter for chunks being hashed/compressed, the
        # rest for multipart parts buffered or in flight.
        self.lookahead = max(2 * o.chunk_size, min(o.max_inflight_bytes // 4, 4 * o.workers * o.chunk_size))
        per_pack = max(1, (o.max_inflight_bytes - self.lookahead) // (o.part_size * (o.packs_in_flight + 1)))
        self.window = max(1, min(8, per_pack - 1))
        self.scratch = repo._buffers("scratch", o.chunk_size, self.lookahead // o.chunk_size + o.workers + 1)
        self.pack: tuple[str, _pack.PackBuilder, ParallelUploader] | None = None
        self.sealing: list[tuple[str, int, cf.Future]] = []
        self.done: dict[str, int] = {}
        self.logical = self.reused = self.new_raw = self.new_stored = 0
        self.new_chunks = self.reused_chunks = 0

    def stats(self, packs: dict[str, int]) -> dict:
        """Byte counts of this save, as manifests record them."""
        return {
            "logical_bytes": self.logical,
            "new_bytes": self.new_raw,
            "stored_bytes": self.new_stored,
            "reused_bytes": self.reused,
            "pack_bytes": sum(packs.values()),
        }

    def add(self, t: torch.Tensor) -> list:
        mv = _tensor_bytes(t)
        dtype = str(t.dtype).removeprefix("torch.")
        self.logical += len(mv)
        refs: list = []
        cs = self.o.chunk_size
        for off in range(0, len(mv), cs):
            piece = mv[off : off + cs]
            while self.pending and self.pending_bytes + len(piece) > self.lookahead:
                self._drain_one()
            fut = self.cpu.submit(self._prepare, piece, dtype)
            self.pending.append((piece, fut, refs, dtype))
            self.pending_bytes += len(piece)
        return refs

    def _prepare(self, piece, dtype):
        """Hash and encode one chunk (on a CPU worker).

        Returns ``(hash, codec, pieces, scratch)``; ``scratch`` (or None)
        backs ``pieces`` and goes back to the pool once they are copied out.
        """
        h = _codec.hash_bytes(piece)
        if h in self.base or h in self.written:
            return h, None, None, None
        scratch = self.scratch.get() if len(piece) == self.scratch.size else None
        codec, pieces = _codec.encode_pieces(piece, self.o.codec, self.o.level, dtype, scratch)
        if scratch is not None and not any(_in_buffer(p, scratch) for p in pieces):
            self.scratch.put(scratch)
            scratch = None
        return h, codec, pieces, scratch

    def _drain_one(self) -> None:
        piece, fut, refs, dtype = self.pending.popleft()
        self.pending_bytes -= len(piece)
        h, codec, stored, scratch = fut.result()
        try:
            ref = self.written.get(h) or self.base.get(h)
            if ref is not None:
                self.reused += len(piece)
                self.reused_chunks += 1
            else:
                if stored is None:  # raced with a chunk that was then not written
                    codec, stored = _codec.encode_pieces(piece, self.o.codec, self.o.level, dtype)
                ref = self._append(h, codec, stored, len(piece))
                self.written[h] = ref
                self.new_raw += len(piece)
                self.new_stored += ref.stored_len
                self.new_chunks += 1
        finally:
            if scratch is not None:
                self.scratch.put(scratch)
        refs.append(ref)

    def _append(self, h, codec, pieces: list, raw_len) -> ChunkRef:
        if self.pack is None:
            pid = uuid.uuid4().hex
            up = ParallelUploader(
                self.repo.store, pack_key(pid), self.o.part_size, self.io, window=self.window,
                buffers=self.repo._buffers(
                    "parts", self.o.part_size, (self.o.packs_in_flight + 1) * (self.window + 1)),
            )
            up.write(_pack.header())
            self.pack = (pid, _pack.PackBuilder(), up)
        pid, builder, up = self.pack
        stored_len = sum(len(p) for p in pieces)
        e = builder.add(h, codec, stored_len, raw_len)
        for p in pieces:
            up.write(p)
        if builder.size >= self.o.pack_size:
            self._seal()
        return ChunkRef(h, pid, e.offset, stored_len, raw_len, codec)

    def _seal(self) -> None:
        pid, builder, up = self.pack
        self.pack = None
        up.write(builder.tail())
        expected = builder.final_size()
        while len([f for _, _, f in self.sealing if not f.done()]) >= self.o.packs_in_flight:
            cf.wait([f for _, _, f in self.sealing if not f.done()], return_when=cf.FIRST_COMPLETED)
        self.sealing.append((pid, expected, self.seal.submit(up.close)))

    def finish(self) -> dict[str, int]:
        while self.pending:
            self._drain_one()
        if self.pack is not None:
            self._seal()
        for pid, expected, fut in self.sealing:
            size = fut.result()
            if size != expected:
                raise StorageError(f"pack {pid}: wrote {size} bytes, expected {expected}")
        # Invariant 3: every pack the manifest will name is complete, with
        # the size we wrote, before the manifest write begins.
        store = self.repo.store
        def head(p):
            try:
                return p[0], p[1], store.head(pack_key(p[0])).size
            except ObjectNotFoundError:
                raise PackVanishedError(
                    f"{store.url}/{pack_key(p[0])}: pack vanished after its upload completed "
                    "(collected by gc after the save outlived the grace period?)"
                ) from None

        heads = list(self.io.map(head, self.sealing))
        for pid, expected, got in heads:
            if got != expected:
                raise StorageError(f"{store.url}/{pack_key(pid)}: stored size {got}, expected {expected}")
            self.done[pid] = got
        return dict(self.done)

    def abort(self) -> None:
        for _, fut, _, _ in self.pending:
            fut.cancel()
        self.pending.clear()
        if self.pack is not None:
            self.pack[2].abort()
            self.pack = None
        for _, _, fut in self.sealing:
            try:
                fut.result()
            except BaseException:
                pass


# ==================================================================== load
class Checkpoint:
    """Read view of one committed step."""

    def __init__(self, repo: Repository, manifest: Manifest):
        self.repo = repo
        self.manifest = manifest
        self.step = manifest.step

    def __repr__(self) -> str:
        return f"Checkpoint({self.repo.url!r}, step={self.step}, tensors={len(self.manifest.tensors)})"

    @property
    def metadata(self) -> dict:
        return self.manifest.metadata

    def keys(self) -> list[str]:
        """Tensor keys in state-dict order."""
        return tree_keys(self.manifest.tree)

    def __contains__(self, key) -> bool:
        return key in self.manifest.tensors

    def _entry(self, key: str) -> TensorEntry:
        try:
            return self.manifest.tensors[key]
        except KeyError:
            raise KeyError(f"step {self.step} has no tensor {key!r}") from None

    def tensor_meta(self, key: str) -> TensorMeta:
        e = self._entry(key)
        return TensorMeta(
            key=key,
            dtype=_m.DTYPES[e.dtype],
            shape=e.shape,
            shards=tuple((s.offsets, s.sizes) for s in e.shards),
            nbytes=e.nbytes,
            stored_bytes=sum(c.stored_len for s in e.shards for c in s.chunks),
            chunks=sum(len(s.chunks) for s in e.shards),
        )

    def values(self) -> dict:
        """The state dict with tensors replaced by their TensorMeta (no data read)."""
        return unflatten(self.manifest.tree, self.tensor_meta)

    def read(self, key: str, index: Any = None) -> torch.Tensor:
        """Read a tensor, or the slice ``index`` of it, fetching only covering chunks."""
        e = self._entry(key)
        dtype = _m.DTYPES[e.dtype]
        box, squeeze = _plan.normalize_index(index, e.shape)
        out = torch.empty(_plan.box_shape(box), dtype=dtype)
        self._read_box(e, box, out)
        if squeeze:
            out = out.reshape([n for d, n in enumerate(out.shape) if d not in squeeze])
        return out

    def read_into(self, key: str, dest: torch.Tensor) -> torch.Tensor:
        """Read a whole tensor into ``dest`` (same shape and dtype) in place."""
        e = self._check_dest(key, dest)
        box = tuple((0, n, 1) for n in e.shape)
        with torch.no_grad():
            if _writable_in_place(dest):
                self._read_box(e, box, dest.detach())
            else:
                tmp = torch.empty(e.shape, dtype=dest.dtype)
                self._read_box(e, box, tmp)
                dest.copy_(tmp)
        return dest

    def read_many_into(self, dests: dict[str, torch.Tensor]) -> None:
        """Read whole tensors into ``dests`` (key -> tensor of the stored shape and dtype).

        Tensors stored as one shard and read into contiguous CPU tensors are
        fetched together: their chunks are coalesced across tensors into few
        range requests (a state dict of many small tensors costs a handful
        of GETs, not one per tensor). The rest go one tensor at a time.
        """
        keys, refs, sinks, rest = [], [], [], []
        for key, dest in dests.items():
            e = self._check_dest(key, dest)
            if not (len(e.shards) == 1 and e.shards[0].sizes == e.shape and _writable_in_place(dest)):
                rest.append(key)
                continue
            if dest.numel() == 0:
                continue
            view = _byte_view(dest.detach())
            shard = e.shards[0]
            for start, c in zip(shard.chunk_starts(), shard.chunks):
                keys.append(key)
                refs.append(c)
                sinks.append(_copy_sink(view, start))
        self._fetch(keys, refs, sinks)
        if rest:
            self.repo._map_tensors(lambda k: self.read_into(k, dests[k]), rest)

    # -- internals
    def _check_dest(self, key: str, dest: torch.Tensor) -> TensorEntry:
        """The entry of ``key``, after checking ``dest`` has its shape and dtype."""
        e = self._entry(key)
        if tuple(dest.shape) != e.shape or dest.dtype != _m.DTYPES[e.dtype]:
            raise ValueError(
                f"step {self.step}: tensor {key!r} is {e.dtype}{list(e.shape)}, "
                f"destination is {str(dest.dtype).removeprefix('torch.')}{list(dest.shape)}"
            )
        return e

    def _read_box(self, e: TensorEntry, box, out: torch.Tensor) -> None:
        """Fill ``out`` (contiguous CPU, shape of the box) from every shard it meets."""
        if out.numel() == 0:
            return
        covered = 0
        jobs = []
        for shard in e.shards:
            hit = _plan.intersect(box, shard.offsets, shard.sizes)
            if hit is None:
                continue
            local, outbox = hit
            covered += math.prod(_plan.box_shape(outbox))
            jobs.append((shard, local, outbox))
        if covered < out.numel():
            raise FormatError(f"step {self.step}: tensor {e.key!r}: shards do not cover the requested region")
        for shard, local, outbox in jobs:
            full_out = len(jobs) == 1 and all(b == (0, n, 1) for b, n in zip(outbox, out.shape))
            target = out if full_out else out[tuple(slice(a, b) for a, b, _ in outbox)]
            self._read_shard(e, shard, local, target)

    def _read_shard(self, e: TensorEntry, shard: Shard, local, target: torch.Tensor) -> None:
        """Read box ``local`` of one shard into ``target`` (shape of the box)."""
        isz = _m.itemsize(e.dtype)
        shape = shard.sizes
        nd = len(shape)
        row = isz * math.prod(shape[1:]) if nd else isz
        if nd:
            r0 = local[0][0]
            r1 = local[0][0] + (_plan.box_len(local[0]) - 1) * local[0][2] + 1
        else:
            r0, r1 = 0, 1
        span_lo, span_hi = r0 * row, r1 * row
        direct = (
            target.device.type == "cpu"
            and target.is_contiguous()
            and (nd == 0 or all(b == (0, n, 1) for b, n in zip(local, shape)))
        )
        if direct:
            buf = target.detach()
        elif nd == 0:
            buf = torch.empty((), dtype=target.dtype)
        else:
            buf = torch.empty((r1 - r0,) + tuple(shape[1:]), dtype=target.dtype)
        view = _byte_view(buf)
        starts = shard.chunk_starts()
        runs = _plan.byte_runs(shape, isz, local)
        needed = _plan.chunks_for_runs(starts, shard.nbytes, runs)

        def sink(i: int, raw) -> None:
            cs, ce = starts[i], starts[i] + shard.chunks[i].raw_len
            lo, hi = max(cs, span_lo), min(ce, span_hi)
            if lo < hi:
                view[lo - span_lo : hi - span_lo] = np.frombuffer(raw, dtype=np.uint8, count=hi - lo, offset=lo - cs)

        self._fetch(e.key, [shard.chunks[i] for i in needed], [(lambda raw, i=i: sink(i, raw)) for i in needed])
        if not direct:
            sub = buf
            if nd:
                sub = buf[
                    (slice(local[0][0] - r0, local[0][1] - r0, local[0][2]),)
                    + tuple(slice(a, b, s) for a, b, s in local[1:])
                ]
            with torch.no_grad():
                target.copy_(sub)

    def _fetch(self, key: str | list[str], refs: Sequence[ChunkRef], sinks: Sequence[Callable]) -> None:
        """Fetch, verify and decode chunks; hand each one's raw bytes to its sink.

        ``key`` names the tensor for error messages: one name, or one per ref.
        """
        if not refs:
            return
        o = self.repo.options
        reqs = _plan.coalesce(
            [(r.pack, r.offset, r.offset + r.stored_len) for r in refs], o.coalesce_gap, o.max_request
        )
        _, io, _ = self.repo._pools()
        futures = [io.submit(self._run_request, key, q, refs, sinks, 0) for q in reqs]
        try:
            for f in cf.as_completed(futures):
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            cf.wait(futures)
            raise

    def _run_request(self, key, req: _plan.RangeRequest, refs, sinks, hops: int) -> None:
        # Bytes fetched and not yet decoded are bounded by the repository's
        # read budget (half of max_inflight_bytes), shared by every read.
        budget = self.repo._read_budget()
        n = req.end - req.start
        budget.acquire(n)
        try:
            moved = self._run_request_budgeted(key, req, refs, sinks)
        finally:
            budget.release(n)
        if moved:  # outside the budget: the relocated reads acquire their own
            self._relocated(key, req, refs, sinks, hops)

    def _run_request_budgeted(self, key, req: _plan.RangeRequest, refs, sinks) -> bool:
        """Fetch and decode one request; True when its pack is gone (see relocations)."""
        store = self.repo.store
        try:
            (data,) = store.get_ranges(pack_key(req.pack), [(req.start, req.end)])
        except ObjectNotFoundError:
            return True
        except ValueError as ex:
            r = refs[req.items[0]]
            raise IntegrityError(
                f"{self.repo.url}: step {self.step}: tensor {_name(key, req.items[0])!r}: pack {req.pack} is shorter than "
                f"the manifest says (offset {r.offset}): {ex}"
            ) from None
        except StorageError as ex:
            # The store's message names the object; add the step and tensor
            # (same class, so retry and caller logic see what they saw).
            raise type(ex)(
                f"step {self.step}: tensor {_name(key, req.items[0])!r}: reading bytes [{req.start}, {req.end}) "
                f"of pack {req.pack} failed: {ex}"
            ) from ex
        if len(data) != req.end - req.start:
            raise IntegrityError(
                f"{self.repo.url}: step {self.step}: tensor {_name(key, req.items[0])!r}: pack {req.pack}: "
                f"short read at {req.start}"
            )
        mv = memoryview(data)

        def decode(i):
            r = refs[i]
            stored = mv[r.offset - req.start : r.offset - req.start + r.stored_len]
            where = (
                f"{self.repo.url}: step {self.step}: tensor {_name(key, i)!r}: chunk {r.hash[:16]} "
                f"in pack {r.pack} at offset {r.offset}"
            )
            sinks[i](_codec.decode_verified(r.codec, stored, r.raw_len, r.hash, where))

        if len(req.items) == 1:
            decode(req.items[0])
            return False
        # Decoding and hashing release the GIL: spread one request's chunks
        # over the CPU pool (its tasks never wait on anything, so an I/O
        # thread waiting here cannot deadlock).
        cpu, _, _ = self.repo._pools()
        futures = [cpu.submit(decode, i) for i in req.items]
        for f in futures:
            f.result()
        return False

    def _relocated(self, key, req: _plan.RangeRequest, refs, sinks, hops: int) -> None:
        """A pack is gone: follow its relocation record (written by repack), if any."""
        r0 = refs[req.items[0]]
        missing = MissingDataError(
            f"{self.repo.url}: step {self.step}: tensor {_name(key, req.items[0])!r}: pack {req.pack} is missing "
            f"(needed at offset {r0.offset}) and no relocation record names its chunks; "
            "the step cannot be restored"
        )
        if hops >= MAX_RELOCATION_HOPS:
            raise missing
        table = self.repo._relocation(req.pack)
        if table is None:
            raise missing
        new_refs, new_sinks = [], []
        new_key = [_name(key, i) for i in req.items] if isinstance(key, list) else key
        for i in req.items:
            moved = table.get(refs[i].hash)
            if moved is None:
                raise missing
            new_refs.append(moved)
            new_sinks.append(sinks[i])
        o = self.repo.options
        sub = _plan.coalesce(
            [(r.pack, r.offset, r.offset + r.stored_len) for r in new_refs], o.coalesce_gap, o.max_request
        )
        for q in sub:  # serially, on this I/O thread: no nested pool waits
            self._run_request(new_key, q, new_refs, new_sinks, hops + 1)
