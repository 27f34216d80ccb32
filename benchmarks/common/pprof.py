"""Read a Go CPU profile (``/debug/pprof/profile``: gzipped protobuf) without Go's tools.

Only what a summary needs: for each sample, its CPU nanoseconds and its
stack as function names (leaf first). The message layout is that of
``profile.proto`` (github.com/google/pprof): Profile{sample_type=1,
sample=2, location=4, function=5, string_table=6}, Sample{location_id=1,
value=2}, Location{id=1, line=4}, Line{function_id=1}, Function{id=1,
name=2}. Fields this reader does not use are skipped by wire type.
"""

from __future__ import annotations

import gzip
from collections import Counter


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of each field of one message; length-delimited values as bytes."""
    i, n = 0, len(buf)
    while i < n:
        key, i = _varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(buf, i)
        elif wt == 2:
            ln, i = _varint(buf, i)
            v, i = buf[i : i + ln], i + ln
        elif wt == 1:
            v, i = buf[i : i + 8], i + 8
        elif wt == 5:
            v, i = buf[i : i + 4], i + 4
        else:
            raise ValueError(f"pprof: unsupported protobuf wire type {wt} (field {num})")
        yield num, wt, v


def _ints(wt: int, v) -> list[int]:
    """A repeated integer field's values: packed (length-delimited) or one varint."""
    if wt == 0:
        return [v]
    out, i = [], 0
    while i < len(v):
        x, i = _varint(v, i)
        out.append(x)
    return out


class Profile:
    """A parsed CPU profile: :attr:`samples` is a list of (value, [function names, leaf first])."""

    def __init__(self, data: bytes):
        self.raw = data
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        strings: list[str] = []
        sample_types: list[tuple[int, int]] = []
        raw_samples: list[tuple[list[int], list[int]]] = []
        loc_funcs: dict[int, list[int]] = {}
        func_names: dict[int, int] = {}
        for num, wt, v in _fields(data):
            if num == 1:
                st = {n: x for n, _, x in _fields(v)}
                sample_types.append((st.get(1, 0), st.get(2, 0)))
            elif num == 2:
                locs, vals = [], []
                for n, w, x in _fields(v):
                    if n == 1:
                        locs += _ints(w, x)
                    elif n == 2:
                        vals += _ints(w, x)
                raw_samples.append((locs, vals))
            elif num == 4:
                lid, funcs = 0, []
                for n, _, x in _fields(v):
                    if n == 1:
                        lid = x
                    elif n == 4:
                        funcs += [y for m, _, y in _fields(x) if m == 1]
                # Lines are innermost first (inlined frames before their caller).
                loc_funcs[lid] = funcs
            elif num == 5:
                f = {n: x for n, _, x in _fields(v) if n in (1, 2)}
                func_names[f.get(1, 0)] = f.get(2, 0)
            elif num == 6:
                strings.append(v.decode("utf-8", "replace"))
        self.sample_types = [(strings[a], strings[b]) for a, b in sample_types]
        # The CPU profile's values are (samples/count, cpu/nanoseconds); take the nanoseconds.
        col = next((k for k, (t, u) in enumerate(self.sample_types) if u == "nanoseconds"), len(self.sample_types) - 1)
        self.samples: list[tuple[int, list[str]]] = []
        for locs, vals in raw_samples:
            stack = [strings[func_names.get(fid, 0)] for lid in locs for fid in loc_funcs.get(lid, [])]
            self.samples.append((vals[col] if col < len(vals) else 0, stack))

    @classmethod
    def merged(cls, profiles: list["Profile"]) -> "Profile":
        """One profile holding the samples of all of ``profiles`` (its :attr:`raw` is the first one's)."""
        out = cls.__new__(cls)
        out.raw = profiles[0].raw if profiles else b""
        out.sample_types = profiles[0].sample_types if profiles else []
        out.samples = [s for p in profiles for s in p.samples]
        return out

    @property
    def total_seconds(self) -> float:
        return sum(v for v, _ in self.samples) / 1e9

    def flat(self) -> Counter:
        """Seconds by leaf function."""
        c: Counter = Counter()
        for v, st in self.samples:
            c[st[0] if st else "?"] += v / 1e9
        return c

    def cumulative(self) -> Counter:
        """Seconds by function anywhere on the stack (counted once per sample)."""
        c: Counter = Counter()
        for v, st in self.samples:
            for f in set(st):
                c[f] += v / 1e9
        return c

    def stacks(self, func: str, depth: int = 8, n: int = 10) -> list[tuple[float, list[str]]]:
        """The ``n`` commonest stacks (``depth`` frames from the leaf) among samples with a frame containing ``func``."""
        c: Counter = Counter()
        for v, st in self.samples:
            if any(func in f for f in st):
                c[tuple(st[:depth])] += v / 1e9
        return [(s, list(k)) for k, s in c.most_common(n)]

    def buckets(self, rules: list[tuple[str, tuple[str, ...]]],
                fallback: list[tuple[str, tuple[str, ...]]] = ()) -> Counter:
        """Seconds by the first rule whose substrings match a frame, searched leaf to root.

        ``rules`` are (label, substrings) in priority order per frame: the
        innermost frame that matches any rule decides the sample. A sample
        no rule matches goes to the first ``fallback`` rule matching any of
        its frames, else to "other".
        """
        c: Counter = Counter()
        for v, st in self.samples:
            label = self._match(rules, st) or self._match(fallback, st) or "other"
            c[label] += v / 1e9
        return c

    @staticmethod
    def _match(rules, stack) -> str | None:
        for f in stack:
            for lab, subs in rules:
                if any(s in f for s in subs):
                    return lab
        return None
