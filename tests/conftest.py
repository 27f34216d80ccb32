"""Shared fixtures: a moto S3 server and a GCS emulator per session, and store URLs per backend.

Slow tests are marked where they are written: ``pytestmark = pytest.mark.slow``
for a module whose every test is long (soak, network faults, crashes,
multi-rank spawns and the 16-rank scale test, emulators in their own process,
the framework integrations, the doc pages), ``@pytest.mark.slow`` on a long
test in an otherwise quick module. ``make test-fast`` (``-m "not slow"``)
leaves them out; ``make test`` and CI run everything.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import pytest

from ckptstore.testing.moto import MotoServer

S3_BUCKET = "ckpt-test"
GCS_BUCKET = "ckpt-gcs"


@pytest.fixture(scope="session")
def moto_server():
    """One moto S3 server on a free loopback port for the whole session."""
    server = MotoServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class S3Env:
    """An empty bucket on the session's moto server.

    Attributes
    ----------
    url:
        ``s3://<bucket>/repo``, the repository root tests use.
    storage_options:
        S3 options (s3fs's names) reaching moto (explicit test credentials).
    server:
        The :class:`MotoServer`.
    """

    url: str
    storage_options: dict
    server: MotoServer
    bucket: str = S3_BUCKET
    _stores: list = field(default_factory=list, repr=False)

    def store(self, url: str | None = None):
        """An :class:`S3Store` for ``url`` (default :attr:`url`), closed at teardown."""
        from ckptstore.storage.s3 import S3Store

        path = (url or self.url).removeprefix("s3://")
        s = S3Store(path, self.storage_options)
        self._stores.append(s)
        return s

    def close(self) -> None:
        for s in self._stores:
            s.close()
        self._stores.clear()


@pytest.fixture
def s3(moto_server):
    """A fresh moto state with one empty bucket; see :class:`S3Env`."""
    moto_server.reset()
    moto_server.create_bucket(S3_BUCKET)
    env = S3Env(f"s3://{S3_BUCKET}/repo", moto_server.storage_options(), moto_server)
    try:
        yield env
    finally:
        env.close()


@pytest.fixture(scope="session")
def gcs_emulator():
    """One GCS emulator on a free loopback port for the whole session."""
    pytest.importorskip("google.auth")
    pytest.importorskip("gcp_storage_emulator")
    from ckptstore.testing.gcs_emulator import GCSEmulator

    with GCSEmulator() as em:
        yield em


@pytest.fixture
def gcs_env(gcs_emulator):
    """A wiped emulator with one empty bucket: ``(url, storage_options)`` of ``gs://ckpt-gcs/repo``."""
    gcs_emulator.reset()
    gcs_emulator.create_bucket(GCS_BUCKET)
    return f"gs://{GCS_BUCKET}/repo", gcs_emulator.storage_options()


@pytest.fixture(params=["memory", "local", "s3", "gcs"])
def repo_url(request, tmp_path):
    """``(url, storage_options)`` of an empty repository root on each backend.

    memory: a unique ``memory://test-<uuid>`` name (dropped afterwards);
    local: a plain path under ``tmp_path``; s3: ``s3://ckpt-test/repo`` on
    moto; gcs: ``gs://ckpt-gcs/repo`` on the GCS emulator.
    """
    if request.param == "memory":
        from ckptstore.storage import MemoryStore

        name = f"test-{uuid.uuid4().hex}"
        try:
            yield f"memory://{name}", None
        finally:
            MemoryStore.clear(name)
    elif request.param == "local":
        yield str(tmp_path / "repo"), None
    elif request.param == "gcs":
        yield request.getfixturevalue("gcs_env")
    else:
        env = request.getfixturevalue("s3")
        yield env.url, env.storage_options
