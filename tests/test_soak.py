"""Fault-injection soak on moto S3: thousands of small operations under transient faults.

A Repository over ``RetryStore(FaultStore(S3Store))`` runs randomly chosen
saves (small state dicts sharing tensors across steps, so dedup is
exercised; now and then one big enough for a multipart upload), loads,
slice reads, tags, deletes, GC runs and verifies while the FaultStore
injects transient errors, lost responses and delays, and now and then a
burst long enough to exhaust the retries. An operation may fail only
cleanly (StorageError after the retries, StaleBaseError); a model records
what each step must be. At the end, with faults off: every step the model
says is committed exists and loads bit-exact, a step whose save failed
either does not exist or loads bit-exact, nothing else exists, and
``verify(read_data=True)`` is clean.

Reproduce a run with ``CKPTSTORE_SOAK_SEED=<seed>`` (printed first);
``CKPTSTORE_SOAK_SECONDS`` (default 45) and ``CKPTSTORE_SOAK_OPS`` (default
5000) bound it.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from ckptstore.errors import RepositoryNotFoundError, StaleBaseError, StepNotFoundError, StorageError
from ckptstore.repo.repository import Repository
from ckptstore.storage.faults import FaultStore, transient
from ckptstore.storage.retry import RetryPolicy, RetryStore

from .helpers import bits_equal, flat_tensors

pytestmark = pytest.mark.slow  # thousands of operations under injected faults

# GC re-lists (and re-reads every tombstone, one GET each) whenever half the
# safety margin (min(10% of grace, 5 min)) has passed while it deletes; with
# a grace of a few seconds, once a re-read takes longer than that (~100
# tombstones on moto), it re-reads before every pack deletion and one GC run
# takes tens of seconds. So: a 30 s grace (re-read every 1.5 s; packs become
# collectable in the second half of a 45 s run), and GC every GC_EVERY
# operations (plus rarely at random).
GRACE = 30.0
GC_EVERY = 400
SMALL = dict(chunk_size=4096, pack_size=256 << 10, part_size=5 << 20)
BIG = dict(chunk_size=64 << 10, pack_size=16 << 20, part_size=5 << 20)  # 3-part multipart packs
CLEAN = (StorageError, StaleBaseError)  # failures allowed while faults are on
BURST_OPS = [
    ("put_if_absent", "manifests/*"),
    ("put", "*"),
    ("get_ranges", "*"),
    ("get", "*"),
    ("upload_part", "*"),
    ("complete_multipart", "*"),
    ("delete", "*"),
    ("list", "*"),
    ("head", "*"),
]


def _faults(fs: FaultStore) -> None:
    t = transient
    fs.add_fault(op="get_ranges", kind="error", error=t("SlowDown"), probability=0.08)
    fs.add_fault(op="upload_part", kind="error", error=t("InternalError"), probability=0.08)
    fs.add_fault(op="put", kind="error", error=t("SlowDown"), probability=0.07)
    fs.add_fault(op="put", kind="lose_response", probability=0.03)
    fs.add_fault(op="put_if_absent", kind="error", error=t("ServiceUnavailable"), probability=0.07)
    fs.add_fault(op="put_if_absent", kind="lose_response", probability=0.07)
    fs.add_fault(op="complete_multipart", kind="lose_response", probability=0.15)
    fs.add_fault(op="get", kind="error", error=t("SlowDown"), probability=0.03)
    fs.add_fault(op="head", kind="error", error=t("RequestTimeout"), probability=0.03)
    fs.add_fault(op="list", kind="error", error=t("InternalError"), probability=0.03)
    fs.add_fault(op="delete", kind="lose_response", probability=0.03)
    fs.add_fault(op="*", kind="delay", delay=0.005, probability=0.02)


class Model:
    """What the repository must hold."""

    def __init__(self):
        self.committed: dict[int, dict] = {}  # must exist, bit-exact
        self.maybe: dict[int, dict] = {}  # may exist; if so, bit-exact
        self.tags: dict[str, int] = {}
        self.maybe_tags: set[str] = set()


def _state(rng: random.Random, pool: list[torch.Tensor], step: int) -> dict:
    """A small state dict: some pool tensors (dedup), some fresh, plain values."""
    g = torch.Generator().manual_seed(rng.getrandbits(63))
    picks = rng.sample(range(len(pool)), rng.randint(1, 3))
    model = {f"shared{i}": pool[i] for i in picks}
    for j in range(rng.randint(1, 2)):
        n = rng.choice([1, 100, 1000, 3000, 5000])
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.uint8])
        raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
        model[f"fresh{j}"] = raw.view(dtype)
    model["mat"] = torch.randn(rng.randint(1, 40), 33, generator=g)
    return {"model": model, "step": step, "lr": rng.random()}


def _big_state(rng: random.Random, step: int) -> dict:
    g = torch.Generator().manual_seed(rng.getrandbits(63))
    return {"big": torch.randint(0, 256, (11 << 20,), dtype=torch.uint8, generator=g), "step": step}


def _same(expected: dict, got: dict) -> bool:
    if set(expected) != set(got):
        return False
    for k, v in expected.items():
        if isinstance(v, dict):
            if not isinstance(got[k], dict) or not _same(v, got[k]):
                return False
        elif isinstance(v, torch.Tensor):
            if not isinstance(got[k], torch.Tensor) or not bits_equal(v, got[k]):
                return False
        elif got[k] != v:
            return False
    return True


def test_fault_injection_soak(s3):
    seed = int(os.environ.get("CKPTSTORE_SOAK_SEED") or random.SystemRandom().randrange(2**32))
    seconds = float(os.environ.get("CKPTSTORE_SOAK_SECONDS", "45"))
    max_ops = int(os.environ.get("CKPTSTORE_SOAK_OPS", "5000"))
    print(f"\nsoak: seed={seed} (reproduce with CKPTSTORE_SOAK_SEED={seed})", flush=True)
    rng = random.Random(seed)

    fs = FaultStore(s3.store(), seed=seed)
    store = RetryStore(fs, RetryPolicy(max_attempts=8, base_delay=0.001, max_delay=0.02), seed=seed)
    repo = Repository(store, grace=GRACE, **SMALL)
    big_repo = Repository(store, grace=GRACE, **BIG)
    _faults(fs)

    model = Model()
    g0 = torch.Generator().manual_seed(seed)
    pool = [torch.randn(rng.choice([500, 2000, 4000]), generator=g0) for _ in range(8)]
    ops: dict[str, int] = {}
    spent: dict[str, float] = {}
    failed: dict[str, int] = {}
    wrong: list[str] = []  # wrong bytes handed out, or committed data unreadable
    unexpected: list[str] = []
    saves_ok = 0
    step = 0
    n = 0
    t_end = time.monotonic() + seconds
    # reads are cheap on moto (~10 ms), saves ~8 requests, GC and verify
    # list and read everything: the mix keeps thousands of operations in 45 s
    # (and steps are deleted - by delete or GC - at well under 6 per second:
    # near that rate GC's re-reads of ~8 ms per tombstone outgrow half the
    # margin, and it re-reads before every pack deletion, quadratically)
    weights = {"save": 10, "load": 12, "read": 50, "tag": 4, "delete": 2, "gc": 0.1, "verify": 0.3,
               "steps": 8, "pool": 3, "big": 0.3}
    names, w = list(weights), list(weights.values())

    def clean_failure(op, ex, step_=None):
        if isinstance(ex, CLEAN):
            failed[op] = failed.get(op, 0) + 1
        else:
            unexpected.append(f"op {n} {op} step {step_}: {type(ex).__name__}: {ex}")

    while n < max_ops and time.monotonic() < t_end:
        n += 1
        op = "gc" if n % GC_EVERY == 0 else rng.choices(names, w)[0]
        ops[op] = ops.get(op, 0) + 1
        t_op = time.monotonic()
        if rng.random() < 0.015:  # a burst that outlasts the retries (or not)
            o, k = rng.choice(BURST_OPS)
            fs.add_fault(op=o, key=k, kind=rng.choice(["error", "lose_response"]) if o != "get_ranges" else "error",
                         count=rng.randint(3, 12))
        if op in ("save", "big"):
            step += 1
            sd = _big_state(rng, step) if op == "big" else _state(rng, pool, step)
            try:
                (big_repo if op == "big" else repo).save(sd, step=step, metadata={"n": n})
                model.committed[step] = sd
                saves_ok += 1
            except Exception as ex:  # noqa: BLE001
                model.maybe[step] = sd
                clean_failure(op, ex, step)
        elif op in ("load", "read") and model.committed:
            s = rng.choice(sorted(model.committed))
            exp = model.committed[s]
            try:
                if op == "load":
                    if not _same(exp, repo.load(s)):
                        wrong.append(f"op {n}: load of step {s} returned other data")
                else:
                    key, t = rng.choice(sorted(flat_tensors(exp).items()))
                    if t.dim() == 0 or t.shape[0] == 0:
                        idx = None
                        want = t
                    else:
                        a = rng.randrange(t.shape[0])
                        b = rng.randrange(a, t.shape[0]) + 1
                        idx = (slice(a, b),)
                        want = t[a:b]
                    got = repo.checkpoint(s).read(key, index=idx)
                    if not bits_equal(want, got):
                        wrong.append(f"op {n}: read {key}{idx} of step {s} returned other bytes")
            except Exception as ex:  # noqa: BLE001
                if isinstance(ex, CLEAN) and not isinstance(ex, StepNotFoundError):
                    failed[op] = failed.get(op, 0) + 1
                else:
                    wrong.append(f"op {n}: {op} of committed step {s}: {type(ex).__name__}: {ex}")
        elif op == "tag" and model.committed:
            s = rng.choice(sorted(model.committed))
            name = rng.choice(["best", "eval", "keep-me", "x.1"])
            try:
                repo.tag(s, name)
                model.tags[name] = s
                model.maybe_tags.discard(name)
            except Exception as ex:  # noqa: BLE001
                model.maybe_tags.add(name)
                clean_failure(op, ex, s)
        elif op == "delete" and len(model.committed) > 1:
            s = rng.choice(sorted(model.committed))
            sd = model.committed.pop(s)
            try:
                repo.delete(s)
            except Exception as ex:  # noqa: BLE001
                model.maybe[s] = sd
                clean_failure(op, ex, s)
        elif op == "gc":
            plan = None
            try:
                plan = repo.plan_gc(keep_last=rng.randint(4, 20), keep_every=rng.choice([None, 7]))
                res = plan.execute()
                for s in res.deleted_steps:
                    model.committed.pop(s, None)
                    model.maybe.pop(s, None)
            except RepositoryNotFoundError as ex:
                # before the first save created config.json, there is no repository to collect
                if model.committed:
                    wrong.append(f"op {n}: gc with steps {sorted(model.committed)} committed: {ex}")
            except Exception as ex:  # noqa: BLE001
                for s in plan.delete_steps if plan is not None else ():
                    if s in model.committed:
                        model.maybe[s] = model.committed.pop(s)
                clean_failure(op, ex)
        elif op == "verify":
            try:
                rep = repo.verify(read_data=rng.random() < 0.3)
                if not rep.ok:  # faults may hide objects from it; re-checked at the end
                    failed["verify-report"] = failed.get("verify-report", 0) + 1
            except RepositoryNotFoundError as ex:
                # before the first save created config.json, there is no repository to verify
                if model.committed:
                    wrong.append(f"op {n}: verify with steps {sorted(model.committed)} committed: {ex}")
            except Exception as ex:  # noqa: BLE001
                clean_failure(op, ex)
        elif op == "steps":
            try:
                listed = set(repo.steps())
                missing = set(model.committed) - listed
                extra = listed - set(model.committed) - set(model.maybe)
                if missing or extra:
                    wrong.append(f"op {n}: steps() missing {sorted(missing)} extra {sorted(extra)}")
            except Exception as ex:  # noqa: BLE001
                clean_failure(op, ex)
        elif op == "pool":  # training moves some shared tensors
            pool[rng.randrange(len(pool))] = pool[rng.randrange(len(pool))] + 1
        spent[op] = spent.get(op, 0.0) + time.monotonic() - t_op

    injected = sum(fs.injected.values())
    retries = store.retries

    # ---- faults off: check everything against the model
    fs.clear()
    final = Repository(s3.store(), grace=GRACE)
    listed = set(final.steps())
    data_lost = len(wrong)
    problems = list(wrong)
    for s in sorted(set(model.committed) - listed):
        problems.append(f"committed step {s} is missing")
    extra = listed - set(model.committed) - set(model.maybe)
    for s in sorted(extra):
        problems.append(f"step {s} exists but the model says it does not")
    verified = 0
    for s in sorted(listed & (set(model.committed) | set(model.maybe))):
        exp = model.committed.get(s, model.maybe.get(s))
        try:
            ok = _same(exp, final.load(s))
        except Exception as ex:  # noqa: BLE001
            ok = False
            problems.append(f"step {s}: {type(ex).__name__}: {ex}")
        if ok:
            verified += 1
        else:
            problems.append(f"step {s} does not load bit-exact")
    rep = final.verify(read_data=True)
    problems += [f"verify: {p}" for p in rep.problems]
    data_lost += len(problems) - len(wrong)
    tags = final.tags()
    for name, s in model.tags.items():
        if name not in model.maybe_tags and tags.get(name) != s:
            problems.append(f"tag {name} -> {tags.get(name)}, expected {s}")
    print(f"soak: ops {dict(sorted(ops.items()))} clean failures {dict(sorted(failed.items()))} "
          f"seconds {({k: round(v, 1) for k, v in sorted(spent.items())})} "
          f"faults {dict(fs.injected)} maybe-steps {len(model.maybe)} gave_up {store.gave_up}")
    print(f"soak: seed={seed} operations={n} faults_injected={injected} retries={retries} "
          f"steps_committed={saves_ok} steps_verified={verified} data_lost={data_lost}", flush=True)
    repo.close()
    big_repo.close()
    final.close()
    assert data_lost == 0, f"seed {seed}: " + "\n".join(problems[:30])
    assert not problems, f"seed {seed}: " + "\n".join(problems[:30])
    assert not unexpected, f"seed {seed}: " + "\n".join(unexpected[:30])
    assert n >= 100 and saves_ok > 0 and injected > 0
