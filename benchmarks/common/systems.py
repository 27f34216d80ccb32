"""The systems the benchmarks compare: ckptstore and its peers, each behind one small class.

A system saves a state dict for one workload and step and loads it back:
``save(sd, wl, step)`` (ckptstore returns the bytes it uploaded),
``load(wl, step, like) -> dict`` (in place into ``like`` where the system
can), ``stored(wl)`` (bytes it holds for the workload) and ``cleanup(wl)``.

* local: :class:`TorchSystem` (``torch.save`` + fsync / ``torch.load``),
  :class:`SafetensorsSystem`, :class:`DcpFsSystem` (DCP ``FileSystemWriter``
  / ``FileSystemReader``, plain or with the ``ZStandard`` extension);
* on an S3 server (:class:`~benchmarks.common.servers.S3Server`):
  :class:`FsspecSystem` (DCP ``FsspecWriter``/``FsspecReader``) and the
  optional peers (:data:`OPTIONAL_PEERS`: s3torchconnector's DCP writer and
  reader, torchsnapshot);
* :class:`CkptSystem`: ckptstore on a local directory or on ``s3://`` (64 MiB packs);
* :func:`raw_put`: raw parallel PUTs of a byte count, the yardstick of an S3 save.

``benchmarks.run`` runs them all on the same data; the experiments take the
ones they need from here.
"""

from __future__ import annotations

import os
import shutil
import warnings

import torch

import ckptstore

from .measure import MiB, Timer, dir_bytes, fsync_path
from .servers import REGION, S3Server, aws_env

#: The bucket every benchmark's S3 server is started with.
BUCKET = "ckptrun"
#: ckptstore's pack size on S3 in the benchmarks (moto reads a whole object per ranged GET).
S3_PACK_SIZE = 64 * MiB

LOCAL_PEERS = ("torch", "safetensors", "dcp-fs", "dcp-fs-zstd")
#: Peers on every S3 server: DCP through fsspec, and the optional ones
#: (skipped with the reason printed when their package is not installed).
S3_PEERS = ("dcp-fsspec", "s3torchconnector", "torchsnapshot")



class System:
    """save(sd, where, step) -> bytes written; load(where, step, like) -> dict."""

    name = ""
    server: S3Server | None = None

    def location(self, wl: str) -> str: ...

    @property
    def remote(self) -> bool:
        """Talks to an S3 server (its operations run on the client CPUs when pinned)."""
        return self.server is not None


class LocalSystem(System):
    def __init__(self, name: str, tmp: str):
        self.name = name
        self.tmp = tmp

    def location(self, wl):
        return os.path.join(self.tmp, f"{wl}-{self.name}")

    def stored(self, wl):
        return dir_bytes(self.location(wl))

    def cleanup(self, wl):
        shutil.rmtree(self.location(wl), ignore_errors=True)


class TorchSystem(LocalSystem):
    def save(self, sd, wl, step):
        os.makedirs(self.location(wl), exist_ok=True)
        path = os.path.join(self.location(wl), f"step{step}.pt")
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, wl, step, like):
        return torch.load(os.path.join(self.location(wl), f"step{step}.pt"), weights_only=True)


class SafetensorsSystem(LocalSystem):
    touch = True  # False in workload d: only the slice's pages are read

    def save(self, sd, wl, step):
        from safetensors.torch import save_file

        os.makedirs(self.location(wl), exist_ok=True)
        path = os.path.join(self.location(wl), f"step{step}.safetensors")
        save_file(sd, path)
        fsync_path(path)

    def load(self, wl, step, like):
        from safetensors.torch import load_file

        out = load_file(os.path.join(self.location(wl), f"step{step}.safetensors"))
        if self.touch:
            # load_file maps the file: pages are read on first touch. Touch
            # one byte per 4 KiB page so that the load row pays for the read.
            for t in out.values():
                b = t.reshape(-1).view(torch.uint8)
                int(b[::4096].sum())
        return out


def quiet_dcp():
    """``torch.distributed.checkpoint``, with its warnings about running without a process group off."""
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*(process group|ProcessGroup).*")
    return dcp


class DcpFsSystem(LocalSystem):
    def __init__(self, name, tmp, zstd: bool):
        super().__init__(name, tmp)
        self.zstd = zstd

    def save(self, sd, wl, step):
        from torch.distributed.checkpoint import FileSystemWriter

        dcp = quiet_dcp()
        path = os.path.join(self.location(wl), f"step{step}")
        if self.zstd:
            from torch.distributed.checkpoint._extension import ZStandard

            writer = FileSystemWriter(path, _extensions=[ZStandard()])
        else:
            writer = FileSystemWriter(path)  # sync_files=True: fsyncs
        dcp.save(sd, storage_writer=writer)

    def load(self, wl, step, like):
        from torch.distributed.checkpoint import FileSystemReader

        dcp = quiet_dcp()
        dcp.load(like, storage_reader=FileSystemReader(os.path.join(self.location(wl), f"step{step}")))
        return like


class FsspecSystem(System):
    def __init__(self, server: S3Server):
        self.server = server
        self.name = f"dcp-fsspec-{server.name}"

    def location(self, wl):
        return f"fsspec-{wl}"

    def save(self, sd, wl, step):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        dcp = quiet_dcp()
        url = f"s3://{BUCKET}/{self.location(wl)}/step{step}"
        dcp.save(sd, storage_writer=FsspecWriter(url, **self.server.storage_options()))

    def load(self, wl, step, like):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp = quiet_dcp()
        url = f"s3://{BUCKET}/{self.location(wl)}/step{step}"
        dcp.load(like, storage_reader=FsspecReader(url, **self.server.storage_options()))
        return like

    def stored(self, wl):
        return self.server.prefix_bytes(self.location(wl))

    def cleanup(self, wl):
        self.server.delete_prefix(self.location(wl))


class S3PeerSystem(System):
    """A peer on an S3 server: one checkpoint per step under ``<name>-<wl>/step<N>``."""

    prefix = ""

    def __init__(self, server: S3Server):
        self.server = server
        self.name = f"{self.prefix}-{server.name}"

    def location(self, wl):
        return f"{self.prefix}-{wl}"

    def url(self, wl, step):
        return f"s3://{BUCKET}/{self.location(wl)}/step{step}"

    def stored(self, wl):
        return self.server.prefix_bytes(self.location(wl))

    def cleanup(self, wl):
        self.server.delete_prefix(self.location(wl))


class S3tcSystem(S3PeerSystem):
    """s3torchconnector's DCP ``S3StorageWriter`` / ``S3StorageReader`` (AWS's CRT client), defaults
    but for path-style addressing; its client finds the server through ``AWS_ENDPOINT_URL``."""

    prefix = "s3torchconnector"

    def _config(self):
        from s3torchconnector import S3ClientConfig

        return S3ClientConfig(force_path_style=True)

    def save(self, sd, wl, step):
        from s3torchconnector.dcp import S3StorageWriter

        dcp = quiet_dcp()
        with aws_env(self.server):
            dcp.save(sd, storage_writer=S3StorageWriter(REGION, self.url(wl, step), s3client_config=self._config()))

    def load(self, wl, step, like):
        from s3torchconnector.dcp import S3StorageReader

        dcp = quiet_dcp()
        with aws_env(self.server):
            dcp.load(like, storage_reader=S3StorageReader(REGION, self.url(wl, step), s3client_config=self._config()))
        return like


class TorchsnapshotSystem(S3PeerSystem):
    """torchsnapshot's ``Snapshot.take`` / ``Snapshot.restore`` (in place) on ``s3://``; its S3 plugin
    ignores storage options and finds the server through the ``AWS_*`` environment."""

    prefix = "torchsnapshot"

    def save(self, sd, wl, step):
        from torchsnapshot import Snapshot, StateDict

        with aws_env(self.server):
            Snapshot.take(path=self.url(wl, step), app_state={"model": StateDict(**sd)})

    def load(self, wl, step, like):
        from torchsnapshot import Snapshot, StateDict

        state = StateDict(**like)
        with aws_env(self.server):
            Snapshot(self.url(wl, step)).restore(app_state={"model": state})
        if all(state[k] is v for k, v in like.items()):
            return like
        return dict(state)


#: Optional peers: system class, the modules it needs, how to install them.
OPTIONAL_PEERS = {
    "s3torchconnector": (S3tcSystem, ("s3torchconnector", "s3torchconnector.dcp"), "make setup-bench"),
    "torchsnapshot": (TorchsnapshotSystem, ("torchsnapshot",), "make setup-bench"),
}


def optional_peers() -> tuple[list[type], list[str]]:
    """The optional peer classes that import here, and a line for each one that does not."""
    import importlib

    usable, skipped = [], []
    for name, (cls, modules, how) in OPTIONAL_PEERS.items():
        try:
            for m in modules:
                importlib.import_module(m)
        except Exception as e:
            skipped.append(f"{name}: skipped: {type(e).__name__}: {e} ({how})")
            continue
        usable.append(cls)
    return usable, skipped


class CkptSystem(System):
    """ckptstore: one handle per save sequence; a fresh handle for every load."""

    def __init__(self, tmp: str | None = None, server: S3Server | None = None, codec: str | None = None):
        self.tmp, self.server = tmp, server
        self.name = "ckptstore-local" if server is None else f"ckptstore-s3-{server.name}"
        self.options = {} if server is None else {"pack_size": S3_PACK_SIZE}
        self.suffix = ""
        if codec is not None:
            self.options["codec"] = codec
            self.suffix = "-nocompress" if codec == "raw" else f"-{codec}"
            self.name += self.suffix
        self.so = None if server is None else server.storage_options()
        self.repo = None
        self.infos: list = []

    def location(self, wl):
        return os.path.join(self.tmp, f"{wl}-ckpt{self.suffix}") if self.server is None else f"ckpt-{wl}{self.suffix}"

    def url(self, wl):
        return self.location(wl) if self.server is None else f"s3://{BUCKET}/{self.location(wl)}"

    def open(self, wl, count: bool = False):
        if not count:
            return ckptstore.open(self.url(wl), storage_options=self.so, **self.options)
        from ckptstore.repo.repository import Repository
        from ckptstore.storage import open_store
        from ckptstore.storage.wrappers import CountingStore

        return Repository(CountingStore(open_store(self.url(wl), self.so)), **self.options)

    def save(self, sd, wl, step):
        if self.repo is None:
            self.repo = self.open(wl)
            self.infos = []
        self.infos.append(self.repo.save(sd, step=step))
        return self.infos[-1].uploaded_bytes

    def end_saves(self):
        if self.repo is not None:
            self.repo.close()
            self.repo = None

    def load(self, wl, step, like):
        # In place, like DCP's loads (same work: no fresh 1 GiB to fault in).
        with self.open(wl) as repo:
            repo.load(step, into=like)
        return like

    def stored(self, wl):
        if self.server is None:
            return dir_bytes(self.location(wl))
        return self.server.prefix_bytes(self.location(wl))

    def cleanup(self, wl):
        self.end_saves()
        if self.server is None:
            shutil.rmtree(self.location(wl), ignore_errors=True)
        else:
            self.server.delete_prefix(self.location(wl))


def settle_disk() -> None:
    """Write out every dirty page before a timed save (``os.sync``, outside the timing).

    Otherwise a save pays for the write-back of what the row before it
    wrote (a 1 GiB DCP directory, a server's volume files), and which
    system follows which decides part of its time.
    """
    os.sync()


#: Threads for the raw-PUT yardstick (the best is taken; on a loopback
#: server sharing two cores fewer threads are often faster).
RAW_PUT_CONCURRENCY = (4, 16)
RAW_PUT_OBJECT = 16 * MiB


class RawPut:
    """Row label for raw PUTs against one server."""

    def __init__(self, server: S3Server):
        self.server = server
        self.name = f"raw-put-{server.name}"


def raw_put(server: S3Server, nbytes: int, concurrency: int) -> Timer:
    """PUT ``nbytes`` as 16 MiB objects from ``concurrency`` threads; returns the Timer.

    One reused random buffer (no data preparation in the timed part); boto3
    with the same integrity settings as ckptstore's S3 store (CRC32 header,
    no SHA-256 payload signing), so the yardstick is as cheap as an upload
    can be for this client.
    """
    import concurrent.futures as cf

    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                          aws_access_key_id=server.key, aws_secret_access_key=server.secret,
                          config=Config(proxies={}, max_pool_connections=max(10, concurrency),
                                        retries={"max_attempts": 1}, s3={"payload_signing_enabled": False}))
    body = os.urandom(RAW_PUT_OBJECT)
    sizes = [RAW_PUT_OBJECT] * (nbytes // RAW_PUT_OBJECT) + ([nbytes % RAW_PUT_OBJECT] if nbytes % RAW_PUT_OBJECT else [])
    mv = memoryview(body)

    def put(i):
        client.put_object(Bucket=BUCKET, Key=f"rawput/{i}", Body=mv[: sizes[i]].tobytes()
                          if sizes[i] != RAW_PUT_OBJECT else body)

    try:
        settle_disk()
        with Timer(server.pid) as tm:
            with cf.ThreadPoolExecutor(concurrency) as ex:
                list(ex.map(put, range(len(sizes))))
    finally:
        server.delete_prefix("rawput")
        client.close()
    return tm
