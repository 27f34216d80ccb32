"""GCSStore on gcp-storage-emulator: the conformance suite, conditional-create
proofs, error mapping, and repository round trips."""

from __future__ import annotations

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
from ckptstore.storage import open_store
from ckptstore.storage.base import MiB
from ckptstore.testing.store_suite import PART, StoreConformance, payload

from .helpers import SMALL, assert_tree_equal, random_tensor, use_in_forked_child

pytest.importorskip("google.auth")
pytest.importorskip("gcp_storage_emulator")

from ckptstore.storage.gcs import GCSHTTPError, GCSStore, classify_error, credentials, parse_timestamp
from ckptstore.testing.gcs_emulator import GCSEmulator

pytestmark = pytest.mark.slow  # the GCS emulator, the conformance suite over HTTP

BUCKET = "ckpt-gcs"


@pytest.fixture
def gcs(gcs_emulator):
    """A wiped emulator with one empty bucket; yields a store factory."""
    gcs_emulator.reset()
    gcs_emulator.create_bucket(BUCKET)
    stores = []

    def make(path: str = f"{BUCKET}/repo") -> GCSStore:
        s = GCSStore(path, gcs_emulator.storage_options())
        stores.append(s)
        return s

    make.emulator = gcs_emulator
    yield make
    for s in stores:
        s.close()


class TestGCSStore(StoreConformance):
    # After an abort the part objects are gone, so compose answers 404.
    complete_after_abort_raises = (ObjectNotFoundError,)

    @pytest.fixture
    def store(self, gcs):
        return gcs()

    @pytest.fixture
    def sibling_store(self, gcs):
        # A sibling whose prefix extends ours as a string.
        return gcs(f"{BUCKET}/repo2")

    def test_url_and_repr(self, gcs):
        s = gcs()
        assert s.url == f"gs://{BUCKET}/repo" and repr(s) == f"GCSStore('gs://{BUCKET}/repo')"
        assert gcs(f"gs://{BUCKET}").url == f"gs://{BUCKET}"
        assert gcs(f"gcs://{BUCKET}/a/b/").prefix == "a/b"

    def test_bucket_root_sees_prefixed_keys(self, gcs):
        gcs().put("a/b", b"x")
        root = gcs(BUCKET)
        assert [o.key for o in root.list()] == ["repo/a/b"]
        assert root.get("repo/a/b") == b"x"

    def test_mtime_has_subsecond_resolution(self, gcs):
        s = gcs()
        s.put("t", b"1")
        assert s.mtime_resolution == 0.001
        # The emulator writes µs, GCS ms: neither is whole seconds every time.
        mtimes = set()
        for i in range(3):
            s.put(f"t{i}", b"")
            mtimes.add(s.head(f"t{i}").mtime % 1)
        assert any(m != 0 for m in mtimes)

    def test_multipart_temporaries_live_under_uploads_prefix(self, gcs):
        s = gcs()
        mpu = s.create_multipart("packs/p", PART)
        mpu.upload_part(1, payload(PART, 1))
        mpu.upload_part(2, b"tail")
        names = gcs.emulator.object_names(BUCKET)
        prefix = f"repo/.uploads/packs/p/{mpu.upload_id}/"
        assert names == sorted([prefix + "part-00001", prefix + "part-00002", prefix + "upload"])
        assert list(s.list()) == []  # hidden from listings
        with pytest.raises(ValueError, match="reserved"):
            s.get(".uploads/packs/p")
        mpu.complete(2)
        # Temporaries deleted, only the object is left.
        assert gcs.emulator.object_names(BUCKET) == ["repo/packs/p"]
        assert s.get("packs/p") == payload(PART, 1) + b"tail"

    def test_abort_deletes_temporaries(self, gcs):
        s = gcs()
        mpu = s.create_multipart("packs/x", PART)
        mpu.upload_part(1, payload(PART))
        mpu.abort()
        assert gcs.emulator.object_names(BUCKET) == []

    def test_orphan_part_is_listed_and_aborted(self, gcs):
        """A part that lands after its marker is gone is still found by GC."""
        s = gcs()
        mpu = s.create_multipart("packs/o", PART)
        mpu.upload_part(1, b"x")
        s._delete_raw(f"repo/.uploads/packs/o/{mpu.upload_id}/upload")
        assert [(m.key, m.upload_id) for m in s.list_multipart()] == [("packs/o", mpu.upload_id)]
        s.abort_multipart("packs/o", mpu.upload_id)
        assert gcs.emulator.object_names(BUCKET) == []
        with pytest.raises(ValueError):
            s.abort_multipart("packs/o", "../../x")

    def test_compose_tree_over_32_parts(self, gcs, monkeypatch):
        """More than 32 parts compose in rounds (GCS's per-request limit)."""
        import ckptstore.storage.gcs as gcs_mod

        monkeypatch.setattr(gcs_mod, "MAX_COMPOSE", 4)
        s = gcs()
        parts = [payload(PART, i) for i in range(1, 10)] + [b"end"]
        mpu = s.create_multipart("packs/tree", PART)
        for n, p in enumerate(parts, 1):
            mpu.upload_part(n, p)
        calls = []
        orig = mpu._compose

        def spy(dest, sources):
            calls.append(len(sources))
            return orig(dest, sources)

        monkeypatch.setattr(mpu, "_compose", spy)
        mpu.complete(len(parts))
        assert sorted(calls) == [2, 3, 4, 4]  # 10 parts -> 3 intermediates (4+4+2) -> final
        assert s.get("packs/tree") == b"".join(parts)
        assert gcs.emulator.object_names(BUCKET) == ["repo/packs/tree"]


# ---------------------------------------------------------------- conditional create
def test_raw_emulator_ignores_if_generation_match():
    """Why GCSEmulator enforces preconditions itself: the emulator as shipped
    lets a second ``ifGenerationMatch=0`` create overwrite the object."""
    with GCSEmulator(enforce_preconditions=False) as em:
        em.create_bucket(BUCKET)
        s = GCSStore(f"{BUCKET}/r", em.storage_options())
        try:
            s.put_if_absent("k", b"one")
            s.put_if_absent("k", b"two")  # no 412
            assert s.get("k") == b"two"
        finally:
            s.close()


def _wire(monkeypatch):
    """Every request the ``requests`` sessions send, as ``(method, url)``, the query included."""
    import requests

    sent = []
    orig = requests.Session.send

    def spy(self, request, **kwargs):
        sent.append((request.method, request.url))
        return orig(self, request, **kwargs)

    monkeypatch.setattr(requests.Session, "send", spy)
    return sent


def test_put_if_absent_sends_if_generation_match_0(gcs, monkeypatch):
    """On the wire: put_if_absent's upload carries ifGenerationMatch=0 (an
    empty one too, which is a multipart upload); plain put does not."""
    s = gcs()
    sent = _wire(monkeypatch)
    s.put_if_absent("m", b"1")
    s.put("n", b"1")
    s.put_if_absent("e", b"")
    (m1, u1), (m2, u2), (m3, u3) = sent
    assert m1 == m2 == m3 == "POST" and all("/upload/storage/v1/b/" in u for u in (u1, u2, u3))
    assert "ifGenerationMatch=0" in u1 and "uploadType=media" in u1
    assert "ifGenerationMatch=0" in u3 and "uploadType=multipart" in u3
    assert "ifGenerationMatch" not in u2
    with pytest.raises(ObjectExistsError):
        s.put_if_absent("e", b"")
    assert s.get("e") == b""


def test_requester_pays_bills_the_project_on_every_request(gcs, monkeypatch):
    s = GCSStore(f"{BUCKET}/repo", {**gcs.emulator.storage_options(), "requester_pays": True})
    sent = _wire(monkeypatch)
    s.put("k", b"v")
    assert s.get("k") == b"v" and [o.key for o in s.list()] == ["k"]
    assert len(sent) == 3 and all("userProject=test" in u for _, u in sent)
    s.close()
    with pytest.raises(ValueError, match="requester_pays=True needs the project"):
        GCSStore(f"{BUCKET}/repo", {"token": "anon", "requester_pays": True})


def _fail_with(status: int, message: str = "x"):
    def send(*args, **kwargs):
        raise GCSHTTPError(status, message)

    return send


def test_412_maps_to_object_exists(gcs, monkeypatch):
    """A 412 answer becomes ObjectExistsError naming the gs:// key, for a create only."""
    err = classify_error(GCSHTTPError(412, "conditionNotMet"), "gs://b/p/k", "objects.insert", exists_on_412=True)
    assert isinstance(err, ObjectExistsError) and "gs://b/p/k" in str(err)
    # Without the create flag a failed precondition is no "exists".
    assert type(classify_error(GCSHTTPError(412, "x"), "gs://b/p/k", "objects.insert")) is StorageError
    s = gcs()
    monkeypatch.setattr(s, "_send", _fail_with(412, "conditionNotMet"))
    with pytest.raises(ObjectExistsError, match=rf"gs://{BUCKET}/repo/k"):
        s.put_if_absent("k", b"x")


def test_emulator_answers_412_like_gcs(gcs):
    s = gcs()
    s.put_if_absent("m", b"1")
    with pytest.raises(ObjectExistsError, match=rf"gs://{BUCKET}/repo/m"):
        s.put_if_absent("m", b"2")
    assert s.get("m") == b"1"


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "status,expected",
    [
        (404, ObjectNotFoundError),
        (408, TransientStorageError),
        (429, TransientStorageError),
        (500, TransientStorageError),
        (502, TransientStorageError),
        (503, TransientStorageError),
        (400, StorageError),
        (401, CredentialsRefusedError),  # a StorageError; the store adds the credential source
        (403, CredentialsRefusedError),
        (409, StorageError),
    ],
)
def test_classify_status(status, expected):
    """Every status through the store's reading of a JSON API error answer."""
    import requests

    resp = requests.Response()
    resp.status_code = status
    resp._content = f'{{"error": {{"code": {status}, "message": "msg {status}", "errors": [{{"reason": "r"}}]}}}}'.encode()
    exc = GCSHTTPError.from_response(resp)
    assert (exc.status, exc.message, exc.reason) == (status, f"msg {status}", "r")
    err = classify_error(exc, "gs://bkt/p/k", "objects.get")
    assert type(err) is expected
    assert "gs://bkt/p/k" in str(err)
    if expected is not ObjectNotFoundError:
        assert f"msg {status}" in str(err)
    resp._content = b"<html>Bad Gateway</html>"  # not JSON: the first line of the body
    assert GCSHTTPError.from_response(resp).message == "<html>Bad Gateway</html>"


def test_classify_without_response():
    import http.client

    import requests
    import urllib3

    for exc in (ConnectionResetError(), requests.ConnectionError("x"), requests.exceptions.ChunkedEncodingError("x"),
                requests.exceptions.ReadTimeout("x"), urllib3.exceptions.ProtocolError("x"),
                http.client.IncompleteRead(b"", 5)):
        assert type(classify_error(exc, "gs://b", "op")) is TransientStorageError, exc
    assert type(classify_error(ValueError("Bad Request: invalid"), "gs://b", "op")) is StorageError


def test_transient_answers_are_tried_again_and_creates_are_not(gcs, monkeypatch):
    """408/429/5xx and connection failures: up to ``tries`` attempts, waits
    through the injected sleep; a conditional create: one attempt."""
    import requests

    waits = []
    s = GCSStore(f"{BUCKET}/repo", gcs.emulator.storage_options(), sleep=waits.append)
    s.put("k", b"v")
    session = s._session()
    orig = session.request
    script = []

    def flaky(method, url, **kwargs):
        if script:
            what = script.pop(0)
            if isinstance(what, Exception):
                raise what
            resp = requests.Response()
            resp.status_code, resp._content = what, b'{"error": {"message": "busy"}}'
            return resp
        return orig(method, url, **kwargs)

    monkeypatch.setattr(session, "request", flaky)
    script[:] = [503, requests.ConnectionError("reset")]
    # jittered backoff: 0.5 s then 1 s, each times a factor in [0.5, 1.5)
    assert s.get("k") == b"v" and len(waits) == 2
    assert 0.25 <= waits[0] < 0.75 and 0.5 <= waits[1] < 1.5, waits
    script[:] = [503, 429, 500]
    with pytest.raises(TransientStorageError, match="500"):
        s.get("k")
    assert script == []
    script[:] = [503]
    with pytest.raises(TransientStorageError, match="503"):
        s.put_if_absent("c", b"x")  # one try: RetryStore decides
    assert s.get_ranges("k", [(0, 1)]) == [b"v"] and not s.exists("c")
    script[:] = [403]
    with pytest.raises(StorageError, match="403"):
        s.get("k")
    assert script == []
    s.close()


def test_error_messages_hide_token(gcs, monkeypatch):
    s = GCSStore(f"{BUCKET}/repo", {**gcs.emulator.storage_options(), "token": "anon"})
    s._secrets = ("sekr1t-token",)
    monkeypatch.setattr(s, "_send", _fail_with(403, "denied for sekr1t-token"))
    with pytest.raises(StorageError) as ei:
        s.head("k")
    assert "sekr1t-token" not in str(ei.value) and f"gs://{BUCKET}/repo/k" in str(ei.value)
    assert GCSStore("b", {"token": "ya29.raw-access-token"})._secrets == ("ya29.raw-access-token",)


def test_416_is_a_range_error(gcs, monkeypatch):
    """GCS answers 416 to a range starting past the end (the emulator sends 206 with no bytes)."""
    s = gcs()
    s.put("r", b"0123456789")
    monkeypatch.setattr(s, "_send", _fail_with(416, "The requested range cannot be satisfied."))
    with pytest.raises(ValueError, match="past end"):
        s.get_ranges("r", [(20, 30)])
    with pytest.raises(ValueError, match="past end"):
        s.read_range_into("r", 20, bytearray(4))


def test_read_range_into_streams_with_advancing_progress(gcs):
    from ckptstore.storage.base import READ_PIECE

    s = gcs()
    data = payload(3 * READ_PIECE + 123, 7)
    s.put("big", data)
    out = bytearray(2 * READ_PIECE + 5)
    seen = []
    s.read_range_into("big", 100, out, seen.append)
    assert bytes(out) == data[100 : 100 + len(out)]
    assert len(seen) >= 3 and seen == sorted(set(seen)) and seen[-1] == len(out)
    with pytest.raises(ValueError, match="past end"):
        s.read_range_into("big", len(data) - 2, bytearray(4))
    with pytest.raises(ObjectNotFoundError):
        s.read_range_into("missing", 0, bytearray(4))


def test_a_server_that_ignores_range_still_gives_exactly_the_range(gcs, monkeypatch):
    import requests

    s = gcs()
    s.put("r", b"0123456789")
    orig = requests.Session.send

    def no_range(self, request, **kwargs):
        request.headers.pop("Range", None)
        return orig(self, request, **kwargs)

    monkeypatch.setattr(requests.Session, "send", no_range)
    out, seen = bytearray(3), []
    s.read_range_into("r", 2, out, seen.append)
    assert out == b"234" and seen == [3]
    assert s.get_ranges("r", [(5, 8), (0, 2)]) == [b"567", b"01"]
    with pytest.raises(ValueError, match="past end"):
        s.read_range_into("r", 8, bytearray(4))


def test_a_forked_child_makes_its_own_session(gcs):
    """A store used before a fork works in the child (a session of its own) and still in the parent."""
    s = gcs()
    s.put("k", b"value")
    parent = s._session()
    assert use_in_forked_child(s, lambda st: st._session()) == b"value from the child value own"
    assert s._session() is parent and s.get("child") == b"from the child"


def test_unknown_options_are_refused_and_gcsfs_cache_options_ignored():
    with pytest.raises(ValueError, match="unknown GCS storage option.*'tokne'"):
        GCSStore("b/p", {"tokne": "anon"})
    with pytest.raises(ValueError, match="access must be one of"):
        GCSStore("b/p", {"token": "anon", "access": "admin"})
    with pytest.raises(ValueError, match="endpoint_url must start with http"):
        GCSStore("b/p", {"token": "anon", "endpoint_url": "localhost:4443"})
    GCSStore("b/p", {"token": "anon", "skip_instance_cache": True, "use_listings_cache": False})
    # Text from the CLI (`-o KEY=VALUE`) means what it says.
    opts = GCSStore("b/p", {"token": "anon", "trust_env": "false", "requester_pays": "other-project",
                            "read_timeout": "7", "tries": "2"})._opts
    assert (opts.trust_env, opts.params, opts.read, opts.tries) == (False, {"userProject": "other-project"}, 7.0, 2)
    assert GCSStore("b/p", {"token": "anon", "trust_env": "True", "requester_pays": "false"})._opts.trust_env is True
    with pytest.raises(ValueError, match="trust_env must be true or false"):
        GCSStore("b/p", {"token": "anon", "trust_env": "maybe"})


def test_token_conventions(tmp_path, monkeypatch):
    """gcsfs's ``token`` values, resolved without a request."""
    import google.auth
    import google.auth.credentials
    import google.oauth2.credentials

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    assert isinstance(credentials("anon"), google.auth.credentials.AnonymousCredentials)
    user = {"type": "authorized_user", "client_id": "cid", "client_secret": "csecret", "refresh_token": "rt"}
    c = credentials(user)
    assert isinstance(c, google.oauth2.credentials.Credentials) and c.refresh_token == "rt"
    f = tmp_path / "adc.json"
    f.write_text(__import__("json").dumps(user))
    assert credentials(str(f)).client_id == "cid"
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from google.oauth2 import service_account

    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    sa = {"type": "service_account", "client_email": "ckpt@p.iam.gserviceaccount.com", "private_key": pem,
          "private_key_id": "1", "token_uri": "https://oauth2.googleapis.com/token", "project_id": "p"}
    c = credentials(sa, "read_write")
    assert isinstance(c, service_account.Credentials) and c.service_account_email == sa["client_email"]
    assert c.scopes == ["https://www.googleapis.com/auth/devstorage.read_write"]
    assert pem in GCSStore("b", {"token": sa})._secrets  # scrubbed from any message
    raw = credentials("ya29.abc")
    assert isinstance(raw, google.oauth2.credentials.Credentials) and raw.token == "ya29.abc"
    mine = google.auth.credentials.AnonymousCredentials()
    assert credentials(mine) is mine
    with pytest.raises(ValueError, match="does not exist"):
        credentials(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="type 'external_account'"):
        credentials({"type": "external_account", "audience": "x"})
    (tmp_path / "bad.json").write_text("not json")
    with pytest.raises(ValueError, match="not a JSON credentials file"):
        credentials(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="interactive"):
        credentials("browser")
    calls = []
    monkeypatch.setattr(google.auth, "default", lambda scopes: calls.append(scopes) or (mine, "p"))
    assert credentials(None, "read_only") is mine and credentials("google_default") is mine
    assert calls[0] == ["https://www.googleapis.com/auth/devstorage.read_only"]

    def none(scopes):
        raise google.auth.exceptions.DefaultCredentialsError("no ADC")

    monkeypatch.setattr(google.auth, "default", none)
    with pytest.raises(StorageError, match="no Google credentials found.*token"):
        credentials(None)


def test_parse_timestamp():
    assert parse_timestamp("1970-01-01T00:00:01.500Z") == 1.5
    assert parse_timestamp("1970-01-01T00:00:01.123456Z") == pytest.approx(1.123456)
    assert parse_timestamp("1970-01-01T01:00:00+01:00") == 0.0


def test_constructor_makes_no_request_and_refuses_credentials():
    s = GCSStore("gs://some-bucket/x", {"token": "anon"})
    assert s._sessions[2] == []
    with pytest.raises(ValueError) as ei:
        GCSStore("gs://user:hunter2@b/x")
    assert "hunter2" not in str(ei.value)


# ---------------------------------------------------------------- open_store / repository
@pytest.mark.parametrize("scheme", ["gs", "gcs"])
def test_open_store_gcs(gcs, scheme):
    s = open_store(f"{scheme}://{BUCKET}/runs/exp1/", gcs.emulator.storage_options())
    try:
        assert isinstance(s, GCSStore) and s.url == f"gs://{BUCKET}/runs/exp1"
        s.put("k", b"v")
        assert gcs(BUCKET).get("runs/exp1/k") == b"v"
    finally:
        s.close()
    for bad in (f"{scheme}://", f"{scheme}:///x", f"{scheme}://b/x?generation=1", f"{scheme}://u:p@b/x"):
        with pytest.raises(ValueError):
            open_store(bad)


def test_repository_multipart_packs(gcs):
    """Packs over the part size go through composite uploads."""
    url = f"gs://{BUCKET}/runs/big"
    repo = ckptstore.open(
        url, storage_options=gcs.emulator.storage_options(), chunk_size=1 * MiB, pack_size=12 * MiB, part_size=5 * MiB
    )
    sd = {"w": random_tensor(torch.uint8, (11 * MiB,), seed=5)}
    repo.save(sd, step=1)
    assert_tree_equal(repo.load(1), sd)
    raw = gcs(f"{BUCKET}/runs/big")
    assert raw.list_multipart() == []
    assert not any(".uploads/" in n for n in gcs.emulator.object_names(BUCKET))


def test_importing_storage_does_not_import_google_auth():
    import subprocess
    import sys

    code = ("import sys, ckptstore.storage; print('google.auth' in sys.modules, 'ckptstore.storage.gcs' in sys.modules,"
            " 'requests' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]


def test_the_store_needs_neither_gcsfs_nor_fsspec_nor_aiohttp(gcs):
    import subprocess
    import sys

    code = ("import sys; sys.modules['gcsfs'] = sys.modules['fsspec'] = sys.modules['aiohttp'] = None\n"
            "from ckptstore.storage.gcs import GCSStore\n"
            f"s = GCSStore('{BUCKET}/nodeps', {gcs.emulator.storage_options()!r}); s.put('k', b'v');"
            " print(s.get('k').decode())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["v"]


def test_missing_bucket_listing_is_not_a_missing_object(gcs):
    s = gcs("no-such-bucket/repo")
    with pytest.raises(StorageError, match="bucket does not exist") as ei:
        list(s.list())
    assert not isinstance(ei.value, ObjectNotFoundError)
    with pytest.raises(StorageError) as ei:
        s.list_multipart()
    assert not isinstance(ei.value, ObjectNotFoundError)


def test_missing_bucket_is_named_by_object_calls_too(gcs):
    # A 404 on an object (read or write) in a bucket that does not exist says
    # so, as S3's NoSuchBucket and Azure's ContainerNotFound do; a missing
    # object in a bucket that exists is still a missing object.
    s = gcs("no-such-bucket/repo")
    for call in (lambda: s.get("config.json"), lambda: s.put("k", b"x"), lambda: s.put_if_absent("k", b"x"),
                 lambda: s.head("k"), lambda: s.get_ranges("k", [(0, 1)])):
        with pytest.raises(StorageError, match=r"^gs://no-such-bucket: bucket does not exist") as ei:
            call()
        assert not isinstance(ei.value, ObjectNotFoundError)
    with pytest.raises(StorageError, match="gs://no-such-bucket: bucket does not exist"):
        ckptstore.open("gs://no-such-bucket/runs/exp1", storage_options=gcs.emulator.storage_options()).save(
            {"w": torch.zeros(2)}, step=1)
    present = gcs()
    with pytest.raises(ObjectNotFoundError, match="no such object"):
        present.get("missing")
    present.put("k", b"x")
    with pytest.raises(ObjectNotFoundError, match="no such object"):
        present.get("missing")


def test_emulator_host_in_the_environment_means_anonymous(gcs, monkeypatch):
    # As google-cloud-storage does: with STORAGE_EMULATOR_HOST set and no
    # token, no default credentials are looked for (and no metadata server asked).
    import google.auth

    def probed(*args, **kwargs):
        raise AssertionError("looked for application-default credentials")

    monkeypatch.setattr(google.auth, "default", probed)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.emulator.endpoint)
    with ckptstore.open(f"gs://{BUCKET}/env") as repo:
        repo.save({"w": torch.arange(3.0)}, step=1)
        assert repo.steps() == [1]
    # A token given explicitly is used as it is.
    with pytest.raises(AssertionError, match="application-default"):
        GCSStore(f"{BUCKET}/env", {"token": "google_default"}).get("x")


def test_cp_s3_to_gcs_copies_unique_chunks_once_and_verifies(gcs, s3):
    """``cp`` between clouds: S3 (moto) to GCS (emulator)."""
    import ckptstore
    from ckptstore.repo.repository import Repository

    src = ckptstore.open(s3.url, storage_options=s3.storage_options, **SMALL)
    frozen = torch.randn(100_000)
    for step in (1, 2, 3):
        src.save({"frozen": frozen, "head": torch.randn(5_000) + step}, step=step)
    dst = Repository(gcs(), **SMALL)
    result = src.copy_to(dst)
    assert result.copied == [1, 2, 3]
    unique = {c.hash: c.stored_len for s in (1, 2, 3) for c in src.chunks(s)}
    assert result.chunks_copied == len(unique) and result.bytes_copied == sum(unique.values())
    assert dst.verify(read_data=True).ok
    for step in (1, 2, 3):
        a, b = src.load(step), dst.load(step)
        assert torch.equal(a["frozen"], b["frozen"]) and torch.equal(a["head"], b["head"])
    again = src.copy_to(dst)
    assert again.copied == [] and again.bytes_copied == 0
    src.close()


def test_429_and_503_lower_the_process_request_rate_and_are_waited_out(gcs_env):
    """The store's throttling answers reach the adaptive rate (every try, the store's own
    included) and a Retry-After pauses the requests; the listing still finds the step."""
    import ckptstore
    from ckptstore.testing.requestproxy import RequestProxy, match

    url, so = gcs_env
    with RequestProxy(so["endpoint_url"], classify=lambda m, k, q: m) as proxy:
        through = dict(so, endpoint_url=proxy.endpoint("gcs"))
        repo = ckptstore.open(url, storage_options=through)
        repo.save({"w": torch.arange(10.0)}, step=1)
        storm = proxy.fail(match(kind="GET"), count=3, status=429, code="rateLimitExceeded", retry_after=0.05)
        again = ckptstore.open(url, storage_options=through)
        assert again.latest() == 1
        assert storm.fired == 3
        stats = again.store.throttle_stats()
        assert stats["throttled"] >= 3 and stats["enabled"]
        assert torch.equal(again.load(1)["w"], torch.arange(10.0))
