"""Faults, retries, idempotent commit, hostile input, secrets, and a model-checked state machine."""

from __future__ import annotations

import ast
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

import ckptstore
from ckptstore.format import manifest as M, pack as P
from ckptstore.errors import (
    FormatError,
    HostNotResolvedError,
    IntegrityError,
    RepositoryNotFoundError,
    StepExistsError,
    StorageError,
    TransientStorageError,
)
from ckptstore.format.layout import manifest_key, parse_relocation
from ckptstore.repo.repository import Repository
from ckptstore.storage.faults import FaultStore, permanent, transient
from ckptstore.storage.memory import MemoryStore
from ckptstore.storage.retry import RetryPolicy, RetryStore

from .helpers import SMALL, assert_tree_equal

FAST = RetryPolicy(max_attempts=6, base_delay=0.001, max_delay=0.005, max_total=5.0)


# ------------------------------------------------------------------ retry wrapper
def test_transient_errors_are_retried_until_success():
    fs = FaultStore(MemoryStore(), seed=1)
    fs.inner.put("k", b"v")
    fs.add_fault(op="get", kind="error", error=transient("SlowDown"), count=3)
    rs = RetryStore(fs, FAST, seed=1)
    assert rs.get("k") == b"v"
    assert rs.retries == 3 and fs.injected["error"] == 3


def test_delete_many_is_retried_whole_on_a_transient_error():
    # The fault store deletes key by key (the base delete_many), so a fault
    # lands mid-batch; the retry sends the whole batch again (deleting twice
    # is harmless) and every key ends up deleted.
    fs = FaultStore(MemoryStore(), seed=1)
    for i in range(5):
        fs.inner.put(f"k{i}", b"v")
    fs.inner.put("keep", b"v")
    fs.add_fault(op="delete", key="k3", kind="error", error=transient("SlowDown"), count=2)
    rs = RetryStore(fs, FAST, seed=1)
    rs.delete_many([f"k{i}" for i in range(5)])
    assert [o.key for o in fs.inner.list()] == ["keep"]
    assert rs.retries == 2 and fs.injected["error"] == 2


def test_permanent_errors_fail_fast():
    fs = FaultStore(MemoryStore())
    fs.add_fault(op="put", kind="error", error=permanent("AccessDenied"), count=5)
    rs = RetryStore(fs, FAST)
    with pytest.raises(StorageError, match="AccessDenied"):
        rs.put("k", b"v")
    assert rs.retries == 0 and fs.injected["error"] == 1


def test_retries_are_bounded_in_attempts_and_time():
    fs = FaultStore(MemoryStore())
    fs.add_fault(op="head", kind="error", error=transient("InternalError"))
    rs = RetryStore(fs, FAST)
    with pytest.raises(TransientStorageError):
        rs.head("k")
    assert fs.injected["error"] == FAST.max_attempts and rs.gave_up == 1
    clock = _SimClock()  # the time bound, in simulated time (no wall-clock threshold)
    slow = RetryStore(fs, RetryPolicy(max_attempts=1000, base_delay=0.02, max_delay=0.05, max_total=0.2),
                      sleep=clock.sleep, monotonic=clock.monotonic)
    with pytest.raises(TransientStorageError):
        slow.head("k")
    assert 0 < clock.now <= 0.2 + 0.05 and len(clock.slept) < 1000


class _SimClock:
    """RetryStore's clock in simulated time: ``sleep`` advances ``monotonic``."""

    def __init__(self):
        self.now = 0.0
        self.slept = []

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s

    def monotonic(self) -> float:
        return self.now


def _unresolved(temporary: bool):
    """A FaultStore error factory: the host name of the store does not resolve."""

    def make(op, key):
        e = HostNotResolvedError(f"s3://b/{key}: S3 {op} failed: could not resolve host 'nohost.invalid'")
        e.temporary = temporary
        return e

    return make


def test_a_host_that_does_not_resolve_is_not_retried_for_minutes():
    policy = RetryPolicy(max_attempts=1000, base_delay=0.05, max_delay=5.0, max_total=120.0)
    # The resolver says the name does not exist: one attempt.
    fs = FaultStore(MemoryStore())
    fs.add_fault(op="head", kind="error", error=_unresolved(temporary=False))
    clock = _SimClock()
    rs = RetryStore(fs, policy, seed=1, sleep=clock.sleep, monotonic=clock.monotonic)
    with pytest.raises(HostNotResolvedError, match="could not resolve host 'nohost.invalid'"):
        rs.head("k")
    assert fs.injected["error"] == 1 and clock.slept == [] and rs.gave_up == 1
    # No answer from the resolver (no network): retried within max_unresolved only.
    fs = FaultStore(MemoryStore())
    fs.add_fault(op="head", kind="error", error=_unresolved(temporary=True))
    clock = _SimClock()
    rs = RetryStore(fs, policy, seed=1, sleep=clock.sleep, monotonic=clock.monotonic)
    with pytest.raises(HostNotResolvedError):
        rs.head("k")
    assert fs.injected["error"] > 1 and 0 < clock.now <= policy.max_unresolved
    # ... while a transient error still gets the whole budget
    fs = FaultStore(MemoryStore())
    fs.add_fault(op="head", kind="error", error=transient("SlowDown"))
    clock = _SimClock()
    rs = RetryStore(fs, policy, seed=1, sleep=clock.sleep, monotonic=clock.monotonic)
    with pytest.raises(TransientStorageError):
        rs.head("k")
    assert policy.max_total - policy.max_delay < clock.now <= policy.max_total


def test_backoff_is_jittered_exponential():
    rs = RetryStore(MemoryStore(), RetryPolicy(base_delay=1.0, max_delay=8.0), seed=3)
    samples = [[rs._backoff(a) for _ in range(200)] for a in (1, 2, 3, 4, 5)]
    for a, xs in enumerate(samples, start=1):
        cap = min(8.0, 2 ** (a - 1))
        assert max(xs) <= cap and min(xs) >= 0 and len(set(xs)) > 150


def test_remote_stores_get_retries_by_default(s3):
    repo = ckptstore.open(s3.url, storage_options=s3.storage_options)
    assert isinstance(repo.store, RetryStore)
    assert not isinstance(ckptstore.open(s3.url, storage_options=s3.storage_options, retry=False).store, RetryStore)
    assert not isinstance(ckptstore.open("memory://x-retry").store, RetryStore)


# ------------------------------------------------------------------ idempotent commit
def test_lost_commit_response_is_retried_and_accepted():
    fs = FaultStore(MemoryStore())
    repo = Repository(RetryStore(fs, FAST), **SMALL)
    fs.add_fault(op="put_if_absent", key="manifests/*", kind="lose_response", count=1)
    sd = {"w": torch.randn(10_000)}
    info = repo.save(sd, step=1)
    assert info.step == 1 and fs.injected["lose_response"] == 1
    assert_tree_equal(sd, Repository(fs.inner).load(1))


def test_lost_commit_response_with_a_different_winner_is_refused():
    fs = FaultStore(MemoryStore())
    repo = Repository(RetryStore(fs, FAST), **SMALL)
    other = Repository(fs.inner, **SMALL)

    def race(op, key):
        # the first create goes through for *another* writer, then our answer is lost
        other.save({"w": torch.zeros(10)}, step=1)
        return TransientStorageError("connection reset")

    fs.add_fault(op="put_if_absent", key="manifests/*", kind="error", error=race, count=1)
    with pytest.raises(StepExistsError, match="another writer"):
        repo.save({"w": torch.ones(10)}, step=1)
    assert torch.equal(Repository(fs.inner).load(1)["w"], torch.zeros(10))


def test_lost_multipart_complete_response_is_accepted():
    fs = FaultStore(MemoryStore())
    repo = Repository(RetryStore(fs, FAST), chunk_size=1 << 20, pack_size=64 << 20, part_size=5 << 20)
    fs.add_fault(op="complete_multipart", key="packs/*", kind="lose_response", count=1)
    sd = {"w": torch.randn(3 << 20)}  # 12 MiB: a multipart pack
    repo.save(sd, step=1)
    assert fs.injected["lose_response"] == 1
    assert_tree_equal(sd, Repository(fs.inner).load(1))


def test_silently_truncated_pack_write_is_caught_before_commit():
    fs = FaultStore(MemoryStore())
    repo = Repository(fs, **SMALL)
    fs.add_fault(op="put", key="packs/*", kind="truncate", count=1)
    with pytest.raises(StorageError, match="stored size"):
        repo.save({"w": torch.randn(10_000)}, step=1)
    assert repo.steps() == []


def test_corrupted_pack_write_is_caught_on_read():
    fs = FaultStore(MemoryStore())
    repo = Repository(fs, **SMALL)
    fs.add_fault(op="put", key="packs/*", kind="corrupt", count=1)
    repo.save({"w": torch.randn(10_000)}, step=1)  # same size: the commit cannot tell
    with pytest.raises(IntegrityError, match="step 1"):
        Repository(fs.inner).load(1)
    assert not Repository(fs.inner).verify(read_data=True).ok


def test_corrupted_read_never_returns_wrong_bytes():
    fs = FaultStore(MemoryStore())
    repo = Repository(fs, **SMALL)
    repo.save({"w": torch.randn(50_000)}, step=1)
    fs.add_fault(op="get_ranges", key="packs/*", kind="corrupt", count=1)
    with pytest.raises(IntegrityError):
        Repository(fs).load(1)
    fs.add_fault(op="get_ranges", key="packs/*", kind="truncate", count=1)
    with pytest.raises(IntegrityError):
        Repository(fs).load(1)


# ------------------------------------------------------------------ hostile input
def test_hostile_tensor_names():
    repo = Repository(MemoryStore(), **SMALL)
    names = {"a/b": 1, "../../../x": 2, "nul\x00byte": 3, "ü🙂名": 4, "x" * 4000: 5, "": 6, ".": 7}
    sd = {k: torch.full((3,), float(v)) for k, v in names.items()}
    repo.save(sd, step=1)
    assert_tree_equal(sd, repo.load(1))
    assert all(k.startswith(("packs/", "segments/", "manifests/", "config.json")) for k in (o.key for o in repo.store.list()))
    with pytest.raises(ValueError, match="limit"):
        repo.save({"y" * 5000: torch.ones(1)}, step=2)


def test_relocation_records_cannot_point_outside_the_prefix():
    good = {"format": "ckptstore.relocation", "version": [1, 0], "pack": "a" * 32, "chunks": {}}
    bad = dict(good, chunks={"b" * 64: ["../../../etc/passwd", 0, 1, 1, "raw"]})
    assert parse_relocation(json.dumps(good).encode(), "a" * 32) == {}
    with pytest.raises(FormatError):
        parse_relocation(json.dumps(bad).encode(), "a" * 32)
    with pytest.raises(FormatError):
        parse_relocation(json.dumps(dict(good, pack="c" * 32)).encode(), "a" * 32)


def test_huge_claims_are_refused_before_allocation(monkeypatch):
    repo = Repository(MemoryStore(), **SMALL)
    repo.save({"w": torch.randn(1000)}, step=1)
    doc = json.loads(repo.store.get(manifest_key(1)))
    doc["tensors"][0]["shape"] = [1 << 40, 1 << 20]
    repo.store.put(manifest_key(1), json.dumps(doc).encode())
    with pytest.raises(FormatError, match="limit"):
        Repository(repo.store).checkpoint(1)
    # a pack footer claiming 2^32 entries is refused before reading the table
    store = MemoryStore()
    footer = P.FOOTER.pack(16, 0xFFFFFFFF, b"\0" * 16, P.END_MAGIC)
    store.put("p", P.header() + footer)
    with pytest.raises(FormatError):
        P.read_table(store, "p")


_VALID_MANIFEST: bytes | None = None


def _valid_manifest() -> bytes:
    global _VALID_MANIFEST
    if _VALID_MANIFEST is None:
        repo = Repository(MemoryStore(), **SMALL)
        repo.save({"a": torch.randn(40_000), "n": {"lr": 0.1, "t": (1, 2)}}, step=1, metadata={"m": 1})
        _VALID_MANIFEST = repo.store.get(manifest_key(1))
    return _VALID_MANIFEST


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_manifest_parser_only_raises_format_errors(data):
    raw = bytearray(_valid_manifest())
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        i = data.draw(st.integers(0, len(raw) - 1))
        if op == "flip":
            raw[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del raw[i : i + data.draw(st.integers(1, 50))]
        else:
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=20))
        if not raw:
            raw = bytearray(b"{")
    try:
        M.from_json(bytes(raw))
    except FormatError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=30))
def test_fuzz_manifest_parser_with_arbitrary_json(doc):
    base = json.loads(_valid_manifest())
    for field in ("tensors", "packs", "tree", "metadata", "dcp", "step"):
        mutated = dict(base)
        mutated[field] = doc
        try:
            M.from_json(json.dumps(mutated).encode())
        except FormatError:
            pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 5))
def test_fuzz_pack_table_parser(blob, n):
    store = MemoryStore()
    # random bytes, and random bytes behind a plausible footer
    for data in (blob, P.header() + blob + P.FOOTER.pack(16, n, b"\0" * 16, P.END_MAGIC)):
        store.put("p", data)
        try:
            P.read_table(store, "p")
        except FormatError:
            pass


def test_no_code_path_unpickles_store_data():
    root = pathlib.Path(ckptstore.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        text = path.read_text()
        for pat in (r"pickle\.loads?\(", r"np\.load\(.*allow_pickle=True", r"cloudpickle", r"marshal\.loads"):
            if re.search(pat, text):
                offenders.append(f"{path.name}: {pat}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("torch.load", "load"):
                kw = {k.arg: k.value for k in node.keywords}
                if ast.unparse(node.func) == "torch.load" and not (
                    "weights_only" in kw and isinstance(kw["weights_only"], ast.Constant) and kw["weights_only"].value is True
                ):
                    offenders.append(f"{path.name}:{node.lineno}: torch.load without weights_only=True")
    assert not offenders, offenders


# ------------------------------------------------------------------ credentials
SECRET = "fAkE/SeCrEt+DoNotLeak0123456789abcdef"
KEY_ID = "AKIAFAKEKEYID0DONOTLEAK"


def test_secrets_never_leak(s3, tmp_path, caplog):
    so = dict(s3.storage_options, key=KEY_ID, secret=SECRET)
    caplog.set_level(logging.DEBUG)
    repo = ckptstore.open(s3.url, storage_options=so, **SMALL)
    repo.save({"w": torch.randn(10_000)}, step=1, metadata={"note": "hi"})
    texts = [repr(repo), repr(repo.store), repo.url, str(repo.stats())]
    # errors: a missing step, a missing bucket
    for bad in (lambda: repo.checkpoint(99), lambda: ckptstore.open("s3://no-such-bucket-zz/x", storage_options=so).steps()):
        try:
            bad()
        except Exception as e:  # noqa: BLE001 - we inspect every message
            texts.append(f"{type(e).__name__}: {e}")
    with pytest.raises(ValueError) as ei:
        ckptstore.open(f"s3://{KEY_ID}:{SECRET}@bucket/x")
    texts.append(str(ei.value))
    stored = [repo.store.get(o.key) for o in repo.store.list()]
    for t in texts:
        assert SECRET not in t and KEY_ID not in t, t[:500]
    # Logs: the secret key never appears, even in botocore's DEBUG request
    # dumps; the access key *id* does appear there (botocore logs the
    # Authorization header's Credential=), never in ckptstore's own records.
    for rec in caplog.records:
        msg = rec.getMessage()
        assert SECRET not in msg
        if rec.name.startswith("ckptstore"):
            assert KEY_ID not in msg
    for b in stored:
        assert SECRET.encode() not in b and KEY_ID.encode() not in b
    repo.close()


@pytest.mark.slow  # six CLI processes, each importing torch
def test_secrets_never_leak_from_the_cli(s3):
    so = dict(s3.storage_options, key=KEY_ID, secret=SECRET)
    with ckptstore.open(s3.url, storage_options=so, **SMALL) as repo:
        repo.save({"w": torch.randn(10_000)}, step=1, metadata={"note": "hi"})
    endpoint = s3.storage_options["client_kwargs"]["endpoint_url"]
    env = dict(os.environ, CKPTSTORE_DEBUG="1")  # tracebacks too
    for args in (["ls", s3.url, "--json"], ["show", s3.url, "1", "--json"], ["stats", s3.url, "--json"],
                 ["verify", s3.url, "--read-data", "--json"], ["show", s3.url, "42"],
                 ["gc", s3.url, "--keep-last", "1", "--dry-run", "--json"]):
        r = subprocess.run([sys.executable, "-m", "ckptstore.cli.main", *args, "-o", f"endpoint_url={endpoint}",
                            "-o", f"key={KEY_ID}", "-o", f"secret={SECRET}"],
                           capture_output=True, text=True, timeout=120, env=env)
        for t in (r.stdout, r.stderr):
            assert SECRET not in t and KEY_ID not in t, (args, t[:500])


# ------------------------------------------------------------------ model-checked state machine
class RepoMachine(RuleBasedStateMachine):
    """save / delete / tag / gc / load / verify against a dict model."""

    backend = "memory"
    steps = Bundle("steps")

    def __init__(self):
        super().__init__()
        if self.backend == "memory":
            self.store = MemoryStore()
        else:
            self._tmp = tempfile.TemporaryDirectory()
            from ckptstore.storage.local import LocalStore

            self.store = LocalStore(self._tmp.name, fsync=False)
        self.repo = Repository(self.store, chunk_size=4096, pack_size=64 << 10, part_size=5 << 20)
        self.model: dict[int, dict] = {}
        self.tags: dict[str, int] = {}
        self.created = False  # the first save creates the repository; reads refuse it before
        self.next_step = 1
        g = torch.Generator().manual_seed(0)
        self.pool = [torch.randn(3000, generator=g) for _ in range(4)]  # shared tensors: dedup

    def teardown(self):
        self.repo.close()
        if self.backend != "memory":
            self._tmp.cleanup()

    @rule(target=steps, picks=st.lists(st.integers(0, 3), min_size=1, max_size=3), fresh=st.booleans(),
          gap=st.integers(0, 3))
    def save(self, picks, fresh, gap):
        step = self.next_step + gap
        self.next_step = step + 1
        sd = {f"t{i}": self.pool[p] for i, p in enumerate(picks)}
        if fresh:
            sd["fresh"] = torch.randn(2000)
        sd["meta"] = {"step": step}
        self.repo.save(sd, step=step)
        self.created = True
        self.model[step] = sd
        return step

    @rule(step=steps)
    def save_existing_fails(self, step):
        if step in self.model:
            with pytest.raises(StepExistsError):
                self.repo.save({"x": torch.ones(1)}, step=step)

    @rule(step=steps)
    def delete(self, step):
        if step in self.model:
            self.repo.delete(step)
            del self.model[step]

    @rule(step=steps, name=st.sampled_from(["best", "keep", "x"]))
    def tag(self, step, name):
        if step in self.model:
            self.repo.tag(step, name)
            self.tags[name] = step

    @rule(keep_last=st.integers(0, 3))
    def gc(self, keep_last):
        if not self.created:
            with pytest.raises(RepositoryNotFoundError):
                self.repo.plan_gc(keep_last=keep_last, now=None)
            return
        plan = self.repo.plan_gc(keep_last=keep_last, now=None)
        plan.execute()
        ordered = sorted(self.model)
        keep = set(ordered[-keep_last:]) if keep_last else set()
        if ordered:
            keep.add(ordered[-1])
        keep |= {s for s in self.tags.values() if s in self.model}
        self.model = {s: v for s, v in self.model.items() if s in keep}

    @rule(step=steps)
    def load(self, step):
        if step in self.model:
            assert_tree_equal(self.model[step], self.repo.load(step))

    @rule()
    def verify(self):
        if not self.created:
            with pytest.raises(RepositoryNotFoundError):
                self.repo.verify(read_data=True)
            return
        rep = self.repo.verify(read_data=True)
        assert rep.ok, str(rep)

    @invariant()
    def steps_match(self):
        assert self.repo.steps() == sorted(self.model)


class LocalRepoMachine(RepoMachine):
    backend = "local"


_sm_settings = settings(max_examples=25, stateful_step_count=20, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
RepoMachine.TestCase.settings = _sm_settings
LocalRepoMachine.TestCase.settings = _sm_settings
TestMemoryRepoMachine = RepoMachine.TestCase
TestLocalRepoMachine = LocalRepoMachine.TestCase
