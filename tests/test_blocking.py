"""The helpers the stores on blocking clients share (ckptstore/storage/_blocking.py)."""

from __future__ import annotations

import threading

import pytest

from ckptstore.storage._blocking import each_threaded, get_ranges_threaded
from ckptstore.storage.base import RangeReplyError

DATA = bytes(range(200))


def _reader(calls=None):
    def read(start, end):
        if calls is not None:
            calls.append((start, end, threading.current_thread().name))
        if end > len(DATA):
            raise RangeReplyError(f"x: range [{start}, {end}) past end")
        return DATA[start:end], len(DATA)

    return read


def test_ranges_in_order_on_a_pool_and_one_on_the_calling_thread():
    calls = []
    ranges = [(i * 10, i * 10 + 7) for i in range(12)][::-1]
    got = get_ranges_threaded(_reader(calls), ranges, 4, lambda: pytest.fail("no head needed"), "x")
    assert got == [DATA[s:e] for s, e in ranges]
    assert {n for *_, n in calls} != {threading.current_thread().name}
    calls.clear()
    assert get_ranges_threaded(_reader(calls), [(3, 5)], 4, lambda: 0, "x") == [DATA[3:5]]
    assert [n for *_, n in calls] == [threading.current_thread().name]


def test_a_range_past_the_end_is_a_value_error_and_empty_ranges_are_checked_against_the_size():
    with pytest.raises(ValueError, match="past end") as ei:
        get_ranges_threaded(_reader(), [(0, 5), (190, 205)], 4, lambda: len(DATA), "x")
    assert type(ei.value) is ValueError
    heads = []
    size_of = lambda: heads.append(1) or len(DATA)  # noqa: E731
    assert get_ranges_threaded(_reader(), [(5, 5), (0, 0)], 4, size_of, "x") == [b"", b""] and heads == [1]
    with pytest.raises(ValueError, match=r"x: range \[300, 300\) past end of 200-byte object"):
        get_ranges_threaded(_reader(), [(300, 300)], 4, size_of, "x")
    # A reply that said the size spares the head.
    assert get_ranges_threaded(_reader(), [(1, 2), (7, 7)], 4, size_of, "x") == [DATA[1:2], b""] and heads == [1, 1]


def test_other_errors_reach_the_store_as_raised():
    def read(start, end):
        raise ConnectionResetError("reset")

    with pytest.raises(ConnectionResetError):
        get_ranges_threaded(read, [(0, 1), (1, 2)], 2, lambda: 2, "x")


@pytest.mark.parametrize("limit", [1, 4])
def test_each_threaded_reports_the_first_failure_in_item_order(limit):
    done = []

    def fn(item):
        if item in (3, 7):
            raise KeyError(item)
        done.append(item)

    assert each_threaded(fn, [0, 1, 2], limit) is None and sorted(done) == [0, 1, 2]
    i, e = each_threaded(fn, list(range(10)), limit)
    assert i == 3 and isinstance(e, KeyError) and e.args == (3,)
    assert each_threaded(fn, [], limit) is None


class _CutBody:
    """A response body that gives ``n`` bytes, then nothing (its connection cut), and no headers."""

    headers: dict = {}

    def __init__(self, n: int):
        self.left = n

    def read(self, k: int) -> bytes:
        k = min(k, self.left)
        self.left -= k
        return b"x" * k


@pytest.mark.parametrize("sent", [0, 100])
def test_a_body_cut_short_without_a_content_range_is_a_transient_error(sent):
    from ckptstore.errors import TransientStorageError
    from ckptstore.storage._blocking import stream_range

    out = memoryview(bytearray(1000))
    # No Content-Length and no Content-Range (a reply whose headers were cut): retried, never
    # taken for a short object
    with pytest.raises(TransientStorageError, match=f"short read of range \\[16, 1016\\): {sent} bytes"):
        stream_range("s3://b/k", 16, out, None, None, _CutBody(sent), None)
