"""The conformance suite every :class:`~ckptstore.storage.ObjectStore` passes.

A backend's test module subclasses :class:`StoreConformance` and provides a
``store`` fixture (an empty store) and, where the backend has roots or
namespaces, a ``sibling_store`` fixture (an empty store on a neighbouring
root of the same backend)::

    class TestMemoryStore(StoreConformance):
        @pytest.fixture
        def store(self):
            yield MemoryStore(f"t-{uuid.uuid4().hex}")

Sizes stay near the S3 part minimum (5 MiB) so the suite runs in seconds
against a local S3 emulator.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import threading
import time

import numpy as np
import pytest

from ..errors import ObjectExistsError, ObjectNotFoundError
from ..storage.base import MIN_PART_SIZE, MiB, MultipartUpload, ObjectStore
from ..storage.upload import ParallelUploader
from ..storage.wrappers import CountingStore

PART = MIN_PART_SIZE
INVALID_KEYS = ["", "../x", "/abs", "a//b", "a/./b", "x/..", "a/"]


def payload(n: int, seed: int = 0) -> bytes:
    """Deterministic, incompressible-looking bytes."""
    return random.Random(seed).randbytes(n)


class InjectedFailure(RuntimeError):
    """Raised by :class:`FailingStore` where a test asked for a failure."""


class _FailingUpload(MultipartUpload):
    def __init__(self, outer: "FailingStore", inner: MultipartUpload):
        super().__init__(inner.key, inner.part_size)
        self.outer = outer
        self.inner = inner

    def upload_part(self, number: int, data) -> None:
        if number in self.outer.fail_parts:
            raise InjectedFailure(f"injected failure uploading part {number} of {self.key}")
        self.inner.upload_part(number, data)

    def complete(self, nparts: int) -> None:
        self.inner.complete(nparts)

    def abort(self) -> None:
        self.inner.abort()


class FailingStore(CountingStore):
    """A :class:`CountingStore` that also fails chosen multipart parts."""

    def __init__(self, inner: ObjectStore, fail_parts=()):
        super().__init__(inner)
        self.fail_parts = set(fail_parts)

    @property
    def aborts(self) -> int:
        return self.calls["abort_multipart"]

    def create_multipart(self, key, part_size):
        return _FailingUpload(self, super().create_multipart(key, part_size))


class StoreConformance:
    """Behaviour every ObjectStore must show; subclasses provide ``store``."""

    #: False where the backend reports a fake upload start time (moto
    #: answers ListMultipartUploads with a fixed date in 2010).
    multipart_initiated_is_real = True
    #: What completing an upload aborted behind the writer's back raises.
    complete_after_abort_raises: tuple[type[BaseException], ...] = (FileNotFoundError,)

    @pytest.fixture
    def store(self) -> ObjectStore:  # pragma: no cover - subclasses override
        raise NotImplementedError("subclasses provide a `store` fixture")

    @pytest.fixture
    def sibling_store(self) -> ObjectStore:
        pytest.skip("this backend has no sibling roots")

    # ------------------------------------------------------------ get/put
    @pytest.mark.parametrize("size", [0, 1, 3 * MiB + 17])
    def test_put_get_roundtrip(self, store, size):
        data = payload(size, seed=size)
        store.put("obj/data.bin", data)
        assert store.get("obj/data.bin") == data

    def test_put_accepts_buffers(self, store):
        data = payload(1000)
        store.put("ba", bytearray(data))
        store.put("mv", memoryview(data)[10:110])
        store.put_if_absent("mv2", memoryview(data))
        assert store.get("ba") == data
        assert store.get("mv") == data[10:110]
        assert store.get("mv2") == data

    def test_get_missing(self, store):
        with pytest.raises(ObjectNotFoundError) as ei:
            store.get("no/such/key")
        assert isinstance(ei.value, FileNotFoundError)
        assert "no/such/key" in str(ei.value)

    def test_put_overwrites(self, store):
        store.put("k", b"first")
        store.put("k", b"second, longer")
        assert store.get("k") == b"second, longer"
        assert store.head("k").size == len(b"second, longer")

    def test_put_if_absent(self, store):
        store.put_if_absent("refs/x", b"one")
        with pytest.raises(ObjectExistsError) as ei:
            store.put_if_absent("refs/x", b"two")
        assert isinstance(ei.value, FileExistsError)
        assert "refs/x" in str(ei.value)
        assert store.get("refs/x") == b"one"

    def test_put_if_absent_after_put(self, store):
        store.put("k", b"plain")
        with pytest.raises(ObjectExistsError):
            store.put_if_absent("k", b"other")
        assert store.get("k") == b"plain"

    def test_put_if_absent_race(self, store):
        n = 8
        barrier = threading.Barrier(n)

        def attempt(i: int) -> bool:
            barrier.wait()
            try:
                store.put_if_absent("manifest", f"writer {i}".encode())
                return True
            except ObjectExistsError:
                return False

        with cf.ThreadPoolExecutor(n) as pool:
            won = list(pool.map(attempt, range(n)))
        assert sum(won) == 1
        assert store.get("manifest") == f"writer {won.index(True)}".encode()

    def test_exists(self, store):
        assert not store.exists("e")
        store.put("e", b"")
        assert store.exists("e")

    # ------------------------------------------------------------ head/list/delete
    def test_head(self, store):
        before = time.time()
        store.put("h/obj", b"x" * 1234)
        info = store.head("h/obj")
        assert info.key == "h/obj"
        assert info.size == 1234
        assert abs(info.mtime - before) < 60

    def test_head_missing(self, store):
        with pytest.raises(ObjectNotFoundError):
            store.head("nope")
        store.put("dir/file", b"1")
        with pytest.raises(ObjectNotFoundError):
            store.head("dir")

    def test_list(self, store):
        keys = ["b/4", "a/2", "a/sub/5", "ab/3", "a/1", "a-x", "top"]
        for i, k in enumerate(keys):
            store.put(k, b"x" * i)
        everything = list(store.list())
        assert [o.key for o in everything] == sorted(keys)
        assert {o.key: o.size for o in everything} == {k: i for i, k in enumerate(keys)}
        assert [o.key for o in store.list("")] == sorted(keys)
        assert [o.key for o in store.list("a/")] == ["a/1", "a/2", "a/sub/5"]
        assert [o.key for o in store.list("a")] == ["a-x", "a/1", "a/2", "a/sub/5", "ab/3"]
        assert [o.key for o in store.list("a/sub/")] == ["a/sub/5"]
        assert list(store.list("zzz")) == []
        assert list(store.list("missing/dir/")) == []
        now = time.time()
        assert all(abs(o.mtime - now) < 60 for o in everything)

    def test_list_empty_store(self, store):
        assert list(store.list()) == []

    def test_delete(self, store):
        store.put("d/1", b"1")
        store.put("d/2", b"2")
        store.delete("d/1")
        assert not store.exists("d/1")
        assert [o.key for o in store.list()] == ["d/2"]
        store.delete("d/1")  # missing: not an error
        store.delete("never/existed")

    def test_delete_many(self, store):
        for i in range(7):
            store.put(f"m/{i}", bytes([i]))
        store.put("keep", b"k")
        store.delete_many(["m/0", "m/2", "m/4", "m/6", "never/existed"])  # a missing key is not an error
        assert [o.key for o in store.list()] == ["keep", "m/1", "m/3", "m/5"]
        store.delete_many([])
        store.delete_many(["m/1", "m/1"])  # the same key twice
        assert [o.key for o in store.list()] == ["keep", "m/3", "m/5"]

    @pytest.mark.parametrize("bad", INVALID_KEYS)
    def test_delete_many_checks_every_key_first(self, store, bad):
        store.put("m/3", b"3")
        with pytest.raises(ValueError):
            store.delete_many(["m/3", bad])
        assert store.get("m/3") == b"3"

    # ------------------------------------------------------------ ranges
    def test_get_ranges(self, store):
        data = payload(1000, seed=1)
        store.put("r", data)
        ranges = [(0, 10), (990, 1000), (5, 5), (999, 1000), (1000, 1000), (0, 1000), (0, 0)]
        assert store.get_ranges("r", ranges) == [data[s:e] for s, e in ranges]

    def test_get_ranges_out_of_order_and_overlapping(self, store):
        data = payload(4096, seed=2)
        store.put("r", data)
        ranges = [(3000, 4000), (0, 100), (50, 150), (2048, 2049), (100, 3000)]
        assert store.get_ranges("r", ranges) == [data[s:e] for s, e in ranges]
        assert store.get_ranges("r", []) == []

    @pytest.mark.parametrize(
        "bad", [[(990, 1001)], [(1000, 1001)], [(0, 10), (2000, 2001)], [(1001, 1001)], [(5000, 5000), (0, 1)]]
    )
    def test_get_ranges_past_end(self, store, bad):
        store.put("r", payload(1000))
        with pytest.raises(ValueError):
            store.get_ranges("r", bad)

    def test_get_ranges_empty_object(self, store):
        store.put("empty", b"")
        assert store.get_ranges("empty", [(0, 0)]) == [b""]
        with pytest.raises(ValueError):
            store.get_ranges("empty", [(0, 1)])

    @pytest.mark.parametrize("bad", [[(5, 3)], [(-1, 2)]])
    def test_get_ranges_invalid(self, store, bad):
        store.put("r", b"0123456789")
        with pytest.raises(ValueError):
            store.get_ranges("r", bad)

    @pytest.mark.parametrize("ranges", [[(0, 1)], [(0, 0)], []])
    def test_get_ranges_missing(self, store, ranges):
        with pytest.raises(ObjectNotFoundError):
            store.get_ranges("nope", ranges)

    def test_read_range_into(self, store):
        data = payload(3 * (1 << 20) + 7, seed=5)  # streaming stores report in several pieces
        store.put("r", data)
        out = bytearray(len(data) - 10)
        seen: list[int] = []
        store.read_range_into("r", 5, out, seen.append)
        assert bytes(out) == data[5:-5]
        assert seen and seen[-1] == len(out)
        assert all(a < b for a, b in zip(seen, seen[1:])), seen  # grows from call to call
        # into part of a larger buffer, without progress reports
        big = np.zeros(100, dtype=np.uint8)
        store.read_range_into("r", 1000, memoryview(big)[10:60])
        assert bytes(big[10:60]) == data[1000:1050] and not big[:10].any() and not big[60:].any()
        store.read_range_into("r", len(data), bytearray(0))  # empty, at the end: nothing to read

    def test_read_range_into_reports_only_final_bytes(self, store):
        data = payload(2 * (1 << 20) + 3, seed=6)
        store.put("r", data)
        out = bytearray(len(data))
        checked = []

        def progress(n: int) -> None:
            checked.append(bytes(out[:n]) == data[:n])  # a prefix reported is already right

        store.read_range_into("r", 0, out, progress)
        assert checked and all(checked)

    @pytest.mark.parametrize("start,n", [(990, 11), (1000, 1), (1001, 0), (-1, 2)])
    def test_read_range_into_outside_the_object(self, store, start, n):
        store.put("r", payload(1000))
        with pytest.raises(ValueError):
            store.read_range_into("r", start, bytearray(n))

    @pytest.mark.parametrize("n", [1, 0])
    def test_read_range_into_missing(self, store, n):
        with pytest.raises(ObjectNotFoundError):
            store.read_range_into("nope", 0, bytearray(n))

    # ------------------------------------------------------------ keys
    @pytest.mark.parametrize("key", INVALID_KEYS)
    def test_invalid_keys(self, store, key):
        calls = [
            lambda: store.get(key),
            lambda: store.get_ranges(key, [(0, 1)]),
            lambda: store.read_range_into(key, 0, bytearray(1)),
            lambda: store.put(key, b"x"),
            lambda: store.put_if_absent(key, b"x"),
            lambda: store.head(key),
            lambda: store.delete(key),
            lambda: store.create_multipart(key, PART),
        ]
        for call in calls:
            with pytest.raises(ValueError):
                call()
        assert list(store.list()) == []

    # ------------------------------------------------------------ multipart
    def _parts(self, seed: int = 3) -> list[bytes]:
        return [payload(PART, seed + i) for i in range(3)] + [payload(12_345, seed + 3)]

    def test_multipart(self, store):
        parts = self._parts()
        mpu = store.create_multipart("packs/p1", PART)
        order = [4, 2, 3, 1]
        with cf.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda n: mpu.upload_part(n, parts[n - 1]), order))
        # Nothing visible before complete.
        assert not store.exists("packs/p1")
        assert list(store.list("packs/")) == []
        with pytest.raises(ObjectNotFoundError):
            store.get("packs/p1")
        mpu.complete(len(parts))
        whole = b"".join(parts)
        assert store.head("packs/p1").size == len(whole)
        assert store.get("packs/p1") == whole
        assert store.get_ranges("packs/p1", [(PART - 5, PART + 5)]) == [whole[PART - 5 : PART + 5]]
        assert [m for m in store.list_multipart("") if m.key == "packs/p1"] == []

    def test_multipart_single_short_part(self, store):
        mpu = store.create_multipart("packs/small", PART)
        mpu.upload_part(1, b"tiny")
        mpu.complete(1)
        assert store.get("packs/small") == b"tiny"

    def test_multipart_part_exactly_full(self, store):
        parts = [payload(PART, 7), payload(PART, 8)]
        mpu = store.create_multipart("packs/even", PART)
        for n, p in enumerate(parts, 1):
            mpu.upload_part(n, p)
        mpu.complete(2)
        assert store.get("packs/even") == b"".join(parts)

    def test_multipart_reupload_part(self, store):
        mpu = store.create_multipart("packs/re", PART)
        mpu.upload_part(1, payload(PART, 1))
        mpu.upload_part(2, b"old")
        mpu.upload_part(2, b"new tail")
        mpu.complete(2)
        assert store.get("packs/re") == payload(PART, 1) + b"new tail"

    def test_multipart_abort(self, store):
        mpu = store.create_multipart("packs/gone", PART)
        mpu.upload_part(1, payload(PART))
        assert [m.key for m in store.list_multipart("packs/")] == ["packs/gone"]
        mpu.abort()
        mpu.abort()  # twice is fine
        assert not store.exists("packs/gone")
        assert store.list_multipart("packs/") == []
        assert list(store.list()) == []

    def test_list_multipart(self, store):
        a = store.create_multipart("packs/a", PART)
        b = store.create_multipart("packs/b", PART)
        c = store.create_multipart("other/c", PART)
        a.upload_part(1, b"part")
        listed = store.list_multipart("packs/")
        assert [m.key for m in listed] == ["packs/a", "packs/b"]
        for m, up in zip(listed, (a, b)):
            assert isinstance(m.upload_id, str) and m.upload_id
            if hasattr(up, "upload_id"):
                assert m.upload_id == up.upload_id
        assert [m.key for m in store.list_multipart()] == ["other/c", "packs/a", "packs/b"]
        assert store.list_multipart("nothing/") == []
        if self.multipart_initiated_is_real:
            now = time.time()
            assert all(abs(m.initiated - now) < 60 for m in listed)
        # Cleanup by what the listing says, as GC does after a crash.
        for m in listed:
            store.abort_multipart(m.key, m.upload_id)
        assert store.list_multipart("packs/") == []
        assert [m.key for m in store.list_multipart()] == ["other/c"]
        store.abort_multipart("packs/a", listed[0].upload_id)  # already gone: fine
        # An upload aborted behind its writer's back never becomes an object.
        with pytest.raises(self.complete_after_abort_raises):
            a.complete(1)
        assert not store.exists("packs/a")
        c.abort()
        assert store.list_multipart() == []

    def test_multipart_rejects_oversized_part(self, store):
        mpu = store.create_multipart("packs/big", PART)
        try:
            with pytest.raises(ValueError):
                mpu.upload_part(1, b"x" * (PART + 1))
            with pytest.raises(ValueError):
                mpu.upload_part(0, b"x")
        finally:
            mpu.abort()

    def test_multipart_rejects_short_middle_part(self, store):
        mpu = store.create_multipart("packs/short", PART)
        try:
            with pytest.raises(ValueError):
                # Rejected when uploaded or, at the latest, at complete.
                mpu.upload_part(1, payload(PART - 1))
                mpu.upload_part(2, payload(PART))
                mpu.upload_part(3, b"tail")
                mpu.complete(3)
        finally:
            mpu.abort()
        assert not store.exists("packs/short")

    def test_multipart_missing_part(self, store):
        mpu = store.create_multipart("packs/hole", PART)
        try:
            mpu.upload_part(1, payload(PART))
            mpu.upload_part(3, b"tail")
            with pytest.raises(ValueError):
                mpu.complete(3)
        finally:
            mpu.abort()
        assert not store.exists("packs/hole")

    def test_multipart_part_size_minimum(self, store):
        with pytest.raises(ValueError):
            store.create_multipart("packs/x", PART - 1)
        assert store.list_multipart() == []

    # ------------------------------------------------------------ ParallelUploader
    def test_parallel_uploader(self, store):
        sizes = [1, 777_777, 3 * MiB + 5, 123, 2 * MiB - 1, 4 * MiB + 4321, 6 * MiB + 1, 999, MiB + 3]
        chunks = [payload(n, 100 + i) for i, n in enumerate(sizes)]
        total = sum(sizes)
        assert 16 * MiB < total < 18 * MiB, total
        spy = FailingStore(store)
        with cf.ThreadPoolExecutor(4) as pool:
            up = ParallelUploader(spy, "packs/pu", PART, pool, window=2)
            for c in chunks:
                up.write(c)
            assert up.size == total
            assert up.close() == total
        assert spy.calls.get("create_multipart") == 1
        assert store.get("packs/pu") == b"".join(chunks)
        assert store.list_multipart() == []

    def test_parallel_uploader_small_object_is_one_put(self, store):
        spy = FailingStore(store)
        with cf.ThreadPoolExecutor(2) as pool:
            up = ParallelUploader(spy, "small", PART, pool, window=2)
            up.write(b"abc")
            up.write(memoryview(b"def"))
            assert up.close() == 6
        assert spy.calls.get("put") == 1
        assert "create_multipart" not in spy.calls
        assert store.get("small") == b"abcdef"
        assert store.list_multipart() == []

    def test_parallel_uploader_failure_aborts(self, store):
        failing = FailingStore(store, fail_parts={2})
        data = payload(3 * PART + 10, 5)
        with cf.ThreadPoolExecutor(4) as pool:
            up = ParallelUploader(failing, "packs/fail", PART, pool, window=2)
            with pytest.raises(InjectedFailure):
                for i in range(0, len(data), MiB):
                    up.write(data[i : i + MiB])
                up.close()
        assert failing.aborts >= 1
        assert not store.exists("packs/fail")
        assert store.list_multipart() == []
        assert list(store.list()) == []

    # ------------------------------------------------------------ isolation
    def test_isolated_from_sibling(self, store, sibling_store):
        store.put("k", b"mine")
        sibling_store.put("k", b"theirs")
        sibling_store.put("only-there", b"x")
        sibling_store.create_multipart("packs/theirs", PART)
        assert store.get("k") == b"mine"
        assert sibling_store.get("k") == b"theirs"
        assert [o.key for o in store.list()] == ["k"]
        assert not store.exists("only-there")
        assert store.list_multipart() == []
        store.delete("only-there")
        assert sibling_store.exists("only-there")
        with pytest.raises(ObjectExistsError):
            sibling_store.put_if_absent("k", b"again")
