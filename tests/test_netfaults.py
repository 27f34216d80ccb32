"""Faults below the process: a TCP fault proxy in front of SeaweedFS, and SeaweedFS killed.

The FaultStore tests (test_reliability, test_soak) inject faults inside the
process. Here they happen on the wire and in the server:

* saves and loads through :class:`~ckptstore.testing.faultproxy.FaultProxy`
  with 5% of connections reset, closed half-way, stalled or slowed;
* SeaweedFS SIGKILLed in the middle of a save and started again on the same
  data (once at once, once only after the save gave up), then GC;
* SeaweedFS SIGKILLed in the middle of a load;
* a seeded soak of saves, loads, deletes and GCs through the proxy against a
  dict model.

Requests carry short timeouts here (``TIMEOUTS``) so that stalls cost
seconds, not the defaults' 15 s. Seeds: ``CKPTSTORE_NETFAULT_SEED`` (tests 1,
4; printed), ``CKPTSTORE_NETSOAK_OPS`` (soak length, default 200).
"""

from __future__ import annotations

import os
import random
import threading
import time

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore.errors import CkptStoreError, StaleBaseError, StepNotFoundError, StorageError
from ckptstore.format.layout import PACK_PREFIX
from ckptstore.storage.retry import RetryPolicy, RetryStore
from ckptstore.storage.s3 import S3Store
from ckptstore.storage.wrappers import WrapperStore
from ckptstore.testing.faultproxy import Fault, FaultProxy
from ckptstore.testing.seaweedfs import SeaweedFS

from .helpers import assert_tree_equal, bits_equal, flat_tensors, random_tensor

BUCKET = "ckpt-net"
#: Per-request timeouts through the proxy: a stall is detected in seconds.
TIMEOUTS = {"connect_timeout": 2, "read_timeout": 3}
#: 12 MiB packs in 5 MiB parts: saves use multipart uploads.
OPTS = dict(chunk_size=256 << 10, pack_size=12 << 20, part_size=5 << 20)


def _seed() -> int:
    return int(os.environ.get("CKPTSTORE_NETFAULT_SEED") or 17)


@pytest.fixture(scope="module")
def weed():
    """One SeaweedFS for the module (tests that kill it start it again)."""
    with SeaweedFS() as w:
        w.create_bucket(BUCKET)
        yield w


def _so(weed: SeaweedFS, endpoint: str | None = None, **timeouts) -> dict:
    so = weed.storage_options(endpoint)
    so.update(timeouts or TIMEOUTS)
    return so


def _upstream(weed: SeaweedFS) -> tuple[str, int]:
    return ("127.0.0.1", weed.port)


def _state(seed: int, mib: int = 8) -> dict:
    return {
        "model": {
            "w": random_tensor(torch.float32, (mib * 256, 1024), seed),  # mib MiB
            "h": random_tensor(torch.bfloat16, (1024, 700), seed + 1),
            "e": torch.randn(300, generator=torch.Generator().manual_seed(seed)),
        },
        "step": seed,
        "name": "net",
    }


def _bound(policy: RetryPolicy, connect: float, read: float) -> float:
    """Longest a call may take: the retry budget plus one last attempt
    (botocore's 3 tries, each up to connect + read timeout, backoff <= 3 s)."""
    return policy.max_total + 3 * (connect + read) + 3 + 10  # +10: a busy 2-core machine


# ---------------------------------------------------------------- 1. 5% of connections faulted
MIN_FAULTS = 6


def test_saves_and_loads_through_faulted_connections(weed):
    """Bit-exact or a clean error within the bound; no step committed without all its data."""
    seed = _seed()
    print(f"\nnetfaults: seed={seed} (CKPTSTORE_NETFAULT_SEED={seed} reproduces the fault sequence)", flush=True)
    url = f"s3://{BUCKET}/faulted-{seed}-{time.time_ns()}"
    policy = RetryPolicy(max_total=60)
    bound = _bound(policy, TIMEOUTS["connect_timeout"], TIMEOUTS["read_timeout"])
    direct = ckptstore.open(url, storage_options=_so(weed), **OPTS)
    with FaultProxy(_upstream(weed), seed=seed, rate=0.05, stall_seconds=5, max_after=256 << 10,
                    idle_close=0.05) as proxy:
        repo = ckptstore.open(url, storage_options=_so(weed, proxy.endpoint), retry=policy, **OPTS)
        committed: dict[int, dict] = {}
        failures: list[tuple[str, int, float, str]] = []
        slowest = 0.0
        sd = _state(seed, mib=4)
        rounds = 0
        # 5% of connections: about one fault per 20 (one whose byte offset
        # lies past what its connection carries never fires); the rounds go
        # on until MIN_FAULTS have fired. Which kinds fire depends on the
        # seed and on how the client pools connections; test_faultproxy.py
        # checks each kind, the stall test below one on a part upload.
        while rounds < 150 and (rounds < 4 or len(proxy.injected) < MIN_FAULTS):
            rounds += 1
            step = rounds
            sd = dict(sd, model=dict(sd["model"], h=random_tensor(torch.bfloat16, (1024, 700), seed + 100 * step)),
                      step=step)
            t0 = time.monotonic()
            try:
                repo.save(sd, step=step)
                committed[step] = sd
            except (StorageError, StaleBaseError) as ex:
                failures.append(("save", step, time.monotonic() - t0, str(ex)))
                assert "s3://" in str(ex), ex
                if step in direct.steps():  # the commit landed, its answer was lost
                    assert_tree_equal(direct.load(step), sd)
                    committed[step] = sd
            slowest = max(slowest, time.monotonic() - t0)
            for s in sorted({step, random.Random(seed + step).choice(sorted(committed) or [step])} & set(committed)):
                t0 = time.monotonic()
                try:
                    got = repo.load(s)
                    assert_tree_equal(got, committed[s])
                    part = repo.checkpoint(s).read("model.w", index=(slice(100, 900), slice(3, 1000)))
                    assert bits_equal(part, committed[s]["model"]["w"][100:900, 3:1000])
                except StorageError as ex:
                    failures.append(("load", s, time.monotonic() - t0, str(ex)))
                    assert f"step {s}" in str(ex) and "s3://" in str(ex), ex
                slowest = max(slowest, time.monotonic() - t0)
        retries, gave_up = repo.store.retries, repo.store.gave_up
        repo.close()
        injected = list(proxy.injected)
        counts = proxy.counts()
        stats = (f"rounds={rounds} connections={proxy.connections} idle_closed={proxy.idle_closed} "
                 f"faults={counts} retries={retries} gave_up={gave_up} failures={len(failures)} "
                 f"slowest_op={slowest:.1f}s bound={bound:.0f}s")
    print(f"netfaults: seed={seed} {stats}", flush=True)
    for f in failures:
        print("netfaults: clean failure", f[:3], f[3][:200])
    # Nothing committed without its data; everything committed is bit-exact.
    assert sorted(direct.steps()) == sorted(committed), (seed, stats)
    rep = direct.verify(read_data=True)
    assert rep.ok, f"seed {seed}: {rep}"
    for s, exp in committed.items():
        assert_tree_equal(direct.load(s), exp)
    assert len(injected) >= MIN_FAULTS, f"seed {seed}: only {len(injected)} faults fired ({stats})"
    assert committed, f"seed {seed}: no save got through ({stats})"
    assert slowest < bound, f"seed {seed}: an operation took {slowest:.0f} s ({stats})"
    direct.close()


def test_stalled_part_upload_is_cut_by_the_timeout_and_retried(weed):
    """The first request body past 1 MiB (a multipart part) stops moving for
    60 s; the client's read timeout (3 s) ends the wait and the part goes
    again on a new connection: the save completes bit-exact long before the
    stall would have ended."""
    url = f"s3://{BUCKET}/stall-{time.time_ns()}"
    stall = 60.0
    with FaultProxy(_upstream(weed), rate=1.0, max_faults=1, stall_seconds=stall) as proxy:
        proxy.plan = lambda i: Fault("stall", "up", 1 << 20, stall)
        repo = ckptstore.open(url, storage_options=_so(weed, proxy.endpoint), **OPTS)
        sd = _state(31, mib=8)
        t0 = time.monotonic()
        repo.save(sd, step=1)
        took = time.monotonic() - t0
        retries = repo.store.retries
        repo.close()
        assert proxy.counts()["stall"] == 1
    print(f"\nstalled upload: save took {took:.1f} s through a {stall:.0f} s stall (read timeout "
          f"{TIMEOUTS['read_timeout']} s), RetryStore retries {retries}", flush=True)
    assert took < stall
    direct = ckptstore.open(url, storage_options=_so(weed), **OPTS)
    assert_tree_equal(direct.load(1), sd)
    assert direct.store.list_multipart() == []
    direct.close()


@pytest.mark.parametrize("kind", ["close", "reset"])
def test_a_cut_range_read_resumes_on_a_new_connection(weed, kind):
    """A ranged GET whose response is cut 3 MiB in: the retry asks only for
    the rest (bytes already read are kept), and the range comes back whole."""
    data = np.random.default_rng(5).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
    key = f"packs/cut-{kind}-{time.time_ns()}"
    S3Store(f"{BUCKET}/net", _so(weed)).put(key, data)
    with FaultProxy(_upstream(weed), rate=1.0, max_faults=1) as proxy:
        proxy.plan = lambda i: Fault(kind, "down", 3 << 20) if i == 0 else None
        spy = _Starts(S3Store(f"{BUCKET}/net", _so(weed, proxy.endpoint)))
        store = RetryStore(spy, RetryPolicy(max_attempts=3), sleep=lambda s: None)
        out = bytearray(len(data) - 1000)
        seen: list[int] = []
        store.read_range_into(key, 1000, out, seen.append)
        assert proxy.counts()[kind] == 1
    assert bytes(out) == data[1000:]
    assert store.retries == 1 and len(spy.starts) == 2
    resumed = spy.starts[1] - 1000
    assert 0 < resumed < 3 << 20 and resumed in seen  # from the last byte reported
    assert seen == sorted(seen) and seen[-1] == len(out)
    store.close()


class _Starts(WrapperStore):
    def __init__(self, inner):
        super().__init__(inner)
        self.starts: list[int] = []

    def read_range_into(self, key, start, out, progress=None):
        self.starts.append(start)
        return self.inner.read_range_into(key, start, out, progress)


# ---------------------------------------------------------------- 2. server killed mid-save
def _packs(store) -> set[str]:
    return {o.key.rsplit("/", 1)[-1][:-5] for o in store.list(PACK_PREFIX) if o.key.endswith(".pack")}


def _referenced(repo) -> set[str]:
    return {c.pack for s in repo.steps() for c in repo.chunks(s)}


def _kill_when(weed: SeaweedFS, proxy: FaultProxy, up_bytes: int, restart: bool, log: list) -> threading.Thread:
    """SIGKILL the server once ``up_bytes`` more bytes went up through the proxy."""
    start = proxy.bytes_up

    def run():
        deadline = time.monotonic() + 120
        while proxy.bytes_up - start < up_bytes and time.monotonic() < deadline:
            time.sleep(0.005)
        log.append(("kill", proxy.bytes_up - start))
        weed.kill()
        proxy.drop_all()
        if restart:
            weed.start()
            log.append(("restarted", weed.ready_seconds))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_server_sigkilled_mid_save_and_restarted(weed):
    url = f"s3://{BUCKET}/killsave-{time.time_ns()}"
    direct = ckptstore.open(url, storage_options=_so(weed), **OPTS)
    expected = {s: _state(10 + s) for s in (1, 2)}
    for s, sd in expected.items():
        direct.save(sd, step=s)
    log: list = []
    outcomes = {}
    try:
        with FaultProxy(_upstream(weed)) as proxy:
            # a: restarted at once; the save's retries (60 s budget) may carry it through.
            repo = ckptstore.open(url, storage_options=_so(weed, proxy.endpoint), retry=RetryPolicy(max_total=60),
                                  **OPTS)
            sd3 = _state(13, mib=16)
            killer = _kill_when(weed, proxy, 6 << 20, restart=True, log=log)
            try:
                repo.save(sd3, step=3)
                outcomes[3] = "completed through retries"
                expected[3] = sd3
            except (StorageError, StaleBaseError) as ex:
                outcomes[3] = f"failed cleanly: {type(ex).__name__}: {str(ex)[:160]}"
            killer.join()
            repo.close()
            # b: restarted only after the save gave up (a 4-attempt, 4 s budget).
            repo = ckptstore.open(url, storage_options=_so(weed, proxy.endpoint),
                                  retry=RetryPolicy(max_attempts=4, max_total=4), **OPTS)
            uploads_before = {u.upload_id for u in direct.store.list_multipart()}
            killer = _kill_when(weed, proxy, 6 << 20, restart=False, log=log)
            with pytest.raises(StorageError) as ei:
                repo.save(_state(14, mib=16), step=4)
            outcomes[4] = f"failed cleanly: {type(ei.value).__name__}: {str(ei.value)[:160]}"
            assert "s3://" in str(ei.value)
            killer.join()
            repo.close()
    finally:
        weed.start()  # on the same data
    print(f"\nkill mid-save: {log} outcomes {outcomes}", flush=True)

    check = ckptstore.open(url, storage_options=_so(weed), **OPTS)
    assert check.steps() == sorted(expected), outcomes
    for s, sd in expected.items():
        assert_tree_equal(check.load(s), sd)
    rep = check.verify(read_data=True)
    assert rep.ok, str(rep)
    # What the failed save left: an open multipart upload (it died mid-part),
    # its lease, and any pack it finished before. GC leaves them while young ...
    orphans = _packs(check.store) - _referenced(check)
    leftover_uploads = {u.upload_id for u in check.store.list_multipart(PACK_PREFIX)} - uploads_before
    leases = [o.key for o in check.store.list("leases/")]
    assert leftover_uploads and leases, (orphans, leftover_uploads, leases)
    plan = check.plan_gc(keep_last=100)
    assert not {p for p, _ in plan.delete_packs} & orphans
    assert not {u.upload_id for u in plan.abort_uploads} & leftover_uploads
    # ... and reclaims them once the grace period has passed (GC's clock runs ahead).
    ahead = check.grace() + check.store.mtime_resolution + 60
    plan = check.plan_gc(keep_last=100, clock=lambda: time.time() + ahead)
    assert {p for p, _ in plan.delete_packs} == orphans
    assert leftover_uploads <= {u.upload_id for u in plan.abort_uploads}
    res = plan.execute()
    assert not res.deleted_steps
    assert _packs(check.store) == _referenced(check)
    assert check.store.list_multipart(PACK_PREFIX) == []
    assert list(check.store.list("leases/")) == []
    assert check.verify(read_data=True).ok
    for s, sd in expected.items():
        assert_tree_equal(check.load(s), sd)
    check.close()
    direct.close()


# ---------------------------------------------------------------- 3. server killed mid-load
def test_server_sigkilled_mid_load_fails_naming_step_and_object(weed):
    """Default retry policy and S3 retries; fails within the stated bound."""
    url = f"s3://{BUCKET}/killload-{time.time_ns()}"
    direct = ckptstore.open(url, storage_options=_so(weed), **OPTS)
    sd = _state(21, mib=24)
    direct.save(sd, step=7)
    policy = RetryPolicy()
    bound = _bound(policy, TIMEOUTS["connect_timeout"], TIMEOUTS["read_timeout"])
    log: list = []
    try:
        # Every response slowed (1 ms per 64 KiB) so the kill lands mid-load.
        with FaultProxy(_upstream(weed), rate=1.0, kinds=("latency",), directions=("down",), max_after=1,
                        latency_seconds=0.001) as proxy:
            repo = ckptstore.open(url, storage_options=_so(weed, proxy.endpoint), **OPTS)
            start = proxy.bytes_down
            t_kill = [0.0]

            def killer():
                while proxy.bytes_down - start < (4 << 20):
                    time.sleep(0.002)
                t_kill[0] = time.monotonic()
                weed.kill()
                proxy.drop_all()
                log.append(("killed after", proxy.bytes_down - start))

            th = threading.Thread(target=killer, daemon=True)
            th.start()
            out = None
            with pytest.raises(StorageError) as ei:
                out = repo.load(7)
            elapsed = time.monotonic() - t_kill[0]
            th.join()
            assert out is None  # nothing handed back as if complete
            gave_up = repo.store.gave_up
            repo.close()
    finally:
        weed.start()
    msg = str(ei.value)
    print(f"\nkill mid-load: {log} failed {elapsed:.1f} s after the kill (bound {bound:.0f} s), "
          f"gave_up={gave_up}: {msg[:300]}", flush=True)
    assert "step 7" in msg and f"{url}/packs/" in msg and ".pack" in msg, msg
    assert elapsed < bound, (elapsed, msg)
    assert isinstance(ei.value, CkptStoreError)
    assert_tree_equal(direct.load(7), sd)  # the data itself is fine once the server is back
    direct.close()


# ---------------------------------------------------------------- 4. seeded soak through the proxy
SOAK_OPTS = dict(chunk_size=8 << 10, pack_size=256 << 10, part_size=5 << 20)


def _small_state(rng: random.Random, pool: list[torch.Tensor], step: int) -> dict:
    g = torch.Generator().manual_seed(rng.getrandbits(63))
    picks = rng.sample(range(len(pool)), rng.randint(1, 3))
    model = {f"shared{i}": pool[i] for i in picks}
    n = rng.choice([1, 500, 4000, 20000])
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.uint8])
    model["fresh"] = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)
    return {"model": model, "step": step, "lr": rng.random()}


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


def test_seeded_soak_through_the_fault_proxy(weed):
    seed = _seed()
    n_ops = int(os.environ.get("CKPTSTORE_NETSOAK_OPS") or 200)
    print(f"\nnetsoak: seed={seed} ops={n_ops} (CKPTSTORE_NETFAULT_SEED={seed} CKPTSTORE_NETSOAK_OPS={n_ops})",
          flush=True)
    rng = random.Random(seed)
    url = f"s3://{BUCKET}/soak-{seed}-{time.time_ns()}"
    direct = ckptstore.open(url, storage_options=_so(weed), **SOAK_OPTS)
    timeouts = {"connect_timeout": 1, "read_timeout": 1}
    # Small operations reuse pooled connections for many requests, so the
    # idle close is short and the rate higher than test 1's 5% to fault
    # a few dozen connections in a couple of hundred operations.
    proxy = FaultProxy(_upstream(weed), seed=seed, rate=0.1, stall_seconds=2, max_after=4 << 10,
                       idle_close=0.005).start()
    repo = ckptstore.open(url, storage_options=_so(weed, proxy.endpoint, **timeouts),
                          retry=RetryPolicy(max_attempts=6, max_total=20), **SOAK_OPTS)
    pool = [torch.randn(rng.choice([500, 3000, 8000]), generator=torch.Generator().manual_seed(seed + i))
            for i in range(6)]
    committed: dict[int, dict] = {}
    maybe: dict[int, dict] = {}
    ops: dict[str, int] = {}
    failed: dict[str, int] = {}
    wrong: list[str] = []
    step = 0
    weights = {"save": 10, "load": 8, "read": 6, "delete": 2, "gc": 2, "steps": 2}
    names, w = list(weights), list(weights.values())

    def resolve(s: int) -> None:
        """After a failed save or delete: ask the server directly what happened."""
        exp = maybe.pop(s)
        if s in direct.steps():
            if not _same(exp, direct.load(s)):
                wrong.append(f"step {s} exists after a failed operation but loads other data")
            committed[s] = exp

    try:
        for n in range(1, n_ops + 1):
            op = rng.choices(names, w)[0]
            ops[op] = ops.get(op, 0) + 1
            try:
                if op == "save":
                    step += 1
                    sd = _small_state(rng, pool, step)
                    maybe[step] = sd
                    repo.save(sd, step=step)
                    committed[step] = maybe.pop(step)
                elif op in ("load", "read") and committed:
                    s = rng.choice(sorted(committed))
                    if op == "load":
                        if not _same(committed[s], repo.load(s)):
                            wrong.append(f"op {n}: load of step {s} returned other data")
                    else:
                        key, t = rng.choice(sorted(flat_tensors(committed[s]).items()))
                        a = rng.randrange(t.shape[0])
                        got = repo.checkpoint(s).read(key, index=(slice(a, t.shape[0]),))
                        if not bits_equal(got, t[a:]):
                            wrong.append(f"op {n}: read of {key} in step {s} returned other bytes")
                elif op == "delete" and len(committed) > 1:
                    s = rng.choice(sorted(committed))
                    maybe[s] = committed.pop(s)
                    repo.delete(s)
                    maybe.pop(s)
                elif op == "gc":
                    # GC's clock past the grace period: leftovers of failed saves go too.
                    ahead = repo.grace() + 120
                    plan = repo.plan_gc(keep_last=rng.randint(3, 8), clock=lambda: time.time() + ahead)
                    for s in plan.delete_steps:
                        if s in committed:
                            maybe[s] = committed.pop(s)
                    res = plan.execute()
                    for s in res.deleted_steps:
                        maybe.pop(s, None)
                    for s in list(maybe):
                        if s in plan.delete_steps:
                            resolve(s)
                elif op == "steps":
                    listed = set(repo.steps())
                    if set(committed) - listed or listed - set(committed) - set(maybe):
                        wrong.append(f"op {n}: steps() {sorted(listed)} vs model {sorted(committed)}")
            except (StorageError, StaleBaseError) as ex:
                if isinstance(ex, StepNotFoundError):
                    wrong.append(f"op {n} {op}: {ex}")
                failed[op] = failed.get(op, 0) + 1
                for s in list(maybe):
                    resolve(s)
    finally:
        retries, gave_up = repo.store.retries, repo.store.gave_up
        repo.close()
        proxy.stop()
    # ---- faults off: the model against the server
    listed = set(direct.steps())
    problems = list(wrong)
    problems += [f"committed step {s} is missing" for s in sorted(set(committed) - listed)]
    problems += [f"step {s} exists, the model says not" for s in sorted(listed - set(committed))]
    for s in sorted(listed & set(committed)):
        if not _same(committed[s], direct.load(s)):
            problems.append(f"step {s} does not load bit-exact")
    rep = direct.verify(read_data=True)
    problems += [f"verify: {p}" for p in rep.problems]
    print(f"netsoak: seed={seed} ops={dict(sorted(ops.items()))} clean_failures={dict(sorted(failed.items()))} "
          f"connections={proxy.connections} idle_closed={proxy.idle_closed} faults={proxy.counts()} "
          f"retries={retries} gave_up={gave_up} steps_committed={len(committed)} data_lost={len(problems)}",
          flush=True)
    direct.close()
    assert not problems, f"seed {seed}: " + "\n".join(problems[:30])
    assert len(proxy.injected) >= 10 and committed, f"seed {seed}: faults {proxy.counts()}"
