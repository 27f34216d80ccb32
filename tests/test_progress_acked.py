"""Progress counts bytes the store acknowledged, not bytes handed to the uploads (which run up to
``max_inflight_bytes`` ahead: a bar stood at 100% for seconds while they finished)."""

from __future__ import annotations

import threading

import torch

from ckptstore.repo.repository import Repository
from ckptstore.storage import MemoryStore
from ckptstore.storage.faults import FaultStore

MiB = 1 << 20
#: One pack of three parts (raw: its size is the data's), each part held at the gate.
OPTS = dict(chunk_size=1 * MiB, pack_size=64 * MiB, part_size=5 * MiB, codec="raw")


class _PartGate:
    """Holds every part upload of packs until opened; counts those waiting."""

    def __init__(self, store: FaultStore):
        self.open = threading.Event()
        self.waiting = 0
        self.cv = threading.Condition()
        store.add_rule("upload_part", "packs/*", self._hook)

    def _hook(self, op, key):
        with self.cv:
            self.waiting += 1
            self.cv.notify_all()
        assert self.open.wait(60), "the test never opened the gate"
        return None

    def wait_for(self, n: int) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: self.waiting >= n, 60), f"{self.waiting} parts reached the store, not {n}"


class _Calls:
    def __init__(self):
        self.calls: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, what, done, total):
        with self.lock:
            self.calls.append((what, done, total))

    def last(self) -> tuple[str, int, int]:
        with self.lock:
            return self.calls[-1]


def _data(seed: int, mib: int = 12) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g)}


def test_save_progress_waits_for_the_store_to_acknowledge_the_parts():
    store = FaultStore(MemoryStore())
    repo = Repository(store, **OPTS)
    gate = _PartGate(store)
    calls = _Calls()
    saver = threading.Thread(target=repo.save, args=(_data(1),), kwargs={"step": 1, "progress": calls})
    saver.start()
    try:
        gate.wait_for(3)  # every part of the pack is with the store, none acknowledged
        what, done, total = calls.last()
        assert (what, total) == ("save bytes", 12 * MiB)
        assert done == 0, f"{done} bytes counted done while the store had acknowledged none"
    finally:
        gate.open.set()
        saver.join(60)
    assert repo.steps() == [1]
    assert calls.last() == ("save bytes", 12 * MiB, 12 * MiB)
    dones = [d for _, d, _ in calls.calls]
    assert dones == sorted(dones)
    # a second save of the same bytes uploads nothing: reused chunks count at once
    calls2 = _Calls()
    repo.save(_data(1), step=2, progress=calls2)
    assert calls2.last() == ("save bytes", 12 * MiB, 12 * MiB)
    repo.close()


def test_copy_progress_waits_for_the_destination_to_acknowledge_the_parts():
    src = Repository(MemoryStore(), **OPTS)
    src.save(_data(2), step=1)
    store = FaultStore(MemoryStore())
    dst = Repository(store, **OPTS)
    gate = _PartGate(store)
    calls = _Calls()
    copier = threading.Thread(target=src.cp, args=(dst,), kwargs={"progress": calls})
    copier.start()
    try:
        gate.wait_for(3)
        what, done, total = calls.last()
        assert what == "copy bytes" and total >= 12 * MiB
        assert done == 0, f"{done} bytes counted copied while the destination had acknowledged none"
    finally:
        gate.open.set()
        copier.join(60)
    assert dst.steps() == [1]
    what, done, total = calls.last()
    assert what == "copy bytes" and done == total
