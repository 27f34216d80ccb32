"""Megatron-Core's async save through ckptstore: plan now, upload in Megatron's worker, commit in finalize.

``CkptStoreSaveStrategy.async_save`` (:mod:`ckptstore.integrations.megatron`)
runs here. The three parts of a step's save and where each runs:

1. in the trainer, inside ``async_save``: Megatron's translation, DCP's
   planning (``dcp.save`` with :class:`_DeferredWriter`: every collective,
   the step claim and lease on the coordinator, the config and dedup base
   shared once), and a **snapshot** of every item this rank writes (CPU
   tensors cloned; CUDA tensors copied into pinned host buffers the strategy
   keeps for its next saves): what is stored is the state at the call;
2. in Megatron's worker process (forked per save, or the persistent one,
   spawned): :class:`Upload`, the ``async_fn``. It reopens the repository
   from its URL and options (it is picklable), uploads this rank's packs and
   chunk table (:func:`ckptstore.dcp.writer.write_rank`: no collective, no
   child process), and writes what it wrote, or its error, to a small JSON
   result file. It never raises: an exception there would leave Megatron's
   finalize waiting forever;
3. on every rank, in ``maybe_finalize_async_calls``: :class:`Finalize`, a
   ``finalize_fn``. The ranks' results meet on the coordinator, which
   commits the step (or, if any rank failed, deletes every rank's uploads of
   the step); every rank then raises the same error, or returns.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import tempfile
import uuid

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..dcp.metadata import _ItemResult, _RankInfo
from ..dcp.shared import unpack
from ..dcp.writer import CkptStoreWriter, _GlobalInfo, write_rank
from ..errors import CkptStoreError
from ..format.model import PackUsage, SegmentRef

RESULT_FORMAT = "ckptstore.megatron.async-result"


class AsyncSaveError(CkptStoreError, RuntimeError):
    """A background upload of an async Megatron save failed on some rank: nothing was committed."""


# ------------------------------------------------------------------ the trainer's half: plan and snapshot
class _DeferredWriter(CkptStoreWriter):
    """A :class:`CkptStoreWriter` for ``dcp.save`` run in the trainer: planning and step claim only.

    ``write_data`` takes part in the config share (a collective), then
    snapshots this rank's items instead of uploading them; ``finish`` (the
    coordinator) keeps DCP's global metadata for the commit in finalize.
    """

    def __init__(self, *args, snapshot: "Snapshot", **kwargs):
        super().__init__(*args, **kwargs)
        self.snapshot = snapshot
        self.job: dict | None = None
        self.global_metadata = None

    def write_data(self, plan, planner):
        info = plan.storage_data if isinstance(plan.storage_data, _GlobalInfo) else None
        rank = info.rank if info is not None else self.rank
        parts = (info.parts if info is not None else None) or {}
        self.shared_blob = None
        if info is not None and info.share:
            self._receive_shared()  # a collective: here, in the trainer, never in the worker
        items, data = [], []
        self.snapshot.begin()
        for item in plan.items:
            part = parts.get((item.index.fqn, tuple(item.index.offset))) if parts and item.index.offset else None
            if part is not None:  # rows of a replicated item (balance_save_plans)
                whole, lo, hi = part
                value = planner.resolve_data(whole).narrow(0, lo, hi - lo)
            else:
                value = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                value = value.getvalue() if isinstance(value, io.BytesIO) else bytes(value)
            else:
                value = self.snapshot.take(value)
            items.append(item)
            data.append(value)
        self.snapshot.end()
        self.job = {"rank": rank, "base_step": info.base_step if info is not None else None,
                    "items": items, "data": data, "shared": self.shared_blob}
        fut: Future = Future()
        fut.set_result([])  # the real results come from the worker, in finalize
        return fut

    def finish(self, metadata, results) -> None:
        self.global_metadata = metadata  # the coordinator commits in finalize, with the workers' results

    def commit(self, results) -> None:
        """The coordinator's commit, with every rank's results (``CkptStoreWriter.finish``)."""
        CkptStoreWriter.finish(self, self.global_metadata, results)

    def discard(self, results, error: BaseException) -> None:
        """The coordinator: delete the uploads the ranks that succeeded made, and drop the step's lease."""
        commit, self._commit = self._commit, None
        try:
            self._discard_ranks_uploads(self._get_repo(), results, error)
        finally:
            if commit is not None:
                commit.end()


class Snapshot:
    """Host copies of the tensors of one save, taken at ``async_save``.

    CPU tensors are cloned (Megatron's preload copies nothing on the CPU);
    CUDA tensors are copied into pinned host buffers with ``non_blocking``
    copies and one wait per device; the buffers are kept and reused by the
    next save of the same strategy (same position, same size and dtype).
    """

    def __init__(self):
        self._pinned: list[torch.Tensor] = []
        self._n = 0
        self._devices: set = set()

    def begin(self) -> None:
        self._n = 0
        self._devices = set()

    def take(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type != "cuda":
            return t.clone(memory_format=torch.contiguous_format)
        i, self._n = self._n, self._n + 1
        if i < len(self._pinned) and self._pinned[i].shape == t.shape and self._pinned[i].dtype == t.dtype:
            buf = self._pinned[i]
        else:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            if i < len(self._pinned):
                self._pinned[i] = buf
            else:
                self._pinned.append(buf)
        buf.copy_(t, non_blocking=True)
        self._devices.add(t.device)
        return buf

    def end(self) -> None:
        for d in self._devices:
            torch.cuda.synchronize(d)
        del self._pinned[self._n:]


# ------------------------------------------------------------------ the worker's half: upload
@dataclasses.dataclass
class Upload:
    """The ``async_fn`` of one rank's share of an async save (picklable; runs in Megatron's worker).

    Opens the repository again from ``url``, ``storage_options`` and
    ``options`` (a forked or spawned worker shares no handle with the
    trainer), takes the config and dedup base the coordinator shared, uploads
    the items, and writes a JSON result to ``result_path``: the write results,
    or the error. Never raises.
    """

    url: str
    storage_options: dict | None
    options: dict
    step: int
    rank: int
    base_step: int | None
    shared: bytes | None
    items: list
    data: list
    result_path: str

    def __call__(self, *_ignored) -> None:
        try:
            doc = {"format": RESULT_FORMAT, "ok": True, "results": self._upload()}
        except BaseException as e:  # noqa: BLE001 - travels to finalize, which raises it on every rank
            doc = {"format": RESULT_FORMAT, "ok": False, "error": f"{type(e).__name__}: {e}"}
        try:
            tmp = f"{self.result_path}.{uuid.uuid4().hex[:8]}.tmp"
            with open(tmp, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, self.result_path)
        except BaseException:  # noqa: BLE001 - finalize reports the missing result
            pass

    def _upload(self) -> list:
        from ..repo.repository import open as open_repo

        repo = open_repo(self.url, storage_options=self.storage_options, **self.options)
        try:
            if self.shared is not None:
                header, (base, cfg) = unpack(self.shared, "config and dedup base")
                if cfg is not None:
                    repo.adopt_config(cfg)
                if base is not None:
                    repo.adopt_manifest(header["base"], base)
            data = iter(self.data)
            results, _, _ = write_rank(repo, self.step, self.rank, self.base_step, self.items, lambda item: next(data))
            return [result_to_json(r) for r in results]
        finally:
            self.data = []
            repo.close()


def result_to_json(wr: WriteResult) -> dict:
    """One ``WriteResult`` of :func:`write_rank` as JSON (the worker's result file; no pickle)."""
    sd: _ItemResult = wr.storage_data
    doc = {"fqn": wr.index.fqn, "offset": None if wr.index.offset is None else list(wr.index.offset),
           "index": wr.index.index, "size": wr.size_in_bytes,
           "item": [sd.rank, sd.bytes_item, sd.nbytes, sd.first, sd.count, sd.stored],
           "tile": None if sd.tile is None else list(sd.tile)}
    if sd.info is not None:
        i = sd.info
        doc["info"] = {"rank": i.rank, "segment": None if i.segment is None else dataclasses.asdict(i.segment),
                       "packs": i.packs, "stats": i.stats,
                       "use": {p: [u.chunks, [list(r) for r in u.ranges]] for p, u in i.use.items()}}
    return doc


def result_from_json(doc: dict) -> WriteResult:
    info = None
    if doc.get("info") is not None:
        i = doc["info"]
        seg = None if i["segment"] is None else SegmentRef(**i["segment"])
        use = {p: PackUsage(int(n), tuple((int(a), int(b)) for a, b in rs)) for p, (n, rs) in i["use"].items()}
        info = _RankInfo(int(i["rank"]), seg, dict(i["packs"]), use, dict(i["stats"]))
    rank, bytes_item, nbytes, first, count, stored = doc["item"]
    offset = None if doc["offset"] is None else torch.Size(doc["offset"])
    tile = doc.get("tile")
    return WriteResult(index=MetadataIndex(doc["fqn"], offset, doc["index"]), size_in_bytes=int(doc["size"]),
                       storage_data=_ItemResult(int(rank), bool(bytes_item), int(nbytes), int(first), int(count),
                                                int(stored), info,
                                                None if tile is None else tuple(int(x) for x in tile)))


# ------------------------------------------------------------------ every rank: finalize
class Finalize:
    """The ``finalize_fn`` of one async save: on every rank, after every rank's worker is done.

    Collects this rank's result file, gathers every rank's on the
    coordinator, which commits the step (all succeeded) or deletes the
    uploads (any failed); the outcome is broadcast and every rank raises
    :class:`AsyncSaveError` naming the failed ranks, or returns. ``on_commit``
    runs on the coordinator once the step is committed (the pointer file).
    """

    def __init__(self, writer: _DeferredWriter, result_path: str, group=None, on_commit=None):
        self.writer = writer
        self.result_path = result_path
        self.group = group
        self.on_commit = on_commit
        self.done = False

    def _own_result(self) -> str:
        try:
            with open(self.result_path) as f:
                raw = f.read()
            os.unlink(self.result_path)
        except FileNotFoundError:
            return json.dumps({"format": RESULT_FORMAT, "ok": False, "error": (
                "the background upload ended without a result (its worker process was killed or died)")})
        return raw

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        w = self.writer
        group = self.group
        raw = self._own_result()
        try:
            mine = json.loads(raw)
            if not isinstance(mine, dict) or mine.get("format") != RESULT_FORMAT:
                raise ValueError("not a result file")
        except ValueError as e:
            raw = json.dumps({"format": RESULT_FORMAT, "ok": False, "error": f"unreadable result file: {e}"})
        world = dist.get_world_size(group)
        me = dist.get_rank(group)
        gathered = [None] * world if me == 0 else None
        dist.gather_object(raw, gathered, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        outcome = [None]
        if me == 0:
            outcome[0] = self._decide([json.loads(x) for x in gathered])
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)
        w.job = None
        w.close()
        if outcome[0] is not None:
            raise AsyncSaveError(outcome[0])

    def _decide(self, docs: list) -> str | None:
        """The coordinator: commit, or discard and return the error every rank raises."""
        w = self.writer
        what = f"async save of step {w.step} of {w.url}"
        failed = {r: d.get("error", "?") for r, d in enumerate(docs) if not d.get("ok")}
        ok = [[result_from_json(x) for x in d["results"]] for d in docs if d.get("ok")]
        if failed:
            msg = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
            err = AsyncSaveError(f"{what}: the background upload failed on {len(failed)} rank(s), nothing was "
                                 f"committed and the step's uploads were removed: {msg}")
            try:
                w.discard(ok, err)
            except Exception as e:  # noqa: BLE001 - the upload error is the one to report
                return f"{err}; removing the uploads failed too ({type(e).__name__}: {e}), GC reclaims them"
            return str(err)
        try:
            w.commit(ok)
            if self.on_commit is not None:
                self.on_commit()
        except Exception as e:  # noqa: BLE001 - every rank raises it
            return f"{what}: the commit failed, nothing was committed: {type(e).__name__}: {e}"
        return None


def result_path(step: int, rank: int) -> str:
    """Where one rank's worker writes its result (the node's temporary folder; removed by finalize)."""
    return os.path.join(tempfile.gettempdir(), f"ckptstore-mcore-{os.getpid()}-{step}-{rank}-{uuid.uuid4().hex[:8]}.json")
