"""Retention, garbage collection under concurrent saves, repack, verify."""

from __future__ import annotations

import json
import os
import random
import threading
import time

import pytest
import torch

import ckptstore
from ckptstore.cli.main import main
from ckptstore.clock import ManualClock
from ckptstore.errors import StaleBaseError, StorageError
from ckptstore.repo.gc import RetentionPolicy, parse_duration, select_steps
from ckptstore.format.layout import manifest_key, pack_key
from ckptstore.repo.repository import Repository
from ckptstore.storage import open_store
from ckptstore.storage.memory import MemoryStore
from ckptstore.storage.faults import FaultStore
from ckptstore.testing.clocked import ClockedStore, ClockOffsets

from .helpers import assert_tree_equal

OPTS = dict(chunk_size=64 << 10, pack_size=1 << 20, part_size=5 << 20)
# Time passes on a ManualClock that the tests advance: no test sleeps out a
# grace period, and no save on a slow machine outlives one by accident.
GRACE = 3600.0


def _past_grace(repo) -> float:
    """Seconds to advance so that everything written so far is older than the grace period."""
    return GRACE + repo.store.mtime_resolution + 1.0


def _listing(store):
    return sorted((o.key, o.size) for o in store.list())


# ------------------------------------------------------------------ pure retention
def test_select_steps_union_of_rules():
    now = 10_000.0
    steps = {s: now - (30 - s) * 100 for s in range(1, 31)}
    keep = select_steps(steps, {"best": 7, "gone": 99}, RetentionPolicy(keep_last=2, keep_every=10, keep_within=450,
                                                                        keep_steps=(3,)), now)
    assert sorted(keep) == [3, 7, 10, 20, 26, 27, 28, 29, 30]
    assert "newest" in keep[30] and "tag best" in keep[7] and "explicit" in keep[3]
    # nothing but the newest without rules
    assert sorted(select_steps(steps, {}, RetentionPolicy(keep_tags=False), now)) == [30]
    assert parse_duration("2h") == 7200 and parse_duration("7d") == 604800 and parse_duration(5) == 5.0
    with pytest.raises(ValueError):
        parse_duration("soon")


# ------------------------------------------------------------------ retention + repack
def _train_steps(repo, n=20):
    g = torch.Generator().manual_seed(0)
    frozen = torch.randn(200_000, generator=g)  # ~12 chunks, never changes
    medium = torch.randn(100_000, generator=g)
    states = {}
    for s in range(1, n + 1):
        if s % 4 == 0:
            medium = medium + 1  # changes every 4th step
        head = torch.randn(30_000, generator=g)  # changes every step
        sd = {"frozen": frozen, "medium": medium, "head": head, "step": s}
        repo.save(sd, step=s)
        states[s] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    return states


def test_retention_over_20_steps_with_repack(repo_url):
    url, so = repo_url
    clock = ManualClock()
    repo = ckptstore.open(url, storage_options=so, grace=GRACE, clock=clock, **OPTS)
    states = _train_steps(repo)
    repo.tag(7, "best")
    clock.advance(_past_grace(repo))
    before = _listing(repo.store)
    plan = repo.plan_gc(keep_last=3, keep_every=5, keep_steps=[2], repack=True, repack_threshold=0.05)
    assert _listing(repo.store) == before  # planning writes nothing
    assert sorted(plan.keep_steps) == [2, 5, 7, 10, 15, 18, 19, 20]
    assert plan.delete_steps == tuple(s for s in range(1, 21) if s not in plan.keep_steps)
    assert plan.bytes_to_free > 0 and "delete 12 step(s)" in str(plan)
    result = plan.execute()
    assert sorted(result.deleted_steps) == list(plan.delete_steps)
    assert repo.steps() == [2, 5, 7, 10, 15, 18, 19, 20]
    fresh = ckptstore.open(url, storage_options=so)
    for s in fresh.steps():
        assert_tree_equal(states[s], fresh.load(s))
    assert fresh.verify(read_data=True).ok
    after = fresh.plan_gc(keep_last=100)
    stored = after.stats["stored_bytes"]
    referenced = after.stats["referenced_bytes"]
    assert stored <= referenced * 1.05, (stored, referenced)
    # nothing else is left but the kept steps' objects
    keys = [k for k, _ in _listing(fresh.store)]
    assert not [k for k in keys if k.startswith(("leases/",))]
    fresh.close()
    repo.close()


def test_gc_keeps_newest_and_tagged_and_rm_refuses_newest(tmp_path, capsys):
    url = str(tmp_path / "repo")
    repo = ckptstore.open(url, grace=GRACE, **OPTS)
    for s in (1, 2, 3):
        repo.save({"w": torch.full((1000,), float(s))}, step=s)
    repo.tag(1, "keepme")
    plan = repo.plan_gc(keep_last=0)
    assert sorted(plan.keep_steps) == [1, 3] and plan.delete_steps == (2,)
    assert main(["rm", url, "3"]) == 1
    assert "newest" in capsys.readouterr().err
    assert main(["rm", url, "2"]) == 0
    assert repo.steps() == [1, 3]
    assert main(["rm", url, "3", "--force"]) == 0
    assert ckptstore.open(url).steps() == [1]


def test_gc_without_keeping_tags_deletes_tagged_steps_but_not_ones_tagged_since_planning(tmp_path):
    repo = ckptstore.open(str(tmp_path / "repo"), grace=GRACE, **OPTS)
    for s in (1, 2, 3, 4):
        repo.save({"w": torch.full((1000,), float(s))}, step=s)
    repo.tag(1, "old")
    repo.tag(2, "best")
    plan = repo.plan_gc(keep_last=1, keep_tags=("best",))
    assert plan.delete_steps == (1, 3)
    repo.tag(3, "late")  # after planning: the plan judged step 3 untagged
    res = plan.execute()
    assert res.deleted_steps == [1]
    assert res.skipped_steps == [(3, "tagged since planning")]
    assert repo.steps() == [2, 3, 4]
    # keep_tags=False: no tag protects, yet a tag moved after planning still does.
    plan = repo.plan_gc(keep_last=1, keep_tags=False)
    assert plan.delete_steps == (2, 3)
    repo.tag(3, "best")
    res = plan.execute()
    assert res.deleted_steps == [2] and res.skipped_steps == [(3, "tagged since planning")]
    assert repo.steps() == [3, 4]

def _cli_options(so: dict | None) -> dict:
    """The ``-o KEY=VALUE`` options reaching the test server a fixture's storage options name."""
    if not so:
        return {}
    if "client_kwargs" in so:  # S3 on moto
        return {"endpoint_url": so["client_kwargs"]["endpoint_url"], "key": so["key"], "secret": so["secret"]}
    return dict(so)  # GCS: endpoint_url, token, project


def test_dry_run_changes_nothing(repo_url, capsys, monkeypatch):
    url, so = repo_url
    repo = ckptstore.open(url, storage_options=so, grace=GRACE, **OPTS)
    _train_steps(repo, 6)
    before = _listing(repo.store)
    # the CLI's repositories run on the default clock: move it past the grace period
    clock = ManualClock(_past_grace(repo))
    monkeypatch.setattr("ckptstore.repo.catalog.SYSTEM_CLOCK", clock)
    args = ["gc", url, "--keep-last", "1"]
    for k, v in _cli_options(so).items():
        args += ["-o", f"{k}={v}"]
    assert main(args + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "delete 5 step(s)" in out and "dry run" in out
    assert _listing(repo.store) == before
    assert main(args + ["--yes", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["delete_steps"] == [1, 2, 3, 4, 5] and doc["result"]["deleted_steps"] == [1, 2, 3, 4, 5]
    assert repo.steps() == [6]
    repo.close()


def test_gc_never_touches_objects_outside_its_prefix(s3):
    outside = s3.store(f"s3://{s3.bucket}/other")
    outside.put("packs/aa/" + "a" * 32 + ".pack", b"not ours")
    outside.put("manifests/x.json", b"{}")
    sibling = s3.store(f"s3://{s3.bucket}/repo-old")
    sibling.put("packs/bb/" + "b" * 32 + ".pack", b"sibling with a shared name prefix")
    clock = ManualClock()
    repo = ckptstore.open(s3.url, storage_options=s3.storage_options, grace=GRACE, clock=clock, **OPTS)
    for s in (1, 2, 3):
        repo.save({"w": torch.randn(50_000)}, step=s)
    clock.advance(_past_grace(repo))
    result = repo.plan_gc(keep_last=1).execute()
    assert result.deleted_steps == [1, 2] and result.deleted_packs
    assert [o.key for o in outside.list()] == ["manifests/x.json", "packs/aa/" + "a" * 32 + ".pack"]
    assert len(list(sibling.list())) == 1
    repo.close()


# ------------------------------------------------------------------ crashed savers
def _orphans(tmp_path):
    """A repository with step 1 committed and the packs of a save that died before its manifest."""
    clock = ManualClock()
    store = FaultStore(open_store(str(tmp_path / "repo")))
    repo = Repository(store, grace=GRACE, clock=clock, **OPTS)
    repo.save({"w": torch.randn(50_000)}, step=1)
    store.add_rule("put_if_absent", "manifests/*", lambda op, k: StorageError("killed"), count=1)
    with pytest.raises(StorageError):
        repo.save({"w": torch.randn(50_000), "x": torch.randn(50_000)}, step=2)
    orphans = sorted({o.key for o in store.list("packs/")} - {pack_key(c.pack) for c in repo.chunks(1)})
    return repo, clock, [k.rsplit("/", 1)[1].removesuffix(".pack") for k in orphans]


def test_crashed_saver_leftovers_reclaimed_only_after_grace(tmp_path):
    # a saver "crashes" before its manifest: packs uploaded, no step
    repo, clock, orphans = _orphans(tmp_path)
    store = repo.store
    orphan_packs = {pack_key(p) for p in orphans}
    assert orphan_packs
    # and one left a multipart upload and a lease behind
    mpu = store.create_multipart("packs/cc/" + "c" * 32 + ".pack", 5 << 20)
    mpu.upload_part(1, b"x" * (5 << 20))
    store.put("leases/" + "d" * 32 + ".json", b'{"step": 2}')

    plan = repo.plan_gc()
    assert not plan.delete_packs and not plan.abort_uploads and not plan.stale_leases
    assert {pack_key(p) for p, _ in plan.young_packs} == orphan_packs
    plan.execute()
    assert orphan_packs <= {o.key for o in store.list("packs/")}
    assert store.list_multipart()

    clock.advance(_past_grace(repo))
    plan = repo.plan_gc()
    assert {pack_key(p) for p, _ in plan.delete_packs} == orphan_packs
    assert len(plan.abort_uploads) == 1 and len(plan.stale_leases) == 1
    plan.execute()
    assert not orphan_packs & {o.key for o in store.list("packs/")}
    assert not store.list_multipart() and not list(store.list("leases/"))
    assert repo.verify(read_data=True).ok
    torch.testing.assert_close(repo.load(1)["w"], repo.load(1)["w"])


def test_slow_saver_refuses_to_commit():
    clock = ManualClock()
    store = FaultStore(MemoryStore())
    repo = Repository(store, grace=GRACE, clock=clock, **OPTS)
    repo.save({"w": torch.randn(50_000)}, step=1)
    # the save stalls for a grace period between its uploads and its commit
    store.add_rule("head", "packs/*", lambda op, k: clock.advance(GRACE), count=1)
    with pytest.raises(StaleBaseError, match="grace period"):
        repo.save({"w": torch.randn(50_000)}, step=2)
    assert repo.steps() == [1]


# ------------------------------------------------------------------ GC racing savers
def _let_pass(clock: ManualClock, seconds: float, slices: int = 10) -> None:
    """Let ``seconds`` pass on the clock in slices, yielding to other threads between them."""
    for _ in range(slices):
        clock.advance(seconds / slices)
        time.sleep(0.002)  # a scheduling point for the racing thread, not a wait


def _race(url, so, rounds, seed, grace=60.0):
    """A saver deduplicates against an older step while GC deletes that step.

    Each round commits step P holding a tensor ``u`` only P has, then a newer
    step E without it, lets P's packs age past the grace period, then races
    a save of step R = {u, x} with ``base=P`` (so R reuses P's packs)
    against GC (keep only the newest step) run three times, time passing
    between the runs. Some saves stall past the grace period. Allowed
    outcomes: R commits and loads, or R refuses with StaleBaseError. Never
    a committed step with a missing chunk. Time is a shared ManualClock:
    both threads see it move, whatever the machine's speed.
    """
    seed = int(os.environ.get("CKPTSTORE_RACE_SEED", seed))
    rng = random.Random(seed)
    clock = ManualClock()
    offsets = ClockOffsets()  # objects are dated by the clock they were written at
    fault = FaultStore(ClockedStore(open_store(url, so), clock, offsets))
    saver = Repository(fault, grace=grace, clock=clock, **OPTS)
    gc_repo = Repository(ClockedStore(open_store(url, so), clock, offsets), clock=clock, **OPTS)
    expected: dict[int, dict] = {}
    outcomes = {"committed": 0, "refused": 0}
    unexpected: list[BaseException] = []
    step = 0
    for _ in range(rounds):
        u = torch.randn(100_000)
        p, e, r = step + 1, step + 2, step + 3
        step = r
        saver.save({"u": u}, step=p, base=None)
        saver.save({"e": torch.randn(1000)}, step=e, base=None)
        clock.advance(grace + fault.mtime_resolution + 1.0)  # P's packs are now "old" to GC
        sd = {"u": u, "x": torch.randn(1000)}
        delay = rng.choice([0.0, 3.0, grace / 2, grace * 3])  # the last must refuse
        fault.rules.clear()
        fault.add_rule("head", "packs/*", lambda op, k, d=delay: _let_pass(clock, d), count=1)
        err = []

        def save():
            try:
                saver.save(sd, step=r, base=p)
                expected[r] = sd
            except StaleBaseError as ex:
                err.append(ex)
            except BaseException as ex:  # anything else fails the test
                unexpected.append(ex)

        def gc():
            # run 1 deletes P (leaving a tombstone), run 2 comes while the
            # tombstone is young, run 3 after it expired.
            time.sleep(rng.random() * 0.05)
            for pause in (grace / 3, grace + fault.mtime_resolution + 1.0, 0):
                gc_repo.plan_gc(keep_last=1, keep_tags=False).execute()
                _let_pass(clock, pause)

        t1, t2 = threading.Thread(target=save), threading.Thread(target=gc)
        t1.start(), t2.start()
        t1.join(), t2.join()
        if unexpected:
            raise AssertionError(f"seed {seed}, round {r}: {unexpected[0]!r}") from unexpected[0]
        outcomes["refused" if err else "committed"] += 1
        if delay > grace:
            assert err, f"seed {seed}, round {r}: a save stalled {delay:.0f} s past a {grace:.0f} s grace committed"
        if os.environ.get("RACE_DEBUG"):
            print("round", r, "delay", delay, "refused" if err else "committed", fault.triggered[-1:])
        for s in gc_repo.steps():  # every committed step that exists loads bit-exact
            out = gc_repo.load(s)
            if s in expected:
                assert torch.equal(out["u"], expected[s]["u"]) and torch.equal(out["x"], expected[s]["x"]), (
                    f"seed {seed}: step {s} does not load bit-exact")
    rep = gc_repo.verify(read_data=True)
    assert rep.ok, f"seed {seed}: {rep}"
    assert outcomes["committed"] > 0, f"seed {seed}: {outcomes}"
    saver.close()
    gc_repo.close()
    return outcomes


def test_gc_racing_savers_local(tmp_path):
    _race(str(tmp_path / "repo"), None, rounds=20, seed=1)


@pytest.mark.slow  # 20 rounds of racing saves on moto; the local-store race runs in the fast subset
def test_gc_racing_savers_s3(s3):
    _race(s3.url, s3.storage_options, rounds=6, seed=2)


# ------------------------------------------------------------------ verify
def test_verify_reports_every_problem(tmp_path, capsys):
    url = str(tmp_path / "repo")
    repo = ckptstore.open(url, **OPTS)
    for s in (1, 2, 3):
        repo.save({"a": torch.randn(100_000) + s, "b": torch.randn(100_000) + s}, step=s)
    assert repo.verify(read_data=True).ok
    store = repo.store
    m1, m2 = repo.resolved_manifest(1), repo.resolved_manifest(2)
    # step 1: flipped byte in a chunk of "a"
    c = m1.tensors["a"].shards[0].chunks[2]
    data = bytearray(store.get(pack_key(c.pack)))
    data[c.offset + 7] ^= 0xFF
    store.put(pack_key(c.pack), bytes(data))
    # step 2: its "b" pack is missing (only b's chunks live in that pack? delete the pack of b's first chunk)
    gone = m2.tensors["b"].shards[0].chunks[0].pack
    store.delete(pack_key(gone))
    # step 3: truncated manifest
    raw = store.get(manifest_key(3))
    store.put(manifest_key(3), raw[:100])
    rep = ckptstore.open(url).verify(read_data=True)
    kinds = {(p.kind, p.step) for p in rep.problems}
    assert ("chunk", 1) in kinds and ("missing_pack", 2) in kinds and ("manifest", 3) in kinds
    chunk = next(p for p in rep.problems if p.kind == "chunk")
    assert chunk.tensor == "a" and chunk.pack == c.pack and chunk.offset == c.offset
    missing = next(p for p in rep.problems if p.kind == "missing_pack")
    assert missing.pack == gone
    assert main(["verify", url, "--read-data"]) == 1
    out = capsys.readouterr().out
    assert c.pack in out and gone in out and "step 3" in out
    assert main(["verify", url, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert not doc["ok"] and {p["kind"] for p in doc["problems"]} >= {"missing_pack", "manifest"}


def test_stats_report_dead_bytes_in_partly_used_packs(tmp_path, capsys):
    url = str(tmp_path / "repo")
    repo = ckptstore.open(url, grace=GRACE, chunk_size=64 << 10, pack_size=64 << 20, part_size=5 << 20)
    a, b = torch.randn(100_000), torch.randn(100_000)
    repo.save({"a": a, "b": b}, step=1)  # one pack holding a and b
    repo.save({"a": a, "b": b + 1}, step=2)
    repo.delete(1)  # b's first version is now dead inside step 1's pack
    st = repo.stats()
    assert st["partial_packs"] == 1
    assert st["partial_dead_bytes"] == pytest.approx(repo.manifest(2).tensors["a"].nbytes / 1.08, rel=0.1)
    assert st["referenced_bytes"] + st["partial_dead_bytes"] <= st["stored_bytes"]
    assert main(["stats", url]) == 0
    assert "dead in partly used packs" in capsys.readouterr().out


def test_gc_reads_no_chunk_table_and_caches_stay_bounded():
    # Format 2.0: GC decides from the roots' pack lists alone; a long-lived
    # handle's manifest cache stays within its byte bound.
    from ckptstore.storage.wrappers import CountingStore

    clock = ManualClock()
    store = CountingStore(MemoryStore())
    repo = Repository(store, grace=GRACE, clock=clock, manifest_cache_bytes=64 << 10, **OPTS)
    for s in range(1, 13):
        repo.save({"frozen": torch.ones(50_000), "w": torch.randn(20_000)}, step=s)
        assert repo._manifests.weight <= 64 << 10
    clock.advance(_past_grace(repo))
    store.reset()
    plan = repo.plan_gc(keep_last=3)
    res = plan.execute()
    assert res.deleted_steps == list(range(1, 10)) and res.deleted_packs and res.deleted_segments
    assert store.read_by_prefix["segments"] == 0, store.read_by_prefix
    for s in (10, 11, 12):
        assert torch.equal(repo.load(s)["frozen"], torch.ones(50_000))
    assert repo.verify(read_data=True).ok


@pytest.mark.parametrize("per_batch, sizes", [(0.24, [2] * 8), (0.34, [2, 1, 1, 1, 1, 1, 1] * 2)])
def test_gc_deletes_in_batches_each_cleared_by_a_listing_within_half_the_margin(monkeypatch, per_batch, sizes):
    # GC sends its pack and segment deletions as delete_many batches. Time
    # passes while each batch goes out (``per_batch`` of the margin): every
    # batch must follow a fresh listing of the manifests by at most half the
    # margin (docs/gc.md, G3), so GC lists again between them; a batch that
    # took over a quarter of the margin makes the next ones smaller.
    from ckptstore.repo import gc as gcmod
    from ckptstore.format.layout import safety_margin
    from ckptstore.storage.wrappers import WrapperStore

    monkeypatch.setattr(gcmod, "DELETE_BATCH", 2)
    clock = ManualClock()
    margin = safety_margin(GRACE)
    events: list[tuple[str, float, int]] = []

    class Timed(WrapperStore):
        def list(self, prefix=""):
            if prefix.startswith("manifests"):
                events.append(("list", clock.time(), 0))
            return self.inner.list(prefix)

        def delete_many(self, keys):
            events.append(("delete_many", clock.time(), len(keys)))
            self.inner.delete_many(keys)
            clock.advance(margin * per_batch)

    store = Timed(MemoryStore())
    repo = Repository(store, grace=GRACE, clock=clock, **OPTS)
    for s in range(1, 10):
        repo.save({f"w{s}": torch.randn(20_000)}, step=s)  # every step its own pack and segment
    clock.advance(_past_grace(repo))
    plan = repo.plan_gc(keep_last=1)
    assert len(plan.delete_packs) == 8 and len(plan.delete_segments) == 8
    events.clear()
    res = plan.execute()
    assert len(res.deleted_packs) == 8 and len(res.deleted_segments) == 8
    deletes = [e for e in events if e[0] == "delete_many"]
    assert [n for _, _, n in deletes] == sizes
    last_list = None
    for kind, t, _ in events:
        if kind == "list":
            last_list = t
        else:
            assert last_list is not None and t - last_list <= margin / 2, events
    assert sum(kind == "list" for kind, _, _ in events) >= 3  # GC listed again between batches
    assert repo.steps() == [9] and repo.verify(read_data=True).ok


# ---------------------------------------------------------------- execute, phase by phase


def test_executor_clear_pack_says_why_each_pack_stays_or_goes(tmp_path):
    from ckptstore.repo.gc import _Executor

    repo, clock, orphans = _orphans(tmp_path)
    live = next(c.pack for c in repo.chunks(1))
    ex = _Executor(repo.plan_gc(), repo, lambda *a: None)
    ex.reread()
    assert ex.clear_pack(orphans[0]) is None and ex.res.skipped_packs[-1] == (orphans[0], "younger than the grace period")
    assert ex.clear_pack("e" * 32) is None and ex.res.skipped_packs[-1] == ("e" * 32, "already gone")
    clock.advance(_past_grace(repo))
    ex = _Executor(repo.plan_gc(), repo, lambda *a: None)
    ex.reread()
    pid, size = ex.clear_pack(orphans[0])
    assert pid == orphans[0] and size > 0
    assert ex.clear_pack(live) is None and ex.res.skipped_packs[-1] == (live, "referenced again")


def test_executor_delete_steps_keeps_the_newest_and_what_was_tagged_since_planning(tmp_path):
    from ckptstore.repo.gc import _Executor

    clock = ManualClock()
    repo = Repository(open_store(str(tmp_path / "repo")), grace=GRACE, clock=clock, **OPTS)
    for s in (1, 2, 3):
        repo.save({"w": torch.full((10,), float(s))}, step=s)
    plan = repo.plan_gc(keep_last=1)
    assert plan.delete_steps == (1, 2)
    repo.tag(2, "keep-me")  # after planning
    ex = _Executor(plan, repo, lambda *a: None)
    ex.delete_steps()
    assert ex.res.deleted_steps == [1] and ex.res.skipped_steps == [(2, "tagged since planning")]
    assert repo.steps() == [2, 3]


def test_executor_expire_bookkeeping_deletes_only_what_the_plan_named(tmp_path):
    from ckptstore.repo.gc import _Executor

    repo, clock, _ = _orphans(tmp_path)
    repo.store.put("leases/" + "d" * 32 + ".json", b'{"step": 2}')
    clock.advance(_past_grace(repo))
    plan = repo.plan_gc()
    assert plan.stale_leases
    repo.store.put("leases/" + "f" * 32 + ".json", b'{"step": 3}')  # a saver that started after planning
    _Executor(plan, repo, lambda *a: None).expire_bookkeeping()
    assert [o.key for o in repo.store.list("leases/")] == ["leases/" + "f" * 32 + ".json"]


def test_a_handle_forgets_what_it_cached_of_steps_another_handle_s_gc_deleted(tmp_path):
    # issue 44 item 3: a handle saving every step beside a keep_last GC kept every manifest it
    # wrote (and their segments' headers) up to manifest_cache_bytes: RSS grew with the run
    import ckptstore

    url = str(tmp_path / "repo")
    with ckptstore.open(url) as saver, ckptstore.open(url) as collector:
        for s in range(1, 21):
            saver.save({"w": torch.full((64,), float(s)), "b": torch.zeros(8)}, step=s)
            if s % 5 == 0:
                collector.plan_gc(keep_last=2).execute()
                assert saver.latest() == s  # a listing: what the store no longer lists is forgotten
                assert set(saver._manifests.keys()) <= {s - 1, s}, saver._manifests.keys()
                assert set(collector._tombstones.keys()) <= set(collector.tombstone_keys())
        assert torch.equal(saver.load(19)["w"], torch.full((64,), 19.0))
