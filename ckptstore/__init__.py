"""ckptstore: deduplicated, compressed PyTorch checkpoints in object stores."""

from __future__ import annotations

from .errors import (
    CkptStoreError,
    FormatError,
    IntegrityError,
    MissingDataError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
    UnsupportedVersionError,
)
from .repository import Checkpoint, Repository, StepInfo, TensorMeta

__version__ = "0.1.0"


def open(url: str, storage_options: dict | None = None, **options) -> Repository:  # noqa: A001
    """Open (or prepare to create) the repository at ``url``.

    Parameters
    ----------
    url:
        ``s3://bucket/prefix``, ``file:///path``, a plain path, or
        ``memory://name``.
    storage_options:
        Passed to the backend (for S3: s3fs options such as ``key``,
        ``secret``, ``client_kwargs={"endpoint_url": ...}``).
    **options:
        :class:`~ckptstore.repository.RepoOptions` fields (``chunk_size``,
        ``pack_size``, ``part_size``, ``workers``, ``io_workers``,
        ``max_inflight_bytes``, ``grace``, ...), and ``retry``: a
        :class:`~ckptstore.storage.retry.RetryPolicy`, or False to turn off
        the retries remote stores get by default.
    """
    from .storage import open_store
    from .storage.retry import RetryPolicy, RetryStore

    retry = options.pop("retry", True)
    store = open_store(url, storage_options)
    if retry and store.remote:
        store = RetryStore(store, retry if isinstance(retry, RetryPolicy) else None)
    return Repository(store, **options)


__all__ = [
    "open",
    "Repository",
    "Checkpoint",
    "StepInfo",
    "TensorMeta",
    "CkptStoreError",
    "FormatError",
    "IntegrityError",
    "MissingDataError",
    "StepExistsError",
    "StepNotFoundError",
    "StorageError",
    "UnsupportedVersionError",
]
