"""S3 servers on 127.0.0.1 for the benchmarks, behind one small handle.

The servers are ``ckptstore.testing``'s: :class:`~ckptstore.testing.moto.MotoServer`
(run here in a child process, so that it has its own GIL and memory, its CPU
time can be read apart from the client's, and it can be pinned to a CPU) and
:class:`~ckptstore.testing.seaweedfs.SeaweedFS` (a Go server, its own process).
"""

from __future__ import annotations

import os
import select
import shlex
import subprocess
import sys
from contextlib import contextmanager

from ckptstore.testing.moto import KEY as MOTO_KEY
from ckptstore.testing.moto import REGION, MotoServer, free_port

__all__ = ["S3Server", "aws_env", "free_port", "moto_process", "moto_thread", "seaweedfs", "start_server"]


class S3Server:
    """What a benchmark needs of an S3 endpoint: options, a client, the server's pid.

    ``pid`` is None when the server runs inside this process (its CPU is then
    the client's). :meth:`spec` / :meth:`from_spec` carry a handle into a
    spawned process (a DCP rank): the copy lists and deletes, it owns nothing.
    """

    def __init__(self, name: str, endpoint: str, key: str, secret: str, storage_options: dict,
                 pid: int | None = None, bucket: str | None = None, info: dict | None = None, starter=None):
        self.name, self.endpoint, self.key, self.secret = name, endpoint, key, secret
        #: The ``ckptstore.testing`` object that started the server (None in a copy from :meth:`spec`).
        self.starter = starter
        self._storage_options = storage_options
        self.pid, self.bucket = pid, bucket
        self.info = dict(info or {})
        self._client = None

    # ------------------------------------------------------------ handles
    def spec(self) -> dict:
        return {"name": self.name, "endpoint": self.endpoint, "key": self.key, "secret": self.secret,
                "storage_options": self._storage_options, "pid": self.pid, "bucket": self.bucket}

    @classmethod
    def from_spec(cls, spec: dict) -> "S3Server":
        return cls(**spec)

    def storage_options(self) -> dict:
        """S3 ``storage_options`` reaching the server (the starter's own)."""
        return self._storage_options

    def client(self):
        """A boto3 S3 client straight to the server (created once, no retries)."""
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                                        aws_access_key_id=self.key, aws_secret_access_key=self.secret,
                                        config=Config(proxies={}, retries={"max_attempts": 1}))
        return self._client

    def close(self) -> None:
        c, self._client = self._client, None
        if c is not None:
            c.close()

    # ------------------------------------------------------------ objects
    def create_bucket(self, name: str) -> None:
        """Create a bucket through the starter (an existing one is fine); the first one is :attr:`bucket`."""
        if self.starter is None:
            raise RuntimeError(f"{self.name}: a handle from spec() cannot create buckets")
        self.starter.create_bucket(name)
        if self.bucket is None:
            self.bucket = name

    def _objects(self, prefix: str, bucket: str | None):
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket or self.bucket,
                                                                        Prefix=prefix + "/")
        for page in pages:
            yield from page.get("Contents", [])

    def prefix_stats(self, prefix: str, bucket: str | None = None) -> tuple[int, int]:
        """(total bytes, object count) under ``prefix/``."""
        total = count = 0
        for o in self._objects(prefix, bucket):
            total += o["Size"]
            count += 1
        return total, count

    def prefix_bytes(self, prefix: str, bucket: str | None = None) -> int:
        return self.prefix_stats(prefix, bucket)[0]

    def delete_prefix(self, prefix: str, bucket: str | None = None) -> None:
        keys = [{"Key": o["Key"]} for o in self._objects(prefix, bucket)]
        for i in range(0, len(keys), 1000):
            self.client().delete_objects(Bucket=bucket or self.bucket, Delete={"Objects": keys[i : i + 1000]})


@contextmanager
def aws_env(server: S3Server):
    """The ``AWS_*`` environment that clients configured only through it (s3torchconnector's CRT
    client, torchsnapshot's aiobotocore session) need to reach ``server``; restored afterwards."""
    want = {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": server.key,
            "AWS_SECRET_ACCESS_KEY": server.secret, "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true"}
    old = {k: os.environ.get(k) for k in want}
    os.environ.update(want)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _serving(srv: S3Server, bucket: str | None):
    """``srv`` with ``bucket`` created (when given); its client closed after."""
    try:
        if bucket:
            srv.create_bucket(bucket)
        yield srv
    finally:
        srv.close()


_MOTO_CHILD = (
    "import sys\n"
    "from ckptstore.testing.moto import MotoServer\n"
    "s = MotoServer(port=int(sys.argv[1])).start()\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
    "s.stop()\n"
)


@contextmanager
def moto_process(bucket: str | None = None):
    """A :class:`MotoServer` in a child process (own GIL, own memory, own CPU time); yields an :class:`S3Server`."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _MOTO_CHILD, str(port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            raise RuntimeError(f"moto server child did not start (exit code {proc.poll()})")
        # Not started here: the handle gives the endpoint and storage options.
        handle = MotoServer(port=port)
        srv = S3Server("moto", handle.endpoint, MOTO_KEY, MOTO_KEY, handle.storage_options(), pid=proc.pid,
                       info={"server": "moto (ThreadedMotoServer in a child process)"}, starter=handle)
        try:
            with _serving(srv, bucket):
                yield srv
        finally:
            handle.stop()  # closes its client; the server is the child's
    finally:
        try:
            proc.stdin.close()
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def moto_thread(bucket: str | None = None):
    """A :class:`MotoServer` in a thread of this process (shares the GIL, the RSS and the CPU counters)."""
    with MotoServer() as m:
        srv = S3Server("moto", m.endpoint, MOTO_KEY, MOTO_KEY, m.storage_options(), pid=None,
                       info={"server": "moto (ThreadedMotoServer in this process)"}, starter=m)
        with _serving(srv, bucket):
            yield srv


@contextmanager
def seaweedfs(bucket: str | None = None, key: str = "ckptrunkey", secret: str = "ckptrunsecret",
              extra_args: tuple[str, ...] = ()):
    """``weed server -s3`` by :class:`~ckptstore.testing.seaweedfs.SeaweedFS`, data in a temp dir deleted after
    (``extra_args``: more ``weed server`` flags)."""
    from ckptstore.testing.seaweedfs import SeaweedFS

    with SeaweedFS(key=key, secret=secret, extra_args=extra_args) as weed:
        srv = S3Server("seaweedfs", weed.endpoint, weed.key, weed.secret, weed.storage_options(), pid=weed.pid,
                       info={"server": f"SeaweedFS {weed.version} ({weed.binary})",
                             "command": shlex.join(weed.command), "ready_seconds": weed.ready_seconds},
                       starter=weed)
        with _serving(srv, bucket):
            yield srv


SERVERS = ("moto", "seaweedfs")


def start_server(name: str, bucket: str | None = None):
    """The context manager of server ``name`` (one of :data:`SERVERS`)."""
    if name == "moto":
        return moto_process(bucket)
    if name == "seaweedfs":
        return seaweedfs(bucket)
    raise ValueError(f"unknown server {name!r}; choose from {SERVERS}")
