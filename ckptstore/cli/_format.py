"""Small output helpers shared by the commands."""

from __future__ import annotations

import datetime as _dt
import json
import sys

from ..units import human_bytes  # noqa: F401  (re-exported for the commands)


def iso(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def table(rows: list[list], header: list[str], out=None) -> None:
    out = out or sys.stdout
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip(), file=out)
        if j == 0:
            print("  ".join("-" * w for w in widths), file=out)


def emit_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
