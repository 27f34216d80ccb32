"""What one repository handle runs on: thread pools, byte budgets, reusable
buffers and bounded caches. Created lazily, released by :meth:`Runtime.close`.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import ctypes
import ctypes.util
import sys
import threading
from typing import Callable, Generic, Hashable, TypeVar

from .options import RepoOptions
from ..storage.upload import BufferPool

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


_LIBC_TRIM: list = []  # [malloc_trim or None], looked up once


def release_free_memory() -> bool:
    """Hand the heap's free memory back to the system (glibc's ``malloc_trim(0)``; elsewhere nothing).

    glibc keeps memory freed by a thread in that thread's arena; a process whose pool threads
    take turns with large short-lived buffers (a write-back step every training step) sees its
    resident size creep while the memory in use stays flat. Called by the write-back uploader
    each time it has drained its queue (once per save at most: about a millisecond), never on
    a save's or load's own path. Returns whether anything was called."""
    if not _LIBC_TRIM:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                fn = getattr(lib, "malloc_trim", None)
                if fn is not None:
                    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            except OSError:
                fn = None
        _LIBC_TRIM.append(fn)
    fn = _LIBC_TRIM[0]
    if fn is None:
        return False
    fn(0)
    return True


class ByteBudget:
    """A counting limit on bytes in flight; one oversize request may pass alone.

    Requests (:meth:`acquire`/:meth:`release`) hold bytes briefly: a range
    request from GET to decode. Reservations (:meth:`reserve`/:meth:`unreserve`)
    hold bytes for as long as a set of buffers lives (the staging buffers
    of :mod:`ckptstore.loading`); every reservation names the largest
    request its owner will make (``room``), and the reservations together
    always leave the largest of those rooms free, so a reservation holder's
    request never waits on another holder's release (no deadlock).

    ``peak`` is the most bytes ever held at once (tests and benchmarks
    read it).
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.reserved = 0
        self.peak = 0
        self._rooms: list[int] = []
        self._cv = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cv:
            while self.used and self.used + n > self.limit:
                self._cv.wait()
            self.used += n
            self.peak = max(self.peak, self.used)

    def release(self, n: int) -> None:
        with self._cv:
            self.used -= n
            self._cv.notify_all()

    def reserve(self, n: int, room: int) -> int:
        """Hold up to ``n`` bytes until :meth:`unreserve`; returns the bytes held.

        At most ``limit - room`` is held (0 when the room takes the whole
        budget, and then nothing is registered). Waits until the
        reservations, this one included, leave every holder's room free.
        """
        n = min(n, self.limit - room)
        if n <= 0:
            return 0
        with self._cv:
            while (self.reserved + n > self.limit - max([room, *self._rooms])
                   or self.used + n > self.limit):
                self._cv.wait()
            self.used += n
            self.reserved += n
            self._rooms.append(room)
            self.peak = max(self.peak, self.used)
        return n

    def unreserve(self, n: int, room: int) -> None:
        """Give back a reservation (``n`` as :meth:`reserve` returned it)."""
        if n <= 0:
            return
        with self._cv:
            self.used -= n
            self.reserved -= n
            self._rooms.remove(room)
            self._cv.notify_all()


class LRUCache(Generic[K, V]):
    """A thread-safe cache bounded by the total weight of its values.

    ``weigh(value)`` estimates a value's size; the least recently used
    entries are dropped once the total passes ``max_weight``. A value
    heavier than the bound is not kept at all.
    """

    def __init__(self, max_weight: int, weigh: Callable[[V], int]):
        self.max_weight = max_weight
        self._weigh = weigh
        self._items: collections.OrderedDict[K, tuple[V, int]] = collections.OrderedDict()
        self._weight = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                return None
            self._items.move_to_end(key)
            return hit[0]

    def put(self, key: K, value: V) -> None:
        w = self._weigh(value)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._weight -= old[1]
            if w > self.max_weight:
                return
            self._items[key] = (value, w)
            self._weight += w
            while self._weight > self.max_weight:
                _, (_, ow) = self._items.popitem(last=False)
                self._weight -= ow

    def keys(self) -> list[K]:
        """The keys held now, least recently used first."""
        with self._lock:
            return list(self._items)

    def pop(self, key: K) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._weight -= old[1]

    @property
    def weight(self) -> int:
        return self._weight

    def __len__(self) -> int:
        return len(self._items)


class Runtime:
    """Thread pools, the read budget and buffer pools of one repository handle.

    - ``cpu``: ``workers`` threads hashing, compressing, decoding;
    - ``io``: ``io_workers`` threads for requests (parts, ranged GETs);
    - ``seal``: completes sealed packs (``packs_in_flight + 1``);
    - ``tensors``: tensors loaded at once (``tensor_workers``);
    - ``background``: one thread running async saves in order.
    """

    def __init__(self, options: RepoOptions):
        self.options = options
        self._lock = threading.Lock()
        self._pools: dict[str, cf.ThreadPoolExecutor] = {}
        self._buffer_pools: dict[str, BufferPool] = {}
        self._budget: ByteBudget | None = None

    def _pool(self, name: str, threads: int) -> cf.ThreadPoolExecutor:
        with self._lock:
            pool = self._pools.get(name)
            if pool is None:
                pool = self._pools[name] = cf.ThreadPoolExecutor(threads, thread_name_prefix=f"ckpt-{name}")
            return pool

    @property
    def cpu(self) -> cf.ThreadPoolExecutor:
        return self._pool("cpu", self.options.workers)

    @property
    def io(self) -> cf.ThreadPoolExecutor:
        return self._pool("io", self.options.io_workers)

    @property
    def seal(self) -> cf.ThreadPoolExecutor:
        return self._pool("seal", self.options.packs_in_flight + 1)

    @property
    def tensors(self) -> cf.ThreadPoolExecutor:
        return self._pool("tensor", self.options.tensor_workers)

    @property
    def background(self) -> cf.ThreadPoolExecutor:
        return self._pool("async", 1)

    def read_budget(self) -> ByteBudget:
        """Bytes fetched and not yet decoded, shared by every read of this handle."""
        with self._lock:
            if self._budget is None:
                o = self.options
                self._budget = ByteBudget(max(o.max_request, o.max_inflight_bytes // 2))
            return self._budget

    def buffers(self, name: str, size: int, keep: int, zeroed: bool = True) -> BufferPool:
        """The pool ``name`` of reusable ``size``-byte buffers.

        Saves share them: ``"parts"`` (multipart part buffers) and
        ``"scratch"`` (chunk-sized byte planes); reads ``"reads"``
        (:meth:`read_buffers`). A pool is rebuilt when its
        size changes (the repository's config can set ``chunk_size``).
        """
        with self._lock:
            pool = self._buffer_pools.get(name)
            if pool is None or pool.size != size:
                pool = self._buffer_pools[name] = BufferPool(size, keep=keep, zeroed=zeroed)
            return pool

    #: Pools of reads only, dropped (their idle buffers) once no read is under way.
    READ_POOLS = ("reads", "tiles", "tile bands")

    def tile_buffers(self) -> tuple[BufferPool, BufferPool]:
        """Reusable buffers of tiled reads: a chunk each for tiles landing one by one (``"tiles"``),
        two chunks each for the bands of tiles landing together (``"tile bands"``)."""
        o = self.options
        return (self.buffers("tiles", o.chunk_size, keep=o.workers + 2, zeroed=False),
                self.buffers("tile bands", 2 * o.chunk_size, keep=o.workers + 2, zeroed=False))

    def drop_read_buffers(self) -> None:
        """Give the idle buffers of the read pools (:data:`READ_POOLS`) back to the system."""
        with self._lock:
            pools = [self._buffer_pools.get(n) for n in self.READ_POOLS]
        for pool in pools:
            if pool is not None:
                pool.clear()

    def read_buffers(self) -> BufferPool:
        """Reusable buffers for range reads (``max_request`` bytes; as many as the read budget holds)."""
        o = self.options
        return self.buffers("reads", o.max_request, keep=max(1, self.read_budget().limit // max(1, o.max_request)),
                            zeroed=False)

    def map_tensors(self, fn: Callable[[str], V], keys: list[str]) -> list[V]:
        """Run ``fn(key)`` for several tensors at once (each fans out to the I/O pool)."""
        pool = self.tensors
        futures = [pool.submit(fn, k) for k in keys]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def close(self, wait: bool = True) -> None:
        """Wait for queued work (async saves first) and stop every thread. ``wait=False`` (from a
        finalizer): stop them without joining (they finish what is queued and exit); a finalizer
        may run inside ``threading``'s own locks, where a join deadlocks."""
        with self._lock:
            pools, self._pools = self._pools, {}
        for name in ("async", "tensor", "seal", "cpu", "io"):
            p = pools.pop(name, None)
            if p is not None:
                p.shutdown(wait=wait)
        for p in pools.values():
            p.shutdown(wait=wait)
