"""Which credentials a request was signed with, in words for error messages: never a secret.

When a store answers 401 or 403 the backends raise
:class:`~ckptstore.errors.CredentialsRefusedError` (:func:`refused`) and add
where their credentials came from (:func:`with_source`): the environment,
a profile (named), an explicit storage option, a metadata server... The
text names options, variables, profiles, files and at most the last four
characters of an access key ID, which is not a secret; never a secret key,
a token, a SAS signature or a connection string.
"""

from __future__ import annotations

import os
from typing import Mapping

from ..errors import CredentialsRefusedError


def refused(where: str, what: str, label: str, message: str = "") -> CredentialsRefusedError:
    """The error for a request the store refused for its credentials (401/403, or a code saying so)."""
    detail = f": {message}" if message else ""
    return CredentialsRefusedError(
        f"{where}: {what} failed ({label}{detail}): the store refused the credentials (wrong or expired, or "
        "without permission on this bucket and prefix)"
    )


def with_source(err: CredentialsRefusedError, source: str | None) -> CredentialsRefusedError:
    """``err`` with the credential source said."""
    if not source:
        return err
    out = type(err)(f"{err}; credentials used: {source}")
    out.__dict__.update(err.__dict__)
    return out


def _key_tail(key) -> str:
    key = str(key or "")
    return f", access key ID ...{key[-4:]}" if len(key) >= 12 else ""


#: botocore's credential provider methods, as a person would name them.
_AWS_METHODS = {
    "env": "environment variables AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY{token}",
    "shared-credentials-file": "profile '{profile}' of the shared credentials file (~/.aws/credentials, "
                               "AWS_SHARED_CREDENTIALS_FILE)",
    "config-file": "profile '{profile}' of the config file (~/.aws/config, AWS_CONFIG_FILE)",
    "custom-process": "the credential_process of profile '{profile}'",
    "assume-role": "a role assumed through profile '{profile}'",
    "assume-role-with-web-identity": "a web identity token (AWS_WEB_IDENTITY_TOKEN_FILE, AWS_ROLE_ARN)",
    "sso": "the SSO login of profile '{profile}'",
    "iam-role": "the instance's IAM role (EC2 instance metadata)",
    "container-role": "the container's role (ECS/EKS credentials endpoint)",
    "boto-config": "a boto2 config file (BOTO_CONFIG)",
    "ec2-credentials-file": "an EC2 credentials file (AWS_CREDENTIAL_FILE)",
}


def s3_source(opts, clients: Mapping | None = None, environ: Mapping[str, str] = os.environ) -> str:
    """Where an S3 store's credentials come from (``opts``: its checked storage options; ``clients``:
    the botocore clients it made, whose resolved credentials say which provider found them)."""
    if getattr(opts, "anon", False):
        return "none: anonymous, unsigned requests (storage option anon=True)"
    profile = getattr(opts, "profile", None)
    key = getattr(opts, "key", None)
    if key and getattr(opts, "secret", None):
        return f"the key and secret given in storage_options (key, secret){_key_tail(key)}"
    creds = None
    for client in (clients or {}).values():
        try:
            creds = client._request_signer._credentials  # botocore's resolved credentials: read, never refreshed
        except AttributeError:
            continue
        if creds is not None:
            break
    named = profile or environ.get("AWS_PROFILE") or environ.get("AWS_DEFAULT_PROFILE") or "default"
    how = "storage option profile" if profile else ("AWS_PROFILE" if environ.get("AWS_PROFILE") else "")
    if creds is None:
        return ("none: botocore's chain found no credentials (storage options key/secret, environment variables "
                f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, profile '{named}' in ~/.aws, SSO, an instance role); "
                "set one, or pass anon=True for a public bucket")
    method = getattr(creds, "method", None) or "unknown"
    token = " / AWS_SESSION_TOKEN" if environ.get("AWS_SESSION_TOKEN") else ""
    text = _AWS_METHODS.get(method, f"botocore's {method!r} credential provider").format(profile=named, token=token)
    if how and "{profile}" in _AWS_METHODS.get(method, ""):
        text += f" (named by {how})"
    access = vars(creds).get("access_key") or vars(creds).get("_access_key")  # not refreshed: no request
    return text + _key_tail(access)


def gcs_source(token, environ: Mapping[str, str] = os.environ) -> str:
    """Where a GCS store's credentials come from (``token``: its ``token`` storage option)."""
    if token is None or token == "google_default":
        path = environ.get("GOOGLE_APPLICATION_CREDENTIALS")
        if environ.get("STORAGE_EMULATOR_HOST") and token is None:
            return "none: anonymous (STORAGE_EMULATOR_HOST is set and no token given)"
        return ("application-default credentials (" + (f"GOOGLE_APPLICATION_CREDENTIALS={path}" if path else
                "`gcloud auth application-default login`, or the GCE metadata server") + ")")
    if token == "anon":
        return "none: anonymous (storage option token='anon')"
    if token == "cloud":
        return "the GCE metadata server's service account (storage option token='cloud')"
    if isinstance(token, dict):
        kind = token.get("type", "credentials")
        who = token.get("client_email")
        return f"the {kind} given as storage option token (a dict)" + (f", {who}" if who else "")
    if isinstance(token, (str, os.PathLike)) and os.path.isfile(token):
        return f"the credentials file {os.fspath(token)} (storage option token)"
    if isinstance(token, str):
        return "the access token given as storage option token"
    return f"the {type(token).__name__} given as storage option token"


def azure_source(opts: Mapping, environ: Mapping[str, str] = os.environ) -> str:
    """Where an Azure store's credentials come from, in the order the account is resolved
    (:func:`~ckptstore.storage._azure_client.resolve_account`)."""
    from ._azure_client import ENVIRONMENT

    def origin(name: str) -> str | None:
        if opts.get(name):
            return f"storage option {name}"
        if environ.get(ENVIRONMENT[name]):
            return ENVIRONMENT[name]
        return None

    if origin("connection_string"):
        return f"a connection string ({origin('connection_string')})"
    account = opts.get("account_name") or environ.get(ENVIRONMENT["account_name"]) or "?"
    if opts.get("credential") is not None:
        return f"the {type(opts['credential']).__name__} given as storage option credential, account {account}"
    if origin("account_key"):
        return f"account {account}'s key ({origin('account_key')})"
    if origin("sas_token"):
        return f"a SAS token for account {account} ({origin('sas_token')})"
    if origin("client_id"):
        client = opts.get("client_id") or environ.get(ENVIRONMENT["client_id"])
        return f"service principal {client} ({origin('client_id')}), account {account}"
    anon = opts.get("anon")
    if anon is None:
        anon = environ.get("AZURE_STORAGE_ANON", "false").lower() not in ("false", "0", "f", "")
    if anon:
        return f"none: anonymous (anon), account {account}"
    return (f"DefaultAzureCredential (environment AZURE_CLIENT_ID/..., workload or managed identity, Azure CLI "
            f"login...), account {account}")
