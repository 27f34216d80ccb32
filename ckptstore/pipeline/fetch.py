"""The one chunk fetcher: coalesced range reads, verified, following relocations.

Every read of chunk bytes goes through :meth:`ChunkFetcher.fetch`: loads and
slice reads (:mod:`ckptstore.repo.reader`), export, ``cp`` (which needs the
stored bytes), GC's repack and ``verify --read-data``. It

1. coalesces the chunks of each pack into range requests
   (:func:`ckptstore.pipeline.planner.coalesce`: ``coalesce_gap``, ``max_request``);
2. runs them on the I/O pool, each holding its bytes against the handle's
   read budget (fetched-but-undecoded bytes are bounded);
3. decodes every chunk and checks it against its hash (format invariant 4)
   on the CPU pool, then hands ``(raw, stored)`` to the caller's ``deliver``,
   or, for a chunk the caller gave a destination (``into``), decodes it
   straight into that memory (no scratch copy) and checks the hash there;
4. follows relocation records when a pack is gone (repacked by GC);
5. with a node-local tier (:mod:`ckptstore.tier.cache`), takes each chunk from
   the tier first (a pack a save wrote through or a peer sent, or a chunk
   kept from an earlier read), checked like any other: one that fails is removed from
   the tier and read from the store, which is also where every chunk the
   tier lacks comes from (and is then kept in the tier).

Errors name the repository, the caller's context (step, tensor), the
chunk, the pack and the offset; wrong bytes are never delivered.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import threading
from typing import Callable, Sequence

import numpy as np

from ..format import codec as _codec
from . import planner as _plan
from ..errors import FormatError, IntegrityError, MissingDataError, ObjectNotFoundError, StorageError
from ..format.layout import MAX_RELOCATION_HOPS, pack_key
from ..format.manifest import ChunkRef
from .options import RepoOptions
from .relocations import Relocations
from .runtime import Runtime
from ..storage.base import ObjectStore
from ..storage.upload import BufferPool
from ..tier.cache import Tier

#: Raw bytes of arrived chunks one decoding task takes at most (several small chunks, one hand-off).
DECODE_BATCH = 2 << 20

#: ``deliver(i, raw, stored)``: chunk ``i``'s decoded bytes and its stored
#: bytes (both valid only during the call).
Deliver = Callable[[int, memoryview, memoryview], None]
#: ``on_error(i, error)``: instead of raising, report a chunk that could not
#: be read or verified (``verify`` collects every problem).
OnError = Callable[[int, Exception], None]
#: ``into(i)``: chunk ``i``'s destination, a writable buffer of exactly its
#: raw length, or None to have it delivered.
Into = Callable[[int], object]


class ChunkFetcher:
    """Fetches chunks of one repository; see the module docstring."""

    def __init__(self, store: ObjectStore, runtime: Runtime, options: RepoOptions, relocations: Relocations,
                 tier: Tier | None = None):
        self.store = store
        self.runtime = runtime
        self.options = options
        self.relocations = relocations
        self.tier = tier
        self._active = 0
        self._lock = threading.Lock()
        #: Stored (compressed) chunk bytes delivered, by where they came from.
        self.read_bytes = {"tier": 0, "peer": 0, "store": 0}
        #: Packs a peer node's tier sent into this node's tier for a load (:mod:`ckptstore.dcp.replicas`):
        #: their chunks count as read from a peer.
        self.peer_packs: set[str] = set()

    def count(self, source: str, nbytes: int) -> None:
        with self._lock:
            self.read_bytes[source] += nbytes

    def fetch(
        self,
        refs: Sequence[ChunkRef],
        deliver: Deliver,
        where: Callable[[int], str],
        on_error: OnError | None = None,
        into: Into | None = None,
        done: Callable[[int], None] | None = None,
        max_gap: int | None = None,
    ) -> None:
        """Fetch, verify and decode ``refs``; call ``deliver`` once per chunk.

        ``max_gap``: the largest gap between two chunks of a pack one request spans (default the
        handle's ``coalesce_gap``; a slice of tiles passes 0: the tiles between the ones it
        needs are the bytes it exists not to read).

        With ``into``, a chunk for which ``into(i)`` names a destination is
        decoded into it and verified there instead of being delivered; if it
        fails to verify, the destination holds bytes that must not be used
        (and the read raises, or reports the chunk to ``on_error``).
        ``done(i)``, if given, is called once chunk ``i`` has been verified
        and delivered or decoded in place (from the decoding threads, for
        progress).

        ``where(i)`` is the start of every message about chunk ``i``: what
        it belongs to, ending in ``": "`` (``"s3://b/run: step 5: tensor 'w': "``),
        or ``""``. Without ``on_error`` the first failure
        raises (:class:`IntegrityError` for bytes that do not verify or a
        pack shorter than recorded, :class:`MissingDataError` for a pack
        that is gone with no relocation record); with it, each failed chunk
        is reported and the others are still delivered.
        """
        if not refs:
            return
        job = _Job(self, list(refs), deliver, where, on_error, into, done, max_gap)
        with self._lock:
            self._active += 1
        try:
            job.run(list(range(len(refs))), 0)
        finally:
            with self._lock:
                self._active -= 1
                idle = not self._active
            if idle:  # no read under way: give the range (and tile) buffers back to the system
                self.runtime.drop_read_buffers()


def _groups(items: list[int], refs) -> list[list[int]]:
    """``items`` in order, cut into groups of at most :data:`DECODE_BATCH` raw bytes (or one chunk)."""
    out: list[list[int]] = []
    size = DECODE_BATCH
    for i in items:
        n = refs[i].raw_len
        if size + n > DECODE_BATCH:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def _wait_all(futures: list[cf.Future]) -> None:
    """Wait for every future; on the first failure cancel the rest, wait for those running, re-raise."""
    try:
        for fut in cf.as_completed(futures):
            fut.result()
    except BaseException:
        for fut in futures:
            fut.cancel()
        cf.wait(futures)
        raise


def _collector(out: list[int]) -> Callable[[list[int]], None]:
    """``missed(idx)``: append chunk indices to ``out`` from any thread."""
    lock = threading.Lock()

    def missed(idx) -> None:
        with lock:
            out.extend(idx)

    return missed


class _Job:
    def __init__(self, fetcher: ChunkFetcher, refs, deliver, where, on_error, into=None, done=None, max_gap=None):
        self.f = fetcher
        self.max_gap = max_gap
        self.refs = refs
        self.deliver = deliver
        self.where = where
        self.on_error = on_error
        self.into = into
        self.done = done

    def fail(self, i: int, err: Exception) -> None:
        if self.on_error is None:
            raise err
        self.on_error(i, err)

    def requests(self, items: list[int]) -> list[_plan.RangeRequest]:
        o = self.f.options
        reqs = _plan.coalesce(
            [(self.refs[i].pack, self.refs[i].offset, self.refs[i].offset + self.refs[i].stored_len) for i in items],
            o.coalesce_gap if self.max_gap is None else min(self.max_gap, o.coalesce_gap),
            o.max_request,
        )
        # coalesce numbers items 0..n-1 of what it was given: map back
        return [_plan.RangeRequest(q.pack, q.start, q.end, tuple(items[k] for k in q.items)) for q in reqs]

    def run(self, items: list[int], hops: int) -> None:
        if self.f.tier is not None and hops == 0:
            items = self.from_tier(items)
        io = self.f.runtime.io
        futures = [io.submit(self.request, q, hops) for q in self.requests(items)]
        _wait_all(futures)

    # ------------------------------------------------------------ the node-local tier
    def from_tier(self, items: list[int]) -> list[int]:
        """Deliver what the tier holds; return the chunks to read from the store (misses included)."""
        tier = self.f.tier
        refs = self.refs
        in_packs: list[int] = []
        in_chunks: list[int] = []
        rest: list[int] = []
        local_pack: dict[str, bool] = {}
        if self.into is not None and tier.keeps_decoded():
            items = self.from_raw(items)
        for i in items:
            pid = refs[i].pack
            if tier.has_chunk(refs[i].hash):
                # first: a chunk file is also the repaired copy of a chunk whose pack copy is damaged
                in_chunks.append(i)
                continue
            if pid not in local_pack:
                local_pack[pid] = tier.has_pack(pid)
            if local_pack[pid]:
                in_packs.append(i)
            else:
                rest.append(i)
        if not in_packs and not in_chunks:
            return rest
        misses: list[int] = []
        missed = _collector(misses)
        io = self.f.runtime.io
        futures = [io.submit(self.request, q, 0, tier, missed) for q in self.requests(in_packs)]
        futures += [io.submit(self.tier_chunk, i, missed) for i in in_chunks]
        _wait_all(futures)
        if misses:
            with self.f._lock:
                tier.stats["tier_misses"] += len(misses)
        return rest + sorted(misses)

    def from_raw(self, items: list[int]) -> list[int]:
        """Chunks kept decoded (``raw/``), each read straight into its destination and checked there;
        the chunks left (none kept, or a miss) for the tier's other copies and the store."""
        tier = self.f.tier
        raw = [i for i in items if os.path.isfile(tier.raw_path(self.refs[i].hash))]
        if not raw:
            return items
        taken = set(raw)
        left = [i for i in items if i not in taken]
        missed = _collector(left)
        futures = [self.f.runtime.io.submit(self.tier_raws, group, missed) for group in _groups(raw, self.refs)]
        _wait_all(futures)
        return left

    def tier_raws(self, items: list[int], missed) -> None:
        """:meth:`tier_raw` for a group of chunks, in one task (small chunks: a tiled tensor's tiles)."""
        for i in items:
            self.tier_raw(i, missed)

    def tier_raw(self, i: int, missed) -> None:
        """A decoded chunk file, read straight into the chunk's destination and hash-checked there; a
        chunk without a destination, a short file or a hash that differs is a miss (read as usual)."""
        r = self.refs[i]
        tier = self.f.tier
        dest = self.into(i)
        if dest is None or memoryview(dest).nbytes != r.raw_len or not tier.read_raw_into(r.hash, dest):
            missed([i])
            return
        if _codec.hash_bytes(dest) != r.hash:
            tier.discard_raw(r.hash)  # the destination's bytes are rewritten by the read that follows
            missed([i])
            return
        self.f.count("tier", r.stored_len)
        if self.done is not None:
            self.done(i)

    def tier_chunk(self, i: int, missed) -> None:
        """One chunk kept in the tier by an earlier read: decode and check it, else a miss."""
        r = self.refs[i]
        tier = self.f.tier
        stored = tier.read_chunk(r.hash, r.stored_len)
        if stored is None:
            missed([i])
            return
        where = f"{self.where(i)}chunk {r.hash[:16]} (node-local tier)"
        dest = self.into(i) if self.into is not None else None
        try:
            if dest is not None:
                if memoryview(dest).nbytes != r.raw_len:
                    raise IntegrityError(f"{where}: holds {r.raw_len} bytes, its place in the tensor {memoryview(dest).nbytes}")
                _codec.decode_verified_into(r.codec, stored, dest, r.hash, where)
            else:
                raw = _codec.decode_verified(r.codec, stored, r.raw_len, r.hash, where)
        except IntegrityError:
            tier.discard_chunk(r.hash)
            missed([i])
            return
        if dest is None:
            self.deliver(i, memoryview(raw), memoryview(stored))
        self.f.count("tier", r.stored_len)
        if self.done is not None:
            self.done(i)

    # ------------------------------------------------------------ ranges
    def request(self, req: _plan.RangeRequest, hops: int, tier: Tier | None = None, missed=None) -> None:
        # Bytes fetched and not yet decoded are bounded by the handle's read
        # budget (half of max_inflight_bytes), shared by every read.
        budget = self.f.runtime.read_budget()
        n = req.end - req.start
        # A range of at least half of max_request is read into a reusable
        # max_request buffer (no fresh memory to fault in), and holds the
        # budget for all of it; a smaller one into memory of its own size.
        pool = self.f.runtime.read_buffers()
        pooled = pool.size // 2 <= n <= pool.size
        hold = pool.size if pooled else n
        budget.acquire(hold)
        try:
            gone = self.fetch_and_decode(req, pool if pooled else None, tier, missed)
        finally:
            budget.release(hold)
        if gone:  # outside the budget: the relocated reads acquire their own
            self.relocated(req, gone, hops)

    def fetch_and_decode(self, req: _plan.RangeRequest, pool: BufferPool | None = None,
                         tier: Tier | None = None, missed=None) -> list[int]:
        """Fetch one request, decoding each chunk as soon as its bytes are in.

        Returns the chunks still to read when the pack turned out to be gone
        (all of them, unless a retried read lost the pack half-way). With
        ``tier``, the range is read from the tier's copy of the pack, and a
        chunk that cannot be read or does not verify there is handed to
        ``missed`` (and the pack file removed) instead of failing.
        """
        first = req.items[0]
        n = req.end - req.start
        buf = pool.get() if pool is not None else np.empty(n, dtype=np.uint8)
        mv = memoryview(buf)[:n]
        refs = self.refs
        # Chunks in the order their last byte arrives; each is handed to the
        # CPU pool (decoding and hashing release the GIL; its tasks never
        # wait on anything, so an I/O thread waiting on them cannot
        # deadlock) while the rest of the range is still on the wire.
        pending = collections.deque(sorted(req.items, key=lambda i: refs[i].offset + refs[i].stored_len))
        started: list[cf.Future] = []
        cpu = self.f.runtime.cpu
        keep = self.f.tier if tier is None and self.f.tier is not None and self.f.tier.writable else None

        def decode(i: int) -> None:
            self.decode_one(i, req, mv, tier, missed, keep)

        def decode_run(items: list[int]) -> None:
            for i in items:
                self.decode_one(i, req, mv, tier, missed, keep)

        def arrived(got: int) -> None:
            # The chunks whose bytes are all in, decoded by one task per DECODE_BATCH raw bytes:
            # a piece of a range holds several small chunks (a tiled tensor's tiles), and a task
            # each cost a hand-off between threads per chunk.
            ready: list[int] = []
            while pending and refs[pending[0]].offset + refs[pending[0]].stored_len - req.start <= got:
                ready.append(pending.popleft())
            for group in _groups(ready, refs):
                started.append(cpu.submit(decode_run, group))

        gone: list[int] = []
        progress = arrived if len(req.items) > 1 else None  # one chunk: decoded here, once it is all in
        try:
            if tier is not None:
                try:
                    copy = tier.pack_source(req.pack)
                    if copy is None:
                        raise ObjectNotFoundError(f"pack {req.pack}: no copy in the tier")
                    copy.read_range_into(pack_key(req.pack), req.start, mv, progress)
                except (ObjectNotFoundError, ValueError, StorageError, OSError) as ex:
                    # The tier's copy is gone (evicted by another process) or short: the store has it.
                    if not isinstance(ex, ObjectNotFoundError):
                        tier.discard_pack(req.pack)
                    cf.wait(started)  # the chunks whose bytes did arrive are decoded first
                    missed(list(pending))
                    pending.clear()
                else:
                    tier.mark_pack_read(req.pack)
                    if len(req.items) == 1:
                        decode(first)
                    else:
                        arrived(n)
            else:
                try:
                    self.f.store.read_range_into(pack_key(req.pack), req.start, mv, progress)
                except ObjectNotFoundError:
                    gone = list(pending)
                except ValueError as ex:
                    err = IntegrityError(
                        f"{self.where(first)}pack {req.pack} is shorter than the manifest says "
                        f"(offset {refs[first].offset}): {ex}"
                    )
                    for i in pending:
                        self.fail(i, err)
                except StorageError as ex:
                    # The store's message names the object; add what it was read for
                    # (same class, so retry and caller logic see what they saw).
                    raise type(ex)(
                        f"{self.where(first)}reading bytes [{req.start}, {req.end}) of pack {req.pack} failed: {ex}"
                    ) from ex
                else:
                    if len(req.items) == 1:
                        decode(first)
                    else:
                        arrived(n)  # a store must report the end; in case one did not
            for fut in started:
                fut.result()
        finally:
            # The decodes read from the buffer: wait for them before reusing it.
            cf.wait(started)
            if pool is not None:
                pool.put(buf)
        return gone

    def decode_one(self, i: int, req: _plan.RangeRequest, mv: memoryview, tier: Tier | None, missed,
                   keep: Tier | None) -> None:
        """Decode and check chunk ``i`` of a range read into ``mv``; deliver it or decode it in place.

        From the tier (``tier``), a chunk that fails its check is handed to
        ``missed`` (read from the store, which keeps a chunk file for it,
        looked at before the pack from then on); from the store, it fails.
        A verified chunk from the store is kept in the tier (``keep``).
        """
        r = self.refs[i]
        stored = mv[r.offset - req.start : r.offset - req.start + r.stored_len]
        where = f"{self.where(i)}chunk {r.hash[:16]} in pack {r.pack} at offset {r.offset}"
        dest = self.into(i) if self.into is not None else None
        try:
            if dest is not None:
                room = memoryview(dest).nbytes
                if room != r.raw_len:
                    raise IntegrityError(f"{where}: holds {r.raw_len} bytes, its place in the tensor {room}")
                _codec.decode_verified_into(r.codec, stored, dest, r.hash, where)
            else:
                raw = _codec.decode_verified(r.codec, stored, r.raw_len, r.hash, where)
        except IntegrityError as e:
            if tier is None:
                self.fail(i, e)
            else:
                missed([i])
            return
        if dest is None:
            self.deliver(i, memoryview(raw), stored)
        self.f.count(("peer" if req.pack in self.f.peer_packs else "tier") if tier is not None else "store",
                     r.stored_len)
        if keep is not None:
            keep.put_chunk(r.hash, stored)  # verified: kept for the next read on this node
        if self.done is not None:
            self.done(i)

    def relocated(self, req: _plan.RangeRequest, items: list[int], hops: int) -> None:
        """A pack is gone: follow its relocation record (written by repack) for ``items``, if any."""
        first = items[0]
        missing = MissingDataError(
            f"{self.where(first)}pack {req.pack} is missing (needed at offset "
            f"{self.refs[first].offset}) and no relocation record names its chunks; the step cannot be restored"
        )
        try:
            table = self.f.relocations.table(req.pack) if hops < MAX_RELOCATION_HOPS else None
        except FormatError as e:
            err = FormatError(f"{self.where(first)}pack {req.pack} is missing and its relocation record is unreadable: {e}")
            for i in items:
                self.fail(i, err)
            return
        moved, lost = [], []
        for i in items:
            new = table.get(self.refs[i].hash) if table else None
            if new is None:
                lost.append(i)
            else:
                self.refs[i] = new
                moved.append(i)
        for i in lost:
            self.fail(i, missing)
        if moved:
            # Serially, on this I/O thread: no nested waits on the I/O pool.
            for q in self.requests(moved):
                self.request(q, hops + 1)
