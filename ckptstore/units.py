"""Human-readable sizes and durations (shared by the library and the CLI)."""

from __future__ import annotations

import math
import re

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}


def parse_size(value) -> int:
    """``"200GB"``, ``"1.5 TiB"``, ``"512M"`` or a number of bytes -> bytes (decimal and binary units)."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"size must not be negative: {value}")
        return int(value)
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"invalid size {value!r}; use e.g. 200GB, 1.5TiB, 512MiB or a number of bytes")
    unit = (m.group(2) or "").lower()
    base = _UNIT[unit[:1]] if unit[:1] in _UNIT else 1
    if "i" in unit:
        base = 1 << (10 * "bkmgtp".index(unit[0])) if unit[0] != "b" else 1
    return int(float(m.group(1)) * base)


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
