"""ckptstore: deduplicated, compressed PyTorch checkpoints in object stores."""

from __future__ import annotations

from .errors import (
    CkptStoreError,
    ConditionalWriteUnsupportedError,
    FormatError,
    IntegrityError,
    MissingDataError,
    RepositoryNotFoundError,
    SaveBacklogError,
    StaleBaseError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
    StoreThrottledError,
    StoreURLError,
    UnsupportedVersionError,
)
from .repo.gc import GCPlan, RetentionPolicy
from .loading import SafetensorsObject, SafetensorsShards, TPPlanError, load_module, open_safetensors
from .repo.repository import Checkpoint, Repository, StepInfo, TensorMeta, open
from .storage.retry import RetryPolicy
from .storage.throttle import ThrottlePolicy

__version__ = "0.1.0"

__all__ = [
    "open",
    "load_module",
    "open_safetensors",
    "SafetensorsObject",
    "SafetensorsShards",
    "TPPlanError",
    "Repository",
    "Checkpoint",
    "StepInfo",
    "TensorMeta",
    "GCPlan",
    "RetentionPolicy",
    "RetryPolicy",
    "ThrottlePolicy",
    "StaleBaseError",
    "SaveBacklogError",
    "CkptStoreError",
    "FormatError",
    "IntegrityError",
    "MissingDataError",
    "RepositoryNotFoundError",
    "StepExistsError",
    "StepNotFoundError",
    "StorageError",
    "StoreThrottledError",
    "ConditionalWriteUnsupportedError",
    "StoreURLError",
    "UnsupportedVersionError",
]
