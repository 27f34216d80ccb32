"""CPU affinity: the S3 server on its own core(s), this client on the others.

``os.sched_setaffinity(pid, ...)`` sets the mask of one thread (the one
whose id is ``pid``); threads inherit the mask of the thread that creates
them. :func:`pin` therefore sets it on every thread in ``/proc/<pid>/task``,
so that a server's existing threads and every thread they start later run
on the given CPUs.
"""

from __future__ import annotations

import os
from contextlib import contextmanager


def thread_ids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def pin(pid: int, cpus: set[int]) -> int:
    """Set the CPU mask of every thread of process ``pid``; returns how many threads now have it."""
    done = 0
    for _ in range(2):  # a thread started while the first pass ran gets the second
        done = 0
        for tid in thread_ids(pid):
            try:
                os.sched_setaffinity(tid, cpus)
                done += 1
            except (ProcessLookupError, FileNotFoundError):
                pass  # the thread ended meanwhile
    return done


def cpus_of(pid: int) -> set[int]:
    """The union of the CPU masks of the threads of ``pid``."""
    out: set[int] = set()
    for tid in thread_ids(pid):
        try:
            out |= os.sched_getaffinity(tid)
        except ProcessLookupError:
            pass
    return out


def fmt_cpus(cpus) -> str:
    return ",".join(str(c) for c in sorted(cpus))


class Pinning:
    """Which CPUs the S3 servers get and which the client gets while it talks to one.

    With ``enabled`` and at least two CPUs allowed to this process, the upper
    half of them goes to the server processes (one CPU on a 2-core machine),
    the lower half to the client while it runs an operation against a server
    (:meth:`client`), with torch's intra-op threads set to the number of
    client CPUs for that time. Local operations (no server involved) run on
    every allowed CPU, as without pinning. Disabled, nothing is pinned.
    """

    def __init__(self, enabled: bool = True):
        self.allowed = set(os.sched_getaffinity(0))
        cpus = sorted(self.allowed)
        self.enabled = bool(enabled) and len(cpus) >= 2
        self.reason = "" if self.enabled or not enabled else f"only CPU {fmt_cpus(cpus)} allowed"
        half = len(cpus) // 2
        self.client_cpus = set(cpus[:half]) if self.enabled else set(cpus)
        self.server_cpus = set(cpus[half:]) if self.enabled else set(cpus)
        self._pinned = False

    def describe(self) -> str:
        if not self.enabled:
            return "pinning: off" + (f" ({self.reason})" if self.reason else " (--no-pin): servers and client share "
                                     f"CPUs {fmt_cpus(self.allowed)}")
        return (f"pinning: S3 server processes on CPU {fmt_cpus(self.server_cpus)}; the client on CPU "
                f"{fmt_cpus(self.client_cpus)} (torch threads {len(self.client_cpus)}) while it runs an operation "
                f"against a server; local rows on CPUs {fmt_cpus(self.allowed)} (--no-pin: no pinning)")

    def server(self, pid: int | None) -> str:
        """Pin a server process; returns what was done, for the run's header."""
        if not self.enabled or pid is None:
            return "not pinned"
        n = pin(pid, self.server_cpus)
        got = cpus_of(pid)
        if got != self.server_cpus:
            raise RuntimeError(f"pinning pid {pid} to CPUs {fmt_cpus(self.server_cpus)} left it on {fmt_cpus(got)}")
        return f"pinned to CPU {fmt_cpus(self.server_cpus)} ({n} threads)"

    def check(self, pid: int | None) -> str:
        """Where the threads of a server process run now (to show the pinning held through the run)."""
        if pid is None:
            return "in this process"
        return f"CPU {fmt_cpus(cpus_of(pid))} ({len(thread_ids(pid))} threads)"

    @contextmanager
    def client(self, remote: bool = True):
        """Run the block on the client CPUs if ``remote`` (and pinning is on); on every CPU otherwise."""
        if not self.enabled or not remote or self._pinned:
            yield
            return
        import torch

        threads = torch.get_num_threads()
        pin(os.getpid(), self.client_cpus)
        torch.set_num_threads(len(self.client_cpus))
        self._pinned = True
        try:
            yield
        finally:
            self._pinned = False
            torch.set_num_threads(threads)
            pin(os.getpid(), self.allowed)
