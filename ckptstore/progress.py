"""Progress of long operations, for the library and the CLI alike.

Long operations (``save``, ``load``, ``load_module``, ``export``, ``copy``,
``verify``, GC's ``execute``) report through a callback
``progress(what, done, total)``; a ``what`` ending in ``" bytes"`` counts
bytes. They take ``progress=`` as:

- ``None`` or ``False``: silent (the library's default);
- ``True``: a tqdm bar per phase on stderr (:class:`Bars`);
- a callable: called with ``(what, done, total)`` as work completes, from
  the operation's worker threads (one call at a time).

Bars count bytes in the units the summaries print (:func:`~ckptstore.units.human_bytes`:
``405.4 MiB``, ``118.0 MiB/s``), never tqdm's own ``405M`` and decimal ``MB/s``.
tqdm is imported only when a bar is drawn.
"""

from __future__ import annotations

import sys
import threading
from typing import Callable

from .units import human_bytes

Progress = Callable[[str, int, int], None]

#: The bar's layout: tqdm's, with the counts and the rate spelled by :func:`human_bytes`.
BYTES_FORMAT = "{l_bar}{bar}| {done_h}/{total_h} [{elapsed}<{remaining}, {rate_h}]"


def silent(what: str, done: int, total: int) -> None:
    """The callback of ``progress=None``."""


def byte_bar(total: int, desc: str, file=None, **kwargs):
    """A tqdm bar counting bytes, spelled like the summaries (``12.0 MiB/405.4 MiB [..., 118.0 MiB/s]``)."""
    from tqdm.auto import tqdm

    class _ByteBar(tqdm):
        @property
        def format_dict(self):
            d = super().format_dict
            n, total = d.get("n") or 0, d.get("total")
            rate = d.get("rate")
            if rate is None and d.get("elapsed"):
                rate = (n - (d.get("initial") or 0)) / d["elapsed"]
            d["done_h"] = human_bytes(n)
            d["total_h"] = human_bytes(total) if total is not None else "?"
            d["rate_h"] = f"{human_bytes(rate)}/s" if rate else "? B/s"
            return d

    return _ByteBar(total=total, desc=desc, file=file or sys.stderr, unit="B", unit_scale=False,
                    bar_format=BYTES_FORMAT, dynamic_ncols=True, **kwargs)


class Bars:
    """A progress callback drawing one tqdm bar per phase (a new ``what`` closes the previous bar).

    A phase with nothing to do (``total == 0``) draws no bar, and a repeated
    final call of a finished phase does not draw it again (a bar drawn anew
    at its end would show every byte moved in no time).

    Parameters
    ----------
    enabled:
        False: a silent callback (the CLI's ``--json``).
    file:
        Where to draw (default stderr); nothing is drawn when it is not a
        terminal, unless ``force``.
    """

    def __init__(self, enabled: bool = True, file=None, force: bool = False):
        self.file = file or sys.stderr
        isatty = getattr(self.file, "isatty", lambda: False)
        self.enabled = enabled and (force or isatty())
        self._bar = None
        self._what: str | None = None
        self._finished: tuple[str, int] | None = None
        self._lock = threading.Lock()

    def __call__(self, what: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            if what != self._what or self._bar is None:
                if total <= 0 or self._finished == (what, total) and done >= total:
                    return
                self._open(what, total)
            bar = self._bar
            if total != bar.total:
                bar.total = total
            bar.update(done - bar.n)
            if done >= total:
                self._close()
                self._finished = (what, total)

    def _open(self, what: str, total: int) -> None:
        self._close()
        self._finished = None
        if what.endswith(" bytes"):
            self._bar = byte_bar(total, what.removesuffix(" bytes"), file=self.file, leave=True)
        else:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=what, file=self.file, unit="it", leave=True, dynamic_ncols=True)
        self._what = what

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            self._what = None

    def close(self) -> None:
        with self._lock:
            self._close()


class Counter:
    """Byte counts reported by many threads, as ``progress(what, done, total)`` calls made one at a time.

    Reports ``(what, 0, total)`` when made; :meth:`add` is an ``on_bytes``
    callback for the pipelines.
    """

    def __init__(self, progress: Progress, what: str, total: int):
        self.progress, self.what, self.total = progress, what, total
        self.done = 0
        self._lock = threading.Lock()
        progress(what, 0, total)

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            self.progress(self.what, self.done, self.total)


def callback(progress) -> tuple[Progress, Callable[[], None]]:
    """``(callback, close)`` for a ``progress=`` argument: None/False, True, or a callable."""
    if progress is None or progress is False:
        return silent, lambda: None
    if progress is True:
        bars = Bars(force=True)
        return bars, bars.close
    if callable(progress):
        return progress, lambda: None
    raise TypeError(f"progress must be None, a bool or a callable progress(what, done, total), not {progress!r}")
