"""Object stores: the :class:`ObjectStore` interface and its backends.

:func:`open_store` turns a URL into a store. ``S3Store``, ``GCSStore`` and ``AzureStore`` are
imported on first use so that importing this package does not import botocore, google-auth or azure-storage-blob.
"""

from __future__ import annotations

import difflib
import re

from ..errors import MissingExtraError, StoreURLError
from .base import MultipartInfo, MultipartUpload, ObjectInfo, ObjectStore
from .upload import BufferPool, ParallelUploader
from .local import LocalStore
from .memory import MemoryStore

__all__ = [
    "ObjectStore",
    "ObjectInfo",
    "MultipartInfo",
    "MultipartUpload",
    "ParallelUploader",
    "BufferPool",
    "MemoryStore",
    "LocalStore",
    "S3Store",
    "GCSStore",
    "AzureStore",
    "open_store",
]

_SUPPORTED = "s3://, gs://, az://, file://, memory://, paths"
_LOCAL_OPTIONS = frozenset({"fsync"})
#: Every scheme :func:`open_store` takes.
SCHEMES = ("s3", "gs", "gcs", "az", "abfs", "abfss", "file", "memory")
#: A known scheme followed by one colon but not by "://": ``s3:/bucket``, ``gs:bucket``, ``az:/``.
_MISTYPED = re.compile(r"^(" + "|".join(SCHEMES) + r"):(?!//)(.*)$", re.IGNORECASE | re.DOTALL)


def __getattr__(name: str):
    if name == "S3Store":
        _require("botocore", "s3", "s3")
        from .s3 import S3Store

        return S3Store
    if name == "GCSStore":
        _require("google.auth", "gcs", "gs")
        from .gcs import GCSStore

        return GCSStore
    if name == "AzureStore":
        _require("azure.storage.blob", "azure", "az")
        from .azure import AzureStore

        return AzureStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _suggest(scheme: str, rest: str) -> str:
    """The URL a mistyped one probably meant (``s3:/b/p`` -> ``s3://b/p``)."""
    rest = rest.lstrip("/")
    if scheme == "file":
        return f"file:///{rest}"
    if not rest:
        return f"{scheme}://{'container' if scheme in ('az', 'abfs', 'abfss') else 'bucket'}/prefix"
    return f"{scheme}://{rest}"


def _refuse_mistyped(url: str) -> None:
    """Refuse a path that is a known scheme with a colon but no ``//`` (it would become a local directory)."""
    m = _MISTYPED.match(url)
    if m is None:
        return
    scheme, rest = m.group(1).lower(), m.group(2)
    if "@" in rest:  # never echo what may be a secret
        raise StoreURLError(f"store URL looks like a mistyped {scheme}:// URL (it has no '//' after '{scheme}:')")
    raise StoreURLError(
        f"{url!r} looks like a mistyped URL: did you mean {_suggest(scheme, rest)!r}? "
        f"(for a local directory of that name, write ./{url})"
    )


def _split_url(url: str) -> tuple[str, str]:
    """``(scheme, rest)``; scheme is ``""`` for a plain path."""
    if not isinstance(url, str) or not url:
        raise StoreURLError("store URL must be a non-empty string")
    scheme, sep, rest = url.partition("://")
    if not sep:
        _refuse_mistyped(url)
        return "", url
    if not scheme or not all(c.isalnum() or c in "+-." for c in scheme):
        # Never echo the URL: it may carry credentials.
        raise StoreURLError("malformed store URL (expected scheme://location or a path)")
    return scheme.lower(), rest


def _unknown_scheme(scheme: str) -> StoreURLError:
    close = difflib.get_close_matches(scheme, SCHEMES, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]}://?" if close else ""
    return StoreURLError(f"unsupported store URL scheme {scheme!r} (supported: {_SUPPORTED}){hint}")


def _refuse_credentials(scheme: str, rest: str) -> None:
    # Look at the whole location, not just up to the first "/": a secret may
    # itself contain "/" (AWS secrets often do), which would hide the "@".
    if "@" in rest:
        # Do not echo the URL: the part before "@" is a secret.
        raise StoreURLError(
            f"{scheme}:// URL must not embed credentials (user:secret@...); "
            "pass them in storage_options or through the environment"
        )


def _no_options(kind: str, storage_options: dict | None, allowed=frozenset()) -> dict:
    opts = dict(storage_options or {})
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        raise ValueError(f"storage options {unknown} do not apply to {kind} stores")
    return opts


def open_store(url: str, storage_options: dict | None = None) -> ObjectStore:
    """Open the store a URL names.

    Parameters
    ----------
    url:
        ``memory://name`` (process-wide named in-memory store),
        ``file:///abs/path`` or a plain (relative or absolute) path,
        ``s3://bucket/prefix``, ``gs://bucket/prefix`` (or ``gcs://``),
        ``az://container/prefix`` (or ``abfs://``, ``abfss://``; the account
        comes from ``storage_options`` or the environment).
        Credentials never go in the URL.
    storage_options:
        For S3, s3fs's names (``key``, ``secret``, ``profile``,
        ``endpoint_url``, ``client_kwargs``...; see :mod:`ckptstore.storage.s3`;
        an unknown one raises ``ValueError``); for GCS, gcsfs's names
        (``token``, ``project``, ``endpoint_url``, ``requester_pays``...; see
        :mod:`ckptstore.storage.gcs`; an unknown one raises ``ValueError``); for Azure,
        the account and credentials (``connection_string``, ``account_name``,
        ``account_key``, ``sas_token``, ``credential``...; see
        :mod:`ckptstore.storage._azure_client`; an unknown one raises ``ValueError``). For local stores only
        ``fsync`` is accepted; memory stores take none.

    Raises
    ------
    StoreURLError
        (a ``ValueError``) An unsupported scheme, embedded credentials, a
        malformed location, or a path that looks like a mistyped URL
        (``s3:/bucket``, ``gs:bucket``, ``az:/``: a known scheme with a colon
        but no ``//``), refused with the URL it probably meant.
    """
    scheme, rest = _split_url(url)
    if scheme:
        _refuse_credentials(scheme, rest)
    if scheme == "":
        opts = _no_options("local", storage_options, _LOCAL_OPTIONS)
        path = url.rstrip("/") or "/"
        return LocalStore(path, **opts)
    if scheme == "file":
        opts = _no_options("local", storage_options, _LOCAL_OPTIONS)
        host, slash, path = rest.partition("/")
        if host not in ("", "localhost") or not slash:
            raise StoreURLError("file:// URL must be file:///absolute/path (no host)")
        return LocalStore("/" + path.strip("/"), **opts)
    if scheme == "memory":
        _no_options("memory", storage_options)
        name = rest.strip("/")
        if not name:
            raise StoreURLError("memory:// URL needs a name, e.g. memory://scratch")
        return MemoryStore(name)
    if scheme == "s3":
        location = rest.rstrip("/")
        if not location.split("/", 1)[0]:
            raise StoreURLError("s3:// URL needs a bucket, e.g. s3://bucket/prefix")
        if "?" in location or "#" in location:
            raise StoreURLError("s3:// URL must not carry a query or fragment")
        _require("botocore", "s3", scheme)
        from .s3 import S3Store

        return S3Store(location, storage_options)
    if scheme in ("gs", "gcs"):
        location = rest.rstrip("/")
        if not location.split("/", 1)[0]:
            raise StoreURLError(f"{scheme}:// URL needs a bucket, e.g. gs://bucket/prefix")
        if "?" in location or "#" in location:
            raise StoreURLError(f"{scheme}:// URL must not carry a query or fragment")
        _require("google.auth", "gcs", scheme)
        from .gcs import GCSStore

        return GCSStore(location, storage_options)
    if scheme in ("az", "abfs", "abfss"):
        location = rest.rstrip("/")
        if not location.split("/", 1)[0]:
            raise StoreURLError(f"{scheme}:// URL needs a container, e.g. az://container/prefix")
        if "?" in location or "#" in location:
            raise StoreURLError(f"{scheme}:// URL must not carry a query or fragment (a SAS token goes in storage_options)")
        _require("azure.storage.blob", "azure", scheme)
        from .azure import AzureStore

        return AzureStore(location, storage_options)
    raise _unknown_scheme(scheme)


def _require(module: str, extra: str, scheme: str) -> None:
    """The cloud's client is an extra: say which one to install, before anything is opened
    (:class:`~ckptstore.errors.MissingExtraError`, an ``ImportError``)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a dotted name whose parent package is missing (azure.storage.blob)
        spec = None
    if spec is None:
        raise MissingExtraError(
            f"{scheme}:// URLs need {module}, which is not installed: pip install 'ckptstore[{extra}]'")
