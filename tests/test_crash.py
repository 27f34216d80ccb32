"""Savers killed with SIGKILL mid-save leave no visible step and nothing GC cannot reclaim.

A child process (``tests/crash_child.py``) saves a ~64 MiB state dict with
small chunks, packs and multipart parts, printing phase markers; the test
reads its stdout until the chosen marker, waits a random few milliseconds
and kills it with SIGKILL. After every kill: nothing committed is damaged
(``verify(read_data=True)``, bit-exact loads), no partial step is visible,
and a normal save of the same step then succeeds. Finally GC reclaims the
orphan packs, leftover multipart uploads and the dead savers' leases, and
only once they are older than the grace period.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import ckptstore
from ckptstore.clock import ManualClock
from ckptstore.format.layout import PACK_PREFIX, pack_id_of_key

from .crash_child import CHILD_OPTS, build_state
from .helpers import assert_tree_equal

pytestmark = pytest.mark.slow  # savers are child processes killed mid-save

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_child.py")
ROOT = os.path.dirname(os.path.dirname(CHILD))
PHASES = ("pack", "multipart", "commit")
# GC's time is a ManualClock that the test advances once every saver is
# dead (the killed children date their objects by the real clock, so the
# clock must not move while they run). No test sleeps out a grace period,
# and an in-process save on 2 busy cores never nears the deadline.
GRACE = 600.0
KILLS = 4
BIG = 10**6  # keep_last: GC here reclaims garbage, it deletes no step


def _pack_objects(store) -> dict[str, float]:
    """pack id -> mtime of every pack object."""
    return {pid: o.mtime for o in store.list(PACK_PREFIX) if (pid := pack_id_of_key(o.key)) is not None}


def _referenced(repo) -> set[str]:
    return {c.pack for s in repo.steps() for c in repo.chunks(s)}


def _kill_at(url, so, step, seed, phase, delay, log, mode="") -> None:
    """Run the child until it prints ``PHASE <phase>``, then SIGKILL it after ``delay`` s."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CKPTSTORE_CRASH_HOLD=phase)  # the child holds still at this phase until killed
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, CHILD, url, str(step), str(seed), json.dumps(so) if so else "", mode],
            stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, env=env,
        )
        watchdog = threading.Timer(120, proc.kill)  # never hang the suite
        watchdog.start()
        seen = []
        try:
            for line in proc.stdout:
                seen.append(line.strip())
                if line.strip() == f"PHASE {phase}":
                    time.sleep(delay)
                    proc.kill()
                    break
        finally:
            watchdog.cancel()
            proc.kill()
            proc.wait()
            proc.stdout.close()
        err.seek(0)
        log.append((phase, round(delay, 4), seen))
        assert f"PHASE {phase}" in seen, f"child never reached {phase}: stdout {seen}, stderr:\n{err.read()[-3000:]}"
        assert "DONE" not in seen
        assert proc.returncode == -signal.SIGKILL, (proc.returncode, seen)


def _crash_rounds(url, so, local: bool, seed: int, mode: str = "") -> None:
    # fixed by default (reproducible); CKPTSTORE_CRASH_SEED explores others
    seed = int(os.environ.get("CKPTSTORE_CRASH_SEED", seed))
    rng = random.Random(seed)
    clock = ManualClock()
    repo = ckptstore.open(url, storage_options=so, grace=GRACE, clock=clock, **CHILD_OPTS)
    store = repo.store
    expected: dict[int, dict] = {}
    for s in (1, 2):  # committed normally first
        expected[s] = build_state(1000 * seed + s)
        repo.save(expected[s], step=s)
    # every phase once, in random order, then a multipart kill last so that
    # an open upload is certainly left for the final GC
    phases = rng.sample(PHASES, len(PHASES)) + ["multipart"]
    assert len(phases) == KILLS
    log: list = []
    step = 3
    for i, phase in enumerate(phases):
        before_steps = repo.steps()
        before_packs = set(_pack_objects(store))
        before_uploads = {u.upload_id for u in store.list_multipart()}
        child_seed = 1000 * seed + step
        _kill_at(url, so, step, child_seed, phase, rng.uniform(0.0, 0.03), log, mode)
        t_kill = clock.time()

        # GC right now: nothing this saver left may be reclaimed yet
        mtimes = _pack_objects(store)
        new_orphans = set(mtimes) - before_packs
        fresh = {u.upload_id for u in store.list_multipart()} - before_uploads
        if phase == "commit":
            assert new_orphans, "a saver killed at its commit has uploaded every pack"
        if phase == "multipart":
            assert fresh, "a saver killed mid-multipart leaves an open upload"
        plan = repo.plan_gc(keep_last=BIG)
        assert not plan.delete_steps
        deleted = {p for p, _ in plan.delete_packs}
        assert not deleted & new_orphans, (phase, log)
        assert new_orphans <= {p for p, _ in plan.young_packs}
        for p in deleted:  # anything GC deletes is an orphan older than the grace period
            assert t_kill - mtimes[p] > GRACE - store.mtime_resolution, (p, t_kill - mtimes[p])
        assert len(plan.live_leases) >= 1  # the killed saver's lease
        if local:
            # Real upload start times: the fresh upload is left alone. (moto
            # dates every upload 2010, so on S3 GC would abort it at once,
            # docs/gc.md "Limits"; there only the final GC runs.)
            assert not fresh & {u.upload_id for u in plan.abort_uploads}
            res = plan.execute()
            assert not res.deleted_steps
            assert new_orphans <= set(_pack_objects(store))
            assert fresh <= {u.upload_id for u in store.list_multipart()}

        # nothing committed is damaged, no partial step is visible
        check = ckptstore.open(url, storage_options=so)
        assert check.steps() == before_steps, (phase, log)
        assert step not in check.steps()
        rep = check.verify(read_data=True)
        assert rep.ok, str(rep)
        for s in before_steps:
            assert_tree_equal(expected[s], check.load(s))
        check.close()

        # a normal save of the same step now succeeds and loads bit-exact
        sd = build_state(child_seed)
        repo.save(sd, step=step, metadata={"seed": child_seed})
        expected[step] = sd
        check = ckptstore.open(url, storage_options=so)
        assert_tree_equal(sd, check.load(step))
        assert check.steps() == before_steps + [step]
        check.close()
        step += 1

    # ---- GC: leftovers reclaimed, and only after the grace period
    # (uploads as GC lists them, under packs/; a marker without its key is
    # covered by the test below)
    orphans = set(_pack_objects(store)) - _referenced(repo)
    uploads = store.list_multipart(PACK_PREFIX)
    leases = [o.key for o in store.list("leases/")]
    # dead savers' leases (the local per-kill GC already dropped expired ones)
    assert 1 <= len(leases) <= KILLS, leases
    assert uploads, "the last saver was killed mid-multipart"
    clock.advance(GRACE + store.mtime_resolution + 1.0)
    plan = repo.plan_gc(keep_last=BIG)
    assert not plan.live_leases and sorted(plan.stale_leases) == sorted(leases)
    left = orphans & set(_pack_objects(store))
    ages = {p: round(plan.created - t, 3) for p, t in _pack_objects(store).items()}
    assert {p for p, _ in plan.delete_packs} == left, (
        f"left {sorted(left)} young {plan.young_packs} protected {plan.protected_packs} ages {ages} log {log}")
    listed = store.list_multipart(PACK_PREFIX)
    assert {u.upload_id for u in plan.abort_uploads} == {u.upload_id for u in listed}, (
        plan.abort_uploads, listed, store.list_multipart(), plan.created, log)
    res = plan.execute()
    assert not res.deleted_steps
    assert set(_pack_objects(store)) == _referenced(repo)
    assert not store.list_multipart(PACK_PREFIX)
    assert not list(store.list("leases/"))
    check = ckptstore.open(url, storage_options=so)
    assert check.steps() == sorted(expected)
    rep = check.verify(read_data=True)
    assert rep.ok, str(rep)
    for s in check.steps():
        assert_tree_equal(expected[s], check.load(s))
    check.close()
    repo.close()
    print(f"crash rounds (seed {seed}):", [(p, d) for p, d, _ in log])


def test_sigkilled_saver_local(tmp_path):
    # Through a FaultStore: packs go up as parts.
    _crash_rounds(str(tmp_path / "repo"), None, local=True, seed=11)


def test_sigkilled_saver_local_direct_writes(tmp_path):
    # A bare LocalStore: chunk pieces written straight at their offsets in the pack file.
    _crash_rounds(str(tmp_path / "repo"), None, local=True, seed=13, mode="direct")


def test_sigkilled_saver_s3(s3):
    _crash_rounds(s3.url, s3.storage_options, local=False, seed=12)


def test_local_upload_marker_left_empty_by_a_kill_is_reclaimed(tmp_path):
    # The state an older LocalStore could leave when SIGKILL landed between
    # creating the marker file and writing its key (markers are now renamed
    # into place whole); GC reclaims such a marker after the grace period.
    root = tmp_path / "repo"
    clock = ManualClock()
    repo = ckptstore.open(str(root), grace=GRACE, clock=clock, **CHILD_OPTS)
    repo.save({"w": build_state(1, mib=1)["model"]["layer.bias"]}, step=1)
    marker = root / ".tmp" / ("ab" * 16 + ".mpu")
    marker.write_bytes(b"")
    assert [u.upload_id for u in repo.store.list_multipart()] == ["ab" * 16]
    clock.advance(GRACE + repo.store.mtime_resolution + 1.0)
    repo.plan_gc(keep_last=BIG).execute()
    assert not repo.store.list_multipart(), "a crashed saver's upload marker outlives GC"
    assert not marker.exists()
