"""Wrong credentials say so: which store refused them, which credentials were used (the environment,
a profile, an explicit option; never a secret), and, for a 404, whether the bucket or the key is
missing. Against a loopback stub that answers every request with the error a cloud gives."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from ckptstore.cli.main import main as cli
from ckptstore.errors import CredentialsRefusedError, ObjectNotFoundError, StorageError
from ckptstore.storage import open_store
from ckptstore.storage._credentials import azure_source, gcs_source

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
KEY_ID = "AKIAIOSFODNN7EXAMPLE"


class _Refuser:
    """A loopback HTTP server answering every request with one error (``status``, headers, body)."""

    def __init__(self):
        self.answer = (403, {}, b"")
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _reply(self):
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                status, headers, body = owner.answer
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _reply

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def s3(self, status: int, code: str, message: str) -> None:
        body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message>"
                "</Error>").encode()
        self.answer = (status, {"Content-Type": "application/xml"}, body)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def refuser():
    r = _Refuser()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """No AWS settings of the machine: empty ~/.aws files, no instance metadata."""
    import os

    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    (tmp_path / "credentials").write_text("")
    (tmp_path / "config").write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return tmp_path


def _s3(refuser, **opts):
    cfg = {"retries": {"max_attempts": 0}, "proxies": {}}
    return open_store("s3://bucket/runs/exp1", {"client_kwargs": {"endpoint_url": refuser.url}, "config_kwargs": cfg,
                                                 **opts})


def test_s3_says_explicit_credentials_were_refused_and_which_key_never_the_secret(refuser, aws_env):
    refuser.s3(403, "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records.")
    store = _s3(refuser, key=KEY_ID, secret=SECRET)
    with pytest.raises(CredentialsRefusedError) as ei:
        store.get("config.json")
    msg = str(ei.value)
    assert msg.startswith("s3://bucket/runs/exp1/config.json: S3 GetObject failed (InvalidAccessKeyId: The AWS "
                          "Access Key Id you provided does not exist in our records.): the store refused the "
                          "credentials"), msg
    assert msg.endswith("credentials used: the key and secret given in storage_options (key, secret), "
                        "access key ID ...MPLE"), msg
    assert SECRET not in msg and KEY_ID not in msg
    assert isinstance(ei.value, PermissionError) and isinstance(ei.value, StorageError)
    # a HEAD has no body: its 403 is the same refusal
    with pytest.raises(CredentialsRefusedError, match=r"HeadObject failed \(403: Forbidden\): the store refused"):
        store.head("config.json")


def test_s3_names_the_environment_or_the_profile_the_credentials_came_from(refuser, aws_env, monkeypatch):
    refuser.s3(403, "SignatureDoesNotMatch", "The request signature we calculated does not match")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    with pytest.raises(CredentialsRefusedError) as ei:
        _s3(refuser).get("config.json")
    assert str(ei.value).endswith("credentials used: environment variables AWS_ACCESS_KEY_ID / "
                                  "AWS_SECRET_ACCESS_KEY, access key ID ...MPLE"), str(ei.value)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    (aws_env / "credentials").write_text(f"[ci]\naws_access_key_id = AKIAEXAMPLECIPROFILE\n"
                                         f"aws_secret_access_key = {SECRET}\n")
    with pytest.raises(CredentialsRefusedError) as ei:
        list(_s3(refuser, profile="ci").list(""))
    msg = str(ei.value)
    assert "credentials used: profile 'ci' of the shared credentials file (~/.aws/credentials, " \
           "AWS_SHARED_CREDENTIALS_FILE) (named by storage option profile), access key ID ...FILE" in msg, msg
    monkeypatch.setenv("AWS_PROFILE", "ci")
    with pytest.raises(CredentialsRefusedError, match=r"profile 'ci' .*\(named by AWS_PROFILE\)"):
        _s3(refuser).get("x")
    assert SECRET not in msg


def test_s3_without_any_credentials_says_where_it_looked(refuser, aws_env):
    with pytest.raises(CredentialsRefusedError) as ei:
        _s3(refuser).get("config.json")
    msg = str(ei.value)
    assert "no credentials to sign it with; credentials used: none: botocore's chain found no credentials" in msg
    assert "anon=True for a public bucket" in msg


def test_s3_404s_say_whether_the_bucket_or_the_key_is_missing(refuser, aws_env):
    store = _s3(refuser, key=KEY_ID, secret=SECRET)
    refuser.s3(404, "NoSuchBucket", "The specified bucket does not exist")
    with pytest.raises(StorageError, match=r"bucket does not exist \(S3 GetObject: NoSuchBucket\); create it "
                                           r"first: ckptstore never creates buckets") as ei:
        store.get("config.json")
    assert not isinstance(ei.value, ObjectNotFoundError)  # never an empty repository
    refuser.s3(404, "NoSuchKey", "The specified key does not exist.")
    with pytest.raises(ObjectNotFoundError, match=r"no such object \(the bucket exists\) \(S3 GetObject: NoSuchKey\)"):
        store.get("config.json")


def test_the_cli_prints_the_refusal_and_its_source_on_one_line(refuser, aws_env, monkeypatch, capsys):
    refuser.s3(403, "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records.")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.delenv("CKPTSTORE_DEBUG", raising=False)
    assert cli(["ls", "s3://bucket/runs/exp1", "-o", f"endpoint_url={refuser.url}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the store refused the credentials" in err[0], err
    assert "credentials used: environment variables AWS_ACCESS_KEY_ID" in err[0] and SECRET not in err[0]


def test_gcs_says_the_credentials_were_refused_and_which(refuser):
    body = json.dumps({"error": {"code": 403, "message": "anonymous caller does not have storage.objects.get access",
                                 "errors": [{"reason": "forbidden"}]}}).encode()
    refuser.answer = (403, {"Content-Type": "application/json"}, body)
    store = open_store("gs://bucket/runs/exp1", {"endpoint_url": refuser.url, "token": "anon", "tries": 1})
    with pytest.raises(CredentialsRefusedError) as ei:
        store.get("config.json")
    msg = str(ei.value)
    assert "GCS objects.get failed (403: anonymous caller does not have storage.objects.get access): the store " \
           "refused the credentials" in msg, msg
    assert msg.endswith("credentials used: none: anonymous (storage option token='anon')")


def test_gcs_and_azure_credential_sources_name_options_and_variables_never_secrets(tmp_path):
    sa = tmp_path / "sa.json"
    sa.write_text("{}")
    assert gcs_source(str(sa), environ={}) == f"the credentials file {sa} (storage option token)"
    assert gcs_source(None, environ={"GOOGLE_APPLICATION_CREDENTIALS": "/k.json"}) == (
        "application-default credentials (GOOGLE_APPLICATION_CREDENTIALS=/k.json)")
    assert gcs_source("ya29.secret-token", environ={}) == "the access token given as storage option token"
    assert gcs_source({"type": "service_account", "client_email": "ci@p.iam", "private_key": "PK"}, environ={}) == (
        "the service_account given as storage option token (a dict), ci@p.iam")
    env = {"AZURE_STORAGE_ACCOUNT_NAME": "acct", "AZURE_STORAGE_ACCOUNT_KEY": "S3CR3T=="}
    assert azure_source({}, env) == "account acct's key (AZURE_STORAGE_ACCOUNT_KEY)"
    assert azure_source({"account_name": "a", "sas_token": "sv=1&sig=S3CR3T"}, {}) == (
        "a SAS token for account a (storage option sas_token)")
    assert azure_source({"connection_string": "AccountKey=S3CR3T"}, {}) == (
        "a connection string (storage option connection_string)")
    assert azure_source({"account_name": "a"}, {}).startswith("DefaultAzureCredential")


def test_azure_says_the_credentials_were_refused_and_which(refuser):
    body = (b"<?xml version='1.0' encoding='utf-8'?><Error><Code>AuthenticationFailed</Code><Message>Server "
            b"failed to authenticate the request.</Message></Error>")
    refuser.answer = (403, {"Content-Type": "application/xml", "x-ms-error-code": "AuthenticationFailed"}, body)
    key = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
    conn = f"DefaultEndpointsProtocol=http;AccountName=acct;AccountKey={key};BlobEndpoint={refuser.url}/acct;"
    store = open_store("az://container/runs/exp1", {"connection_string": conn})
    with pytest.raises(CredentialsRefusedError) as ei:
        store.get("config.json")
    msg = str(ei.value)
    assert "the store refused the credentials" in msg and "AuthenticationFailed" in msg, msg
    assert msg.endswith("credentials used: a connection string (storage option connection_string)")
    assert key not in msg
