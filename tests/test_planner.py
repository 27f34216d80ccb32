"""Pure read planning: indices, shard intersection, byte runs, coalescing."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ckptstore.pipeline import planner as pl


def test_normalize_index():
    box, sq = pl.normalize_index((slice(2, 8, 2), -1), (10, 5))
    assert box == ((2, 8, 2), (4, 5, 1)) and sq == (1,)
    box, sq = pl.normalize_index(..., (3, 4))
    assert box == ((0, 3, 1), (0, 4, 1)) and sq == ()
    box, _ = pl.normalize_index((slice(8, 2),), (10,))
    assert pl.box_shape(box) == (0,)
    with pytest.raises(IndexError):
        pl.normalize_index((slice(None, None, -1),), (4,))
    with pytest.raises(TypeError):
        pl.normalize_index(([1, 2],), (4,))


def _selected(box):
    return [list(range(*b)) for b in box]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_byte_runs_cover_exactly_the_box(data):
    nd = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.integers(1, 6)) for _ in range(nd))
    box = []
    for n in shape:
        a = data.draw(st.integers(0, n - 1))
        b = data.draw(st.integers(a + 1, n))
        s = data.draw(st.integers(1, 3))
        box.append((a, b, s))
    isz = data.draw(st.sampled_from([1, 2, 4]))
    runs = pl.byte_runs(shape, isz, tuple(box))
    covered = np.zeros(math.prod(shape) * isz, dtype=bool)
    for s, e in runs:
        covered[s:e] = True
    want = np.zeros(shape + (isz,), dtype=bool)
    want[tuple(slice(*b) for b in box)] = True
    assert np.array_equal(covered, want.reshape(-1))


def test_byte_runs_widen_when_too_many(monkeypatch):
    monkeypatch.setattr(pl, "MAX_RUNS", 10)
    runs = pl.byte_runs((100, 100), 4, ((0, 100, 1), (0, 100, 2)))
    assert len(runs) <= 100
    covered = np.zeros(100 * 100 * 4, dtype=bool)
    for s, e in runs:
        covered[s:e] = True
    want = np.zeros((100, 100, 4), dtype=bool)
    want[:, ::2] = True
    assert not np.any(want.reshape(-1) & ~covered)  # a superset


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_intersect_matches_brute_force(data):
    n = data.draw(st.integers(1, 30))
    a = data.draw(st.integers(0, n - 1))
    b = data.draw(st.integers(a, n))
    s = data.draw(st.integers(1, 5))
    o = data.draw(st.integers(0, n - 1))
    size = data.draw(st.integers(1, n - o))
    sel = list(range(a, b, s))
    hit = pl.intersect(((a, b, s),), (o,), (size,))
    inside = [(k, i) for k, i in enumerate(sel) if o <= i < o + size]
    if not inside:
        assert hit is None
        return
    local, out = hit
    assert [i + o for i in range(*local[0])] == [i for _, i in inside]
    assert list(range(*out[0])) == [k for k, _ in inside]


def test_chunks_for_runs():
    starts = [0, 10, 20, 30]
    runs = np.array([[5, 12], [29, 30]])
    assert pl.chunks_for_runs(starts, 40, runs) == [0, 1, 2]
    assert pl.chunks_for_runs(starts, 40, np.zeros((0, 2), dtype=np.int64)) == []


def test_coalesce():
    items = [("p1", 0, 10), ("p1", 12, 20), ("p2", 0, 5), ("p1", 100, 110), ("p1", 20, 30)]
    reqs = pl.coalesce(items, max_gap=5, max_request=1000)
    assert [(r.pack, r.start, r.end, r.items) for r in reqs] == [
        ("p1", 0, 30, (0, 1, 4)),
        ("p1", 100, 110, (3,)),
        ("p2", 0, 5, (2,)),
    ]
    reqs = pl.coalesce(items, max_gap=5, max_request=15)
    assert all(r.end - r.start <= 15 for r in reqs)
    assert sorted(i for r in reqs for i in r.items) == [0, 1, 2, 3, 4]
