"""Exception tree of ckptstore.

Every class derives from :class:`CkptStoreError` and from the built-in
exception a caller would naturally catch (``FileNotFoundError`` for missing
objects, ``ValueError`` for malformed data, ``OSError`` for storage failures),
so ``except FileNotFoundError`` keeps working for code that does not know
ckptstore.
"""

from __future__ import annotations


class CkptStoreError(Exception):
    """Base class of every error ckptstore raises on purpose."""


# ---------------------------------------------------------------- storage
class StorageError(CkptStoreError, OSError):
    """An object-store operation failed."""


class TransientStorageError(StorageError):
    """A storage failure that may succeed when retried (throttling, 5xx, resets)."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The named object does not exist in the store."""


class ObjectExistsError(StorageError, FileExistsError):
    """A create-if-absent write found the object already present."""


# ---------------------------------------------------------------- repository
class StepExistsError(CkptStoreError, FileExistsError):
    """A step with this number is already committed; nothing was changed."""


class StepNotFoundError(CkptStoreError, LookupError):
    """No committed step has this number."""


class FormatError(CkptStoreError, ValueError):
    """An object in the store is malformed (truncated, bad JSON, bad schema)."""


class UnsupportedVersionError(FormatError):
    """The object was written by a newer, incompatible format version."""


class IntegrityError(CkptStoreError, ValueError):
    """Bytes read back do not match their content hash, or cannot be decoded."""


class MissingDataError(CkptStoreError, FileNotFoundError):
    """A committed step references a pack that is no longer in the store."""


class StaleBaseError(CkptStoreError, RuntimeError):
    """A save ran longer than the GC grace period allows; it did not commit."""


class PackVanishedError(ObjectNotFoundError):
    """A pack this save uploaded is gone before the commit (collected by GC?)."""


class MissingStepError(CkptStoreError, LookupError):
    """A step named for copying is not committed in the source."""


class ManifestTooLargeError(CkptStoreError, ValueError):
    """A step's manifest would be larger than readers accept; nothing was committed."""
