"""A fake process group for :class:`ckptstore.dcp.exchange.Exchanger`: ranks as threads of one process.

``Hub(n)`` holds the shared state; ``FakeComm(hub, rank)`` has the methods of
:class:`ckptstore.dcp.exchange.TorchComm`. Collectives complete once every rank
has called them (matched by each rank's call count, as a real group matches
them by order); point-to-point messages wait in a mailbox per (source,
destination, tag). Every ``wait`` honours its timeout (False when it runs
out), so a rank that never calls shows up as the timeout a real group gives.
"""

from __future__ import annotations

import collections
import datetime
import threading

import torch


class Hub:
    def __init__(self, n: int):
        self.n = n
        self.cv = threading.Condition()
        self.slots: dict[int, list] = {}
        self.mail: dict[tuple[int, int, int], collections.deque] = collections.defaultdict(collections.deque)


def _seconds(timeout) -> float | None:
    if timeout is None:
        return None
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


class _Done:
    def wait(self, timeout=None) -> bool:
        return True


class _Collective:
    def __init__(self, hub: Hub, seq: int, finish):
        self.hub, self.seq, self.finish = hub, seq, finish

    def wait(self, timeout=None) -> bool:
        hub = self.hub
        with hub.cv:
            ok = hub.cv.wait_for(lambda: all(x is not None for x in hub.slots[self.seq]), _seconds(timeout))
            if not ok:
                return False
            self.finish(hub.slots[self.seq])
        return True


class _Receive:
    def __init__(self, hub: Hub, key: tuple[int, int, int], t: torch.Tensor):
        self.hub, self.key, self.t = hub, key, t

    def wait(self, timeout=None) -> bool:
        hub = self.hub
        with hub.cv:
            if not hub.cv.wait_for(lambda: hub.mail[self.key], _seconds(timeout)):
                return False
            data = hub.mail[self.key].popleft()
        dst = self.t.reshape(-1).view(torch.uint8)  # a contiguous buffer, as the exchange's are
        if data.numel() != dst.numel():
            raise RuntimeError(f"a message of {data.numel()} bytes for a buffer of {dst.numel()}")
        dst.copy_(data)
        return True


class FakeComm:
    def __init__(self, hub: Hub, rank: int):
        self.hub, self.rank, self.size, self.devices = hub, rank, hub.n, {"cpu"}
        self._seq = 0

    def _collective(self, mine, finish):
        hub = self.hub
        seq, self._seq = self._seq, self._seq + 1
        with hub.cv:
            hub.slots.setdefault(seq, [None] * hub.n)[self.rank] = mine
            hub.cv.notify_all()
        return _Collective(hub, seq, finish)

    def all_reduce_max(self, t: torch.Tensor):
        return self._collective(t.clone(), lambda xs: t.copy_(torch.stack(xs).max(dim=0).values))

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor):
        def finish(xs):
            for o, x in zip(out, xs):
                o.copy_(x)
        return self._collective(t.clone(), finish)

    def all_gather_into_tensor(self, out: torch.Tensor, t: torch.Tensor):
        return self._collective(t.clone(), lambda xs: out.copy_(torch.cat(xs)))

    def broadcast(self, t: torch.Tensor, src: int):
        return self._collective(t.clone(), lambda xs: t.copy_(xs[src]))

    def post(self, sends, recvs, batched: bool) -> list:
        hub = self.hub
        works = [_Receive(hub, (p, self.rank, tag), t) for t, p, tag in recvs]
        with hub.cv:
            for t, p, tag in sends:
                hub.mail[(self.rank, p, tag)].append(t.detach().contiguous().reshape(-1).view(torch.uint8).clone())
            hub.cv.notify_all()
        return works + [_Done() for _ in sends]


def run_ranks(n: int, body, timeout: float = 60.0) -> list:
    """Run ``body(rank, comm)`` on ``n`` threads sharing one hub; each rank's result or exception."""
    hub = Hub(n)
    out: list = [None] * n

    def one(r: int) -> None:
        try:
            out[r] = body(r, FakeComm(hub, r))
        except BaseException as e:  # noqa: BLE001 - returned to the test
            out[r] = e

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a fake rank hung"
    return out
