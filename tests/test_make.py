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
    for heavy in ("[test]", "[integrations]", "[torchtitan]", "npm install", "azurite"):
        assert heavy not in out, heavy


def test_make_test_installs_everything(tmp_path):
    out = _dry_run("test", tmp_path)
    for wanted in ("torch==2.13.0", "[demo]", "[test]", "[integrations]", "[torchtitan]", "npm install", "azurite", "pytest -q"):
        assert wanted in out, wanted
    assert "--durations=15" in out and "not slow" not in out  # everything, then the slowest tests


def test_make_test_fast_leaves_out_the_slow_tests(tmp_path):
    out = _dry_run("test-fast", tmp_path)
    assert 'pytest -q -m "not slow"' in out
