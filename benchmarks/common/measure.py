"""Clocks and counters: wall time, CPU seconds, RSS, page faults, bytes on disk."""

from __future__ import annotations

import gc
import os
import resource
import threading
import time

MiB = 1 << 20
GiB = 1 << 30


def cpu_self() -> float:
    """User + system CPU seconds of this process (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def proc_cpu(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (from /proc), or None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def rss_now() -> int:
    """Resident set size of this process now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak() -> int:
    """Peak RSS of this process so far (``ru_maxrss``), in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_peak_children() -> int:
    """Peak RSS of the largest waited-for child process, in bytes."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


class Timer:
    """Wall clock, this process's CPU and minor page faults, and a server process's CPU.

    ``with Timer(server_pid) as tm: ...`` then ``tm.seconds``, ``tm.cpu``,
    ``tm.minflt`` and ``tm.server_cpu`` (None without a server pid). A
    garbage collection runs before the clock starts, so that one operation's
    garbage is not collected inside the next one's time.
    """

    def __init__(self, server_pid: int | None = None):
        self.pid = server_pid
        self.seconds = self.cpu = 0.0
        self.minflt = 0
        self.server_cpu: float | None = None

    def __enter__(self) -> "Timer":
        gc.collect()
        self.cpu0, self.srv0 = cpu_self(), proc_cpu(self.pid)
        self.flt0 = minor_faults()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.cpu = cpu_self() - self.cpu0
        self.minflt = minor_faults() - self.flt0
        s1 = proc_cpu(self.pid)
        self.server_cpu = s1 - self.srv0 if s1 is not None and self.srv0 is not None else None


def best_of(fn, n: int = 3) -> float:
    """The shortest wall time of ``n`` calls of ``fn``."""
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def median_sample(samples: list, key=lambda x: x[0].seconds):
    """The sample with the median ``key`` (default: its Timer's wall time; the lower one of an even count)."""
    return sorted(samples, key=key)[(len(samples) - 1) // 2]


def median(xs) -> float:
    """The median of ``xs`` (the upper one of an even count), NaN when empty."""
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def dir_bytes(path: str) -> int:
    """Total size of the files under ``path`` (files vanishing meanwhile count 0)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RssSampler:
    """Peak RSS of this process while the block runs, sampled every ``period`` seconds."""

    def __init__(self, period: float = 0.005):
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_now())
            time.sleep(self.period)

    def __enter__(self) -> "RssSampler":
        self.peak = rss_now()
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_now())
