"""Human-readable sizes and durations (shared by the library and the CLI)."""

from __future__ import annotations

import math

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def parse_duration(text: str | float | int | None) -> float | None:
    """``"90s"``, ``"15m"``, ``"2h"``, ``"7d"``, ``"1w"`` or a number of seconds."""
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"duration must not be negative: {text}")
        return float(text)
    t = str(text).strip().lower()
    try:
        if t and t[-1] in _UNITS:
            value = float(t[:-1]) * _UNITS[t[-1]]
        else:
            value = float(t)
    except ValueError:
        raise ValueError(f"invalid duration {text!r}; use e.g. 90s, 15m, 2h, 7d") from None
    if value < 0 or not math.isfinite(value):
        raise ValueError(f"invalid duration {text!r}")
    return value
