"""Retries with jittered exponential backoff, as a wrapper around any store.

Only :class:`~ckptstore.errors.TransientStorageError` is retried (throttling,
5xx, connection resets and timeouts, as the backends classify them by error
code); everything else fails on the first attempt. Attempts and total time
are both bounded. A throttled answer's ``Retry-After`` is waited out (at
most :data:`MAX_RETRY_AFTER`); a request still throttled when the bounds
run out raises :class:`~ckptstore.errors.StoreThrottledError`, which says
so (a listing the store refused is never an empty repository). The
process-wide request rate that throttling lowers is the backends' own
(:mod:`ckptstore.storage.throttle`), below every retry. On by default for remote stores (``ckptstore.open(...,
retry=RetryPolicy(...) | False)``).

A host name that does not resolve (:class:`~ckptstore.errors.HostNotResolvedError`)
is not transient: a name the resolver says does not exist fails at once,
and one it could not get an answer for (no network, a name server that did
not reply) is retried for at most ``max_unresolved`` seconds, so a
mistyped endpoint or a machine without network fails within seconds, not
after the minutes of backoff a flaky server deserves.

Two operations need care because the first attempt may have succeeded with
its response lost:

- ``put_if_absent``: a retry that finds the object present raises
  ``ObjectExistsError`` with ``maybe_ours=True``; the repository then reads
  the object back and accepts it if it is byte-identical to its own.
- multipart ``complete``: a retry answered "no such upload" heads the key
  and succeeds if an object of exactly the uploaded size is there.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..errors import (
    HostNotResolvedError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreThrottledError,
    TransientStorageError,
)
from .base import MultipartUpload, ObjectStore
from .wrappers import WrapperStore

#: Longest ``Retry-After`` a retry waits for, seconds.
MAX_RETRY_AFTER = 60.0


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to retry.

    max_attempts: attempts per call, the first included.
    base_delay: first backoff, seconds; doubles each retry.
    max_delay: cap of one backoff.
    max_total: give up once this many seconds have passed since the first attempt.
    max_unresolved: the same bound for a host name the resolver could not
        get an answer for (``EAI_AGAIN``); a name that does not exist is not
        retried at all.
    """

    max_attempts: int = 8
    base_delay: float = 0.05
    max_delay: float = 5.0
    max_total: float = 120.0
    max_unresolved: float = 5.0

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")


class RetryStore(WrapperStore):
    """Retries transient failures of ``inner`` (thread-safe).

    ``retries`` counts retries made, ``gave_up`` calls that exhausted the policy.
    ``sleep`` and ``monotonic`` are the clock the backoff waits on and the
    time bounds read (tests pass a simulated one).
    """

    def __init__(self, inner: ObjectStore, policy: RetryPolicy | None = None, seed: int | None = None,
                 sleep: Callable[[float], None] = time.sleep, monotonic: Callable[[], float] = time.monotonic):
        super().__init__(inner)
        self.policy = policy or RetryPolicy()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._sleep = sleep
        self._monotonic = monotonic
        self.retries = 0
        self.gave_up = 0

    def _backoff(self, attempt: int) -> float:
        cap = min(self.policy.max_delay, self.policy.base_delay * (2 ** (attempt - 1)))
        with self._lock:
            return self._rng.uniform(0, cap)  # "full jitter"

    def _run(self, fn: Callable, on_retry_error: Callable | None = None):
        start = self._monotonic()
        attempt = 1
        throttled = 0
        while True:
            try:
                return fn()
            except (TransientStorageError, HostNotResolvedError) as e:
                elapsed = self._monotonic() - start
                delay = self._backoff(attempt)
                if getattr(e, "throttled", False):
                    throttled += 1
                    if e.retry_after:
                        delay = max(delay, min(e.retry_after, MAX_RETRY_AFTER))
                bound = self.policy.max_total
                if isinstance(e, HostNotResolvedError):
                    bound = min(bound, self.policy.max_unresolved) if e.temporary else -1.0
                if attempt >= self.policy.max_attempts or elapsed + delay > bound:
                    with self._lock:
                        self.gave_up += 1
                    if throttled and getattr(e, "throttled", False):
                        raise StoreThrottledError(
                            f"{e}; the store kept throttling this request ({throttled} of {attempt} attempts over "
                            f"{elapsed:.3g} s answered 'slow down', and this process lowered its request rate to "
                            "the store): the repository is not known to be empty or damaged. Retry later, spread the "
                            "job's requests over time, or allow more time (retry=RetryPolicy(max_total=...))"
                        ) from e
                    raise
                with self._lock:
                    self.retries += 1
                self._sleep(delay)
                attempt += 1
            except Exception as e:
                if attempt > 1 and on_retry_error is not None:
                    return on_retry_error(e)
                raise

    def get(self, key):
        return self._run(lambda: self.inner.get(key))

    def get_ranges(self, key, ranges):
        return self._run(lambda: self.inner.get_ranges(key, ranges))

    def read_range_into(self, key, start, out, progress=None):
        # A retry reads only what the failed attempt had not delivered yet:
        # reported bytes are final (the store's contract), and a caller may
        # already be using them.
        mv = memoryview(out).cast("B")
        done = [0]

        def attempt():
            base = done[0]

            def seen(n: int) -> None:
                done[0] = base + n
                if progress is not None:
                    progress(base + n)

            self.inner.read_range_into(key, start + base, mv[base:], seen)

        return self._run(attempt)

    def put(self, key, data):
        return self._run(lambda: self.inner.put(key, data))

    def put_if_absent(self, key, data):
        def after_retry(e):
            if isinstance(e, ObjectExistsError):
                e.maybe_ours = True  # the first attempt may have written it
            raise e

        return self._run(lambda: self.inner.put_if_absent(key, data), after_retry)

    def head(self, key):
        return self._run(lambda: self.inner.head(key))

    def list(self, prefix=""):
        return iter(self._run(lambda: list(self.inner.list(prefix))))

    def delete(self, key):
        return self._run(lambda: self.inner.delete(key))

    def delete_many(self, keys):
        # Deleting is idempotent: a failed batch is sent again whole.
        keys = list(keys)
        return self._run(lambda: self.inner.delete_many(keys))

    def create_multipart(self, key, part_size):
        return _RetryMultipart(self, self._run(lambda: self.inner.create_multipart(key, part_size)))

    def list_multipart(self, prefix=""):
        return self._run(lambda: self.inner.list_multipart(prefix))

    def abort_multipart(self, key, upload_id):
        return self._run(lambda: self.inner.abort_multipart(key, upload_id))


class _RetryMultipart(MultipartUpload):
    def __init__(self, owner: RetryStore, inner: MultipartUpload):
        self.owner, self.inner = owner, inner
        self.key, self.part_size = inner.key, inner.part_size
        self.upload_id = getattr(inner, "upload_id", None)
        self._sizes: dict[int, int] = {}

    def upload_part(self, number, data):
        self._sizes[number] = len(data)
        return self.owner._run(lambda: self.inner.upload_part(number, data))

    def complete(self, nparts):
        expected = sum(self._sizes.get(n, 0) for n in range(1, nparts + 1))

        def after_retry(e):
            # An earlier attempt completed the upload; its answer was lost.
            if isinstance(e, (ObjectNotFoundError, FileNotFoundError, TransientStorageError)):
                try:
                    if self.owner.inner.head(self.key).size == expected:
                        return None
                except ObjectNotFoundError:
                    pass
            raise e

        return self.owner._run(lambda: self.inner.complete(nparts), after_retry)

    def abort(self):
        try:
            return self.owner._run(lambda: self.inner.abort())
        except Exception:
            pass
