"""The TCP fault proxy itself (ckptstore.testing.faultproxy), against an echo server."""

from __future__ import annotations

import errno
import socket
import threading

import pytest

from ckptstore.testing.faultproxy import Fault, FaultProxy


@pytest.fixture
def echo():
    """A server echoing every byte back, on a free loopback port."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(32)

    def serve(c):
        with c:
            while True:
                try:
                    d = c.recv(65536)
                except OSError:
                    return
                if not d:
                    return
                try:
                    c.sendall(d)
                except OSError:
                    return

    def accept():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(c,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()
    srv.close()


def _exchange(port: int, payload: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        got = b""
        while True:
            d = c.recv(65536)
            if not d:
                return got
            got += d


def _forced(proxy: FaultProxy, fault: Fault) -> None:
    proxy.plan = lambda i: fault  # every connection gets this fault


def test_pass_through_is_byte_exact(echo):
    data = bytes(range(256)) * 4096
    with FaultProxy(echo) as p:
        assert _exchange(p.port, data) == data
        assert p.injected == [] and p.connections == 1 and p.bytes_up == p.bytes_down == len(data)


def test_reset_after_n_bytes(echo):
    with FaultProxy(echo, rate=1) as p:
        _forced(p, Fault("reset", "down", 1000))
        with pytest.raises(ConnectionResetError):
            got = _exchange(p.port, b"x" * 100_000)
            assert len(got) < 100_000  # a reset may surface as a short read first
            raise ConnectionResetError("short")
        assert [i.fault.kind for i in p.injected] == ["reset"]


def test_close_cuts_the_response_short(echo):
    with FaultProxy(echo, rate=1) as p:
        _forced(p, Fault("close", "down", 5000))
        got = _exchange(p.port, b"y" * 100_000)
        assert got == b"y" * 5000


def test_stall_needs_a_client_timeout(echo):
    with FaultProxy(echo, rate=1, stall_seconds=30) as p:
        _forced(p, Fault("stall", "down", 10, 30.0))
        with pytest.raises(socket.timeout):
            _exchange(p.port, b"z" * 1000, timeout=0.5)
        assert p.counts()["stall"] == 1
    # stop() ended the stall: no thread waits out its 30 s


def test_latency_keeps_bytes_exact(echo):
    with FaultProxy(echo, rate=1, latency_seconds=0.001) as p:
        _forced(p, Fault("latency", "up", 100, 0.001))
        data = b"abc" * 50_000
        assert _exchange(p.port, data) == data
        assert p.counts()["latency"] == 1


def test_faults_are_seeded_and_bounded(echo):
    a, b, c = FaultProxy(echo, seed=5, rate=0.3), FaultProxy(echo, seed=5, rate=0.3), FaultProxy(echo, seed=6, rate=0.3)
    try:
        plans = [a.plan(i) for i in range(200)]
        assert plans == [b.plan(i) for i in range(200)]
        assert plans != [c.plan(i) for i in range(200)]
        assert 30 < sum(p is not None for p in plans) < 90
        assert {p.kind for p in plans if p} == {"reset", "close", "stall", "latency"}
    finally:
        for p in (a, b, c):
            p.stop()
    with FaultProxy(echo, seed=1, rate=1.0, max_faults=2, kinds=("close",)) as p:
        for _ in range(5):
            try:
                _exchange(p.port, b"q" * 3_000_000)
            except OSError:
                pass  # closed under us while still sending
        assert len(p.injected) == 2  # the count bound
    with FaultProxy(echo, seed=1, rate=1.0, window=0.0, kinds=("close",)) as p:
        assert _exchange(p.port, b"w" * 100_000) == b"w" * 100_000  # outside the time window
        assert p.injected == []


def test_dead_upstream_drops_the_connection():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    with FaultProxy(("127.0.0.1", port)) as p:
        # the proxy may drop the client before it has sent: then even the
        # shutdown of its own side fails (ENOTCONN), another form of the same drop
        with pytest.raises(OSError) as e:
            got = _exchange(p.port, b"hello")
            if got == b"":
                raise ConnectionResetError("closed")
        assert e.value.errno in (None, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE, errno.ENOTCONN), e.value
