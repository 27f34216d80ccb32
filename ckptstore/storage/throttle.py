"""Slowing a whole process down when a store throttles it.

A store answers ``503 SlowDown`` (S3), ``429``/``503`` (GCS) or ``503
ServerBusy`` (Azure) when it is sent more requests than it serves (S3:
about 3,500 writes and 5,500 reads a second per partitioned prefix; GCS:
about 1,000 writes a second per bucket to start with; Azure: about 500
requests a second per blob). Retrying each request on its own thread does
not help: sixteen upload threads, each backing off by itself, keep the
aggregate rate where it was, and most answers stay 503. The AWS SDKs'
answer, which this module follows, is a client-side rate (their "adaptive"
retry mode):

* every request first takes a token from a bucket refilled at ``rate``
  tokens a second (the bucket holds at most one second's worth);
* the bucket is off until the store first throttles: an unthrottled process
  runs at full speed;
* a throttled answer sets ``rate`` to ``beta`` times the rate the process
  was sending at, and the rate then grows back along a cubic curve
  (CUBIC congestion control: slowly near the rate that was throttled,
  faster away from it) as answers succeed, never above twice the measured
  send rate;
* ``Retry-After`` on a throttled answer stops every request to that
  endpoint until it has passed (at most ``max_retry_after`` seconds);
* a minute without a throttled answer (``forget_after``) turns the bucket
  off again: checkpoints come in bursts, and the next one should not start
  at the rate measured while the process sat idle (the AWS SDKs' cap of
  twice the measured rate would hold it there).

One :class:`AdaptiveRate` serves every store of the process that talks to
one endpoint (:func:`rate_for`): all threads, all handles. The backends call
:meth:`AdaptiveRate.before` before each HTTP request and
:meth:`AdaptiveRate.after` with its outcome. Time comes from a clock and a
sleep that tests replace.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ThrottlePolicy:
    """How a process adapts its request rate to a store that throttles (repository option ``throttle=``).

    beta: the rate after a throttled answer, as a fraction of the rate sent at (AWS: 0.7).
    scale: the cubic growth constant, requests/s per second cubed (AWS: 0.4).
    min_rate: the lowest rate, requests a second.
    max_retry_after: longest ``Retry-After`` honoured, seconds.
    forget_after: seconds without a throttled answer after which the bucket is off again
        (checkpoints come in bursts: the next one starts at full speed, not at a
        rate measured while the process was idle).
    """

    beta: float = 0.7
    scale: float = 0.4
    min_rate: float = 0.5
    max_retry_after: float = 60.0
    forget_after: float = 60.0

    def __post_init__(self):
        if not 0 < self.beta < 1:
            raise ValueError(f"ThrottlePolicy.beta must be in (0, 1), got {self.beta!r}")
        if not self.scale > 0 or not self.min_rate > 0 or not self.max_retry_after >= 0 or not self.forget_after > 0:
            raise ValueError("ThrottlePolicy: scale, min_rate and forget_after must be positive, max_retry_after "
                             "not negative")


class AdaptiveRate:
    """The token bucket and cubic rate of one endpoint (thread-safe); see the module docstring.

    Counters: ``throttled`` answers, ``succeeded`` answers, ``waited``
    seconds spent in :meth:`before`.
    """

    def __init__(self, policy: ThrottlePolicy | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.policy = policy or ThrottlePolicy()
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        now = clock()
        self.enabled = False
        self.rate = math.inf  # tokens a second, once enabled
        self._tokens = 0.0
        self._refilled = now
        self._paused_until = 0.0
        # CUBIC: the rate last throttled at, when, and the time it takes to grow back to it
        self._w_max = 0.0
        self._last_throttle = now
        self._k = 0.0
        # measured send rate: requests per half-second bucket, smoothed
        self._measured = 0.0
        self._bucket_start = now
        self._bucket_count = 0
        self.throttled = 0
        self.succeeded = 0
        self.waited = 0.0

    # ------------------------------------------------------------ the bucket
    def _refill(self, now: float) -> None:
        if self.enabled and math.isfinite(self.rate):
            self._tokens = min(max(self.rate, 1.0), self._tokens + (now - self._refilled) * self.rate)
        self._refilled = now

    def before(self) -> None:
        """Wait until a request may be sent (a token, and no ``Retry-After`` pause)."""
        while True:
            with self._lock:
                now = self._clock()
                self._forget(now)
                wait = self._paused_until - now
                if wait <= 0:
                    if not self.enabled:
                        return
                    self._refill(now)
                    if self._tokens >= 1 - 1e-9:  # not 1: float time may never add the last 1e-15
                        self._tokens = max(0.0, self._tokens - 1)
                        return
                    wait = max((1 - self._tokens) / self.rate, 1e-6)
                self.waited += wait
            self._sleep(wait)

    def _forget(self, now: float) -> None:
        if self.enabled and now - self._last_throttle > self.policy.forget_after:
            self.enabled = False
            self.rate = math.inf

    # ------------------------------------------------------------ answers
    def _measure(self, now: float) -> float:
        """Record one answer; the send rate (requests a second): smoothed over half-second spans,
        or the current span's if higher (a burst in the first span counts at once)."""
        self._bucket_count += 1
        span = now - self._bucket_start
        if span >= 0.5:
            current = self._bucket_count / span
            self._measured = 0.8 * current + 0.2 * self._measured
            self._bucket_count = 0
            self._bucket_start = now
            return self._measured
        return max(self._measured, self._bucket_count / 0.5)

    def after(self, throttled: bool, retry_after: float | None = None) -> None:
        """Take one answer: ``throttled`` lowers the rate, a success lets it grow."""
        p = self.policy
        with self._lock:
            now = self._clock()
            self._forget(now)
            measured = self._measure(now)
            if throttled:
                self.throttled += 1
                sent = measured if not self.enabled else min(measured, self.rate)
                sent = max(p.min_rate, sent)
                self._w_max = sent
                self._k = (self._w_max * (1 - p.beta) / p.scale) ** (1 / 3)
                self._last_throttle = now
                new = sent * p.beta
                if not self.enabled:
                    self.enabled = True
                    self._tokens = 0.0
                if retry_after is not None and retry_after > 0:
                    self._paused_until = max(self._paused_until, now + min(retry_after, p.max_retry_after))
            else:
                self.succeeded += 1
                if not self.enabled:
                    return
                new = p.scale * (now - self._last_throttle - self._k) ** 3 + self._w_max
            self._refill(now)  # tokens earned until now at the old rate
            self.rate = max(p.min_rate, min(new, 2 * measured))
            self._tokens = min(self._tokens, max(self.rate, 1.0))

    def stats(self) -> dict:
        with self._lock:
            return {"enabled": self.enabled, "rate": None if not self.enabled else self.rate,
                    "throttled": self.throttled, "succeeded": self.succeeded, "waited": self.waited}


_RATES: dict[tuple, AdaptiveRate] = {}
_RATES_LOCK = threading.Lock()


def rate_for(endpoint: str, policy: ThrottlePolicy | None = None) -> AdaptiveRate:
    """The process's :class:`AdaptiveRate` for ``endpoint`` (one per endpoint and policy)."""
    policy = policy or ThrottlePolicy()
    key = (endpoint, policy)
    with _RATES_LOCK:
        r = _RATES.get(key)
        if r is None:
            r = _RATES[key] = AdaptiveRate(policy)
        return r


def reset_rates() -> None:
    """Forget every endpoint's rate (tests that restart servers)."""
    with _RATES_LOCK:
        _RATES.clear()


def parse_retry_after(value) -> float | None:
    """Seconds from a ``Retry-After`` header (a number of seconds; an HTTP date is not honoured)."""
    if value is None:
        return None
    try:
        seconds = float(str(value).strip())
    except ValueError:
        return None
    return seconds if seconds >= 0 and math.isfinite(seconds) else None
