"""Clocks: wall time for object ages, a monotonic clock for durations.

Everything that ages objects or times a save (GC's grace period, a saver's
dedup-base age, lease and tombstone times) reads one :class:`Clock`, so
tests move time forward with :class:`ManualClock` instead of sleeping.
"""

from __future__ import annotations

import threading
import time


class Clock:
    """The system clock."""

    def time(self) -> float:
        """Seconds since the epoch (comparable with object-store mtimes)."""
        return time.time()

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (for durations)."""
        return time.perf_counter()


SYSTEM_CLOCK = Clock()


class ManualClock(Clock):
    """The system clock plus an offset that tests advance.

    Both readings move with real time, so objects written during the test
    age as they do; :meth:`advance` makes every object (and every running
    save) look ``seconds`` older at once.
    """

    def __init__(self, offset: float = 0.0):
        self._offset = float(offset)
        self._lock = threading.Lock()

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock only moves forward")
        with self._lock:
            self._offset += seconds

    @property
    def offset(self) -> float:
        return self._offset

    def time(self) -> float:
        return time.time() + self._offset

    def monotonic(self) -> float:
        return time.perf_counter() + self._offset
