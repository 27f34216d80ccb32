"""The Makefile's set-up targets, read with ``make -n`` (nothing is run or installed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _dry_run(target: str, tmp_path) -> str:
    # A venv and a node folder that do not exist: every set-up step is listed.
    r = subprocess.run(
        ["make", "-n", target, f"VENV={tmp_path / 'venv'}", f"NODE_DIR={tmp_path / 'node'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )
    return r.stdout


def test_make_demo_installs_the_core_and_the_demo_extra_only(tmp_path):
    out = _dry_run("demo", tmp_path)
    assert "torch==2.13.0" in out and "-e '.[demo]'" in out and "ckptstore demo" in out
    for heavy in ("npm install", "azurite"):
        assert heavy not in out, heavy
    for line in out.splitlines():
        if "pip install" in line:
            assert not any(x in line.split("pip install")[1] for x in ("test", "integrations", "torchtitan")), line
    _every_install_is_locked(out)


def _every_install_is_locked(out: str) -> None:
    # Every pip install reads the lock through the environment (build environments included).
    # (the Megatron-Core 0.19 overlay excepted: its own exact pins, requirements/megatron-0.19.txt)
    installs = [line for line in out.splitlines() if "pip install" in line and "megatron-0.19.txt" not in line]
    assert installs
    lock = str(ROOT / "requirements" / "lock.txt")
    for line in installs:
        assert f"PIP_CONSTRAINT={lock} " in line, line


def test_make_test_installs_everything(tmp_path):
    out = _dry_run("test", tmp_path)
    for wanted in ("torch==2.13.0", "npm install", "azurite", "pytest -q"):
        assert wanted in out, wanted
    # every extra the tests need in one resolver call, after the demo's
    (together,) = [line for line in out.splitlines() if "-e '.[demo,test,integrations,torchtitan]'" in line]
    assert "DS_BUILD_OPS=0" in together and "torch==2.13.0" in together
    _every_install_is_locked(out)
    assert "--durations=15" in out and "not slow" not in out  # everything, then the slowest tests
    assert "-n 2 --dist loadfile" in out  # two workers, a file whole on one


def test_make_test_fast_leaves_out_the_slow_tests(tmp_path):
    out = _dry_run("test-fast", tmp_path)
    assert 'pytest -q -n 2 --dist loadfile -m "not slow"' in out


def test_make_lock_re_resolves_and_lock_check_only_reports(tmp_path):
    assert ".ci/lock.py\n" in _dry_run("lock", tmp_path)
    assert ".ci/lock.py --check" in _dry_run("lock-check", tmp_path)


def test_nothing_tracked_is_a_symlink_or_a_set_up_output():
    # A committed `.node -> /work/main/.node` pointed at itself in every fresh clone and broke
    # `make test` before a test ran (npm: ELOOP). Set-up outputs are built, never committed.
    r = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True)
    if not r.stdout:
        pytest.skip("not a git checkout")
    links = [line.split("\t", 1)[1] for line in r.stdout.splitlines() if line.startswith("120000")]
    assert links == [], f"symlinks are tracked: {links}"
    outputs = (".venv", ".node", ".runai", ".mcore019")
    tracked = [p for p in (line.split("\t", 1)[1] for line in r.stdout.splitlines()) if p.split("/")[0] in outputs]
    assert tracked == [], f"set-up outputs are tracked: {tracked}"
