"""What the remote backends share when they turn client exceptions into ours.

``s3.py`` and ``gcs.py`` each decide *which* ckptstore error a failure is
(by S3 error code, by HTTP status); the scaffolding around that decision is
here: optional exception types imported where installed, walking an
exception's cause chain, recognising network-level failures, keeping
messages short and free of secrets.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Callable, TypeVar

#: Longest server message quoted in an error.
MAX_MESSAGE = 300

T = TypeVar("T")


def optional_types(*names: str) -> tuple[type[BaseException], ...]:
    """The exception classes named ``"module:Class"`` whose modules import."""
    out: list[type[BaseException]] = []
    for name in names:
        module, _, attr = name.partition(":")
        try:
            out.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):  # pragma: no cover - optional dependency absent
            continue
    return tuple(out)


def in_chain(exc: BaseException, pick: Callable[[BaseException], T | None]) -> T | None:
    """The first non-None ``pick(e)`` for ``exc`` and its causes/contexts."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        found = pick(e)
        if found is not None:
            return found
        e = e.__cause__ or e.__context__
    return None


#: Network-level failures every backend retries (besides its own).
_NETWORK = ("fsspec.exceptions:FSTimeoutError",)


def is_network_error(exc: BaseException, extra: tuple[type[BaseException], ...] = (),
                     not_these: tuple[type[BaseException], ...] = ()) -> bool:
    """Connection resets, timeouts, truncated bodies: worth retrying."""
    if not_these and isinstance(exc, not_these):
        return False
    base = (ConnectionError, TimeoutError, asyncio.TimeoutError, *optional_types(*_NETWORK))
    return isinstance(exc, base + tuple(extra))


def scrub(err: Exception, exc: BaseException, secrets: tuple[str, ...]) -> Exception:
    """``err`` with every secret replaced by ``***`` (``exc`` itself is left alone)."""
    if not secrets or err is exc:
        return err
    msg = scrubbed = str(err)
    for s in secrets:
        scrubbed = scrubbed.replace(s, "***")
    return type(err)(scrubbed) if scrubbed != msg else err
