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


class HostNotResolvedError(StorageError):
    """The store's host name did not resolve (DNS): a mistyped endpoint, or no network.

    Not a :class:`TransientStorageError`: :class:`~ckptstore.storage.retry.RetryStore`
    retries it only briefly (``RetryPolicy.max_unresolved``), so a typo or a
    machine without network fails within seconds instead of after minutes of
    backoff. ``temporary`` is True when the resolver said the failure was
    temporary (``EAI_AGAIN``: no answer from the name server), False when the
    name does not exist.
    """

    temporary: bool = True


class StoreURLError(CkptStoreError, ValueError):
    """A repository URL is malformed, names an unknown scheme, or looks like a mistyped one."""


# ---------------------------------------------------------------- repository
class StepExistsError(CkptStoreError, FileExistsError):
    """A step with this number is already committed; nothing was changed."""


class StepNotFoundError(CkptStoreError, LookupError):
    """No committed step has this number."""


class RepositoryNotFoundError(StepNotFoundError, FileNotFoundError):
    """The location holds no repository (no ``config.json``): a mistyped URL, or nothing saved yet.

    Raised by reads that need a repository (``checkpoint``, ``load``,
    ``verify``, ``plan_gc``, ``stats``, copying from it), never by
    ``steps()`` or ``latest()``, which answer ``[]`` and ``None``. It is a
    ``FileNotFoundError`` (the location has nothing) and, since no step of
    that number is committed there either, a :class:`StepNotFoundError`, which
    code written before this class existed catches.
    """


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


#: The former name of :class:`StepNotFoundError` for a step named for copying (one error now).
MissingStepError = StepNotFoundError


class ManifestTooLargeError(CkptStoreError, ValueError):
    """A step's manifest would be larger than readers accept; nothing was committed."""


class UnsupportedLayoutError(CkptStoreError, NotImplementedError):
    """A step's layout is one ckptstore cannot convert (consolidate, re-partition); the step itself is intact.

    Raised, for instance, for a DeepSpeed step whose files belong to several
    tensor-parallel ranks when its weights are consolidated. The message
    names the file and what can be done instead.
    """
