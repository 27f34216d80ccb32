"""AzureStore on Azurite: the conformance suite, conditional create and block
uploads on the wire, error mapping, secrets, repository round trips, and
``cp`` between S3 (moto), GCS (emulator) and Azure (Azurite)."""

from __future__ import annotations


import socket
import threading
import time
import uuid

import pytest
import torch

import ckptstore
from ckptstore.errors import (
    CredentialsRefusedError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    TransientStorageError,
)
from ckptstore.repo.repository import Repository
from ckptstore.storage import open_store
from ckptstore.storage.azure import AzureStore, block_id, classify_error
from ckptstore.storage.base import MiB
from ckptstore.testing.azurite import ACCOUNT, ACCOUNT_KEY, Azurite
from ckptstore.testing.store_suite import PART, StoreConformance, payload

from .helpers import SMALL, all_dtypes, assert_tree_equal, bits_equal, random_tensor, use_in_forked_child

pytestmark = pytest.mark.slow  # starts Azurite (a Node.js process)


@pytest.fixture(scope="session")
def azurite():
    """One Azurite blob service on a free loopback port for the whole session."""
    with Azurite() as az:
        yield az


@pytest.fixture
def az(azurite):
    """A fresh container; yields a store factory (``make(path)``, path relative to the container)."""
    container = f"t{uuid.uuid4().hex[:20]}"
    azurite.create_container(container)
    stores = []

    def make(path: str = "repo", **extra) -> AzureStore:
        s = AzureStore(f"{container}/{path}".rstrip("/"), {**azurite.storage_options(), **extra})
        stores.append(s)
        return s

    make.container = container
    make.azurite = azurite
    make.url = f"az://{container}/repo"
    yield make
    for s in stores:
        s.close()
    azurite.delete_container(container)


class TestAzureStore(StoreConformance):
    @pytest.fixture
    def store(self, az):
        return az()

    @pytest.fixture
    def sibling_store(self, az):
        # A sibling whose prefix extends ours as a string.
        return az("repo2")

    def test_url_and_repr(self, az):
        s = az()
        assert s.url == f"az://{az.container}/repo" and repr(s) == f"AzureStore('az://{az.container}/repo')"
        assert AzureStore(f"abfs://{az.container}/a/b/").prefix == "a/b"
        assert AzureStore(f"az://{az.container}").url == f"az://{az.container}"

    def test_container_root_sees_prefixed_keys(self, az):
        az().put("a/b", b"x")
        root = az("")
        assert [o.key for o in root.list()] == ["repo/a/b"]
        assert root.get("repo/a/b") == b"x"

    def test_staged_blocks_are_invisible_until_the_block_list_commits(self, az):
        s = az()
        mpu = s.create_multipart("packs/p", PART)
        mpu.upload_part(2, b"tail")
        mpu.upload_part(1, payload(PART, 1))
        marker = f"repo/.uploads/packs/p/{mpu.upload_id}"
        # Committed blobs: only the upload's marker (hidden from list()).
        assert az.azurite.blob_names(az.container) == [marker]
        assert list(s.list()) == [] and not s.exists("packs/p")
        # The staged blocks sit on the destination blob, uncommitted.
        assert "repo/packs/p" in az.azurite.blob_names(az.container, uncommitted=True)
        blocks = az.azurite.client().get_blob_client(az.container, "repo/packs/p").get_block_list("uncommitted")[1]
        assert sorted(b.id for b in blocks) == sorted([block_id(mpu.upload_id, 1), block_id(mpu.upload_id, 2)])
        assert len({len(b.id) for b in blocks}) == 1  # Azure wants one id length per blob
        with pytest.raises(ValueError, match="reserved"):
            s.get(".uploads/packs/p/" + mpu.upload_id)
        mpu.complete(2)
        assert az.azurite.blob_names(az.container) == ["repo/packs/p"]  # marker deleted
        assert s.get("packs/p") == payload(PART, 1) + b"tail"

    def test_abort_drops_staged_blocks_and_marker(self, az):
        s = az()
        mpu = s.create_multipart("packs/x", PART)
        mpu.upload_part(1, payload(PART))
        mpu.abort()
        assert az.azurite.blob_names(az.container, uncommitted=True) == []

    def test_abort_of_a_leftover_marker_never_deletes_the_committed_object(self, az):
        """A marker left after a successful commit (its delete failed) is aborted
        by GC later: the committed object must survive that."""
        s = az()
        mpu = s.create_multipart("packs/kept", PART)
        mpu.upload_part(1, b"data")
        mpu.complete(1)
        s._upload(s._marker("packs/kept", mpu.upload_id), b"{}", None)
        assert [m.upload_id for m in s.list_multipart()] == [mpu.upload_id]
        s.abort_multipart("packs/kept", mpu.upload_id)
        assert s.list_multipart() == [] and s.get("packs/kept") == b"data"
        with pytest.raises(ValueError):
            s.abort_multipart("packs/kept", "../../x")


# ---------------------------------------------------------------- on the wire
def _spy(store: AzureStore, seen: list):
    def hook(request):
        r = request.http_request
        seen.append((r.method, r.url.split("?")[0].rsplit("/", 1)[-1], r.url, dict(r.headers)))

    store._req["raw_request_hook"] = hook


def test_put_if_absent_sends_if_none_match_star(az):
    s = az()
    seen: list = []
    _spy(s, seen)
    s.put_if_absent("m", b"1")
    s.put("n", b"1")
    (m1, n1, _, h1), (m2, n2, _, h2) = seen
    assert (m1, n1, m2, n2) == ("PUT", "m", "PUT", "n")
    assert h1.get("If-None-Match") == "*" and "If-None-Match" not in h2
    with pytest.raises(ObjectExistsError, match=rf"az://{az.container}/repo/m"):
        s.put_if_absent("m", b"2")
    assert s.get("m") == b"1"


def test_block_upload_is_put_block_then_one_put_block_list(az):
    s = az()
    mpu = s.create_multipart("packs/w", PART)
    seen: list = []
    _spy(s, seen)
    mpu.upload_part(1, payload(PART))
    mpu.upload_part(2, b"end")
    mpu.complete(2)
    comps = [u.split("comp=")[1].split("&")[0] for m, _, u, _ in seen if "comp=" in u and m == "PUT"]
    assert comps == ["block", "block", "blocklist"]
    assert s.head("packs/w").size == PART + 3


def test_requests_carry_timeouts_and_no_sdk_retries(az):
    s = az()
    assert s._req["retry_total"] == 0
    assert s._req["connection_timeout"] > 0 and s._req["read_timeout"] > 0
    t = az(connection_timeout=3, read_timeout=4)
    assert (t._req["connection_timeout"], t._req["read_timeout"]) == (3.0, 4.0)


class _Server:
    """A TCP server on 127.0.0.1 handing each connection to ``answer(conn)`` on a thread, then closing it."""

    def __init__(self, answer=lambda conn: None):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted: list = []
        self.answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(1)  # before the close the client waits for
            try:
                self.answer(c)
            except OSError:
                pass
            finally:
                c.close()

    def connection_string(self, azurite) -> str:
        return azurite.connection_string.replace(azurite.endpoint, f"http://127.0.0.1:{self.port}/{ACCOUNT}")

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self.sock.close()


def _read_request(conn) -> bytes:
    got = b""
    while b"\r\n\r\n" not in got:
        more = conn.recv(65536)
        if not more:
            break
        got += more
    return got


def test_a_dead_server_is_one_attempt_then_transient(azurite):
    """Against a port that accepts and closes at once, one call is one attempt
    of the SDK's pipeline (its own retries are off, and so are urllib3's
    under requests) and fails as transient."""
    srv = _Server()
    s = AzureStore("ctr/x", {"connection_string": srv.connection_string(azurite)})
    attempts: list = []
    s._req["raw_request_hook"] = lambda request: attempts.append(request.http_request.method)
    try:
        with pytest.raises(TransientStorageError) as ei:
            s.head("k")
        assert attempts == ["HEAD"] and len(srv.accepted) == 1
        assert "az://ctr/x/k" in str(ei.value) and ACCOUNT_KEY not in str(ei.value)
    finally:
        s.close()
        srv.close()


def test_a_body_cut_short_is_transient_after_one_request(azurite):
    """An answer whose body stops before its Content-Length: TransientStorageError,
    whichever way the body is read, after one request (no hidden resend)."""

    def cut(conn):
        _read_request(conn)
        conn.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 100\r\nContent-Range: bytes 0-99/1000\r\n"
                     b"x-ms-blob-type: BlockBlob\r\n\r\n" + b"x" * 40)

    srv = _Server(cut)
    s = AzureStore("ctr/x", {"connection_string": srv.connection_string(azurite)})
    try:
        seen: list = []
        with pytest.raises(TransientStorageError, match="az://ctr/x/k"):
            s.read_range_into("k", 0, bytearray(100), seen.append)
        assert len(srv.accepted) == 1 and all(n <= 40 for n in seen)
        with pytest.raises(TransientStorageError, match="az://ctr/x/k"):
            s.get_ranges("k", [(0, 100)])
        with pytest.raises(TransientStorageError, match="az://ctr/x/k"):
            s.get("k")
        assert len(srv.accepted) == 3
    finally:
        s.close()
        srv.close()


def test_read_range_into_streams_one_request_into_the_buffer(az):
    """One ranged Get Blob, its body read into the caller's buffer piece by
    piece, progress reported as the pieces arrive (the default would read
    the range whole, then report once)."""
    s = az()
    data = payload(3 * MiB + 5, seed=3)
    s.put("r", data)
    seen: list = []
    _spy(s, seen)
    out = bytearray(3 * MiB)
    progress: list = []
    s.read_range_into("r", 5, out, progress.append)
    assert bytes(out) == data[5 : 5 + len(out)]
    assert [(m, h.get("x-ms-range")) for m, _, _, h in seen] == [("GET", f"bytes=5-{5 + len(out) - 1}")]
    assert len(progress) > 1 and progress[-1] == len(out)
    assert all(a < b for a, b in zip(progress, progress[1:])), progress
    # Running past the end: ValueError from the headers, before any byte is reported.
    progress.clear()
    with pytest.raises(ValueError, match="past end"):
        s.read_range_into("r", len(data) - 10, bytearray(20), progress.append)
    assert progress == []


def test_a_forked_child_uses_the_store_with_a_client_of_its_own(az):
    """Connection pools do not cross fork: a child of a process that used the
    store makes its own client on first use, reads and writes; the parent's
    client goes on."""
    store = az()
    store.put("k", b"value")  # the parent's client holds a pooled connection
    parent = store._client()
    assert use_in_forked_child(store, lambda s: s._client()) == b"value from the child value own"
    assert store._client() is parent and store.get("child") == b"from the child"


def _pool_size(store: AzureStore) -> int:
    return store._client().session.get_adapter("http://127.0.0.1/").poolmanager.connection_pool_kw["maxsize"]


def test_the_connection_pool_keeps_every_concurrent_connection(az, caplog):
    """The session keeps at least max_concurrency connections (requests' own
    default, 10, closed the others after each request)."""
    import logging

    from ckptstore.storage._azure_client import POOL_CONNECTIONS

    assert _pool_size(az()) == POOL_CONNECTIONS >= 16
    wide = AzureStore(f"{az.container}/repo", az.azurite.storage_options(), max_concurrency=POOL_CONNECTIONS + 16)
    try:
        assert _pool_size(wide) == POOL_CONNECTIONS + 16
        data = payload(64 * 64 * 1024, seed=4)
        wide.put("r", data)
        ranges = [(i * 65536, (i + 1) * 65536) for i in range(64)]
        with caplog.at_level(logging.WARNING, logger="urllib3.connectionpool"):
            assert b"".join(wide.get_ranges("r", ranges)) == data
        assert not [r for r in caplog.records if "pool is full" in r.getMessage()]
    finally:
        wide.close()


def test_proxies_come_from_the_environment_and_netrc_never(az, monkeypatch, tmp_path):
    """As the asynchronous client's session before: HTTP_PROXY is used unless
    NO_PROXY names the host (read when the client is made); a ~/.netrc login
    never replaces the SDK's signature."""
    for var in ("http_proxy", "HTTP_PROXY", "no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    proxy = _Server()
    try:
        s = az()
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
        with pytest.raises(TransientStorageError):
            s.head("k")
        assert len(proxy.accepted) == 1
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        s.close()  # the next client reads the environment again
        s.put("k", b"v")
        assert len(proxy.accepted) == 1
    finally:
        proxy.close()
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login someone password not-the-key\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    s.close()
    assert s.get("k") == b"v"


# ---------------------------------------------------------------- account and credentials
@pytest.fixture
def no_azure_env(monkeypatch):
    """No AZURE_STORAGE_* variable set: each test sets the ones it means."""
    from ckptstore.storage._azure_client import ENVIRONMENT

    for var in (*ENVIRONMENT.values(), "AZURE_STORAGE_ANON"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_resolve_account_follows_the_azure_conventions():
    from ckptstore.storage._azure_client import resolve_account as r

    key, sas = "a2V5a2V5", "sv=1&sig=c2ln"
    assert r({"connection_string": "C", "account_name": "x", "account_key": key}, {}).connection_string == "C"
    assert r({"account_name": "x"}, {"AZURE_STORAGE_CONNECTION_STRING": "C"}).connection_string == "C"
    acct = r({"account_name": "acct", "account_key": key, "sas_token": sas}, {})
    assert (acct.url, acct.credential) == ("https://acct.blob.core.windows.net",
                                           {"account_name": "acct", "account_key": key})
    mine = object()
    assert r({"account_name": "acct", "account_key": key, "credential": mine}, {}).credential is mine
    for opts, env in (({"account_name": "acct", "sas_token": "?" + sas}, {}),
                      ({}, {"AZURE_STORAGE_ACCOUNT_NAME": "acct", "AZURE_STORAGE_SAS_TOKEN": sas})):
        acct = r(opts, env)
        assert (acct.url, acct.credential, acct.default) == (f"https://acct.blob.core.windows.net?{sas}", None, False)
    sp = {"client_id": "cid", "client_secret": "csecret", "tenant_id": "tid"}
    assert r({"account_name": "acct", **sp}, {}).principal == ("tid", "cid", "csecret")
    env_sp = {f"AZURE_STORAGE_{k.upper()}": v for k, v in sp.items()}
    assert r({"account_name": "acct"}, env_sp).principal == ("tid", "cid", "csecret")
    assert r({"account_name": "acct", "account_key": key}, env_sp).principal is None  # a key comes first
    for opts, env in (({"account_name": "acct", "anon": True}, {}),
                      ({"account_name": "acct"}, {"AZURE_STORAGE_ANON": "true"})):
        acct = r(opts, env)
        assert (acct.url, acct.credential, acct.principal, acct.default) == (
            "https://acct.blob.core.windows.net", None, None, False)
    assert r({"account_name": "acct"}, {"AZURE_STORAGE_ANON": "false"}).default
    assert r({"account_name": "acct", "anon": False}, {"AZURE_STORAGE_ANON": "1"}).default
    assert r({"account_name": "a", "account_host": "a.blob.core.chinacloudapi.cn"}, {}).url == \
        "https://a.blob.core.chinacloudapi.cn"
    assert r({"account_name": "a", "account_host": "http://127.0.0.1:1/a"}, {}).url == "http://127.0.0.1:1/a"
    with pytest.raises(ValueError, match=r"\['client_secret', 'tenant_id'\] not given") as ei:
        r({"account_name": "acct", "client_id": "cid"}, {})
    assert "AZURE_STORAGE_CLIENT_SECRET" in str(ei.value)
    with pytest.raises(ValueError, match="connection_string, or account_name"):
        r({"account_key": key, "anon": True}, {})
    assert repr(r({"account_name": "acct", "account_key": key}, {})).count(key) == 0


class _Credential:
    """Stands in for an azure.identity credential: records how it was made; asked for no token."""

    def __init__(self, **kwargs):
        self.kwargs, self.closed = kwargs, False

    def get_token(self, *args, **kwargs):
        raise AssertionError("no request is sent, so no token is asked for")

    def close(self):
        self.closed = True


def test_each_credential_route_builds_its_client(no_azure_env):
    """The client each route builds, seen without a request: its URL and credential."""
    import azure.identity

    monkeypatch = no_azure_env
    monkeypatch.setattr(azure.identity, "ClientSecretCredential", _Credential)
    monkeypatch.setattr(azure.identity, "DefaultAzureCredential", _Credential)
    key = ACCOUNT_KEY

    def built(opts: dict):
        s = AzureStore("ckpt/x", opts)
        return s, s._client().service

    conn = (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={key};"
            f"BlobEndpoint=http://127.0.0.1:9/{ACCOUNT};")
    s, svc = built({"connection_string": conn, "account_name": "other", "sas_token": "sv=1&sig=x"})
    assert (svc.account_name, svc.url, svc.credential.account_key) == (ACCOUNT, f"http://127.0.0.1:9/{ACCOUNT}/", key)
    s, svc = built({"account_name": "acct", "account_key": key})
    assert (svc.url, svc.credential.account_name, svc.credential.account_key) == (
        "https://acct.blob.core.windows.net/", "acct", key)
    s, svc = built({"account_name": "acct", "sas_token": "sv=1&sig=c2ln"})
    assert (svc.url, svc.credential) == ("https://acct.blob.core.windows.net/?sv=1&sig=c2ln", None)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "envacct")
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", "?sv=2&sig=ZW52")
    s, svc = built({})
    assert (svc.url, svc.credential) == ("https://envacct.blob.core.windows.net/?sv=2&sig=ZW52", None)
    monkeypatch.delenv("AZURE_STORAGE_SAS_TOKEN")
    s, svc = built({"anon": True})
    assert (svc.url, svc.credential) == ("https://envacct.blob.core.windows.net/", None)
    mine = _Credential()
    s, svc = built({"credential": mine, "account_key": key})
    assert svc.credential is mine
    s.close()
    assert not mine.closed  # the caller's credential stays theirs
    s, svc = built({"client_id": "cid", "client_secret": "csecret", "tenant_id": "tid"})
    assert isinstance(svc.credential, _Credential)
    assert svc.credential.kwargs == {"tenant_id": "tid", "client_id": "cid", "client_secret": "csecret"}
    made = svc.credential
    s.close()
    assert made.closed  # the store's own: closed with its client
    assert s._client().service.credential is not made  # a later call makes new ones
    s.close()
    s, svc = built({})  # no credential, not anonymous: the default chain
    assert isinstance(svc.credential, _Credential) and svc.credential.kwargs == {}
    s.close()


def test_a_service_principal_builds_a_client_secret_credential(no_azure_env):
    from azure.identity import ClientSecretCredential

    s = AzureStore("ckpt/x", {"account_name": "acct", "client_id": "cid", "client_secret": "csecret",
                              "tenant_id": "00000000-0000-0000-0000-000000000000"})
    try:
        assert isinstance(s._client().service.credential, ClientSecretCredential)
    finally:
        s.close()


def test_azure_identity_missing_names_the_extra(no_azure_env):
    no_azure_env.setitem(__import__("sys").modules, "azure.identity", None)
    s = AzureStore("ckpt/x", {"account_name": "acct"})
    with pytest.raises(ImportError, match=r"pip install 'ckptstore\[azure\]'"):
        s.head("k")
    # ...while routes that need no azure.identity are unaffected.
    assert AzureStore("ckpt/x", {"account_name": "acct", "anon": True})._client().service.credential is None


def test_unknown_options_are_refused_by_name():
    with pytest.raises(ValueError) as ei:
        AzureStore("ckpt/x", {"acount_name": "acct", "skip_instance_cache": True})
    text = str(ei.value)
    assert "'acount_name'" in text and "'skip_instance_cache'" in text and "'account_name'" in text
    with pytest.raises(ValueError, match="acount_name"):
        open_store("az://ckpt/x", {"acount_name": "acct"})


def test_a_missing_account_or_principal_part_says_what_to_pass(no_azure_env):
    s = AzureStore("ckpt/x", {"account_key": ACCOUNT_KEY})
    with pytest.raises(StorageError, match="pass connection_string, or account_name") as ei:
        s.head("k")
    assert ACCOUNT_KEY not in str(ei.value)
    no_azure_env.setenv("AZURE_STORAGE_CLIENT_SECRET", "the-client-secret")
    s = AzureStore("ckpt/x", {"account_name": "acct", "client_id": "cid"})
    with pytest.raises(StorageError, match=r"\['tenant_id'\] not given") as ei:
        s.head("k")
    assert "the-client-secret" not in str(ei.value)


def _container_sas(az) -> str:
    import datetime

    from azure.storage.blob import generate_container_sas

    expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)
    return generate_container_sas(ACCOUNT, az.container, ACCOUNT_KEY, permission="racwdl", expiry=expiry)


def test_account_key_and_sas_routes_reach_azurite(az, no_azure_env):
    """account_name with a key, with a SAS token (option, then environment),
    at an account_host written with its http:// scheme: put, get, list."""
    host = az.azurite.endpoint  # http://127.0.0.1:<port>/devstoreaccount1
    sas = _container_sas(az)
    stores = [az(account_name=ACCOUNT, account_key=ACCOUNT_KEY, account_host=host, connection_string=None)]
    stores.append(az(account_name=ACCOUNT, sas_token=sas, account_host=host, connection_string=None))
    no_azure_env.setenv("AZURE_STORAGE_ACCOUNT_NAME", ACCOUNT)
    no_azure_env.setenv("AZURE_STORAGE_SAS_TOKEN", sas)
    stores.append(az(account_host=host, connection_string=None))
    for i, s in enumerate(stores):
        s.put(f"k{i}", b"v%d" % i)
        assert s.get(f"k{i}") == b"v%d" % i and f"k{i}" in [o.key for o in s.list()]
    assert "sig=" not in repr(stores[1]) and "sig=" not in stores[1].url


# ---------------------------------------------------------------- errors
def _http_error(cls_name: str, status: int, code: str):
    import azure.core.exceptions as ace

    e = getattr(ace, cls_name)(message=f"{code} happened")
    e.status_code = status
    e.error_code = code
    return e


@pytest.mark.parametrize(
    "cls,status,code,expected",
    [
        ("ResourceExistsError", 409, "BlobAlreadyExists", ObjectExistsError),
        ("ResourceModifiedError", 412, "ConditionNotMet", ObjectExistsError),
        ("ResourceNotFoundError", 404, "BlobNotFound", ObjectNotFoundError),
        ("ResourceNotFoundError", 404, "ContainerNotFound", StorageError),
        ("HttpResponseError", 503, "ServerBusy", TransientStorageError),
        ("HttpResponseError", 500, "InternalError", TransientStorageError),
        ("HttpResponseError", 500, "OperationTimedOut", TransientStorageError),
        ("HttpResponseError", 429, "", TransientStorageError),
        ("HttpResponseError", 408, "", TransientStorageError),
        ("ClientAuthenticationError", 403, "AuthenticationFailed", CredentialsRefusedError),  # a StorageError
        ("HttpResponseError", 400, "InvalidHeaderValue", StorageError),
    ],
)
def test_classify_on_create(cls, status, code, expected):
    err = classify_error(_http_error(cls, status, code), "az://c/p/k", "PutBlob", exists_on_conflict=True)
    assert type(err) is expected and "az://c/p/k" in str(err)


def test_conflict_is_exists_only_for_a_create():
    e = _http_error("ResourceModifiedError", 412, "ConditionNotMet")
    assert type(classify_error(e, "az://c/k", "PutBlob")) is StorageError
    e = _http_error("ResourceExistsError", 409, "BlobAlreadyExists")
    assert type(classify_error(e, "az://c/k", "PutBlob")) is StorageError


def test_classify_network_failures():
    import http.client

    import requests
    import urllib3
    from azure.core.exceptions import IncompleteReadError, ServiceRequestError, ServiceResponseError

    cut = IncompleteReadError(message="cut")
    cut.status_code = 206  # the status of the answer whose body was cut
    # ...and below the SDK, from bodies the store reads itself (requests, urllib3, http.client).
    below = (requests.exceptions.ConnectionError("x"), requests.exceptions.ChunkedEncodingError("x"),
             requests.exceptions.ReadTimeout("x"), urllib3.exceptions.ProtocolError("Connection broken"),
             urllib3.exceptions.ReadTimeoutError(None, "/c/k", "timed out"), http.client.IncompleteRead(b"ab", 5))
    for exc in (ServiceRequestError("refused"), ServiceResponseError("reset"), IncompleteReadError(message="cut"), cut,
                ConnectionResetError(), TimeoutError(), *below):
        assert type(classify_error(exc, "az://c", "GetBlob")) is TransientStorageError, exc
    assert type(classify_error(FileNotFoundError("x"), "az://c/k", "GetBlob")) is ObjectNotFoundError


def test_missing_container_is_not_an_empty_store(azurite):
    s = AzureStore("no-such-container/repo", azurite.storage_options())
    try:
        for call in (lambda: list(s.list()), s.list_multipart, lambda: s.get("k"), lambda: s.put("k", b"x")):
            with pytest.raises(StorageError, match="container does not exist") as ei:
                call()
            assert not isinstance(ei.value, ObjectNotFoundError)
    finally:
        s.close()


def test_secrets_never_appear_in_messages_or_reprs(azurite, monkeypatch):
    wrong_key = "V3J" + "x" * 60 + "=="
    conn = azurite.connection_string.replace(ACCOUNT_KEY, wrong_key)
    sas = "sv=2024-01-01&sp=r&sig=SeCrEtSiGnAtUrE123%3D"
    for opts in ({"connection_string": conn}, {"account_name": ACCOUNT, "account_key": wrong_key,
                                              "account_host": azurite.endpoint.removeprefix("http://")}):
        s = AzureStore("ckpt/repo", opts)
        try:
            with pytest.raises(StorageError) as ei:
                s.head("k")
            text = str(ei.value) + repr(s) + s.url
            assert wrong_key not in text and "az://ckpt/repo/k" in str(ei.value), text
        finally:
            s.close()
    # Secrets taken from the environment are scrubbed too.
    from ckptstore.storage.azure import _secrets_of as secrets_of

    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", wrong_key)
    assert wrong_key in secrets_of({"account_name": ACCOUNT})
    # A malformed connection string is never quoted back.
    s = AzureStore("ckpt/repo", {"connection_string": f"AccountKey={wrong_key};Garbage"})
    with pytest.raises(StorageError) as ei:
        s.head("k")
    assert wrong_key not in str(ei.value)
    # SAS signatures are scrubbed from any message.
    from ckptstore.storage.azure import _scrub_text, _secrets_of

    msg = _scrub_text(f"GET https://a.blob.core.windows.net/c/k?{sas} failed", _secrets_of({"sas_token": sas}))
    assert "SeCrEtSiGnAtUrE" not in msg
    # ...and a signature nobody declared (a SAS inside some URL) too.
    assert _scrub_text(f"url?{sas}", ()) == "url?sv=2024-01-01&sp=r&sig=***"


def test_constructor_makes_no_request_and_refuses_bad_paths():
    s = AzureStore("az://some-container/x", {"account_name": "nobody", "anon": True})
    assert s._clients[2] == []
    for bad in ("az://c/x", "az://UPPER/x", "az://ctr@account.dfs.core.windows.net/x", "az://a--b/x"):
        with pytest.raises(ValueError) as ei:
            AzureStore(bad)
        assert "account.dfs" not in str(ei.value)


# ---------------------------------------------------------------- open_store / repository
@pytest.mark.parametrize("scheme", ["az", "abfs", "abfss"])
def test_open_store_azure(az, scheme):
    s = open_store(f"{scheme}://{az.container}/runs/exp1/", az.azurite.storage_options())
    try:
        assert isinstance(s, AzureStore) and s.url == f"az://{az.container}/runs/exp1"
        s.put("k", b"v")
        assert az("").get("runs/exp1/k") == b"v"
    finally:
        s.close()
    for bad in (f"{scheme}://", f"{scheme}:///x", f"{scheme}://ctr/x?sig=abc", f"{scheme}://u:p@ctr/x"):
        with pytest.raises(ValueError) as ei:
            open_store(bad)
        assert "sig=abc" not in str(ei.value) and "u:p" not in str(ei.value)


def test_importing_storage_does_not_import_the_azure_sdk():
    import subprocess
    import sys

    code = ("import sys, ckptstore.storage; "
            "print(*(m in sys.modules for m in ('azure.storage.blob', 'ckptstore.storage.azure', 'adlfs')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]


def _state(seed: int = 0) -> dict:
    sd = {
        f"t_{str(dt).split('.')[-1]}": random_tensor(dt, (17, 33), seed=seed + i)
        for i, dt in enumerate(all_dtypes())
    }
    sd["big"] = random_tensor(torch.float32, (256, 1024), seed=seed + 99)  # 1 MiB: several chunks
    sd["scalar"] = torch.tensor(3.5)
    sd["empty"] = torch.zeros(0, 4)
    sd["meta"] = {"lr": 0.1, "name": "run", "steps": [1, 2]}
    return sd


def test_repository_roundtrip_dedup_and_slice(az):
    opts = az.azurite.storage_options()
    repo = ckptstore.open(az.url, storage_options=opts, **SMALL)
    sd = _state()
    info = repo.save(sd, step=1)
    assert info.uploaded_bytes > 0
    assert_tree_equal(repo.load(1), sd)
    sd2 = dict(sd)
    sd2["t_float32"] = random_tensor(torch.float32, (17, 33), seed=1234)
    info2 = repo.save(sd2, step=2)
    assert info2.reused_bytes >= sd["big"].numel() * 4
    assert info2.new_bytes < info.new_bytes / 4
    repo2 = ckptstore.open(az.url, storage_options=opts, **SMALL)
    assert repo2.steps() == [1, 2]
    got = repo2.checkpoint(2).read("big", index=(slice(10, 20), slice(100, 300)))
    assert bits_equal(got, sd["big"][10:20, 100:300])
    assert_tree_equal(repo2.load(2), sd2)
    # A second writer of step 2 loses cleanly; the winner's data stays.
    with pytest.raises(FileExistsError):
        repo2.save(_state(7), step=2)
    assert_tree_equal(repo.load(2), sd2)
    assert repo2.verify(read_data=True).ok
    repo.close()
    repo2.close()


def test_repository_multipart_packs_and_gc(az):
    """Packs over the part size go up as staged blocks; GC deletes what the
    retention drops and leaves no marker or staged block behind."""
    repo = ckptstore.open(az.url, storage_options=az.azurite.storage_options(),
                          chunk_size=1 * MiB, pack_size=12 * MiB, part_size=5 * MiB)
    sd = {"w": random_tensor(torch.uint8, (11 * MiB,), seed=5)}
    repo.save(sd, step=1)
    sd2 = {"w": random_tensor(torch.uint8, (11 * MiB,), seed=6)}
    repo.save(sd2, step=2)
    assert_tree_equal(repo.load(1), sd)
    raw = az()
    assert raw.list_multipart() == []
    assert not any("/.uploads/" in n for n in az.azurite.blob_names(az.container, uncommitted=True))
    # A crashed saver's upload: a marker and staged blocks, no object.
    left = raw.create_multipart("packs/00/" + "0" * 32 + ".pack", 5 * MiB)
    left.upload_part(1, payload(5 * MiB, 9))
    packs_before = {o.key for o in raw.list("packs/")}
    ahead = repo.grace() + 60
    plan = repo.plan_gc(keep_last=1, clock=lambda: time.time() + ahead)
    assert list(plan.delete_steps) == [1]
    assert [u.upload_id for u in plan.abort_uploads] == [left.upload_id]
    res = plan.execute()
    assert res.deleted_steps == [1] and res.aborted_uploads == 1
    assert {o.key for o in raw.list("packs/")} < packs_before
    assert raw.list_multipart() == []
    assert not any("/.uploads/" in n or n.endswith("0" * 32 + ".pack")
                   for n in az.azurite.blob_names(az.container, uncommitted=True))
    assert repo.verify(read_data=True).ok
    assert_tree_equal(repo.load(2), sd2)
    repo.close()


def test_cli_accepts_az_urls(az, capsys, monkeypatch):
    from ckptstore.cli.main import main

    repo = ckptstore.open(az.url, storage_options=az.azurite.storage_options(), **SMALL)
    repo.save({"w": torch.arange(10.0)}, step=3)
    repo.close()
    # The connection string through the Azure convention, never on the command line.
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", az.azurite.connection_string)
    assert main(["ls", az.url, "--json"]) == 0
    out = capsys.readouterr().out
    assert '"step": 3' in out.replace(" ", " ") or '"step":3' in out.replace(" ", "")
    assert ACCOUNT_KEY not in out
    assert main(["verify", az.url, "--read-data"]) == 0


# ---------------------------------------------------------------- cp between clouds
@pytest.fixture
def gcs_store():
    pytest.importorskip("gcp_storage_emulator")
    from ckptstore.storage.gcs import GCSStore
    from ckptstore.testing.gcs_emulator import GCSEmulator

    with GCSEmulator() as em:
        em.create_bucket("ckpt-az-cp")
        s = GCSStore("ckpt-az-cp/repo", em.storage_options())
        yield s
        s.close()


def test_cp_between_s3_gcs_and_azure(s3, az, gcs_store):
    """S3 (moto) -> Azure (Azurite) -> GCS (emulator), then GCS -> Azure
    elsewhere: every copy verifies clean and loads bit-exact; unique chunks
    move once; a second copy moves nothing."""
    src = ckptstore.open(s3.url, storage_options=s3.storage_options, **SMALL)
    frozen = torch.randn(100_000)
    for step in (1, 2, 3):
        src.save({"frozen": frozen, "head": torch.randn(5_000) + step}, step=step)
    on_az = Repository(az(), **SMALL)
    result = src.copy_to(on_az)
    assert result.copied == [1, 2, 3]
    unique = {c.hash: c.stored_len for s in (1, 2, 3) for c in src.chunks(s)}
    assert result.chunks_copied == len(unique) and result.bytes_copied == sum(unique.values())
    on_gcs = Repository(gcs_store, **SMALL)
    assert on_az.copy_to(on_gcs).copied == [1, 2, 3]
    back = Repository(az("back"), **SMALL)
    assert on_gcs.copy_to(back, steps=[2, 3]).copied == [2, 3]
    for repo, steps in ((on_az, (1, 2, 3)), (on_gcs, (1, 2, 3)), (back, (2, 3))):
        assert repo.verify(read_data=True).ok
        for step in steps:
            a, b = src.load(step), repo.load(step)
            assert torch.equal(a["frozen"], b["frozen"]) and torch.equal(a["head"], b["head"])
    again = src.copy_to(on_az)
    assert again.copied == [] and again.bytes_copied == 0
    src.close()


def test_503_server_busy_lowers_the_process_request_rate_and_is_waited_out(az):
    """Azure's throttling answers (503 ServerBusy) reach the adaptive rate through the SDK's
    response hook and are waited out; the listing still finds the step."""
    from ckptstore.testing.azurite import ACCOUNT
    from ckptstore.testing.requestproxy import RequestProxy, match

    azurite = az.azurite
    upstream = azurite.endpoint.rsplit("/", 1)[0]
    with RequestProxy(upstream, classify=lambda m, k, q: m) as proxy:
        cs = azurite.connection_string.replace(azurite.endpoint, f"{proxy.endpoint('az')}/{ACCOUNT}")
        so = {"connection_string": cs}
        repo = ckptstore.open(az.url, storage_options=so)
        repo.save({"w": torch.arange(10.0)}, step=1)
        storm = proxy.fail(match(kind="GET"), count=3, status=503, code="ServerBusy", retry_after=0.05)
        again = ckptstore.open(az.url, storage_options=so)
        assert again.latest() == 1
        assert storm.fired == 3
        stats = again.store.throttle_stats()
        assert stats["throttled"] >= 3 and stats["enabled"]
        assert torch.equal(again.load(1)["w"], torch.arange(10.0))
