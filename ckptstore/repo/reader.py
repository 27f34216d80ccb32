"""Reading steps: :class:`Checkpoint`, the read view of one committed step.

A read maps the wanted slice to a box, intersects it with every stored
shard, turns each shard's sub-box into byte runs and the runs into the
chunks they touch (:mod:`ckptstore.pipeline.planner`), and fetches those chunks
through the repository's one :class:`~ckptstore.pipeline.fetch.ChunkFetcher`
(coalesced, concurrent, verified), decoding each chunk straight into the
destination tensor's memory where the chunk lies wholly inside it (no
per-chunk scratch allocation and copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch

from ..format import manifest as _m
from ..pipeline import planner as _plan
from .catalog import Catalog
from ..errors import FormatError
from ..format.manifest import Manifest, Shard, TensorEntry
from ..progress import Counter
from ..progress import callback as progress_callback
from ..pipeline.staging import TensorReader, make_staging
from ..pipeline.tensors import byte_view, castable, writable_in_place
from ..format.tree import decode_value, flatten, tensor_paths, tree_keys, unflatten
from ..format.unpickle import load_safe
from ..tier import bands as _bands
from .tile_read import TileRead
from .tile_read import box_refs as tile_box_refs


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


def _cast_note(stored: str, dest: torch.dtype) -> str:
    return (
        f"cannot load {stored} values into {str(dest).removeprefix('torch.')} "
        "(values are cast only between floating dtypes, or between complex dtypes)"
    )


class Checkpoint:
    """Read view of one committed step."""

    def __init__(self, cat: Catalog, manifest: Manifest):
        self.repo = cat
        self.manifest = manifest
        self.step = manifest.step
        self._chunks: dict[tuple[str, int], tuple] = {}  # shards whose chunk tables were read

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

    def entry(self, key: str) -> TensorEntry:
        """The manifest entry of one tensor (``KeyError`` naming the step if absent)."""
        try:
            return self.manifest.tensors[key]
        except KeyError:
            raise KeyError(f"step {self.step} has no tensor {key!r}") from None

    def tensor_meta(self, key: str) -> TensorMeta:
        e = self.entry(key)
        offs, sizes = e.boxes()
        return TensorMeta(
            key=key,
            dtype=_m.DTYPES[e.dtype],
            shape=e.shape,
            shards=tuple((tuple(o), tuple(n)) for o, n in zip(offs.tolist(), sizes.tolist())),
            nbytes=e.nbytes,
            stored_bytes=e.stored_bytes,
            chunks=e.nchunks,
        )

    def shards(self, key: str, indices) -> list[Shard]:
        """Shards ``indices`` of tensor ``key`` with their chunks (chunk tables read as needed, once)."""
        e = self.entry(key)
        self.resolve((key, i) for i in indices)
        out = []
        for i in indices:
            s = e.shard(int(i))
            out.append(s if s.chunks is not None else Shard(s.offsets, s.sizes, self._chunks[(key, int(i))], s.table))
        return out

    def resolved(self, key: str) -> TensorEntry:
        """Tensor ``key``'s entry with every shard's chunks (its chunk tables read, once)."""
        e = self.entry(key)
        return e.with_shards(self.shards(key, range(e.nshards)))

    def shard_at(self, key: str, offsets) -> int:
        """The index of tensor ``key``'s shard whose box starts at ``offsets`` (None: the origin)."""
        e = self.entry(key)
        want = tuple(offsets) if offsets is not None else (0,) * len(e.shape)
        offs, _ = e.boxes()
        if offs.shape[1] == 0:
            hits = np.arange(len(offs))
        else:
            hits = np.nonzero(np.all(offs == np.asarray(want, dtype=np.int64), axis=1))[0]
        if len(hits) == 0:
            raise FormatError(f"step {self.step}: tensor {key!r} has no stored shard at offsets {want}")
        return int(hits[0])

    def resolve(self, pairs) -> None:
        """Read the chunk tables of shards ``(key, index)`` in one batch (kept for later reads)."""
        todo = {(k, int(i)) for k, i in pairs if (k, int(i)) not in self._chunks}
        todo = [(k, i) for k, i in todo if self.entry(k).known_chunks(i) is None]
        if todo:
            self._chunks.update(self.repo.tables.resolve(self.manifest, todo))

    def prefetch(self, keys) -> None:
        """Read the chunk tables of every shard of these tensors in one batch."""
        self.resolve((key, i) for key in keys for i in range(self.entry(key).nshards))

    def values(self) -> dict:
        """The state dict with tensors replaced by their TensorMeta (no data read)."""
        return unflatten(self.manifest.tree, self.tensor_meta)

    def read_value(self, key: str, safe_globals=None):
        """A value a DCP save pickled (a bytes item), through :func:`ckptstore.format.unpickle.load_safe`.

        ``safe_globals``: what the value may hold besides ckptstore's
        allowlist (as ``torch.serialization.add_safe_globals`` takes it).
        """
        if self.manifest.dcp is None or key not in self.manifest.dcp.get("bytes", ()):
            raise KeyError(f"{self.repo.url}: step {self.step} has no value {key!r} saved through DCP")
        data = self.read(key).numpy().tobytes()
        return load_safe(data, f"{self.repo.url}: step {self.step}: value {key!r}", safe_globals)

    def read(self, key: str, index: Any = None) -> torch.Tensor:
        """Read a tensor, or the slice ``index`` of it, fetching only covering chunks."""
        e = self.entry(key)
        dtype = _m.DTYPES[e.dtype]
        box, squeeze = _plan.normalize_index(index, e.shape)
        out = torch.empty(_plan.box_shape(box), dtype=dtype)
        self.read_box(e, box, out)
        if squeeze:
            out = out.reshape([n for d, n in enumerate(out.shape) if d not in squeeze])
        return out

    def read_into(self, key: str, dest: torch.Tensor) -> torch.Tensor:
        """Read a whole tensor into ``dest`` (the stored shape) in place.

        ``dest`` may have another floating (or complex) dtype than the one
        stored: values are cast as ``Tensor.copy_`` casts them, like DCP's
        own reader. Where the dtypes match and ``dest`` is a contiguous CPU
        tensor, chunks are decoded straight into its memory.
        """
        e = self._check_dest(key, dest)
        with torch.no_grad():
            self.read_box(e, tuple((0, n, 1) for n in e.shape), dest.detach())
        return dest

    def read_many_into(self, dests: dict[str, torch.Tensor], on_bytes: Callable[[int], None] | None = None) -> None:
        """Read whole tensors into ``dests`` (key -> tensor of the stored shape).

        Dtypes cast as in :meth:`read_into`. Tensors stored as one shard and
        read into contiguous CPU tensors of the stored dtype are fetched
        together: their chunks are coalesced across tensors into few range
        requests (a state dict of many small tensors costs a handful of GETs,
        not one per tensor). The rest go one tensor at a time.
        ``on_bytes(n)`` is called (from several threads) as ``n`` more bytes
        of the destinations are filled.
        """
        keys, refs, targets, rest, whole = [], [], [], [], []
        checked = {key: self._check_dest(key, dest) for key, dest in dests.items()}
        self.prefetch(checked)
        for key, dest in dests.items():
            e = checked[key]
            if not (
                e.nshards == 1
                and tuple(e.boxes()[1][0]) == e.shape
                and writable_in_place(dest)
                and dest.dtype == _m.DTYPES[e.dtype]
            ):
                rest.append(key)
                continue
            if dest.numel() == 0:
                continue
            (shard,) = self.shards(key, [0])
            whole.append((e, shard, tuple((0, n, 1) for n in e.shape), dest.detach()))
            view = byte_view(dest.detach())
            for start, c in zip(shard.chunk_starts(), shard.chunks):
                keys.append(key)
                refs.append(c)
                targets.append((view, start))

        def into(i: int):
            view, start = targets[i]
            return view[start : start + refs[i].raw_len]

        def deliver(i: int, raw, stored) -> None:  # every chunk has a destination
            into(i)[:] = np.frombuffer(raw, dtype=np.uint8, count=len(raw))

        done = None if on_bytes is None else (lambda i: on_bytes(refs[i].raw_len))
        if any(job[0].tile is not None for job in whole):
            # Tiles among them: every tensor as a job of one fetch (a tile lands by its own rule, and
            # no range is read twice by two fetches whose gaps overlap).
            self.read_shards(whole, on_bytes)
        else:
            self.repo.fetcher.fetch(refs, deliver, lambda i: f"{self.repo.url}: step {self.step}: tensor {keys[i]!r}: ",
                                    into=into, done=done)
        if rest:
            self._read_staged(rest, dests, on_bytes)

    def _read_staged(self, keys: list[str], dests: dict[str, torch.Tensor], on_bytes=None) -> None:
        """Tensors :meth:`read_many_into` cannot decode into in place (CUDA, another dtype,
        not contiguous, several shards): ``tensor_workers`` at a time, through one set
        of staging buffers (pinned when a destination is on CUDA), the path of
        :func:`~ckptstore.load_module`. Host memory stays at the staging size
        instead of a host copy of each tensor being read."""
        pin = torch.cuda.is_available() and any(dests[k].device.type == "cuda" for k in keys)
        room, chunk = self.largest_chunks(keys)
        # Half the read budget (reserved in it, so memory stays within the
        # budget). Each block is its own fetch: load_module's smaller default
        # (a quarter, at most 64 MiB) was slower than a host copy per tensor
        # here; this is faster (benchmarks/experiments/load_staged.py, docs/performance.md).
        nbytes = self.repo.runtime.read_budget().limit // 2
        with make_staging(self, pin=pin, room=room, chunk=chunk, staging_bytes=nbytes) as staging:
            reader = TensorReader(self, staging)
            self.repo.runtime.map_tensors(lambda k: reader.read_into(k, dests[k], on_bytes=on_bytes), keys)

    # -- boxes and shards
    def _check_dest(self, key: str, dest: torch.Tensor) -> TensorEntry:
        """The entry of ``key``, after checking ``dest`` has its shape and a dtype it casts to."""
        e = self.entry(key)
        if tuple(dest.shape) != e.shape or not castable(_m.DTYPES[e.dtype], dest.dtype):
            raise ValueError(
                f"{self.repo.url}: step {self.step}: tensor {key!r} is {e.dtype}{list(e.shape)}, "
                f"destination is {str(dest.dtype).removeprefix('torch.')}{list(dest.shape)}"
                + ("" if tuple(dest.shape) != e.shape else
                   " (values are cast only between floating dtypes, or between complex dtypes)")
            )
        return e

    def meeting(self, e: TensorEntry, box) -> list[int]:
        """Indices of the shards of ``e`` that ``box`` (``(start, stop, step)`` per dim) meets."""
        lo = [a for a, _, _ in box]
        hi = [a + (_plan.box_len((a, b, st)) - 1) * st + 1 if b > a else a for a, b, st in box]
        return e.meeting(lo, [h - l for l, h in zip(lo, hi)])

    def largest_chunks(self, keys, indices=None) -> tuple[int, int]:
        """``(stored, raw)`` bytes of the largest chunks of tensors ``keys``: of their
        shards ``indices``, default every shard (chunk tables read as needed)."""
        chunks = [c for k in keys
                  for s in self.shards(k, range(self.entry(k).nshards) if indices is None else list(indices))
                  for c in s.chunks]
        return max((c.stored_len for c in chunks), default=0), max((c.raw_len for c in chunks), default=0)

    def read_box(self, e: TensorEntry, box, out: torch.Tensor) -> None:
        """Fill ``out`` (the box's shape; any device, a dtype the stored one casts to)
        from every shard the box meets."""
        if out.numel() == 0:
            return
        covered = 0
        jobs = []
        candidates = self.meeting(e, box)
        for i, shard in zip(candidates, self.shards(e.key, candidates)):
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
            self.read_shard(e, shard, local, target)

    def box_refs(self, e: TensorEntry, shard: Shard, local) -> list:
        """The chunks a read of box ``local`` of one shard fetches (what :meth:`read_shard` reads)."""
        if e.tile is not None:
            return tile_box_refs(e, shard, local)
        runs = _plan.byte_runs(shard.sizes, _m.itemsize(e.dtype), local)
        return [shard.chunks[i] for i in _plan.chunks_for_runs(shard.chunk_starts(), shard.nbytes, runs)]

    def read_shard(self, e: TensorEntry, shard: Shard, local, target: torch.Tensor) -> None:
        """Read box ``local`` of one shard into ``target`` (shape of the box).

        ``target`` may be on any device and of any dtype the stored one casts
        to (see :func:`~ckptstore.pipeline.tensors.castable`); a contiguous CPU target
        of the stored dtype whose box is one contiguous byte run of the shard
        receives the decoded bytes directly, any other gets them through a
        buffer of the box's rows and one ``copy_``.
        """
        self.read_shards([(e, shard, local, target)])

    def read_shards(self, jobs, on_bytes: Callable[[int], None] | None = None) -> None:
        """:meth:`read_shard` for each ``(entry, shard, box, target)`` job, in one fetch: the chunks of
        every job are coalesced together, so boxes that lie close in a pack (a rank's shards of many
        small tensors) cost a few range requests, not one or more each. A tiled shard's job reads
        only the tiles its box meets (:class:`~ckptstore.repo.tile_read.TileRead`). ``on_bytes(n)``:
        as in :meth:`read_many_into`, ``n`` raw bytes of chunks were read (from several threads)."""
        pool = bands = None
        if any(job[0].tile is not None for job in jobs):
            pool, bands = self.repo.runtime.tile_buffers()
        plans = [TileRead(*job, pool, bands) if job[0].tile is not None else _ShardRead(self, *job) for job in jobs]
        filled = self._from_tier_bands(plans, on_bytes)
        refs, owner = [], []
        for j, plan in enumerate(plans):
            ks = [k for k in range(len(plan.refs)) if (j, k) not in filled]
            refs += [plan.refs[k] for k in ks]
            owner += [(j, k) for k in ks]

        def into(i: int):
            j, k = owner[i]
            return plans[j].into(k)

        def deliver(i: int, raw, stored) -> None:
            j, k = owner[i]
            plans[j].deliver(k, raw)

        def done(i: int) -> None:
            j, k = owner[i]
            plans[j].done(k)
            if on_bytes is not None:
                on_bytes(refs[i].raw_len)

        # A slice of tiles fills no gaps: the tiles between those it needs are what it saves.
        partial = any(isinstance(p, TileRead) and len(p.refs) < len(p.shard.chunks) for p in plans)
        try:
            self.repo.fetcher.fetch(
                refs, deliver, lambda i: f"{self.repo.url}: step {self.step}: tensor {plans[owner[i][0]].e.key!r}: ",
                into=into, done=done, max_gap=0 if partial else None,
            )
        finally:
            for plan in plans:
                plan.release()
        for plan in plans:
            plan.finish()


    def _from_tier_bands(self, plans, on_bytes) -> set:
        """The tiles of ``plans`` filled from band copies in the node-local tier (``(plan, tile)``
        pairs): each band read straight into its destination rows and checked there, on the I/O pool.
        A band not there or damaged is left to the fetch (its tiles, from the tier's other copies or
        the store)."""
        fetcher = self.repo.fetcher
        tier = fetcher.tier
        if tier is None or not any(isinstance(p, TileRead) for p in plans) or not _bands.keeps_bands(tier):
            return set()
        jobs = [(j, name, dest, ks) for j, p in enumerate(plans) if isinstance(p, TileRead)
                for name, dest, ks in p.tier_bands()]
        if not jobs:
            return set()
        futures = [self.repo.runtime.io.submit(_bands.read_band_into, tier, name, dest) for _, name, dest, _ in jobs]
        filled: set = set()
        stored = raw = 0
        for (j, _, _, ks), fut in zip(jobs, futures):
            if fut.result():
                filled.update((j, k) for k in ks)
                stored += sum(plans[j].refs[k].stored_len for k in ks)
                raw += sum(plans[j].refs[k].raw_len for k in ks)
        if stored:
            fetcher.count("tier", stored)
        if raw and on_bytes is not None:
            on_bytes(raw)
        return filled


class _ShardRead:
    """One box of one shard as :meth:`Checkpoint.read_shards` reads it: the chunks it needs, where
    each one's bytes go (straight into the target, or a buffer of the box's rows), the copy after."""

    def __init__(self, ckpt: Checkpoint, e: TensorEntry, shard: Shard, local, target: torch.Tensor):
        isz = _m.itemsize(e.dtype)
        stored_dtype = _m.DTYPES[e.dtype]
        if not castable(stored_dtype, target.dtype):
            raise ValueError(
                f"{ckpt.repo.url}: step {ckpt.step}: tensor {e.key!r} is {e.dtype}; "
                + _cast_note(e.dtype, target.dtype)
            )
        self.e, self.shard, self.local, self.target = e, shard, local, target
        shape = shard.sizes
        nd = self.nd = len(shape)
        row = isz * math.prod(shape[1:]) if nd else isz
        if nd:
            r0 = local[0][0]
            r1 = local[0][0] + (_plan.box_len(local[0]) - 1) * local[0][2] + 1
        else:
            r0, r1 = 0, 1
        self.r0 = r0
        span_lo, span_hi = r0 * row, r1 * row
        self.starts = shard.chunk_starts()
        runs = _plan.byte_runs(shape, isz, local)
        self.needed = _plan.chunks_for_runs(self.starts, shard.nbytes, runs)
        self.refs = [shard.chunks[i] for i in self.needed]
        # A box whose bytes are one contiguous run of the shard (the whole
        # shard, a range of rows, or a range of one row's elements: the
        # blocks ckptstore.loading stages) decodes straight into a
        # contiguous target of the stored dtype.
        self.direct = (
            writable_in_place(target)
            and target.dtype == stored_dtype
            and len(runs) == 1
            and int(runs[0, 1] - runs[0, 0]) == target.numel() * isz
        )
        if self.direct:
            self.buf = target.detach()
            span_lo, span_hi = int(runs[0, 0]), int(runs[0, 1])
        elif nd == 0:
            self.buf = torch.empty((), dtype=stored_dtype)
        else:
            self.buf = torch.empty((r1 - r0,) + tuple(shape[1:]), dtype=stored_dtype)
        self.view = byte_view(self.buf)
        self.span = (span_lo, span_hi)

    def done(self, k: int) -> None:
        pass

    def release(self) -> None:
        pass

    def into(self, k: int):
        # A chunk wholly inside the span decodes straight into its place.
        i = self.needed[k]
        cs, ce = self.starts[i], self.starts[i] + self.shard.chunks[i].raw_len
        lo, hi = self.span
        return self.view[cs - lo : ce - lo] if lo <= cs and ce <= hi else None

    def deliver(self, k: int, raw) -> None:
        i = self.needed[k]
        cs, ce = self.starts[i], self.starts[i] + self.shard.chunks[i].raw_len
        span_lo, span_hi = self.span
        lo, hi = max(cs, span_lo), min(ce, span_hi)
        if lo < hi:
            self.view[lo - span_lo : hi - span_lo] = np.frombuffer(raw, dtype=np.uint8, count=hi - lo, offset=lo - cs)

    def finish(self) -> None:
        if self.direct:
            return
        sub, local, r0 = self.buf, self.local, self.r0
        if self.nd:
            sub = self.buf[
                (slice(local[0][0] - r0, local[0][1] - r0, local[0][2]),)
                + tuple(slice(a, b, st) for a, b, st in local[1:])
            ]
        with torch.no_grad():
            self.target.copy_(sub)


def open_checkpoint(cat: Catalog, step: int) -> Checkpoint:
    return Checkpoint(cat, cat.manifest(step))


def load_step(cat: Catalog, step: int | None = None, into: Mapping | None = None, progress=None,
              safe_globals=None) -> dict:
    """The body of ``Repository.load``; see there."""
    if step is None:
        step = cat.newest_step()
    ckpt = open_checkpoint(cat, step)
    if into is None:
        dest = {}
        for k in ckpt.keys():
            e = ckpt.manifest.tensors[k]
            dest[k] = torch.empty(e.shape, dtype=_m.DTYPES[e.dtype])
    else:
        _, dest = flatten(_tensors_of(into))
        missing = [k for k in dest if k not in ckpt.manifest.tensors]
        if missing:
            raise KeyError(f"step {step} has no tensor(s) {missing[:5]} present in `into`")
    report, close = progress_callback(progress)
    try:
        on_bytes = None
        if progress is not None and progress is not False:
            on_bytes = Counter(report, "load bytes", sum(t.numel() * t.element_size() for t in dest.values())).add
        ckpt.read_many_into(dest, on_bytes)
    finally:
        close()
    if into is None:
        values = _bytes_items(ckpt.manifest)
        if not values:
            return unflatten(ckpt.manifest.tree, dest.__getitem__)
        # A DCP step: tensors and values in the order DCP flattened them (its planner data).
        where = dict(tensor_paths(ckpt.manifest.tree))
        where.update(values)
        out: dict = {}
        for fqn in sorted(where, key=_dcp_order(ckpt.manifest).get):
            v = ckpt.read_value(fqn, safe_globals) if fqn in values else dest[fqn]
            _place(out, where[fqn], v, fqn)
        return out
    _replace_values(into, ckpt.manifest.tree)
    for fqn, path in _bytes_items(ckpt.manifest).items():
        parent = _parent_in(into, path)
        if parent is not None:  # as DCP loads: only the values the destination names
            parent[path[-1]] = ckpt.read_value(fqn, safe_globals)
    return into


def _tensors_of(into):
    """``into`` with its non-JSON values (a DCP template's NumPy arrays, RNG states...) as None,
    so that :func:`flatten` finds its tensors by the keys it always gives them."""
    if isinstance(into, torch.Tensor):
        return into
    if isinstance(into, Mapping):
        return {k: _tensors_of(v) for k, v in into.items()}
    if isinstance(into, (list, tuple)):
        return type(into)(_tensors_of(v) for v in into) if type(into) in (list, tuple) else [_tensors_of(v) for v in into]
    return into if into is None or type(into) in (bool, int, float, str) else None


def _bytes_items(man: Manifest) -> dict[str, tuple]:
    """A step saved through DCP: its bytes items (values DCP pickled) by key, each with its path."""
    if man.dcp is None or not man.dcp.get("bytes"):
        return {}
    pd = man.dcp.get("planner_data")
    paths = decode_value(pd) if pd is not None else None
    out = {}
    for fqn in man.dcp["bytes"]:
        p = paths.get(fqn) if isinstance(paths, dict) else None
        ok = isinstance(p, (tuple, list)) and p and all(type(x) in (str, int) for x in p)
        out[fqn] = tuple(p) if ok else (fqn,)
    return out


def _dcp_order(man: Manifest) -> dict[str, int]:
    """Key -> position in DCP's planner data (the state dict's order); keys it lacks come last."""
    pd = man.dcp.get("planner_data") if man.dcp else None
    paths = decode_value(pd) if pd is not None else None
    order = {k: i for i, k in enumerate(paths)} if isinstance(paths, dict) else {}
    n = len(order)
    for k in man.tensors:
        if k not in order:
            order[k] = n
            n += 1
    return order


def _place(out: dict, path: tuple, value, fqn: str) -> None:
    node = out
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise FormatError(f"value {fqn!r}: its path {list(path)} runs through a tensor or value")
    if path[-1] in node:
        raise FormatError(f"value {fqn!r}: its path {list(path)} is taken by another item")
    node[path[-1]] = value


def _parent_in(into, path: tuple):
    """The container of ``into`` that holds ``path``'s last part, or None when ``into`` lacks the path."""
    node = into
    for part in path[:-1]:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and type(part) is int and 0 <= part < len(node):
            node = node[part]
        else:
            return None
    last = path[-1]
    if isinstance(node, dict) and last in node:
        return node
    if isinstance(node, list) and type(last) is int and 0 <= last < len(node):
        return node
    return None


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
