"""Crash-resume: a real training job SIGKILLed at random moments ends where an uninterrupted one ends.

Run from the repository root::

    python -m benchmarks.distributed.crash_resume [--world 4] [--steps 96] [--save-every 4] [--kills 20]
        [--seed N] [--no-resize] [--json OUT.json]

The job is :mod:`benchmarks.distributed.crash_trainer` (a small transformer
under FSDP2 on a gloo CPU mesh, AdamW, a LR scheduler, torchdata's
``StatefulDataLoader``, dropout, the torch, NumPy and Python RNG states in
the checkpoint), every rank a process of one process group, saving every
``--save-every`` steps through ``CkptStoreWriter`` (blocking, async and
write-back saves in turn) and resuming from the newest committed step
through ``CkptStoreReader``.

1. **Uninterrupted**: the reference run, on its own repository.
2. **Killed**: the same job, SIGKILLed as a whole (``killpg``) ``--kills``
   times at seeded moments, each of a kind drawn in turn from
   ``train`` (at a step's end, a few ms in), ``save`` (a blocking save
   stalled in its pack uploads), ``async`` (a ``dcp.async_save`` stalled
   in its background uploads while training goes on), ``drain`` (a
   write-back save's background uploads, ``cache_dir`` + ``write_back=True``)
   and ``commit`` (every pack and chunk table uploaded, the manifest's
   exclusive create about to run: the hooks of
   :class:`~benchmarks.distributed.crash_trainer.Hooks`, FaultStore rules as
   tests/crash_child.py uses them), restarted each time until the last step.
   After every kill: every committed step verifies (``read_data=True``) and
   equals the reference run's step bit for bit (no partial step is ever
   visible); the restart resumes exactly from the newest step committed
   (in the store, or durable in the tier and committed by the restart's
   flush), never older than the newest save that had returned; the steps
   lost are those since that step. Every loss the job prints (steps done
   again included) must equal the reference's bit for bit, and so must
   the final weights, optimizer state, scheduler, dataloader and RNG states.
3. **Resized** (``--world`` 4 only): the job run to a step on 4 ranks, resumed
   on 2, resumed on 4 again to the end. It must resume at the right steps;
   its losses are compared with the 4-rank reference against the noise of
   reduction order, measured as the largest gap between the 4-rank and a
   2-rank uninterrupted run.

``--json`` writes the figures; docs/reliability.md quotes them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from .crash_trainer import TrainConfig, save_mode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ("train", "save", "async", "drain", "commit")
STALL = {"save": 1.0, "async": 1.0, "drain": 1.0, "commit": 600.0}  # seconds a hook holds its phase
EVENT_TIMEOUT = 300.0


class HarnessError(AssertionError):
    """A requirement of the crash-resume run failed."""


# ------------------------------------------------------------------ a job
class Zygotes:
    """One pre-imported process per rank slot (:func:`crash_trainer.zygote`): each job's ranks are forked from them."""

    def __init__(self, n: int, logs: str):
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        self.procs = []
        self.lines: list[queue.Queue] = []
        for i in range(n):
            err = open(os.path.join(logs, f"zygote{i}.log"), "w")
            p = subprocess.Popen([sys.executable, "-m", "benchmarks.distributed.crash_trainer"], cwd=ROOT, env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1)
            err.close()
            q: queue.Queue = queue.Queue()
            threading.Thread(target=lambda p=p, q=q: [q.put(x.strip()) for x in p.stdout] + [q.put(None)],
                             daemon=True).start()
            self.procs.append(p)
            self.lines.append(q)
        for i in range(n):
            self.expect(i, "READY")

    def expect(self, i: int, prefix: str) -> str:
        try:
            line = self.lines[i].get(timeout=EVENT_TIMEOUT)
        except queue.Empty:
            line = None
        if line is None or not line.startswith(prefix):
            raise HarnessError(f"zygote {i}: expected {prefix!r}, got {line!r}")
        return line[len(prefix):].strip()

    def fork(self, i: int, cmd: dict) -> int:
        self.procs[i].stdin.write(json.dumps(cmd) + "\n")
        self.procs[i].stdin.flush()
        return int(self.expect(i, "PID"))

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


class RunningJob:
    """The ranks of one job (one process group), rank 0's events read from its stdout file on a thread."""

    def __init__(self, zyg: Zygotes, cfg: TrainConfig, world: int, logs: str, tag: str):
        from ckptstore.testing import free_port

        self.zyg, self.world = zyg, world
        self.events: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        self.logs = [os.path.join(logs, f"{tag}.rank{r}.log") for r in range(world)]
        self.out = os.path.join(logs, f"{tag}.events")
        open(self.out, "w").close()
        port, self.pgid, self.codes = free_port(), 0, None
        for r in range(world):
            pid = zyg.fork(r, {"cfg": dataclasses.asdict(cfg), "rank": r, "world": world, "port": port,
                               "pgid": self.pgid, "out": self.out if r == 0 else self.logs[r], "err": self.logs[r]})
            self.pgid = self.pgid or pid
        self._stop = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with open(self.out) as f:
            buf = ""
            while True:
                chunk = f.read()
                if chunk:
                    buf += chunk
                    *lines, buf = buf.split("\n")
                    for line in lines:
                        if line.startswith("EV "):
                            self.events.put(json.loads(line[3:]))
                elif self._stop.is_set():
                    break
                else:
                    time.sleep(0.005)
        self.events.put(None)

    def next(self, timeout: float = EVENT_TIMEOUT) -> dict | None:
        try:
            ev = self.events.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise HarnessError(f"no event from the job in {timeout:.0f} s; logs: {self.logs}") from None
        if ev is not None:
            self.seen.append(ev)
            if ev["ev"] == "done":
                self._stop.set()
        return ev

    def _reap(self) -> list[int]:
        if self.codes is None:
            self.codes = [int(self.zyg.expect(r, "EXIT")) for r in range(self.world)]
            self._stop.set()
        return self.codes

    def kill(self) -> None:
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._reap()

    def wait(self) -> None:
        codes = self._reap()
        bad = [(r, c) for r, c in enumerate(codes) if c != 0]
        if bad:
            tail = open(self.logs[bad[0][0]]).read()[-3000:]
            raise HarnessError(f"ranks exited with {bad}; rank {bad[0][0]}'s log ends:\n{tail}")


def losses(events: list[dict]) -> dict[int, str]:
    return {e["step"]: e["loss"] for e in events if e["ev"] == "step"}


def run_clean(zyg: Zygotes, cfg: TrainConfig, world: int, logs: str, tag: str) -> tuple[int, list[dict]]:
    """Run a job to its end (or ``stop_at``): (the step it resumed from, its events)."""
    job = RunningJob(zyg, cfg, world, logs, tag)
    while (ev := job.next()) is not None and ev["ev"] != "done":
        pass
    job.wait()
    start = next(e["resume"] for e in job.seen if e["ev"] == "start")
    return start, job.seen


# ------------------------------------------------------------------ comparing steps
def same(a, b, path: str = "") -> str | None:
    """None when ``a`` and ``b`` are the same bit for bit, else where they differ."""
    import torch

    from ckptstore.testing import bits_equal

    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        return None if bits_equal(a, b) else f"{path}: tensors differ"
    if isinstance(a, np.ndarray):
        return None if a.dtype == b.dtype and a.tobytes() == b.tobytes() and a.shape == b.shape else f"{path}: arrays differ"
    if dataclasses.is_dataclass(a):
        return same(vars(a), vars(b), path)
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(a)[:5]} != {list(b)[:5]}"
        return next((d for k in a if (d := same(a[k], b[k], f"{path}.{k}")) is not None), None)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: lengths {len(a)} != {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := same(x, y, f"{path}[{i}]")) is not None), None)
    if isinstance(a, float):
        return None if a.hex() == b.hex() else f"{path}: {a!r} != {b!r}"
    return None if a == b else f"{path}: {a!r} != {b!r}"


class StepChecker:
    """Every step the killed run committed verifies and equals the reference's same step."""

    def __init__(self, url: str, ref_url: str):
        self.url, self.ref_url = url, ref_url
        self.checked: set[int] = set()
        self.divergent: list[str] = []

    def check_new(self) -> list[int]:
        import ckptstore

        with ckptstore.open(self.url) as repo, ckptstore.open(self.ref_url) as ref:
            steps = repo.steps() if repo.exists() else []
            ref_steps = set(ref.steps())
            for s in steps:
                if s in self.checked:
                    continue
                if s not in ref_steps:
                    raise HarnessError(f"step {s} is committed, but the reference run never saved it")
                report = repo.verify(step=s, read_data=True)
                if not report.ok:
                    raise HarnessError(f"step {s} does not verify: {report}")
                d = same(repo.load(s), ref.load(s), f"step {s}")
                if d is not None:
                    self.divergent.append(d)
                self.checked.add(s)
        return steps


def newest_resumable(url: str, cache_dir: str) -> int:
    """The step a restart must resume from: the newest committed in the store or durable in the tier."""
    import ckptstore

    with ckptstore.open(url, cache_dir=cache_dir) as repo:
        steps = repo.steps(pending=True) if repo.exists() else repo.pending_steps()
    return max(steps, default=0)


# ------------------------------------------------------------------ the killed run
@dataclasses.dataclass
class Kill:
    kind: str
    at: int  # train: the step after which to kill; other kinds: the first step whose phase stalls
    delay: float  # seconds after the trigger event


NEEDS = {"save": "blocking", "async": "async", "drain": "writeback", "commit": None}


def _plan_next(rng: random.Random, left: list[str], start: int, cfg: TrainConfig, i: int, n: int) -> Kill | None:
    """Kill ``i`` of ``n`` after a resume at ``start``: a kind still to do whose moment lies ahead (None: none does).

    The kills are spread over the run: kill ``i`` aims at the ``i``-th of
    ``n`` equal stretches of it. ``train`` kills a few ms after the end of a
    random step between saves; the other kinds stall the first matching
    phase of a save that has it
    (:class:`~benchmarks.distributed.crash_trainer.Hooks`), so every planned
    kill fires. A kind whose last chance comes before the next stretch goes
    now; otherwise the kind with the nearest moment (ties drawn).
    """
    aim, aim_next = max(start + 1, i * cfg.steps // n), (i + 1) * cfg.steps // n
    saves = range(start + cfg.save_every - start % cfg.save_every, cfg.steps + 1, cfg.save_every)
    options = {}
    for kind in dict.fromkeys(left):
        if kind == "train":
            at = [s for s in range(start + 1, cfg.steps) if s % cfg.save_every]
        else:
            at = [s for s in saves if NEEDS[kind] in (None, save_mode(cfg, s))]
        if at:
            options[kind] = at
    if not options:
        return None
    urgent = sorted(k for k, v in options.items() if v[-1] < aim_next)
    if urgent:
        last = min(options[k][-1] for k in urgent)
        kind = rng.choice([k for k in urgent if options[k][-1] == last])
        at = next((s for s in options[kind] if s >= aim), options[kind][-1])
    else:
        first = {k: next(s for s in v if s >= aim) for k, v in options.items()}
        near = min(first.values())
        kind = rng.choice(sorted(k for k, f in first.items() if f == near))
        at = first[kind]
    left.remove(kind)
    if kind == "train":
        return Kill(kind, rng.choice([s for s in options[kind] if at <= s < at + cfg.save_every]), rng.uniform(0.0, 0.05))
    return Kill(kind, at, rng.uniform(0.0, 0.3 if kind == "commit" else STALL[kind] * 0.6))


def run_killed(zyg: Zygotes, cfg: TrainConfig, world: int, kills: int, seed: int, ref_url: str, logs: str,
               ref_losses: dict[int, str], log=print) -> dict:
    """The killed and restarted run; raises :class:`HarnessError` on any requirement broken."""
    rng = random.Random(seed)
    left = [KINDS[i % len(KINDS)] for i in range(kills)]
    checker = StepChecker(cfg.url, ref_url)
    expect, records, loss_mismatch, n = 0, [], [], 0
    while True:
        kill = _plan_next(rng, left, expect, cfg, len(records), kills) if left else None
        stall = None if kill is None or kill.kind == "train" else {"kind": kill.kind, "from": kill.at,
                                                                      "secs": STALL[kill.kind]}
        job = RunningJob(zyg, dataclasses.replace(cfg, stall=stall), world, logs, f"killed{n}")
        n += 1
        fired, last_step, durable, begun = False, expect, expect, expect
        while (ev := job.next()) is not None:
            if ev["ev"] == "start" and ev["resume"] != expect:
                job.kill()
                raise HarnessError(f"restart {n - 1} resumed from step {ev['resume']}, the newest committed step "
                                   f"is {expect}")
            if ev["ev"] == "step":
                last_step = ev["step"]
                if ref_losses.get(ev["step"]) != ev["loss"]:
                    loss_mismatch.append((ev["step"], ev["loss"], ref_losses.get(ev["step"])))
            elif ev["ev"] == "save":
                begun = ev["step"]
            elif ev["ev"] == "durable":
                durable = max(durable, ev["step"])
            elif ev["ev"] == "done":
                break
            if kill is not None and ((kill.kind == "train" and ev["ev"] == "step" and ev["step"] >= kill.at)
                                     or (ev["ev"] == "phase" and ev["kind"] == kill.kind)):
                time.sleep(kill.delay)
                job.kill()
                fired = True
                break
        if not fired:
            job.wait()
            if kill is not None:
                raise HarnessError(f"the planned kill {kill} never fired")
            break
        steps = checker.check_new()
        expect = newest_resumable(cfg.url, cfg.cache_dir)
        if expect < durable:
            raise HarnessError(f"kill {len(records)} ({kill.kind}): the save of step {durable} had returned, "
                               f"but the newest resumable step is {expect}")
        if expect > begun:
            raise HarnessError(f"kill {len(records)}: step {expect} is resumable, no save of it had begun")
        rec = {"kind": kill.kind, "fired": True, "at_step": last_step, "resume": expect,
               "lost_steps": last_step - expect, "committed": len(steps)}
        records.append(rec)
        log(f"  kill {len(records):2d} {kill.kind:7s} after step {last_step:3d}: resumes at {expect:3d} "
            f"({rec['lost_steps']} steps lost)")
    checker.check_new()
    final = max(checker.checked, default=None)
    if final != cfg.steps:
        raise HarnessError(f"the killed run's newest step is {final}, not {cfg.steps}")
    fired = [r for r in records if r["fired"]]
    return {"kills": len(fired), "not_planned": left,
            "by_kind": {k: sum(r["kind"] == k for r in fired) for k in KINDS},
            "lost_steps": [r["lost_steps"] for r in fired], "max_lost": max((r["lost_steps"] for r in fired), default=0),
            "divergences": len(checker.divergent) + len(loss_mismatch), "divergent": checker.divergent[:5],
            "loss_mismatches": loss_mismatch[:5], "steps_compared": len(checker.checked), "records": records}


# ------------------------------------------------------------------ resized
def run_resized(zyg: Zygotes, cfg: TrainConfig, plan: list[tuple[int, int | None]], logs: str, ref4: dict[int, str],
                ref2: dict[int, str], log=print) -> dict:
    """Run ``plan`` ((world, stop_at), ...) in turn; compare its losses with the 4-rank reference."""
    got: dict[int, str] = {}
    resumes, expect = [], 0
    for i, (world, stop) in enumerate(plan):
        start, events = run_clean(zyg, dataclasses.replace(cfg, stop_at=stop), world, logs, f"resized{i}")
        if start != expect:
            raise HarnessError(f"the {world}-rank leg resumed from step {start}, expected {expect}")
        resumes.append({"world": world, "resume": start})
        got.update(losses(events))
        expect = max(got)
        log(f"  {world} ranks: resumed at step {start}, ran to {expect}")
    steps = sorted(ref4)
    fl = lambda h: float.fromhex(h)  # noqa: E731
    noise = max(abs(fl(ref2[s]) - fl(ref4[s])) for s in steps)
    gap = max(abs(fl(got[s]) - fl(ref4[s])) for s in steps)
    first = next((s for s in steps if got[s] != ref4[s]), None)
    return {"plan": plan, "resumes": resumes, "noise_2_vs_4": noise, "max_gap_vs_4": gap,
            "first_differing_step": first, "within_noise": gap <= 2 * noise if noise else gap == 0,
            "noise_rel": noise / fl(ref4[steps[-1]])}


# ------------------------------------------------------------------ the whole run
def crash_resume(world: int = 4, steps: int = 96, save_every: int = 4, kills: int = 20, seed: int | None = None,
                 resize: bool = True, workdir: str | None = None, log=print, **train) -> dict:
    """The three runs; returns the figures (raises :class:`HarnessError` when a requirement fails)."""
    seed = random.SystemRandom().randrange(2**32) if seed is None else seed
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="crash-resume-")
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    base = TrainConfig(url="", cache_dir="", steps=steps, save_every=save_every, seed=seed % 10**6, **train)

    def cfg_for(name: str) -> TrainConfig:
        return dataclasses.replace(base, url=os.path.join(workdir, name), cache_dir=os.path.join(workdir, name + "-tier"))

    log(f"crash-resume: seed={seed} world={world} steps={steps} save_every={save_every} kills={kills} "
        f"(reproduce with --seed {seed}); work dir {workdir}")
    out = {"seed": seed, "world": world, "steps": steps, "save_every": save_every, "modes": list(base.modes)}
    zyg = None
    try:
        t = time.monotonic()
        zyg = Zygotes(world, logs)
        out["startup_s"] = round(time.monotonic() - t, 1)
        t = time.monotonic()
        ref = cfg_for("reference")
        _, ev = run_clean(zyg, ref, world, logs, "reference")
        ref_losses = losses(ev)
        out["uninterrupted_s"] = round(time.monotonic() - t, 1)
        log(f"  uninterrupted: {len(ref_losses)} steps in {out['uninterrupted_s']} s, "
            f"loss {float.fromhex(ref_losses[1]):.4f} -> {float.fromhex(ref_losses[steps]):.4f}")
        t = time.monotonic()
        out["killed"] = run_killed(zyg, cfg_for("killed"), world, kills, seed, ref.url, logs, ref_losses, log)
        out["killed_s"] = round(time.monotonic() - t, 1)
        k = out["killed"]
        log(f"  killed run: {k['kills']} kills survived ({k['by_kind']}), divergences {k['divergences']}, "
            f"steps lost per kill {k['lost_steps']} (max {k['max_lost']}), {k['steps_compared']} committed steps "
            f"compared, {out['killed_s']} s")
        if k["divergences"]:
            raise HarnessError(f"seed {seed}: {k['divergences']} divergences: {k['divergent']} {k['loss_mismatches']}")
        if resize and world == 4:
            _, ev2 = run_clean(zyg, cfg_for("reference2"), 2, logs, "reference2")
            third = (steps // 3) // save_every * save_every
            plan = [(4, third), (2, 2 * third), (4, None)]
            out["resized"] = run_resized(zyg, cfg_for("resized"), plan, logs, ref_losses, losses(ev2), log)
            r = out["resized"]
            log(f"  resized 4 -> 2 -> 4: resumed at {[x['resume'] for x in r['resumes']]}; largest loss gap to the "
                f"4-rank run {r['max_gap_vs_4']:.3g}, reduction-order noise (2- vs 4-rank runs) {r['noise_2_vs_4']:.3g}")
            if not r["within_noise"]:
                raise HarnessError(f"seed {seed}: the resized run left the curve: {r}")
    except Exception:
        log(f"crash-resume FAILED: seed={seed} (reproduce with --seed {seed}); logs in {logs}")
        own = False  # keep the evidence
        raise
    finally:
        if zyg is not None:
            zyg.close()
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--no-resize", action="store_true")
    ap.add_argument("--workdir", default=None, help="keep repositories and logs here (default: a temp dir, removed)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    out = crash_resume(a.world, a.steps, a.save_every, a.kills, a.seed, not a.no_resize, a.workdir)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
