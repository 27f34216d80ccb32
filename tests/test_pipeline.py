"""The save and load pipelines' fast paths: what they must keep true.

- Local packs are written straight from the chunks' buffers at their
  offsets (no part buffers), with their write-out started early; every
  pack and the chunk table are durable (file and directory entries, new
  directories included) before the manifest naming them is created.
- Loads decode chunks straight into the destination tensors (no
  chunk-sized scratch), and still refuse corrupted bytes.
- S3 stores with exactly the same options share their clients across
  repository handles; different credentials never do.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time
import tracemalloc

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore.format import codec
from ckptstore.errors import IntegrityError, TransientStorageError
from ckptstore.repo.repository import Repository
from ckptstore.storage import local as local_mod
from ckptstore.storage.base import MiB
from ckptstore.storage.local import LocalStore
from ckptstore.storage.memory import MemoryStore
from ckptstore.storage.retry import RetryPolicy, RetryStore
from ckptstore.storage.upload import BufferPool, ParallelUploader
from ckptstore.storage.wrappers import CountingStore
from ckptstore.pipeline.tensors import to_host

from .helpers import SMALL, assert_tree_equal

PART = 5 * MiB


def _bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# ------------------------------------------------------------------ local positional writes
def test_local_positional_writes(tmp_path):
    store = LocalStore(str(tmp_path / "r"))
    a, b, c = _bytes(1000, 1), _bytes(3 * MiB + 7, 2), _bytes(5, 3)
    mpu = store.create_multipart("packs/ab/x.pack", PART)
    assert mpu.write_at(0, [a, memoryview(b)]) == len(a) + len(b)
    assert mpu.write_at(len(a) + len(b), [np.frombuffer(c, dtype=np.uint8), b""]) == len(c)
    assert [u.key for u in store.list_multipart()] == ["packs/ab/x.pack"]
    with pytest.raises(ValueError, match="completing"):
        mpu.complete_written(len(a) + len(b))  # not what was written: refused, nothing visible
    assert not store.exists("packs/ab/x.pack")
    mpu.complete_written(len(a) + len(b) + len(c))
    assert store.get("packs/ab/x.pack") == a + b + c
    assert store.list_multipart() == [] and os.listdir(tmp_path / "r" / ".tmp") == []

    mixed = store.create_multipart("packs/ab/y.pack", PART)
    mixed.upload_part(1, a)
    mixed.write_at(len(a), [b])
    with pytest.raises(ValueError):
        mixed.complete(1)
    mixed.abort()
    assert not store.exists("packs/ab/y.pack") and store.list_multipart() == []


def test_direct_uploader_uses_no_part_buffers_and_frees_the_callers_buffers(tmp_path):
    store = LocalStore(str(tmp_path / "r"))
    pool_bufs = BufferPool(PART)
    pieces = [_bytes(n, i) for i, n in enumerate([16, 3 * MiB, 700_001, 4 * MiB + 3, 9, 2 * MiB])]
    with cf.ThreadPoolExecutor(2) as io:
        up = ParallelUploader(store, "packs/cd/z.pack", PART, io, window=2, buffers=pool_bufs)
        assert up.direct
        scratch = bytearray(4 * MiB + 3)
        for p in pieces:
            scratch[: len(p)] = p
            up.write_many([memoryview(scratch)[: len(p) // 2], memoryview(scratch)[len(p) // 2 : len(p)]])
            scratch[:] = b"\xff" * len(scratch)  # the caller reuses its buffer at once
        assert up.close() == sum(map(len, pieces))
    assert store.get("packs/cd/z.pack") == b"".join(pieces)
    assert pool_bufs.allocated == 0  # no part buffer, no copy
    # A wrapped store keeps the part path (its wrapper sees every part).
    wrapped = CountingStore(store)
    with cf.ThreadPoolExecutor(2) as io:
        up = ParallelUploader(wrapped, "packs/cd/w.pack", PART, io, window=2)
        assert not up.direct
        up.write_many(pieces)
        up.close()
    assert wrapped.calls["upload_part"] >= 2
    assert store.get("packs/cd/w.pack") == b"".join(pieces)


def test_local_upload_starts_write_out_as_it_goes(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(local_mod, "start_writeback", lambda fd, off, n: calls.append((off, n)))
    store = LocalStore(str(tmp_path / "r"))
    mpu = store.create_multipart("packs/ef/a.pack", PART)
    off = 0
    for i in range(20):
        off += mpu.write_at(off, [_bytes(MiB, i)])
    ranges = list(calls)
    mpu.complete_written(off)
    wb = local_mod.WRITEBACK_BYTES
    assert ranges == [(k * wb, wb) for k in range(off // wb)]  # contiguous, in WRITEBACK_BYTES steps
    calls.clear()
    nosync = LocalStore(str(tmp_path / "n"), fsync=False)
    mpu = nosync.create_multipart("packs/ef/a.pack", PART)
    mpu.write_at(0, [_bytes(20 * MiB, 0)])
    mpu.complete_written(20 * MiB)
    assert calls == []


def test_packs_and_chunk_table_are_durable_before_the_manifest(tmp_path, monkeypatch):
    """Invariant 3 on a local disk, with the direct path: every object a manifest names
    is fsynced, renamed into place and its directory (and any new parent) fsynced first."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace, real_link = os.fsync, os.replace, os.link

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", f"{src}\0{dst}"))
        return real_replace(src, dst)

    def link(src, dst):
        events.append(("link", f"{src}\0{dst}"))
        return real_link(src, dst)

    monkeypatch.setattr(local_mod.os, "fsync", fsync)
    monkeypatch.setattr(local_mod.os, "replace", replace)
    monkeypatch.setattr(local_mod.os, "link", link)
    root = str(tmp_path / "repo")
    repo = ckptstore.open(root, **SMALL)
    g = torch.Generator().manual_seed(5)
    sd = {f"w{i}": torch.randn(64, 1024, generator=g) for i in range(12)}  # 3 MiB: several 1 MiB packs
    repo.save(sd, step=1)
    man_link = [i for i, (op, a) in enumerate(events) if op == "link" and "/manifests/" in a]
    assert len(man_link) == 1
    m = man_link[0]

    def synced_before(path, limit):
        return any(op == "fsync" and a == path for op, a in events[:limit])

    named = [k for k in (o.key for o in repo.store.list()) if k.startswith(("packs/", "segments/"))]
    assert sum(k.startswith("packs/") for k in named) >= 2 and any(k.startswith("segments/") for k in named)
    for key in named:
        path = os.path.join(root, *key.split("/"))
        (r,) = [i for i, (op, a) in enumerate(events) if op == "rename" and a.endswith("\0" + path)]
        src = events[r][1].split("\0")[0]
        assert synced_before(src, r), f"{key}: data not fsynced before it was renamed into place"
        d = os.path.dirname(path)
        assert any(op == "fsync" and a == d for op, a in events[r:m]), f"{key}: directory not fsynced before the commit"
        # the directories it needed were created by this save: each durable in its parent
        assert synced_before(os.path.dirname(d), m) and synced_before(root, m), key
    assert_tree_equal(sd, ckptstore.open(root).load(1))


# ------------------------------------------------------------------ decoding into destinations
def test_decode_into_needs_no_chunk_sized_scratch():
    raw = (np.arange(1 << 20, dtype=np.int64) % 7).tobytes()  # 8 MiB, compressible, not floating point
    name, stored = codec.encode(raw, "zstd", 1, "int64")
    assert name == "zstd"
    out = np.full(len(raw), 0xAA, dtype=np.uint8)
    tracemalloc.start()
    try:
        codec.decode_verified_into(name, stored, out, codec.hash_bytes(raw), "x")
        _, peak_into = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        codec.decode(name, stored, len(raw))
        _, peak_plain = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.tobytes() == raw
    assert peak_plain >= len(raw)  # what decoding into a fresh buffer allocates (the control)
    assert peak_into < len(raw) // 16, peak_into


def test_decode_into_refuses_damage():
    raw = torch.randn(50_000).numpy().tobytes()
    name, stored = codec.encode(raw, "zstd", 1, "float32")
    out = np.empty(len(raw), dtype=np.uint8)
    with pytest.raises(IntegrityError, match="w: content hash mismatch"):
        codec.decode_verified_into(name, stored, out, codec.hash_bytes(raw[:-1] + b"x"), "w")
    zraw = bytes(100_000)
    zname, zstored = codec.encode(zraw, "zstd", 1, None)
    for bad, n in ((zstored[:-3], len(zraw)), (zstored, len(zraw) - 1), (zstored, len(zraw) + 1)):
        with pytest.raises(IntegrityError):
            codec.decode_into(zname, bad, np.empty(n, dtype=np.uint8))
    with pytest.raises(IntegrityError):
        codec.decode_into("raw", b"abc", np.empty(4, dtype=np.uint8))


def test_load_decodes_into_destinations_and_refuses_corruption(tmp_path):
    root = str(tmp_path / "repo")
    repo = ckptstore.open(root, chunk_size=1 * MiB)
    ints = (torch.arange(4 << 20, dtype=torch.int32) % 5).reshape(1024, -1)  # 16 MiB, zstd chunks
    w = torch.randn(512, 1024)  # bgz chunks
    repo.save({"ints": ints, "w": w, "step": 3}, step=1)
    dest = {"ints": torch.full_like(ints, -1), "w": torch.full_like(w, float("nan")), "step": 0}
    fresh = ckptstore.open(root)
    fresh.load(1, into=dest)
    assert torch.equal(dest["ints"], ints) and torch.equal(dest["w"], w) and dest["step"] == 3
    ck = fresh.checkpoint(1)
    again = torch.full_like(ints, -1)
    tracemalloc.start()
    try:
        ck.read_into("ints", again)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(again, ints)
    # 16 chunks of 1 MiB decoded into the tensor: nothing chunk-sized allocated for any of them.
    assert peak < MiB, peak
    # Rows of a tensor (one contiguous run) and a slice across rows too.
    ck = fresh.checkpoint(1)
    assert torch.equal(ck.read("w", (slice(100, 300),)), w[100:300])
    assert torch.equal(ck.read("ints", (slice(3, 900, 7), slice(5, 2000))), ints[3:900:7, 5:2000])
    # One flipped byte in a chunk: the load raises, naming the tensor.
    refs = list(fresh.chunks(1))
    pack = sorted(refs, key=lambda c: c.offset)[len(refs) // 2]
    path = os.path.join(root, "packs", pack.pack[:2], f"{pack.pack}.pack")
    with open(path, "r+b") as f:
        f.seek(pack.offset + pack.stored_len // 2)
        b = f.read(1)
        f.seek(pack.offset + pack.stored_len // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(IntegrityError, match="tensor '(ints|w)'"):
        ckptstore.open(root).load(1, into=dest)
    fresh.close()
    repo.close()


def test_to_host_in_slices_on_a_cpu_only_machine():
    # The path CUDA tensors take (pinned buffer when CUDA exists), run on CPU here.
    t = torch.randn(1000, 37)
    out = to_host(t, slice_bytes=4096)
    assert torch.equal(out, t) and out.data_ptr() != t.data_ptr()
    assert to_host(torch.empty(0, 3)).shape == (0, 3)


# ------------------------------------------------------------------ streamed range reads
class _GatedStore(CountingStore):
    """Streams each pack range in two reports and, between them, waits until
    ``gate()`` says a chunk of it has been decoded: a fetcher that decodes
    only once the whole range is in never gets past the gate."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate = lambda: True
        self.passed = self.pack_reads = 0

    def read_range_into(self, key, start, out, progress=None):
        n = memoryview(out).nbytes
        self.inner.read_range_into(key, start, out)
        if key.startswith("packs/"):
            self.pack_reads += 1
            assert progress is not None
            progress(n // 2)
            deadline = time.monotonic() + 30  # a guard against a hang, not a timing
            while not self.gate():
                assert time.monotonic() < deadline, "no chunk was decoded before its range was all in"
                time.sleep(0.005)
            self.passed += 1
        if progress is not None:
            progress(n)


def test_chunks_are_decoded_while_their_range_is_still_arriving():
    mem = MemoryStore()
    w = torch.randn(256, 1024)  # 1 MiB: 16 chunks of 64 KiB in one pack (row-major runs: tiles=False)
    Repository(mem, tiles=False, **SMALL).save({"w": w}, step=1)
    gated = _GatedStore(mem)
    repo = Repository(gated, **SMALL)
    refs = list(repo.chunks(1))
    assert len({r.pack for r in refs}) == 1 and len(refs) == 16
    got: dict[int, bytes] = {}
    gated.gate = lambda: bool(got)

    def deliver(i, raw, stored):
        got[i] = bytes(raw)

    repo.fetcher.fetch(refs, deliver, lambda i: "")
    assert gated.passed == gated.pack_reads == 1  # one request, past the gate
    raw = w.numpy().tobytes()
    starts = np.cumsum([0] + [r.raw_len for r in refs])
    assert all(got[i] == raw[starts[i] : starts[i + 1]] for i in range(len(refs)))
    # A load decodes into place the same way.
    dest = torch.full_like(w, float("nan"))
    gated.gate = lambda: not bool(torch.isnan(dest).all())
    repo.load(1, into={"w": dest})
    assert torch.equal(dest, w) and gated.passed == 2


def test_range_reads_reuse_their_buffers_and_give_them_back():
    mem = MemoryStore()
    w = torch.randn(2048, 1024)  # 8 MiB in 1 MiB packs: 6+ range requests
    Repository(mem, **SMALL).save({"w": w}, step=1)
    repo = Repository(mem, **SMALL, max_request=1 * MiB, max_inflight_bytes=4 * MiB)
    counting = CountingStore(mem)
    repo.fetcher.store = counting
    pool = repo.runtime.read_buffers()
    for _ in range(2):
        before = pool.allocated
        counting.reset()
        dest = torch.full_like(w, float("nan"))
        repo.load(1, into={"w": dest})
        assert torch.equal(dest, w)
        large = [r for r in counting.reads if r[0].startswith("packs/") and r[2] - r[1] >= MiB // 2]
        assert len(large) >= 6  # 8 MiB stores about 6.6 MiB
        # The read budget (half of max_inflight_bytes) holds two such ranges
        # at once: two buffers serve them all ...
        assert pool.keep == 2 and pool.allocated - before <= 2, pool.allocated
        # ... and go back once no read is under way.
        assert pool._free == []
    repo.close()


class _CutOnce(MemoryStore):
    """Delivers the first ``cut`` bytes of the first ranged read, then fails it."""

    def __init__(self, cut: int):
        super().__init__()
        self.cut = cut
        self.starts: list[int] = []

    def read_range_into(self, key, start, out, progress=None):
        self.starts.append(start)
        mv = memoryview(out).cast("B")
        if len(self.starts) == 1:
            super().read_range_into(key, start, mv[: self.cut], progress)
            raise TransientStorageError(f"{key}: connection reset after {self.cut} bytes")
        super().read_range_into(key, start, mv, progress)


def test_a_retried_range_read_resumes_where_the_failed_one_stopped():
    data = _bytes(3 * MiB, seed=9)
    inner = _CutOnce(cut=MiB + 17)
    inner.put("packs/x", data)
    store = RetryStore(inner, RetryPolicy(max_attempts=3), sleep=lambda s: None)
    out = bytearray(len(data) - 100)
    seen: list[int] = []
    store.read_range_into("packs/x", 100, out, seen.append)
    assert bytes(out) == data[100:]
    assert inner.starts == [100, 100 + MiB + 17]  # the retry asked only for the rest
    assert seen == [MiB + 17, len(out)] and store.retries == 1
