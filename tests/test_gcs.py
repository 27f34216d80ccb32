"""GCSStore on gcp-storage-emulator: the conformance suite, conditional-create
proofs, error mapping, and repository round trips."""

from __future__ import annotations

import os

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported

import pytest  # noqa: E402
import torch  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore.errors import (  # noqa: E402
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    TransientStorageError,
)
from ckptstore.storage import open_store  # noqa: E402
from ckptstore.storage.base import MiB  # noqa: E402
from ckptstore.testing.store_suite import PART, StoreConformance, payload  # noqa: E402

from .helpers import SMALL, assert_tree_equal, random_tensor  # noqa: E402

pytest.importorskip("gcsfs")
pytest.importorskip("gcp_storage_emulator")

from ckptstore.storage.gcs import GCSStore, classify_error, parse_timestamp  # noqa: E402
from ckptstore.testing.gcs_emulator import GCSEmulator  # noqa: E402

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
        s._run(None, "delete", s._adelete, f"repo/.uploads/packs/o/{mpu.upload_id}/upload")
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
        orig = mpu._acompose

        async def spy(dest, sources):
            calls.append(len(sources))
            return await orig(dest, sources)

        monkeypatch.setattr(mpu, "_acompose", spy)
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


def test_put_if_absent_sends_if_generation_match_0(gcs, monkeypatch):
    """The request gcsfs sends for put_if_absent carries ifGenerationMatch=0
    (and plain put does not): captured at gcsfs's ``_call``."""
    s = gcs()
    fs = s._fs
    seen = []
    orig = fs._call

    async def spy(method, path, *args, **kwargs):
        seen.append((method, path, kwargs))
        return await orig(method, path, *args, **kwargs)

    monkeypatch.setattr(fs, "_call", spy)
    s.put_if_absent("m", b"1")
    s.put("n", b"1")
    s.put_if_absent("e", b"")  # empty bodies take gcsfs's simple_upload
    (m1, p1, k1), (m2, p2, k2), (m3, p3, k3) = seen
    assert m1 == m2 == m3 == "POST" and all("/upload/storage/v1/b/" in p for p in (p1, p2, p3))
    assert k1.get("ifGenerationMatch") == "0" and k3.get("ifGenerationMatch") == "0"
    assert "ifGenerationMatch" not in k2
    with pytest.raises(ObjectExistsError):
        s.put_if_absent("e", b"")


def test_put_if_absent_query_reaches_server(gcs, monkeypatch):
    """On the wire: the URL of the upload request has ifGenerationMatch=0."""
    import aiohttp

    s = gcs()
    urls = []
    orig = aiohttp.ClientSession._request

    async def spy(self, method, url, *args, **kwargs):
        urls.append((method, str(url), dict(kwargs.get("params") or {})))
        return await orig(self, method, url, *args, **kwargs)

    monkeypatch.setattr(aiohttp.ClientSession, "_request", spy)
    s.put_if_absent("w", b"1")
    ((method, url, params),) = urls
    assert method == "POST" and params.get("ifGenerationMatch") == "0"


def test_412_maps_to_object_exists(gcs, monkeypatch):
    """A 412 answer (gcsfs raises FileExistsError) becomes ObjectExistsError
    naming the gs:// key; exercised end to end against a fake 412 too."""
    from gcsfs.retry import HttpError, validate_response

    with pytest.raises(FileExistsError) as ei:
        validate_response(412, b'{"error": {"code": 412, "message": "conditionNotMet"}}', "u")
    err = classify_error(ei.value, "gs://b/p/k", "objects.insert", exists_on_412=True)
    assert isinstance(err, ObjectExistsError) and "gs://b/p/k" in str(err)
    # Without the create flag a failed precondition is no "exists".
    assert type(classify_error(ei.value, "gs://b/p/k", "objects.insert")) is StorageError
    assert isinstance(
        classify_error(HttpError({"code": 412, "message": "x"}), "gs://b/k", "op", exists_on_412=True),
        ObjectExistsError,
    )

    s = gcs()

    async def fake_call(*args, **kwargs):
        validate_response(412, b'{"error": {"code": 412, "message": "conditionNotMet"}}', "u")

    monkeypatch.setattr(s._fs, "_call", fake_call)
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
        (401, StorageError),
        (403, StorageError),
        (409, StorageError),
    ],
)
def test_classify_status(status, expected):
    """Every status through gcsfs's own translation of a response."""
    from gcsfs.retry import validate_response

    body = f'{{"error": {{"code": {status}, "message": "msg {status}"}}}}'.encode()
    try:
        validate_response(status, body, "b/{}/o/{}", ("bkt", "k"))
    except Exception as e:  # noqa: BLE001 - whatever gcsfs raises
        exc = e
    err = classify_error(exc, "gs://bkt/p/k", "objects.get")
    assert type(err) is expected
    assert "gs://bkt/p/k" in str(err)


def test_classify_without_response():
    import aiohttp

    assert type(classify_error(ConnectionResetError(), "gs://b", "op")) is TransientStorageError
    assert type(classify_error(aiohttp.ClientConnectionError("x"), "gs://b", "op")) is TransientStorageError
    assert type(classify_error(ValueError("Bad Request: invalid"), "gs://b", "op")) is StorageError
    assert type(classify_error(FileNotFoundError("x"), "gs://b", "op")) is ObjectNotFoundError


def test_error_messages_hide_token(gcs, monkeypatch):
    from gcsfs.retry import HttpError

    s = GCSStore(f"{BUCKET}/repo", {**gcs.emulator.storage_options(), "token": "anon"})
    s._secrets = ("sekr1t-token",)

    async def boom(*a, **k):
        raise HttpError({"code": 403, "message": "denied for sekr1t-token"})

    monkeypatch.setattr(s._fs, "_call", boom)
    with pytest.raises(StorageError) as ei:
        s.head("k")
    assert "sekr1t-token" not in str(ei.value) and f"gs://{BUCKET}/repo/k" in str(ei.value)


def test_416_is_a_range_error(gcs, monkeypatch):
    """GCS answers 416 to a range starting past the end (the emulator sends 206 with no bytes)."""
    from gcsfs.retry import HttpError

    s = gcs()
    s.put("r", b"0123456789")

    async def r416(*a, **k):
        raise HttpError({"code": 416, "message": "The requested range cannot be satisfied."})

    monkeypatch.setattr(s._fs, "_request", r416)
    with pytest.raises(ValueError, match="past end"):
        s.get_ranges("r", [(20, 30)])


def test_parse_timestamp():
    assert parse_timestamp("1970-01-01T00:00:01.500Z") == 1.5
    assert parse_timestamp("1970-01-01T00:00:01.123456Z") == pytest.approx(1.123456)
    assert parse_timestamp("1970-01-01T01:00:00+01:00") == 0.0


def test_constructor_makes_no_request_and_refuses_credentials():
    s = GCSStore("gs://some-bucket/x", {"token": "anon"})
    assert s._fs_obj is None
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


def test_importing_storage_does_not_import_gcsfs():
    import subprocess
    import sys

    code = "import sys, ckptstore.storage; print('gcsfs' in sys.modules, 'ckptstore.storage.gcs' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


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
    import gcsfs.credentials

    def probed(self):
        raise AssertionError("looked for application-default credentials")

    monkeypatch.setattr(gcsfs.credentials.GoogleCredentials, "_connect_google_default", probed)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.emulator.endpoint)
    with ckptstore.open(f"gs://{BUCKET}/env") as repo:
        repo.save({"w": torch.arange(3.0)}, step=1)
        assert repo.steps() == [1]
    # A token given explicitly is used as it is.
    s = GCSStore(f"{BUCKET}/env", {"token": "anon", "project": "p"})
    assert s._gcsfs_options()["project"] == "p"
    with pytest.raises(AssertionError, match="application-default"):
        GCSStore(f"{BUCKET}/env", {"token": "google_default"}).get("x")


def test_cp_s3_to_gcs_copies_unique_chunks_once_and_verifies(gcs, s3):
    """``cp`` between clouds: S3 (moto) to GCS (emulator)."""
    import ckptstore
    from ckptstore.repository import Repository

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
