"""Azurite (the Azure Storage emulator, npm package ``azurite``) on a free loopback port.

No pytest here: tests, demos and benchmarks use it alike. Only the blob
service is started (``azurite-blob``), with its data in a temporary
directory deleted on :meth:`Azurite.stop`, telemetry off
(``--disableTelemetry``; Azurite collects it by default), any client API
version accepted (``--skipApiVersionCheck``: azure-storage-blob is often
newer than the emulator) and no access log (``--silent``).

Where the binary comes from: ``make setup`` runs ``npm install azurite``
into ``.node/`` at the repository root (git-ignored); :func:`azurite_binary`
looks there, then in ``$CKPTSTORE_AZURITE`` (a path to ``azurite-blob``),
then on ``PATH``.

Credentials are Azurite's documented well-known development account
(``devstoreaccount1``); they are handed to clients in
:meth:`Azurite.storage_options` and the process environment is never changed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from .ports import free_port

HOST = "127.0.0.1"
#: Azurite's fixed development account (public, documented by Microsoft).
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def azurite_binary() -> str | None:
    """Path of ``azurite-blob``: ``$CKPTSTORE_AZURITE``, ``<repo>/.node``, then ``PATH``."""
    env = os.environ.get("CKPTSTORE_AZURITE")
    cands = [env] if env else []
    cands.append(os.path.join(_ROOT, ".node", "node_modules", ".bin", "azurite-blob"))
    for c in cands:
        if c and os.access(c, os.X_OK):
            return c
    return shutil.which("azurite-blob")


class Azurite:
    """``azurite-blob`` on ``127.0.0.1:<free port>`` in a child process.

    Use as a context manager, or call :meth:`start` and :meth:`stop`::

        with Azurite() as az:
            az.create_container("ckpt")
            store = AzureStore("ckpt/run", az.storage_options())

    Parameters
    ----------
    port:
        Blob service port (default: a free one).
    binary:
        The ``azurite-blob`` executable (default: :func:`azurite_binary`).
    startup_timeout:
        Seconds to wait for the service to answer.
    """

    def __init__(self, port: int | None = None, binary: str | None = None, startup_timeout: float = 60.0):
        self.port = port or free_port()
        self.endpoint = f"http://{HOST}:{self.port}/{ACCOUNT}"
        self.binary = binary or azurite_binary()
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen | None = None
        self._tmp: str | None = None
        self._client = None
        self.version: str | None = None

    @property
    def connection_string(self) -> str:
        """A connection string reaching this emulator (it carries the account key)."""
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
            f"BlobEndpoint={self.endpoint};"
        )

    # ------------------------------------------------------------ lifetime
    def start(self) -> "Azurite":
        if self._proc is not None:
            return self
        if self.binary is None:
            raise RuntimeError(
                "azurite-blob not found: run `make setup` (npm install azurite into .node/), "
                "or set CKPTSTORE_AZURITE to the azurite-blob executable"
            )
        self._tmp = tempfile.mkdtemp(prefix="ckpt-azurite-")
        cmd = [self.binary, "--blobHost", HOST, "--blobPort", str(self.port), "--location", self._tmp,
               "--disableTelemetry", "--skipApiVersionCheck", "--silent"]
        log = open(os.path.join(self._tmp, "azurite.log"), "wb")
        try:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          cwd=self._tmp, start_new_session=True)
        finally:
            log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"azurite exited with status {self._proc.returncode}:\n{self._log_tail()}")
            try:
                # Any HTTP answer (400/403: no auth) means the service is up.
                opener.open(f"http://{HOST}:{self.port}/{ACCOUNT}?comp=list", timeout=5).read()
                return
            except urllib.error.HTTPError:
                return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"azurite did not answer within {self.startup_timeout:.0f} s:\n{self._log_tail()}")
            time.sleep(0.2)

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self._tmp, "azurite.log"), errors="replace") as f:
                return f.read()[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the emulator and delete its data."""
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "Azurite":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ helpers
    def storage_options(self) -> dict:
        """``storage_options`` for :class:`~ckptstore.storage.azure.AzureStore` reaching this emulator."""
        return {"connection_string": self.connection_string}

    def client(self):
        """A synchronous ``BlobServiceClient`` for this emulator (created once)."""
        if self._client is None:
            from azure.storage.blob import BlobServiceClient

            self._client = BlobServiceClient.from_connection_string(self.connection_string, retry_total=0)
        return self._client

    def create_container(self, name: str) -> None:
        """Create a container (an existing one is fine)."""
        from azure.core.exceptions import ResourceExistsError

        try:
            self.client().create_container(name)
        except ResourceExistsError:
            pass

    def delete_container(self, name: str) -> None:
        """Delete a container and everything in it (a missing one is fine)."""
        from azure.core.exceptions import ResourceNotFoundError

        try:
            self.client().delete_container(name)
        except ResourceNotFoundError:
            pass

    def blob_names(self, container: str, uncommitted: bool = False) -> list[str]:
        """Every blob name in ``container``; with ``uncommitted``, blobs with only staged blocks too."""
        include = ["uncommittedblobs"] if uncommitted else None
        cc = self.client().get_container_client(container)
        return sorted(b.name for b in cc.list_blobs(include=include))
