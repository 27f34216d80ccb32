"""pytest plugin of a framework-suite run: tells every process which test runs now.

Before each test it writes the test's id, made safe for a path, to
``$CKPTSTORE_SUITE_DIR/current`` (see ``sitecustomize``), so each test gets
a repository of its own.

It also lets DeepSpeed 0.19's ``DistributedFixture`` classes work under
pytest >= 8.4 (the same on both sides of a run): DeepSpeed marks them as
fixtures with a ``_pytestfixturefunction`` class attribute, which pytest
no longer reads, so tests using them failed with "fixture ... not found".
Each such class in a test module is registered as a real fixture whose
function builds the class; DeepSpeed's own ``pytest_fixture_setup`` hook
(``tests/conftest.py``) then runs it on its ranks as it does under older
pytest.
"""

from __future__ import annotations

import hashlib
import os
import re

import pytest


def slug(nodeid: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", nodeid.split("::", 1)[-1])[:80]
    return f"{name}-{hashlib.sha1(nodeid.encode()).hexdigest()[:8]}"


def _register_dist_fixtures(module) -> None:
    for name, obj in list(vars(module).items()):
        if not (isinstance(obj, type) and getattr(obj, "is_dist_fixture", False)):
            continue
        if obj.__module__ != module.__name__:
            continue  # DistributedFixture itself, imported

        def build(cls=obj):
            return cls()

        build.is_dist_fixture = True
        build.__name__ = name
        # the class keeps its own name in the module: DeepSpeed pickles it to its ranks
        setattr(module, f"_ckptstore_dist_fixture_{name}", pytest.fixture(name=name)(build))


def pytest_pycollect_makemodule(module_path, parent):
    module = pytest.Module.from_parent(parent, path=module_path)
    getobj = module._getobj

    def _getobj():
        obj = getobj()
        _register_dist_fixtures(obj)
        return obj

    module._getobj = _getobj
    return module


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    d = os.environ.get("CKPTSTORE_SUITE_DIR")
    if d:
        os.makedirs(d, exist_ok=True)
        rank = os.environ.get("CKPTSTORE_SUITE_RANK")  # one pytest process per rank (Megatron's tests)
        name = "current" if rank is None else f"current.{rank}"
        tmp = os.path.join(d, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(slug(item.nodeid))
        os.replace(tmp, os.path.join(d, name))


_MEGATRON = os.environ.get("CKPTSTORE_SUITE_FRAMEWORK") == "megatron"
_tests_run = 0


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid, location):
    # Megatron's tests: every test starts on a process group of its own (below); its rendezvous
    # port is the run's MASTER_PORT plus the test's place in the run, the same on every rank
    global _tests_run
    if _MEGATRON:
        base = int(os.environ.setdefault("CKPTSTORE_SUITE_MASTER_PORT", os.environ.get("MASTER_PORT", "29500")))
        _tests_run += 1
        os.environ["MASTER_PORT"] = str(10000 + (base + _tests_run) % 20000)  # below the ephemeral ports


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Megatron's tests: the process group ends with the test that made it.

    Megatron's ``Utils`` makes the default group once per run; under gloo a
    test that leaves one rank in a collective (a failure on the other, a
    timeout) closes the pairs of that group for good, and every later test
    failed with "Application timeout caused pair closure" (152 of 0.19's).
    After each test's own teardown the group and Megatron's parallel state
    are destroyed, so the next test's ``Utils.initialize_distributed``
    makes a fresh one (on both sides of a run)."""
    yield
    if not _MEGATRON:
        return
    import sys

    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None:
        try:
            ps.destroy_model_parallel()
        except Exception:
            pass
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    for name in ("tests.unit_tests.test_utilities",):
        utils = getattr(sys.modules.get(name), "Utils", None)
        if utils is not None:
            utils.store = None
            utils.inited = False
            # a test that changed the world size (Utils.set_world_size) and failed before setting it
            # back left every later test waiting a minute for ranks that do not exist
            utils.world_size = int(os.environ.get("WORLD_SIZE", "1"))
            utils.rank = int(os.environ.get("LOCAL_RANK", "0"))


def pytest_runtest_logreport(report):
    """``CKPTSTORE_SUITE_OUTCOMES``: one JSON line per test phase, written as it ends (a run stopped by
    its time limit keeps its outcomes so far; pytest writes the JUnit XML only at the end)."""
    path = os.environ.get("CKPTSTORE_SUITE_OUTCOMES")
    if not path:
        return
    import json

    msg = ""
    if report.failed:
        msg = str(getattr(report.longrepr, "reprcrash", None) and report.longrepr.reprcrash.message or report.longrepr)
        msg = msg.strip().splitlines()[0] if msg.strip() else ""
    elif report.skipped:
        lr = report.longrepr
        msg = str(lr[2] if isinstance(lr, tuple) and len(lr) == 3 else lr)
    with open(path, "a") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                            "message": msg[:300]}) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """``CKPTSTORE_SUITE_TEST_TIMEOUT`` seconds: a test running longer fails (pytest-timeout is not installed here).

    An alarm in the main thread: it fires when the test returns to Python (a collective blocked in
    gloo returns at the process group's timeout, which the Megatron CPU shim sets below this)."""
    limit = float(os.environ.get("CKPTSTORE_SUITE_TEST_TIMEOUT") or 0)
    if limit <= 0:
        yield
        return
    import signal

    def expired(signum, frame):
        raise TimeoutError(f"test ran past the suite's per-test timeout ({limit:.0f} s)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
