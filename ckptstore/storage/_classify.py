"""What the remote backends share when they turn client exceptions into ours.

``s3.py``, ``gcs.py`` and ``azure.py`` each decide *which* ckptstore error a failure is
(by S3 error code, by HTTP status); the scaffolding around that decision is
here: optional exception types imported where installed, walking an
exception's cause chain, recognising network-level failures and host names
that do not resolve, keeping messages short and free of secrets.
"""

from __future__ import annotations

import importlib
import socket
import urllib.parse
from typing import Callable, TypeVar

from ..errors import HostNotResolvedError

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


def is_network_error(exc: BaseException, extra: tuple[type[BaseException], ...] = (),
                     not_these: tuple[type[BaseException], ...] = ()) -> bool:
    """Connection resets, timeouts, truncated bodies: worth retrying."""
    if not_these and isinstance(exc, not_these):
        return False
    return isinstance(exc, (ConnectionError, TimeoutError, *extra))


#: ``getaddrinfo`` answers that say the name does not exist (retrying cannot help).
_NO_SUCH_NAME = frozenset(
    getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA", "EAI_FAIL", "EAI_ADDRFAMILY") if hasattr(socket, n)
)
#: Client exceptions that wrap a failed name resolution, each with where it keeps the host name.
_DNS_WRAPPERS = ("urllib3.exceptions:NameResolutionError",)


def _host_of(e: BaseException) -> str | None:
    host = getattr(e, "_host", None)  # urllib3
    if isinstance(host, str) and host:
        return host
    url = (getattr(e, "kwargs", None) or {}).get("endpoint_url")  # botocore's EndpointConnectionError
    if isinstance(url, str):
        return urllib.parse.urlsplit(url).hostname
    return None


def unresolved_host(exc: BaseException) -> tuple[str | None, str, bool] | None:
    """``(host, reason, temporary)`` if ``exc`` (or a cause) is a failed host-name resolution, else None.

    ``temporary`` is False when the resolver said the name does not exist
    (``EAI_NONAME``...), True when it could not get an answer (``EAI_AGAIN``:
    no network, or a name server that did not reply) or did not say.
    """
    wrappers = optional_types(*_DNS_WRAPPERS)
    gai = in_chain(exc, lambda e: e if isinstance(e, socket.gaierror) else None)
    wrapped = in_chain(exc, lambda e: e if wrappers and isinstance(e, wrappers) else None)
    if gai is None and wrapped is None:
        return None
    host = in_chain(exc, _host_of)
    if gai is not None:
        reason = gai.strerror or str(gai)
        return host, reason, gai.errno not in _NO_SUCH_NAME
    return host, "name resolution failed", True


def host_not_resolved(exc: BaseException, where: str, what: str, host: str | None = None) -> HostNotResolvedError | None:
    """A :class:`HostNotResolvedError` for ``exc`` if it is a failed name resolution (``what``: "S3 GetObject")."""
    found = unresolved_host(exc)
    if found is None:
        return None
    found_host, reason, temporary = found
    host = host or found_host
    err = HostNotResolvedError(
        f"{where}: {what} failed: could not resolve host {host or '(unknown)'!r} ({reason}); "
        "check the endpoint (the URL, storage options, AWS_ENDPOINT_URL / STORAGE_EMULATOR_HOST) and the network"
    )
    err.temporary = temporary
    return err


def check_resolves(url: str, where: str, what: str, resolver: Callable = socket.getaddrinfo) -> None:
    """Resolve ``url``'s host once (``resolver`` has ``socket.getaddrinfo``'s signature).

    For a client that would otherwise spend its tries (and their waits) on a
    name that does not resolve: a :class:`HostNotResolvedError` at once.
    """
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        resolver(parts.hostname, port, 0, socket.SOCK_STREAM)
    except socket.gaierror as e:
        err = host_not_resolved(e, where, what, host=parts.hostname)
        raise (err or e) from e  # host_not_resolved knows every gaierror
    except UnicodeError:
        return  # a name the client refuses itself, with its own message


def scrub(err: Exception, exc: BaseException, secrets: tuple[str, ...]) -> Exception:
    """``err`` with every secret replaced by ``***`` (``exc`` itself is left alone)."""
    if not secrets or err is exc:
        return err
    msg = scrubbed = str(err)
    for s in secrets:
        scrubbed = scrubbed.replace(s, "***")
    if scrubbed == msg:
        return err
    out = type(err)(scrubbed)
    out.__dict__.update(err.__dict__)  # e.g. HostNotResolvedError.temporary
    return out
