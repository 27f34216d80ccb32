"""The account an :class:`~ckptstore.storage.azure.AzureStore` reaches, its credentials, and the client.

:func:`resolve_account` reads storage options and the environment into an
:class:`Account` (pure: it imports nothing and sends nothing); the store
calls :func:`connect` with it on first use.

Account and credentials. The conventions are those adlfs had (ckptstore's
Azure client before the store moved to azure-storage-blob's synchronous
client): its storage option names, and its ``AZURE_STORAGE_*`` environment
variables (:data:`ENVIRONMENT`), each read when its option is not given.
In order:

1. ``connection_string`` (``AZURE_STORAGE_CONNECTION_STRING``), whatever
   else is given;
2. else the account ``account_name`` (``AZURE_STORAGE_ACCOUNT_NAME``) at
   ``https://<account_host>``, by default ``<account_name>.blob.core.windows.net``
   (an ``account_host`` written with ``http://`` reaches an emulator),
   authenticated by the first of: ``credential`` (an azure-core credential
   object, or a string: an account key or a SAS token); ``account_key``
   (``AZURE_STORAGE_ACCOUNT_KEY``); ``sas_token`` (``AZURE_STORAGE_SAS_TOKEN``,
   added to the account URL); a service principal, ``client_id`` /
   ``client_secret`` / ``tenant_id`` (``AZURE_STORAGE_CLIENT_ID``, ...,
   ``azure.identity.ClientSecretCredential``); nothing when ``anon``
   (``AZURE_STORAGE_ANON``: anything but ``false``/``0``/``f``/empty);
   else ``azure.identity.DefaultAzureCredential``.

Unlike adlfs: no account at all, or a service principal missing a part,
raises ``ValueError`` saying what to pass (adlfs made a
``DefaultAzureCredential`` or handed ``None`` parts to azure.identity
first); options it did not know raise ``ValueError`` in the store (adlfs
handed unknown keys to ``DefaultAzureCredential``); an ``account_host`` may
carry its scheme (adlfs always wrote ``https://`` in front); the store
closes the azure.identity credentials it made, never a ``credential``
passed in (adlfs closed that too).

Secrets (account keys, connection strings and their keys or signatures,
SAS tokens and their signatures, client secrets), from options or
environment, are collected by :func:`secrets_of` and kept out of every
message (:func:`scrub_text`).

Connections. The client's ``requests`` session keeps up to
:data:`POOL_CONNECTIONS` connections (at least the store's
``max_concurrency``) for reuse; requests' default, 10, would close all but
ten threads' connections after every request. Like adlfs's aiohttp session
(azure-core's ``use_env_settings``, on by default), it takes a proxy from
``HTTP_PROXY`` / ``HTTPS_PROXY`` unless ``NO_PROXY`` names the account's
host (so an emulator on 127.0.0.1 goes through a proxy set for the machine
unless ``NO_PROXY`` names it), read once when the client is made, not on
every request as requests would (and never a ``~/.netrc`` login, which
requests would put in place of the SDK's ``Authorization`` header). TLS
certificates are checked against ``REQUESTS_CA_BUNDLE`` (or
``CURL_CA_BUNDLE``) when set, else against requests' bundle (certifi), not
the system's store that aiohttp used.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, NamedTuple

from ..errors import MissingExtraError

#: Where each option is read from when ``storage_options`` do not give it.
ENVIRONMENT = {
    "connection_string": "AZURE_STORAGE_CONNECTION_STRING", "account_name": "AZURE_STORAGE_ACCOUNT_NAME",
    "account_key": "AZURE_STORAGE_ACCOUNT_KEY", "sas_token": "AZURE_STORAGE_SAS_TOKEN",
    "client_id": "AZURE_STORAGE_CLIENT_ID", "client_secret": "AZURE_STORAGE_CLIENT_SECRET",
    "tenant_id": "AZURE_STORAGE_TENANT_ID",
}
#: Connections kept open for reuse (at least the store's ``max_concurrency``): as
#: many as run at once, get_ranges' threads besides the loader's and the
#: uploader's (``io_workers`` each, 16 by default). A slot never used costs nothing.
POOL_CONNECTIONS = 64
#: The storage options naming the account and its credentials.
ACCOUNT_OPTIONS = frozenset({*ENVIRONMENT, "credential", "account_host", "anon"})
#: Query parameters of a SAS token that are secret (the signature), for scrubbing.
_SAS_SIG = re.compile(r"(sig=)[^&\s\"']+", re.IGNORECASE)
_CONN_SECRET = re.compile(r"((?:AccountKey|SharedAccessSignature)=)[^;\s\"']+", re.IGNORECASE)


@dataclass(frozen=True, repr=False)  # no repr: the fields hold secrets
class Account:
    """How to reach the account, as :func:`resolve_account` read it.

    Exactly one way: ``connection_string``; or ``url`` (carrying the SAS
    token when one authenticates) with ``credential`` (the caller's object
    or string, or ``{"account_name", "account_key"}``), with ``principal``
    (``(tenant_id, client_id, client_secret)``), with ``default``
    (``DefaultAzureCredential``), or with none of them (anonymous).
    """

    connection_string: str | None = None
    url: str | None = None
    credential: object = None
    principal: tuple[str, str, str] | None = None
    default: bool = False


def resolve_account(opts: Mapping, environ: Mapping[str, str] = os.environ) -> Account:
    """The account and credentials that storage options ``opts`` and ``environ`` name (module docstring).

    Raises ``ValueError`` when no account is named, or a service principal
    lacks a part.
    """
    def get(name: str):
        return opts.get(name) or environ.get(ENVIRONMENT[name]) or None

    if get("connection_string"):
        return Account(connection_string=get("connection_string"))
    name = get("account_name")
    if not name:
        raise ValueError("no Azure account given: pass connection_string, or account_name with its credentials "
                         "(account_key, sas_token, credential, client_id/client_secret/tenant_id, or anon), "
                         "in storage_options or as AZURE_STORAGE_CONNECTION_STRING / AZURE_STORAGE_ACCOUNT_NAME")
    host = opts.get("account_host") or f"{name}.blob.core.windows.net"
    url = host if re.match(r"https?://", host) else f"https://{host}"
    if opts.get("credential") is not None:
        return Account(url=url, credential=opts["credential"])
    if get("account_key"):
        return Account(url=url, credential={"account_name": name, "account_key": get("account_key")})
    if get("sas_token"):
        return Account(url=f"{url}?{get('sas_token').lstrip('?')}")
    if get("client_id"):
        parts = {k: get(k) for k in ("tenant_id", "client_id", "client_secret")}
        missing = sorted(k for k, v in parts.items() if not v)
        if missing:
            raise ValueError(f"an Azure service principal needs client_id, client_secret and tenant_id: {missing} "
                             f"not given (storage_options, or {', '.join(ENVIRONMENT[k] for k in missing)})")
        return Account(url=url, principal=(parts["tenant_id"], parts["client_id"], parts["client_secret"]))
    anon = opts.get("anon")
    if anon is None:
        anon = environ.get("AZURE_STORAGE_ANON", "false").lower() not in ("false", "0", "f", "")
    return Account(url=url) if anon else Account(url=url, default=True)


def identity_credential(account: Account):
    """The azure.identity credential of a service principal or of the default chain (nothing is sent yet)."""
    try:
        import azure.identity as identity
    except ImportError as e:
        raise MissingExtraError("Azure credentials from a service principal or DefaultAzureCredential need "
                          "azure-identity, which is not installed: pip install 'ckptstore[azure]'") from e
    if account.principal is not None:
        tenant_id, client_id, client_secret = account.principal
        return identity.ClientSecretCredential(tenant_id=tenant_id, client_id=client_id, client_secret=client_secret)
    return identity.DefaultAzureCredential()


def secrets_of(opts: Mapping, environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """Every secret a store with storage options ``opts`` may send (from them, else from ``environ``)."""
    opts = dict(opts)
    for k in ("account_key", "connection_string", "sas_token", "client_secret"):
        if not opts.get(k) and environ.get(ENVIRONMENT[k]):
            opts[k] = environ[ENVIRONMENT[k]]
    out = []
    for k in ("account_key", "connection_string", "sas_token", "client_secret", "credential"):
        v = opts.get(k)
        if isinstance(v, str) and v:
            out += [v, v.lstrip("?")]
    for text, sep, names in ((opts.get("connection_string"), ";", ("accountkey", "sharedaccesssignature")),
                             (opts.get("sas_token"), "&", ("sig",))):
        if isinstance(text, str):
            for part in text.lstrip("?").split(sep):
                name, _, value = part.partition("=")
                if name.strip().lower() in names and value:
                    out.append(value)
    return tuple(sorted({s for s in out if len(s) >= 4}, key=len, reverse=True))


def scrub_text(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with every secret, and any SAS signature or connection-string key, replaced by ``***``."""
    for s in secrets:
        text = text.replace(s, "***")
    return _CONN_SECRET.sub(r"\1***", _SAS_SIG.sub(r"\1***", text))


class Client(NamedTuple):
    """What :func:`connect` makes; the store closes ``service`` and ``credential``."""

    service: object  # azure.storage.blob.BlobServiceClient
    container: object  # its ContainerClient
    session: object  # the requests.Session under both
    credential: object  # the azure.identity credential made for it, closed with it; else None


def connect(account: Account, container: str, pool: int, req: dict, hooks: dict | None = None) -> Client:
    """A synchronous client for ``account``'s ``container``, its session keeping ``pool`` connections.

    ``req``: ``retry_total``, ``connection_timeout``, ``read_timeout``.
    ``hooks``: ``raw_request_hook`` and ``raw_response_hook`` callables, called
    for every request the client sends and every answer it gets.
    """
    import requests
    from azure.core.pipeline.transport import RequestsTransport
    from azure.storage.blob import BlobServiceClient
    from urllib3.util.retry import Retry

    session = requests.Session()
    # The environment is read here, once (module docstring): requests would
    # read it again on every request, and take ~/.netrc logins with it.
    session.trust_env = False
    # As azure-core's own session (retries belong to the pipeline), with room for every thread.
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=pool,
                                            max_retries=Retry(total=False, redirect=False, raise_on_status=False))
    for scheme in ("http://", "https://"):
        session.mount(scheme, adapter)
    verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
    transport = RequestsTransport(session=session, session_owner=True, connection_verify=verify,
                                  connection_timeout=req["connection_timeout"], read_timeout=req["read_timeout"])
    made = None
    try:
        if account.connection_string:
            service = BlobServiceClient.from_connection_string(account.connection_string, transport=transport,
                                                               retry_total=req["retry_total"], **(hooks or {}))
        else:
            credential = account.credential
            if account.principal is not None or account.default:
                credential = made = identity_credential(account)
            service = BlobServiceClient(account.url, credential=credential, transport=transport,
                                        retry_total=req["retry_total"], **(hooks or {}))
        # Every request goes to the account's host: its proxies (none if NO_PROXY names it) hold for all.
        session.proxies.update(requests.utils.get_environ_proxies(service.url))
        return Client(service, service.get_container_client(container), session, made)
    except BaseException:
        session.close()
        if made is not None:
            made.close()
        raise
