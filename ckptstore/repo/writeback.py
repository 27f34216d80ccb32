"""Write-back saves: a step is durable in the node-local tier first, in the object store later.

``ckptstore.open(url, cache_dir=..., write_back=True)``: a save writes its
packs and segment into the tier (fsynced), then the step's *pending record*
(the manifest it will commit, the packs and segments it needs, its lease;
fsynced, renamed into place: the local commit) and returns. A background
thread of the handle then, in order, uploads each pending step's packs and
segment from the tier, checks their sizes in the store, and commits the
step exactly as a direct save does (:class:`~ckptstore.repo.save.StepCommit`:
the dedup base's age is checked, the manifest is created with an exclusive
create), drops the lease and removes the pending record. So the step
appears in the store atomically, only once all its packs are there.

At most ``write_back_steps`` steps are pending per handle; a further save
waits for the oldest to commit. A process that dies leaves its pending
steps in the tier: the next handle opened with ``write_back=True`` on that
tier (or ``ckptstore flush URL --cache-dir DIR``) claims them and commits
them in step order. A step whose upload fails stays pending, with every
later one; the error is raised by :meth:`WriteBack.flush` and by the next
save, and ``flush`` tries again.

At interpreter exit, a handle that was not closed and still has pending
steps finishes them (:func:`finish_at_exit`): it says so on stderr, waits
at most ``write_back_exit_timeout`` seconds (default
:data:`EXIT_TIMEOUT`) for their uploads and commits, and where they cannot
finish (the store unreachable, the wait ran out, Ctrl-C) it says which
steps are left pending and the ``ckptstore flush`` command that commits
them. It runs before Python stops the thread pools the uploads need
(``threading._register_atexit``, as ``concurrent.futures`` does).
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass

from ..format import manifest as _m
from .catalog import Catalog
from ..errors import CkptStoreError, ObjectNotFoundError, PackVanishedError, StorageError
from ..format.layout import UPLOAD_FORMAT, manifest_key, pack_key, segment_key, upload_key, upload_of_key, upload_prefix
from ..format.manifest import Manifest, SegmentRef
from ..pipeline.runtime import release_free_memory
from .save import StepCommit
from ..storage.upload import ParallelUploader
from ..tier.cache import PendingSteps, is_pending_file, tier_files
from ..units import human_bytes as _human

log = logging.getLogger(__name__)

#: Default number of steps a handle keeps pending before a save waits.
WRITE_BACK_STEPS = 2
#: Default seconds a handle waits at interpreter exit for its pending steps' uploads and commits.
EXIT_TIMEOUT = 600.0
#: Seconds between the lines saying an exit wait is still going on.
EXIT_REPORT_EVERY = 30.0


class WriteBackError(CkptStoreError):
    """A pending step could not be committed in the store; its data stays in the tier."""


class TierNotWritableError(WriteBackError, OSError):
    """``write_back=True`` on a ``cache_dir`` this process cannot write (read-only, no permission...)."""


def check_writable(tier, url: str) -> None:
    """Refuse, at open, a tier a write-back save could not write: say which directory, and what to do.

    Creates the tier's folders (a write-back handle writes there from its
    first save) and one empty probe file, removed at once.
    """
    try:
        tier.prepare()
        records = tier.pending
        for d in (records.dir, records.durable.root):
            os.makedirs(d, exist_ok=True)
        probe = os.path.join(records.dir, f".probe.{os.getpid()}.{threading.get_ident()}")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as e:
        where = e.filename or tier.cache_dir
        raise TierNotWritableError(
            f"{url}: write_back=True needs a node-local tier it can write, and {tier.cache_dir} is not "
            f"writable ({e.strerror or type(e).__name__}: {where}): each step is written there before it is "
            "uploaded. Give a cache_dir on a writable local disk (check the mount and the permissions), or "
            "open without write_back=True (a cache_dir alone still reads from a read-only tier)"
        ) from e


@dataclass
class _Pending:
    """One queued job: ``kind`` "save" (upload, then commit), "rank" (a DCP rank's uploads, then its
    marker) or "commit" (a DCP coordinator: every rank's marker, then the commit)."""

    step: int
    commit: StepCommit | None
    man: Manifest | None
    packs: dict[str, int]
    segments: dict[str, int]
    kind: str = "save"
    rank: int | None = None
    ranks: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return PendingSteps.name(self.step, self.rank if self.kind == "rank" else None)


class WriteBack:
    """The write-back queue of one repository handle; see the module docstring."""

    def __init__(self, cat: Catalog, max_pending: int = WRITE_BACK_STEPS, exit_timeout: float | None = EXIT_TIMEOUT,
                 before_exit=None):
        if cat.tier is None:
            raise ValueError("write_back=True needs a cache_dir (the node-local tier the steps are written to first)")
        if max_pending < 1:
            raise ValueError("write_back_steps must be at least 1")
        if exit_timeout is not None and not exit_timeout >= 0:
            raise ValueError(f"write_back_exit_timeout must be a number of seconds >= 0 or None, got {exit_timeout!r}")
        self.exit_timeout = exit_timeout
        self._before_exit = before_exit  # waits for the handle's async save (it may hand over one more step)
        self._failed: list[int] = []  # steps whose commit failed, left pending (for the exit report)
        self._deadline: float | None = None  # the exit wait's end (monotonic): a DCP commit stops waiting then
        self.cat = cat
        self.tier = cat.tier
        self.records = cat.tier.pending
        self.store = self.records.durable  # the tier's root, fsynced writes
        self.max_pending = max_pending
        self._cv = threading.Condition()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._reserved = 0
        self._busy = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._closing = False  # a commit waiting for other ranks' uploads gives up at once (left pending)
        check_writable(cat.tier, cat.url)
        self.recover()
        _register(self)

    # ------------------------------------------------------------ saving
    def reserve(self, need: int = 0, what: str = "the save") -> None:
        """Wait for room for one more pending step (raises an earlier write-back failure).

        ``need``: most bytes the save may add to the tier (its raw size).
        With a ``cache_size``, a save waits while the pending steps' files
        and ``need`` do not fit in it and uploads are under way (each one
        committed frees its files for eviction); one that can never fit
        (``need`` over ``cache_size``) fails before writing anything.
        """
        cap = self.tier.cache_size
        if cap is not None and need > cap:
            raise WriteBackError(
                f"{self.cat.url}: {what} needs up to {_human(need)} in the node-local tier {self.tier.cache_dir} "
                f"while pending, more than its cache_size of {_human(cap)}: it can never fit. Nothing was written; "
                "raise cache_size, or save it without write_back"
            )
        self.tier.prepare()  # the tier's marks, before the save's first file
        with self._cv:
            while self._error is None:
                if len({j.step for j in self._queue}) + self._reserved >= self.max_pending:
                    self._cv.wait()
                elif cap is not None and need and self._queue and self.pending_bytes() + need > cap:
                    self._cv.wait()  # an upload that finishes frees its files for eviction
                else:
                    break
            self._raise_error()
            self._reserved += 1
        if need:
            self.tier.make_room(need)  # the save's files count only once committed: room first

    def pending_bytes(self) -> int:
        """Bytes of pending steps' files in the tier (``wb/``: never evicted)."""
        return sum(f[1] for f in tier_files(self.tier.cache_dir) if is_pending_file(f[0]))

    def unreserve(self) -> None:
        with self._cv:
            self._reserved -= 1
            self._cv.notify_all()

    def hand_over(self, commit: StepCommit, man: Manifest, packs: dict[str, int], seg: SegmentRef) -> bytes:
        """Record the step as pending (its local commit) and queue its upload; returns the manifest body."""
        cat = self.cat
        body = _m.to_json(man)
        commit.check_manifest_size(man, body)
        started = cat.clock.time() - (cat.clock.monotonic() - commit.t0)
        record = {
            "url": cat.url,
            "step": man.step,
            "started": started,
            "lease": commit.lease,
            "base": commit.base_step,
            "packs": packs,
            "segments": {seg.id: seg.size},
            "manifest": body.decode("utf-8"),
        }
        self.records.write(man.step, record)
        self.records.claim(man.step)
        cat.remember(man)
        job = _Pending(man.step, commit, man, dict(packs), {seg.id: seg.size})
        with self._cv:
            self._reserved -= 1
            self._queue.append(job)
            self._start()
            self._cv.notify_all()
        return body

    def hand_over_rank(self, step: int, rank: int, packs: dict[str, int], seg: SegmentRef | None) -> None:
        """A DCP rank's packs and segment are in the tier: record them and queue their upload and marker."""
        segments = {seg.id: seg.size} if seg is not None else {}
        name = PendingSteps.name(step, rank)
        self.records.write(name, {"url": self.cat.url, "step": step, "kind": "rank", "rank": rank,
                                  "packs": packs, "segments": segments})
        self.records.claim(name)
        self._queue_job(_Pending(step, None, None, dict(packs), segments, kind="rank", rank=rank), reserved=True)

    def hand_over_commit(self, commit: StepCommit, man: Manifest, ranks) -> bytes:
        """A DCP coordinator's step: record it and queue its commit, once every rank's uploads are in."""
        cat = self.cat
        body = _m.to_json(man)
        commit.check_manifest_size(man, body)
        started = cat.clock.time() - (cat.clock.monotonic() - commit.t0)
        ranks = tuple(sorted(set(int(r) for r in ranks)))
        self.records.write(man.step, {"url": cat.url, "step": man.step, "kind": "commit", "ranks": list(ranks),
                                      "started": started, "lease": commit.lease, "base": commit.base_step,
                                      "packs": {}, "segments": {}, "manifest": body.decode("utf-8")})
        self.records.claim(man.step)
        cat.remember(man)
        self._queue_job(_Pending(man.step, commit, man, {}, {}, kind="commit", ranks=ranks), reserved=False)
        return body

    def _queue_job(self, job: _Pending, reserved: bool) -> None:
        with self._cv:
            if reserved:
                self._reserved -= 1
            self._queue.append(job)
            self._start()
            self._cv.notify_all()

    # ------------------------------------------------------------ recovery
    def recover(self) -> list[int]:
        """Queue the pending steps of this repository no live process is uploading; their steps."""
        cat = self.cat
        taken = []
        with self._cv:
            queued = {j.name for j in self._queue}
        for name in self.records.names():
            if name in queued:
                continue
            rec = self.records.read(name)
            if rec is None or rec.get("url") != cat.url or not self.records.claim(name):
                continue
            step, kind = rec["step"], rec.get("kind", "save")
            packs, segments = dict(rec.get("packs", {})), dict(rec.get("segments", {}))
            if kind == "rank":
                taken.append(_Pending(step, None, None, packs, segments, kind="rank", rank=int(rec.get("rank", -1))))
                continue
            try:
                man = _m.from_json(rec["manifest"].encode("utf-8"), expect_step=step)
            except (KeyError, AttributeError, CkptStoreError) as e:
                log.warning("ckptstore: write-back: pending record %s in %s is unreadable: %s",
                            name, self.tier.cache_dir, e)
                self.records.release(name)
                continue
            commit = StepCommit(cat, step, rec.get("base"))
            commit.base_step = rec.get("base")
            commit.lease = rec.get("lease")
            # The base-age check counts from when the lease was written (wall time, across processes).
            commit.t0 = cat.clock.monotonic() - max(0.0, cat.clock.time() - float(rec.get("started", 0.0)))
            cat.remember(man)
            taken.append(_Pending(step, commit, man, packs, segments, kind=kind,
                                  ranks=tuple(int(r) for r in rec.get("ranks", ()))))
        if taken:
            order = {n: i for i, n in enumerate(self.records.names())}
            with self._cv:
                self._queue.extend(sorted(taken, key=lambda j: order.get(j.name, 0)))
                self._start()
                self._cv.notify_all()
        return sorted({j.step for j in taken})

    # ------------------------------------------------------------ the uploader
    def _start(self) -> None:
        """Start the uploader thread if it is not running (called holding the lock)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ckptstore-write-back", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._queue or self._error is not None:
                    self._busy = False
                    self._thread = None  # under the lock: a step queued from now on starts a new thread
                    self._cv.notify_all()
                    drained = self._error is None
                    break
                job = self._queue[0]
                self._busy = True
            try:
                self._commit(job)
            except BaseException as e:  # kept: raised by flush() and the next save
                log.warning("ckptstore: write-back of step %d to %s failed (its data stays in %s; commit it with "
                            "repo.flush() or `%s`): %s", job.step, self.cat.url, self.tier.cache_dir,
                            self.flush_command(), e)
                with self._cv:
                    self._error = e
                    self._failed = sorted({j.step for j in self._queue})
                    for j in self._queue:
                        self.records.release(j.name)
                    self._queue.clear()
                    self._busy = False
                    self._thread = None
                    self._cv.notify_all()
                return
            with self._cv:
                self._queue.popleft()
                self._cv.notify_all()
        if drained:  # every queued step committed: the heap's free memory back to the system
            release_free_memory()

    def _commit(self, job: _Pending) -> None:
        if job.kind == "rank":
            self._rank_uploads(job)
            return
        if job.kind == "commit":
            self._dcp_commit(job)
            return
        base = job.commit.base_step
        if base is not None and not self.cat.store.exists(manifest_key(base)):
            raise WriteBackError(
                f"{self.cat.url}: step {job.step} reuses chunks of step {base}, which is not committed in the store "
                "(it failed, or was discarded); this step cannot commit before it"
            )
        for pid, size in job.packs.items():
            self._upload(pack_key(pid), size)
        for sid, size in job.segments.items():
            self._upload(segment_key(sid), size)
        job.commit.commit(job.man)  # the base-age check, then the exclusive create
        job.commit.end()
        self.records.remove(job.step)
        # now ordinary copies: into the cache, counted against the budget
        moved = self.records.settle([pack_key(p) for p in job.packs] + [segment_key(s) for s in job.segments])
        self.tier.added(moved)

    def _rank_uploads(self, job: _Pending) -> None:
        """A DCP rank: its files up, their sizes checked, then the marker rank 0's commit waits for."""
        for pid, size in job.packs.items():
            self._upload(pack_key(pid), size)
        for sid, size in job.segments.items():
            self._upload(segment_key(sid), size)
        marker = {"format": UPLOAD_FORMAT, "version": 1, "step": job.step, "rank": job.rank,
                  "packs": job.packs, "segments": job.segments}
        self.cat.store.put(upload_key(job.step, job.rank), json.dumps(marker).encode())
        self.records.remove(job.name)
        moved = self.records.settle([pack_key(p) for p in job.packs] + [segment_key(s) for s in job.segments])
        self.tier.added(moved)

    def _dcp_commit(self, job: _Pending) -> None:
        """A DCP coordinator: wait until every rank's marker is in the store, then commit the step."""
        cat = self.cat
        want = set(job.ranks)
        delay = 0.05
        while True:
            have = {r for s, r in (upload_of_key(o.key) or (None, None) for o in cat.store.list(upload_prefix(job.step)))
                    if s == job.step}
            if want <= have:
                break
            job.commit.check_base_age()  # a rank that never uploads: refused as stale, as any slow save
            if self._closing or (self._deadline is not None and time.monotonic() > self._deadline):
                raise WriteBackError(
                    f"{cat.url}: step {job.step} waits for the uploads of rank(s) {sorted(want - have)}; "
                    "left pending in the tier for the next handle or `ckptstore flush`"
                )
            time.sleep(delay)
            delay = min(1.0, delay * 2)
        base = job.commit.base_step
        if base is not None and not cat.store.exists(manifest_key(base)):
            raise WriteBackError(f"{cat.url}: step {job.step} reuses chunks of step {base}, which is not committed")
        job.commit.commit(job.man)
        job.commit.end()
        self.records.remove(job.name)
        try:
            cat.store.delete_many([upload_key(job.step, r) for r in sorted(want)])
        except Exception as e:  # noqa: BLE001 - markers of a committed step are GC's to reclaim
            log.warning("ckptstore: write-back: could not delete step %d's upload markers: %s", job.step, e)

    def _upload(self, key: str, size: int) -> None:
        cat = self.cat
        try:
            if cat.store.head(key).size == size:
                return  # uploaded before a crash or by another process
        except ObjectNotFoundError:
            pass
        path = os.path.join(self.store.root, key)  # the tier's wb/ folder
        o = cat.options
        parts = cat.runtime.buffers("parts", o.part_size, (o.packs_in_flight + 1) * 5)
        # The read buffer is a pooled part buffer, not a new one an upload: with a fresh part_size
        # bytearray a pack, a DCP soak's rank 0 held about 300 MB free in glibc's arenas (in-use
        # memory flat; the arenas grew by part_size at a time: freeing one mmapped buffer raises
        # glibc's dynamic mmap threshold, so later ones came from the arenas; issue 44 item 3).
        buf = parts.get()
        up = ParallelUploader(cat.store, key, o.part_size, cat.runtime.io, window=4, buffers=parts)
        try:
            with open(path, "rb") as f:
                while n := f.readinto(buf):
                    up.write(memoryview(buf)[:n])
            sent = up.close()
        except FileNotFoundError:
            up.abort()
            raise WriteBackError(
                f"{cat.url}: write-back: {key} is missing from the node-local tier {self.tier.cache_dir}; "
                "the pending step cannot be committed: save it again"
            ) from None
        except BaseException:
            up.abort()
            raise
        finally:
            parts.put(buf)  # the uploader took (copied or wrote) what it was given
        try:
            got = cat.store.head(key).size
        except ObjectNotFoundError:
            raise PackVanishedError(f"{cat.url}/{key}: vanished after its upload completed") from None
        if sent != size or got != size:
            raise StorageError(f"{cat.url}/{key}: uploaded {sent} bytes, stored {got}, expected {size}")

    # ------------------------------------------------------------ waiting
    def pending_steps(self) -> list[int]:
        return self.records.steps()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every pending step is committed; after a failure, try again first.

        Raises :class:`WriteBackError` if a step still cannot be committed;
        until one flush succeeds, saves raise it too (a later step may reuse
        the failed one's chunks). ``timeout``: seconds to wait at most
        (None: until done); returns False if uploads were still under way
        then, True once every step is committed.
        """
        with self._cv:
            failed, self._error = self._error, None
        if failed is not None:
            self.recover()  # try again from the first step that failed
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while (self._queue or self._busy) and self._error is None:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
            self._raise_error()
            self._failed = []
        return True

    def flush_command(self) -> str:
        """The shell command that commits this handle's pending steps from another process."""
        return f"ckptstore flush {shlex.quote(self.cat.url)} --cache-dir {shlex.quote(self.tier.cache_dir)}"

    def _mine(self) -> list[int]:
        """Steps this handle queued and has not committed, or whose commit failed."""
        with self._cv:
            return sorted({j.step for j in self._queue} | set(self._failed))

    def finish_at_exit(self, timeout: float | None = None, out=None) -> bool:
        """At interpreter exit: commit this handle's pending steps, or say loudly that they are not.

        Waits for an async save still running (it ends in one more pending
        step), then at most ``timeout`` seconds (default: the handle's
        ``write_back_exit_timeout``) for the uploads and commits, with a
        line on ``out`` (stderr) when it starts, every
        :data:`EXIT_REPORT_EVERY` seconds, and when it ends. Steps that
        cannot be committed (a failure, the wait ran out, Ctrl-C) stay in
        the tier; the last lines name them and the command that commits
        them. Returns True if nothing is left pending by this handle.
        """
        out = sys.stderr if out is None else out
        timeout = self.exit_timeout if timeout is None else timeout
        if self._closed:
            return True
        t0 = time.monotonic()
        self._deadline = None if timeout is None else t0 + timeout
        reason = None
        try:
            if self._before_exit is not None:
                self._before_exit()
            self.recover()  # a record of this process not queued (a save stopped right after its local commit)
            steps = self._mine()
            if not steps:
                return True
            bound = "no time limit" if timeout is None else f"at most {timeout:g} s"
            _say(out, f"ckptstore: write-back: step{_s(steps)} {_list(steps)} not committed in {self.cat.url} "
                      f"yet; uploading and committing before exit ({bound}; Ctrl-C leaves them pending)")
            while True:
                left = None if self._deadline is None else self._deadline - time.monotonic()
                wait = EXIT_REPORT_EVERY if left is None else max(0.0, min(EXIT_REPORT_EVERY, left))
                if self.flush(wait):
                    _say(out, f"ckptstore: write-back: committed step{_s(steps)} {_list(steps)} in {self.cat.url} "
                              f"({time.monotonic() - t0:.1f} s)")
                    return True
                if left is not None and left <= wait:
                    reason = f"still uploading after {timeout:g} s, the write_back_exit_timeout"
                    break
                _say(out, f"ckptstore: write-back: still uploading step{_s(self._mine())} {_list(self._mine())} "
                          f"({time.monotonic() - t0:.0f} s)")
        except KeyboardInterrupt:
            reason = "interrupted"
        except WriteBackError as e:
            reason = str(e.__cause__ or e)
        except Exception as e:  # noqa: BLE001 - at exit: report, never raise
            reason = f"{type(e).__name__}: {e}"
        left = self._mine() or self.pending_steps()
        _say(out, f"ckptstore: WARNING: write-back: step{_s(left)} {_list(left)} saved with write_back=True "
                  f"{'are' if len(left) > 1 else 'is'} NOT committed in {self.cat.url} ({reason}); "
                  f"{'they stay' if len(left) > 1 else 'it stays'} pending in the node-local tier "
                  f"{self.tier.cache_dir}. Commit {'them' if len(left) > 1 else 'it'} with:\n"
                  f"    {self.flush_command()}")
        return False

    def discard(self, step: int) -> None:
        """Give up a pending step (its record goes; its files stay as ordinary tier copies)."""
        with self._cv:
            if self._busy and self._queue and self._queue[0].step == step:
                raise WriteBackError(f"{self.cat.url}: step {step} is being committed; flush() first")
            self._queue = collections.deque(j for j in self._queue if j.step != step)
            self._failed = [s for s in self._failed if s != step]
        names = [n for n in self.records.names() if n[:20] == PendingSteps.name(step)]
        if not names:
            raise KeyError(f"{self.cat.url}: step {step} is not pending in {self.tier.cache_dir}")
        for n in names:
            if n != PendingSteps.name(step):
                r = self.records.read(n) or {}
                self.records.remove(n)
                self.records.settle([pack_key(p) for p in r.get("packs", {})] +
                                    [segment_key(x) for x in r.get("segments", {})])
        rec = self.records.read(step) or {}
        self.records.remove(step)
        self.records.settle([pack_key(p) for p in rec.get("packs", {})] + [segment_key(s) for s in rec.get("segments", {})])
        self.cat.drop_lease(rec.get("lease"))
        self.cat.forget(step)
        with self._cv:
            if self._error is not None and not self._queue:
                self._error = None

    def _raise_error(self) -> None:
        e = self._error
        if e is None:
            return
        raise WriteBackError(
            f"{self.cat.url}: a step saved with write-back could not be committed in the store ({e}); it stays "
            f"in the node-local tier {self.tier.cache_dir}. Once the store is reachable, call repo.flush() or run "
            f"`ckptstore flush {self.cat.url} --cache-dir {self.tier.cache_dir}`; a step refused as stale or "
            "one whose base failed cannot commit: read it with repo.load(STEP) (from the tier), give it up with "
            "repo.discard_pending(STEP), and save it again"
        ) from e

    def close(self) -> None:
        """Wait for the pending steps (a failure is logged: they stay in the tier for the next handle).

        A DCP step still waiting for another rank's uploads is not waited for.
        """
        self._closing = True
        try:
            self.flush()
        except WriteBackError as e:
            log.warning("ckptstore: %s", e)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        _unregister(self)


def _s(steps) -> str:
    return "s" if len(steps) != 1 else ""


def _list(steps) -> str:
    return ", ".join(map(str, steps))


def _say(out, line: str) -> None:
    try:
        print(line, file=out, flush=True)
    except (OSError, ValueError):  # stderr closed at exit
        pass


#: Write-back queues of this process not closed yet (weak: a handle dropped with nothing to upload goes;
#: one whose uploader thread runs is held by that thread).
_LIVE: "weakref.WeakSet[WriteBack]" = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()
_HOOKED = False


def _register(wb: WriteBack) -> None:
    global _HOOKED
    with _LIVE_LOCK:
        _LIVE.add(wb)
        if _HOOKED:
            return
        _HOOKED = True
    # Before concurrent.futures stops its pools at exit (it registers the same way, earlier: these run
    # last-registered first), so that uploads can still use the handle's I/O threads.
    hook = getattr(threading, "_register_atexit", None)
    try:
        if hook is None:
            raise RuntimeError("no threading._register_atexit")
        hook(finish_at_exit)
    except RuntimeError:  # already shutting down, or an interpreter without the hook
        atexit.register(finish_at_exit)


def _unregister(wb: WriteBack) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(wb)


def finish_at_exit(out=None) -> None:
    """Every write-back handle of this process not closed: commit its pending steps, or say which are left
    and how to commit them (:meth:`WriteBack.finish_at_exit`). Runs at interpreter exit."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for wb in live:
        try:
            wb.finish_at_exit(out=out)
        except BaseException as e:  # noqa: BLE001 - one handle's failure must not hide the next one's report
            _say(sys.stderr if out is None else out, f"ckptstore: write-back: at exit: {type(e).__name__}: {e}")


def flush_on_signal(repo, signals=(signal.SIGTERM,)) -> None:
    """On ``signals`` (default SIGTERM, a preemption notice), flush ``repo`` before the previous handler runs.

    Call from the main thread. The previous handler (or the default action)
    runs after the flush, so a job that is being stopped still stops.
    """
    for sig in signals:
        previous = signal.getsignal(sig)

        def handler(signum, frame, previous=previous):
            try:
                repo.flush()
            except Exception as e:  # noqa: BLE001 - the data stays in the tier; the process is going down
                log.warning("ckptstore: flush on signal %d: %s", signum, e)
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)
