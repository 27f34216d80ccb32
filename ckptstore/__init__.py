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
from .repository import Checkpoint, Repository, StepInfo, TensorMeta, open

__version__ = "0.1.0"

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
