"""The training job :mod:`benchmarks.distributed.crash_resume` kills and resumes: one rank's body.

    python -m benchmarks.distributed.crash_trainer     (a zygote forking ranks: see :func:`zygote`)

A small transformer (token embedding, ``layers`` pre-norm blocks of causal
self-attention and an MLP, each followed by dropout, a tied-free LM head),
every block and the root under FSDP2 ``fully_shard`` on a gloo CPU mesh,
AdamW, a warm-up + cosine ``LambdaLR``, torchdata's ``StatefulDataLoader``
(shuffled per epoch by :class:`EpochBatches`) over a synthetic Markov-chain token set, a
random crop (Python's ``random``) and random token noise (NumPy's global
RNG) on every batch, dropout from torch's RNG. The checkpoint holds all of
it: model and optimizer (``get_state_dict``), scheduler, dataloader, the
torch, NumPy and Python RNG states, and a :class:`TrainProgress` dataclass.

World-size independent by construction, so a run that changes its world
size stays on the same curve up to reduction order: every rank loads the
same *global* batch (the loader, the crop and the noise are drawn
identically on every rank, so their states are the same on every rank) and
takes its slice; dropout masks are drawn for the global batch from torch's
RNG (same state on every rank) and sliced the same way (``nn.Dropout``
would draw per-rank masks, which change with the world size).

Saves every ``save_every`` steps through ``CkptStoreWriter``, the save mode
cycling by save index through ``modes``: ``blocking`` (``dcp.save``),
``async`` (``dcp.async_save`` on a process group of its own; the next save
waits for it) and ``writeback`` (``cache_dir`` + ``write_back=True``: the
save returns once durable in the node-local tier; its uploads drain in the
background while training goes on, flushed before the next save of another
mode). Resumes from the newest committed step through ``CkptStoreReader``
after finishing what a killed job left pending in the tier.

Rank 0 prints one JSON event per line on stdout (``EV {...}``): ``start``
(the step resumed from), ``step`` (the global loss, as ``float.hex``),
``save`` (a save began), ``durable`` (a save returned, or its async upload
finished), ``phase`` (a stall hook fired, see :class:`Hooks`), ``done``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

MODES = ("blocking", "async", "writeback")


@dataclasses.dataclass
class TrainConfig:
    """Everything a job needs; the driver passes it as JSON."""

    url: str
    cache_dir: str
    steps: int = 48
    save_every: int = 4
    modes: tuple = MODES
    seed: int = 1234
    vocab: int = 64
    dim: int = 64
    heads: int = 4
    layers: int = 2
    seq: int = 32
    global_batch: int = 8
    samples: int = 256  # 32 global batches an epoch: long runs cross epochs
    dropout: float = 0.1
    lr: float = 3e-3
    warmup: int = 5
    stop_at: int | None = None  # exit cleanly once the save of this step is durable
    stall: dict | None = None  # {"kind": ..., "from": step, "secs": s}: the hook to fire (see Hooks)


@dataclasses.dataclass
class TrainProgress:
    """Trainer bookkeeping saved as a dataclass of plain values (a DCP bytes item)."""

    step: int = 0
    tokens: int = 0
    epoch: int = 0
    at: datetime.datetime = datetime.datetime(2025, 1, 1)


def save_mode(cfg: TrainConfig, step: int) -> str:
    """How the save of ``step`` (a multiple of ``save_every``) is made: the modes in turn."""
    return cfg.modes[(step // cfg.save_every - 1) % len(cfg.modes)]


# ------------------------------------------------------------------ model
class GlobalDropout(nn.Module):
    """Dropout whose mask is drawn for the global batch and sliced to this rank's rows."""

    def __init__(self, p: float, rank: int, world: int):
        super().__init__()
        self.p, self.rank, self.world = p, rank, world

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        b = x.shape[0]
        keep = torch.rand((b * self.world, *x.shape[1:]))[self.rank * b:(self.rank + 1) * b] >= self.p
        return x * keep / (1 - self.p)


class Block(nn.Module):
    def __init__(self, cfg: TrainConfig, rank: int, world: int):
        super().__init__()
        d = cfg.dim
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop1 = GlobalDropout(cfg.dropout, rank, world)
        self.drop2 = GlobalDropout(cfg.dropout, rank, world)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop1(self.proj(a))
        return x + self.drop2(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class TinyLM(nn.Module):
    def __init__(self, cfg: TrainConfig, rank: int, world: int):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg, rank, world) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


# ------------------------------------------------------------------ data
class MarkovTokens(torch.utils.data.Dataset):
    """Sequences from a fixed random Markov chain (each token has a few likely successors): learnable."""

    def __init__(self, cfg: TrainConfig):
        rs = np.random.RandomState(cfg.seed)
        trans = rs.dirichlet(np.full(cfg.vocab, 0.05), size=cfg.vocab)
        n = cfg.seq + 1 + 4  # room for the random crop
        seqs = np.empty((cfg.samples, n), dtype=np.int64)
        seqs[:, 0] = rs.randint(0, cfg.vocab, cfg.samples)
        cum = trans.cumsum(1)
        for j in range(1, n):
            u = rs.random_sample(cfg.samples)
            seqs[:, j] = np.minimum((cum[seqs[:, j - 1]] < u[:, None]).sum(1), cfg.vocab - 1)
        self.seqs = torch.from_numpy(seqs)

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i]


class EpochBatches:
    """Shuffled batches, each epoch's order drawn from ``(seed, epoch)``; a stateful batch sampler.

    ``StatefulDataLoader(shuffle=True)`` (torchdata 0.11) does not resume
    exactly across epochs: restored mid-epoch, the *next* epoch's order
    differs from an uninterrupted run's (its sampler's generator is shared
    with the loader's per-``iter()`` seed draw; restored in a later epoch,
    it replays the first epoch's order). This run found it (a divergence
    at the first step of epoch 2). The loader saves and restores this
    sampler's ``state_dict`` instead of fast-forwarding.
    """

    def __init__(self, n: int, batch: int, seed: int):
        self.n, self.batch, self.seed = n, batch, seed
        self.epoch, self.pos = 0, 0

    def __len__(self):
        return self.n // self.batch

    def __iter__(self):
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch))
        while self.pos + self.batch <= self.n:
            self.pos += self.batch
            yield perm[self.pos - self.batch:self.pos].tolist()
        self.epoch, self.pos = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])


def make_loader(cfg: TrainConfig):
    from torchdata.stateful_dataloader import StatefulDataLoader

    # generator=: the loader's own per-iter() seed draw (unused without workers) stays off torch's global RNG.
    return StatefulDataLoader(MarkovTokens(cfg), batch_sampler=EpochBatches(cfg.samples, cfg.global_batch, cfg.seed),
                              generator=torch.Generator(), num_workers=0)


def augment(batch: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """A random crop (Python's RNG) and random token noise (NumPy's), drawn for the global batch."""
    off = random.randint(0, 4)
    x = batch[:, off:off + cfg.seq + 1].clone()
    noise = np.random.rand(x.shape[0], cfg.seq) < 0.05
    repl = np.random.randint(0, cfg.vocab, size=(x.shape[0], cfg.seq))
    x[:, :-1][torch.from_numpy(noise)] = torch.from_numpy(repl[noise])
    return x


# ------------------------------------------------------------------ hooks
class Hooks:
    """Phase markers and stalls in the store calls of rank 0's saves (FaultStore rules used as hooks).

    The save in progress sets :attr:`mode` and :attr:`step`. A pack upload
    (``put``/``upload_part`` under ``packs/``) is a ``save`` phase during a
    blocking save, an ``async`` phase during an async one, a ``drain`` phase
    of a write-back save (the background uploads; a stall there first waits
    for the save to return, so the kill lands after it is durable in the
    tier); the manifest's exclusive create is the ``commit`` phase, between a save's
    uploads and its commit. When ``stall`` names the phase and the step is
    at least its ``from``, the first such call prints ``EV phase`` and
    sleeps ``secs`` (a commit stalls until the driver kills the job), so the
    kill lands inside that phase.
    """

    def __init__(self, stall: dict | None):
        self.mode: str | None = None
        self.step = 0
        self.stall = stall
        self._fired = False
        self._lock = threading.Lock()
        self.returned = threading.Event()  # the write-back save in progress has returned

    def _maybe_stall(self, kind: str, step: int) -> None:
        s = self.stall
        if s is None or s["kind"] != kind or step < s["from"]:
            return
        with self._lock:
            if self._fired:
                return
            self._fired = True
        if kind == "drain":
            # A write-back save's uploads start while its ranks still write the tier; the
            # drain proper is what runs after the save returned (durable in the tier).
            self.returned.wait(60)
        emit("phase", kind=kind, step=step)
        time.sleep(s["secs"])

    def on_pack(self, op, key):
        kind = {"blocking": "save", "async": "async", "writeback": "drain"}.get(self.mode)
        if kind is not None:
            self._maybe_stall(kind, self.step)
        return None

    def on_commit(self, op, key):
        from ckptstore.format.layout import step_of_manifest_key

        step = step_of_manifest_key(key)
        if step is not None:
            self._maybe_stall("commit", step)
        return None

    def install(self, repo) -> None:
        from ckptstore.storage.faults import FaultStore

        if isinstance(repo.store, FaultStore):
            return
        fs = FaultStore(repo.store)
        fs.add_rule("put", "packs/*", self.on_pack)
        fs.add_rule("upload_part", "packs/*", self.on_pack)
        fs.add_rule("put_if_absent", "manifests/*", self.on_commit)
        repo.store = fs


def hooked_writer(hooks: Hooks | None):
    from ckptstore.dcp import CkptStoreWriter

    class HookedWriter(CkptStoreWriter):
        def _get_repo(self):
            repo = super()._get_repo()
            if hooks is not None:
                hooks.install(repo)
            return repo

    return HookedWriter


def emit(ev: str, **kw) -> None:
    sys.stdout.write("EV " + json.dumps({"ev": ev, **kw}) + "\n")
    sys.stdout.flush()


# ------------------------------------------------------------------ the job
class Job:
    """One rank's trainer: built, resumed, trained, saved."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.cfg, self.rank, self.world = cfg, rank, world
        self.mesh = init_device_mesh("cpu", (world,))
        self.ckpt_group = dist.new_group(backend="gloo")  # saves' collectives, off the training group
        torch.manual_seed(cfg.seed)  # the same init, and the same dropout stream, on every rank
        np.random.seed(cfg.seed)
        random.seed(cfg.seed)
        self.model = TinyLM(cfg, rank, world)
        for blk in self.model.blocks:
            fully_shard(blk, mesh=self.mesh)
        fully_shard(self.model, mesh=self.mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.1)
        total = cfg.steps

        def lr_at(s):
            if s < cfg.warmup:
                return (s + 1) / cfg.warmup
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - cfg.warmup) / max(1, total - cfg.warmup))))

        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_at)
        self.loader = make_loader(cfg)
        self.it = None
        self.progress = TrainProgress()
        self.hooks = Hooks(cfg.stall) if rank == 0 else None
        self.writer_cls = hooked_writer(self.hooks)
        self.pending_async = None  # (step, future)
        self.wb_writer = None

    # -- checkpoint -----------------------------------------------------
    def state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd, "sched": self.sched.state_dict(), "loader": self.loader.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
                "progress": self.progress}

    def resume(self) -> int:
        import ckptstore
        from ckptstore.dcp import CkptStoreReader
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if self.rank == 0 and self.cfg.cache_dir:
            # Finish what a killed job left pending in the node-local tier: its write-back
            # steps are durable there and are committed before anything is loaded.
            with ckptstore.open(self.cfg.url, cache_dir=self.cfg.cache_dir, write_back=True) as r:
                r.flush()
        dist.barrier()
        with ckptstore.open(self.cfg.url) as r:
            latest = r.latest() if r.exists() else None
        if latest is None:
            return 0
        sd = self.state()
        dcp.load(sd, storage_reader=CkptStoreReader(self.cfg.url))
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.sched.load_state_dict(sd["sched"])
        self.loader.load_state_dict(sd["loader"])
        torch.set_rng_state(sd["rng"]["torch"])
        np.random.set_state(sd["rng"]["numpy"])
        random.setstate(sd["rng"]["python"])
        self.progress = sd["progress"]
        if self.progress.step != latest:
            raise RuntimeError(f"loaded progress.step {self.progress.step}, the newest committed step is {latest}")
        return latest

    def _finish_background(self, upto_mode: str | None) -> None:
        """The async save in flight done; the write-back drain flushed unless the next save is write-back."""
        if self.pending_async is not None:
            step, fut = self.pending_async
            fut.result()
            self.pending_async = None
            if self.rank == 0:
                emit("durable", step=step, mode="async")
        if self.wb_writer is not None and upto_mode != "writeback":
            self.wb_writer.flush()  # collective: every rank's uploads and the commit are done
            self.wb_writer = None

    def save(self, step: int) -> None:
        cfg = self.cfg
        mode = save_mode(cfg, step)
        self._finish_background(mode)
        if self.hooks is not None:
            self.hooks.mode, self.hooks.step = mode, step
            self.hooks.returned.clear()
        if self.rank == 0:
            emit("save", step=step, mode=mode)
        opts = {"process_group": self.ckpt_group}
        if mode == "writeback":
            opts.update(cache_dir=cfg.cache_dir, write_back=True)
        writer = self.writer_cls(cfg.url, step=step, **opts)
        if mode == "async":
            resp = dcp.async_save(self.state(), storage_writer=writer, process_group=self.ckpt_group)
            self.pending_async = (step, getattr(resp, "upload_completion", resp))
            return
        dcp.save(self.state(), storage_writer=writer, process_group=self.ckpt_group)
        if mode == "writeback":
            self.wb_writer = writer
        else:
            writer.close()
        if self.rank == 0:
            emit("durable", step=step, mode=mode)
            self.hooks.returned.set()

    # -- training --------------------------------------------------------
    def batch(self) -> torch.Tensor:
        if self.it is None:
            self.it = iter(self.loader)
        try:
            return next(self.it)
        except StopIteration:
            self.progress.epoch += 1
            self.it = iter(self.loader)
            return next(self.it)

    def train_step(self) -> float:
        cfg = self.cfg
        x = augment(self.batch(), cfg)
        b = cfg.global_batch // self.world
        x = x[self.rank * b:(self.rank + 1) * b]
        logits = self.model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), x[:, 1:].reshape(-1))
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item() / self.world

    def run(self) -> None:
        cfg = self.cfg
        start = self.resume()
        if self.rank == 0:
            emit("start", resume=start, world=self.world)
        for step in range(start + 1, cfg.steps + 1):
            loss = self.train_step()
            self.progress.step = step
            self.progress.tokens += cfg.global_batch * cfg.seq
            self.progress.at = TrainProgress.at + datetime.timedelta(seconds=step)
            if self.rank == 0:
                emit("step", step=step, loss=float(loss).hex())
            if step % cfg.save_every == 0:
                self.save(step)
            if cfg.stop_at is not None and step >= cfg.stop_at and step % cfg.save_every == 0:
                break
        self._finish_background(None)
        if self.rank == 0:
            emit("done", step=self.progress.step)


def run_rank(cfg: TrainConfig, rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    Job(cfg, rank, world).run()
    dist.barrier()
    dist.destroy_process_group()


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def zygote() -> None:
    """Fork rank processes on demand, everything already imported (a restart then takes ~1 s, not ~10).

    Reads one JSON command a line on stdin (``cfg``, ``rank``, ``world``,
    ``port``, ``pgid``: the job's process group, 0 to lead a new one,
    ``out``/``err``: files for the rank's stdout and stderr), forks the
    rank, prints ``PID <pid>``, waits for it and prints ``EXIT <status>``
    (negative: the signal that ended it). This process itself runs no torch
    op and starts no thread, so forking it is safe.
    """
    import warnings

    warnings.filterwarnings("ignore")
    _die_with_parent()
    import torch.distributed.checkpoint.state_dict  # noqa: F401 - imported once, here
    import torch.distributed.fsdp  # noqa: F401
    import torchdata.stateful_dataloader  # noqa: F401

    import ckptstore.dcp  # noqa: F401

    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _die_with_parent()  # a rank never outlives its zygote, nor a zygote the driver
                os.setpgid(0, cmd["pgid"])
                for fd, path in ((1, cmd["out"]), (2, cmd["err"])):
                    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(f, fd)
                    os.close(f)
                cfg = TrainConfig(**cmd["cfg"])
                cfg.modes = tuple(cfg.modes)
                run_rank(cfg, cmd["rank"], cmd["world"], cmd["port"])
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # gloo's threads may abort a normal interpreter exit
        try:
            os.setpgid(pid, cmd["pgid"] or pid)  # here too: the next rank may join before the child runs
        except OSError:
            pass  # the child got there first, or is gone already
        print(f"PID {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"EXIT {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    # Run the module under its own name: the checkpoint's TrainProgress must pickle as
    # benchmarks.distributed.crash_trainer.TrainProgress, which the driver has imported.
    from benchmarks.distributed.crash_trainer import zygote as _zygote

    _zygote()
