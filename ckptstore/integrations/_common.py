"""Helpers shared by the integrations (no framework imports)."""

from __future__ import annotations

from ..errors import CkptStoreError


def unwrap_checkpoint_exception(e, what: str) -> BaseException:
    """DCP's ``CheckpointException`` (a ``BaseException``) -> the first failing rank's own error.

    The error keeps its type (``StepExistsError``, ``StorageError``, ...)
    and says which rank failed; a failure that is not an ``Exception``
    becomes a :class:`CkptStoreError`.
    """
    failures = getattr(e, "failures", None) or {}
    for rank in sorted(failures):
        item = failures[rank]
        exc = item[0] if isinstance(item, tuple) else item
        if isinstance(exc, Exception):
            msg = f"{what}: rank {rank}: {exc}"
            try:
                return type(exc)(msg)
            except Exception:
                return CkptStoreError(msg)
    return CkptStoreError(f"{what} failed: {e}")
