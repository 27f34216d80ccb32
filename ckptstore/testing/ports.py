"""Free loopback TCP ports, for the servers and process groups tests start.

No pytest here, and nothing but :mod:`socket`: the emulators, the benchmarks
and spawned ranks import it alike.
"""

from __future__ import annotations

import socket

HOST = "127.0.0.1"


def free_ports(n: int, host: str = HOST) -> list[int]:
    """``n`` distinct TCP ports nothing listens on right now.

    All ``n`` sockets are bound before any is closed, so the ports differ;
    another process may still take one before the caller binds it.
    """
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def free_port(host: str = HOST) -> int:
    """A TCP port nothing listens on right now (a server's, or ``MASTER_PORT`` of a gloo group)."""
    return free_ports(1, host)[0]
