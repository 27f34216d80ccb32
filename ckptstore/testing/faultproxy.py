"""A TCP fault proxy for tests: faults on the wire, below every client library.

:class:`FaultProxy` listens on ``127.0.0.1:<free port>`` and forwards each
connection to an upstream server (SeaweedFS, moto), two threads per
connection. A seeded share of connections is faulted, each with one
:class:`Fault`:

* ``reset``: after ``after`` bytes in one direction, both sockets are closed
  with an RST (``SO_LINGER`` 0): the client sees ``ECONNRESET`` mid-request
  or mid-response;
* ``close``: after ``after`` bytes, both sides are closed cleanly (FIN): a
  response cut short, or a request body that never arrives whole;
* ``stall``: after ``after`` bytes, that direction stops moving for
  ``seconds`` (bytes are neither read nor forwarded), then the connection
  is reset: only a client-side timeout gets the client out before that;
* ``latency``: from ``after`` bytes on, every forwarded block waits
  ``seconds`` first.

Keep-alive. With ``idle_close`` set, a connection on which no byte has
moved either way for that long, and whose last bytes went from the server
to the client (no request waits for its answer), is closed cleanly, as
servers and load balancers close idle keep-alive connections: clients then open new ones,
so a share of *connections* faulted reaches a steady share of requests
(without it, a client reusing a few pooled connections would see only their
faults), and the client's handling of a pooled connection closed under it
is exercised too (counted in ``idle_closed``).

Bounded. At most ``max_faults`` faults fire (a planned fault past that
budget does not, and its connection works normally), only within
``window`` seconds of :meth:`FaultProxy.start` (None: no limit), and every
stall ends after its ``seconds`` or when the proxy stops; ``rate`` can be
changed at any time (0 turns faults off).

Seeded. The fault of connection number ``i`` (in accept order) is a pure
function of ``(seed, i)`` (:meth:`FaultProxy.plan`), so a seed names one
sequence of faults. Which request a connection carries when its fault fires
depends on the client's connection pooling and thread timing, so a run is
reproducible in its faults, not byte for byte.

No pytest here. Everything stays on loopback.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from dataclasses import dataclass

HOST = "127.0.0.1"
KINDS = ("reset", "close", "stall", "latency")
_BLOCK = 64 << 10


@dataclass(frozen=True)
class Fault:
    """One connection's fault.

    Attributes
    ----------
    kind:
        ``"reset"``, ``"close"``, ``"stall"`` or ``"latency"`` (module docstring).
    direction:
        ``"up"`` (client to server: request bodies) or ``"down"`` (server to client: responses).
    after:
        Bytes forwarded in that direction before the fault fires.
    seconds:
        How long a stall lasts, or the delay per block of a latency fault.
    """

    kind: str
    direction: str
    after: int
    seconds: float = 0.0


@dataclass(frozen=True)
class Injected:
    """A fault that fired: on which connection, and when (seconds since start)."""

    conn: int
    fault: Fault
    at: float


class _Conn:
    def __init__(self, proxy: "FaultProxy", num: int, client: socket.socket, fault: Fault | None):
        self.proxy, self.num, self.client, self.fault = proxy, num, client, fault
        self.upstream: socket.socket | None = None
        self.done = threading.Event()
        self.fired = False
        self.lock = threading.Lock()
        self.last = time.monotonic()
        self.last_up = self.last_down = 0.0  # when bytes last went each way

    def run(self) -> None:
        try:
            self.upstream = socket.create_connection(self.proxy.upstream, timeout=10)
        except OSError:
            self.close(reset=True)  # the server is down: the client sees the connection drop
            return
        self.upstream.settimeout(None)
        self.client.settimeout(None)
        t = threading.Thread(target=self.pump, args=(self.client, self.upstream, "up"), daemon=True)
        t.start()
        self.pump(self.upstream, self.client, "down")
        t.join()
        self.close()

    def _fire(self) -> bool:
        """Whether the fault fires now (once per connection, within the proxy's budget)."""
        with self.lock:
            if self.fired:
                return True
            if not self.proxy._take_budget():
                return False
            self.fired = True
        self.proxy._record(self)
        return True

    def pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        fault = self.fault if self.fault is not None and self.fault.direction == direction else None
        sent = 0
        slow = False
        try:
            while not self.done.is_set():
                data = src.recv(_BLOCK)
                self.last = time.monotonic()
                if not data:
                    try:
                        dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                if fault is not None and not slow and sent + len(data) > fault.after:
                    if not self._fire():
                        fault = None  # over the proxy's fault budget: a normal connection
                if fault is not None and not slow and sent + len(data) > fault.after:
                    head = data[: max(0, fault.after - sent)]
                    if head:
                        dst.sendall(head)
                        sent += len(head)
                    if fault.kind == "latency":
                        slow = True
                        data = data[len(head):]
                    else:
                        if fault.kind == "stall":
                            # Neither read nor forward; the client's timeout or
                            # the end of the stall ends it.
                            self.done.wait(fault.seconds)
                        self.close(reset=fault.kind != "close")
                        return
                if slow:
                    if self.done.wait(self.fault.seconds):
                        return
                dst.sendall(data)
                sent += len(data)
                self.last = time.monotonic()
                if direction == "up":
                    self.last_up = self.last
                else:
                    self.last_down = self.last
                self.proxy._moved(direction, len(data))
        except OSError:
            self.close(reset=True)

    def close(self, reset: bool = False) -> None:
        self.done.set()
        for s in (self.client, self.upstream):
            if s is None:
                continue
            try:
                if reset:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                else:
                    s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass
        self.proxy._forget(self)


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream``, faulting a seeded share of connections.

    Parameters
    ----------
    upstream:
        ``(host, port)`` of the real server.
    seed:
        Names the sequence of faults (:meth:`plan`).
    rate:
        Share of connections faulted (0..1); settable later.
    kinds:
        Which fault kinds to draw from.
    directions:
        Which directions faults fire in (``"up"``: requests, ``"down"``: responses).
    max_faults:
        Most faults fired over the proxy's life (None: no limit).
    window:
        Faults only within this many seconds of :meth:`start` (None: no limit).
    max_after:
        A fault fires after a uniform ``[0, max_after)`` bytes in its direction.
    stall_seconds, latency_seconds:
        Length of a stall; delay per forwarded block of a latency fault.
    idle_close:
        Close connections idle this many seconds (None: never); see the module docstring.
    """

    def __init__(self, upstream: tuple[str, int], seed: int = 0, rate: float = 0.0, kinds=KINDS,
                 directions=("up", "down"), max_faults: int | None = None, window: float | None = None, max_after: int = 1 << 20,
                 stall_seconds: float = 5.0, latency_seconds: float = 0.05, idle_close: float | None = None,
                 port: int = 0):
        bad = set(kinds) - set(KINDS)
        if bad or not kinds:
            raise ValueError(f"unknown fault kinds {sorted(bad)} (known: {KINDS})")
        self.upstream = upstream
        self.seed = seed
        self.rate = rate
        self.kinds = tuple(kinds)
        if not directions or set(directions) - {"up", "down"}:
            raise ValueError(f"directions must be from ('up', 'down'), got {directions!r}")
        self.directions = tuple(directions)
        self.max_faults = max_faults
        self.window = window
        self.max_after = max_after
        self.stall_seconds = stall_seconds
        self.latency_seconds = latency_seconds
        self.idle_close = idle_close
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((HOST, port))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self.endpoint = f"http://{HOST}:{self.port}"
        self._lock = threading.Lock()
        self._live: set[_Conn] = set()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._stopped = threading.Event()
        #: Connections accepted so far.
        self.connections = 0
        #: Faults that fired, in order.
        self.injected: list[Injected] = []
        self._fired = 0  # faults fired (the max_faults budget)
        #: Connections closed for being idle (``idle_close``).
        self.idle_closed = 0
        #: Bytes forwarded client -> server and server -> client.
        self.bytes_up = 0
        self.bytes_down = 0

    def _moved(self, direction: str, n: int) -> None:
        with self._lock:
            if direction == "up":
                self.bytes_up += n
            else:
                self.bytes_down += n

    # ------------------------------------------------------------ faults
    def plan(self, i: int) -> Fault | None:
        """The fault connection ``i`` would get at rate ``self.rate`` (pure in ``(seed, i)``)."""
        rng = random.Random(f"{self.seed}:{i}")
        if rng.random() >= self.rate:
            return None
        kind = self.kinds[rng.randrange(len(self.kinds))]
        direction = self.directions[rng.randrange(len(self.directions))]
        after = rng.randrange(self.max_after)
        seconds = self.stall_seconds if kind == "stall" else self.latency_seconds if kind == "latency" else 0.0
        return Fault(kind, direction, after, seconds)

    def _choose(self, i: int) -> Fault | None:
        if self.window is not None and time.monotonic() - self._t0 > self.window:
            return None
        return self.plan(i)

    def _take_budget(self) -> bool:
        with self._lock:
            if self.max_faults is not None and self._fired >= self.max_faults:
                return False
            if self.window is not None and time.monotonic() - self._t0 > self.window:
                return False
            self._fired += 1
            return True

    def _record(self, conn: _Conn) -> None:
        with self._lock:
            self.injected.append(Injected(conn.num, conn.fault, round(time.monotonic() - self._t0, 3)))

    def _forget(self, conn: _Conn) -> None:
        with self._lock:
            self._live.discard(conn)

    def counts(self) -> dict[str, int]:
        """Faults fired so far, by kind."""
        out = {k: 0 for k in self.kinds}
        for f in list(self.injected):
            out[f.fault.kind] += 1
        return out

    # ------------------------------------------------------------ lifetime
    def start(self) -> "FaultProxy":
        if self._thread is None:
            self._t0 = time.monotonic()
            self._thread = threading.Thread(target=self._accept, name=f"faultproxy-{self.port}", daemon=True)
            self._thread.start()
            if self.idle_close is not None:
                threading.Thread(target=self._reap, name=f"faultproxy-idle-{self.port}", daemon=True).start()
        return self

    def _reap(self) -> None:
        while not self._stopped.wait(self.idle_close / 4):
            now = time.monotonic()
            with self._lock:
                idle = [c for c in self._live if c.upstream is not None and now - c.last > self.idle_close
                        and c.last_down >= c.last_up  # no request waiting for its answer
                        and not (c.fired and c.fault.kind == "stall")]  # a stall ends on its own clock
                self.idle_closed += len(idle)
            for c in idle:
                c.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                num = self.connections
                self.connections += 1
                conn = _Conn(self, num, client, self._choose(num))
                self._live.add(conn)
            threading.Thread(target=conn.run, name=f"faultproxy-conn-{num}", daemon=True).start()

    def drop_all(self) -> int:
        """Reset every open connection (as a server that died would); returns how many."""
        with self._lock:
            live = list(self._live)
        for c in live:
            c.close(reset=True)
        return len(live)

    def stop(self) -> None:
        self._stopped.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        self.drop_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
