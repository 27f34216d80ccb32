"""Free loopback TCP ports, for the servers and process groups tests start.

No pytest here, and nothing but :mod:`socket`: the emulators, the benchmarks
and spawned ranks import it alike.
"""

from __future__ import annotations

import random
import socket

HOST = "127.0.0.1"
#: Ports are drawn from here, below the kernel's ephemeral range (Linux: 32768-60999), so that a
#: port handed out is not then taken as the local port of some outgoing connection (the test
#: clients make thousands) before the server or ``MASTER_PORT`` binds it: EADDRINUSE.
LOW, HIGH = 20000, 32767
_rng = random.Random()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return HIGH + 1


def free_ports(n: int, host: str = HOST) -> list[int]:
    """``n`` distinct TCP ports nothing listens on right now.

    All ``n`` sockets are bound before any is closed, so the ports differ;
    another process may still take one before the caller binds it.
    """
    socks, ports = [], []
    high = min(HIGH, _ephemeral_start() - 1)
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            for _ in range(64 if high > LOW else 0):  # a random port below the ephemeral range, free now
                try:
                    s.bind((host, _rng.randint(LOW, high)))
                    break
                except OSError:
                    continue
            else:
                s.bind((host, 0))  # the kernel's choice
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def free_port(host: str = HOST) -> int:
    """A TCP port nothing listens on right now (a server's, or ``MASTER_PORT`` of a gloo group)."""
    return free_ports(1, host)[0]
