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
    """A storage failure that may succeed when retried (throttling, 5xx, resets).

    ``throttled``: the store said it was sent too many requests (S3 503
    SlowDown, GCS 429, Azure 503 ServerBusy); ``retry_after``: the seconds
    its ``Retry-After`` asked for, if any.
    """

    throttled: bool = False
    retry_after: float | None = None


class StoreThrottledError(TransientStorageError):
    """The store kept throttling a request after every retry; nothing is assumed about what it holds.

    Raised instead of an empty answer: a listing the store refused is an
    error, never "no checkpoint".
    """

    throttled = True


class ConditionalWriteUnsupportedError(StorageError):
    """The store accepted a second conditional create (``If-None-Match: *``) of one key: it cannot
    make a step's commit atomic, so ckptstore does not commit to it."""


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


class CredentialsRefusedError(StorageError, PermissionError):
    """The store refused the credentials a request was signed with (HTTP 401/403: a wrong key or
    secret, an expired token, or a key without permission on the bucket or prefix).

    The message names the credential source that was used (environment
    variables, a profile, an explicit storage option...), never a secret.
    Not retried: trying again cannot fix a credential.
    """


class MissingExtraError(CkptStoreError, ImportError):
    """A URL's cloud client is an optional extra that is not installed; the message names the
    ``pip install`` that adds it."""


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


class SaveBacklogError(CkptStoreError, TimeoutError):
    """An async save waited ``async_wait`` seconds for the handle's previous one, still writing; nothing
    of it was saved."""


class PackVanishedError(ObjectNotFoundError):
    """A pack this save uploaded is gone before the commit (collected by GC?)."""


#: The former name of :class:`StepNotFoundError` for a step named for copying (one error now).
MissingStepError = StepNotFoundError


class ManifestTooLargeError(CkptStoreError, ValueError):
    """A step's manifest would be larger than readers accept; nothing was committed."""


class TPPlanError(CkptStoreError, ValueError):
    """A tensor-parallel plan ``load_module`` cannot apply; the message names the entry and the tensor."""


class UnsupportedLayoutError(CkptStoreError, NotImplementedError):
    """A step's layout is one ckptstore cannot convert (consolidate, re-partition); the step itself is intact.

    Raised, for instance, for a DeepSpeed step whose files belong to several
    tensor-parallel ranks when its weights are consolidated. The message
    names the file and what can be done instead.
    """
