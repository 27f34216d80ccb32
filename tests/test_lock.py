"""The set-up's lock (requirements/lock.txt) against the venv the suite runs in.

``make test`` installs every extra in one resolver call constrained by the
lock, so the venv it builds holds exactly the lock's distributions at the
lock's versions, and ``pip check`` passes there. A venv built some other way
(by hand, or by an older Makefile) fails here with the packages named:
``make clean setup`` rebuilds it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("ckptstore_lock", ROOT / ".ci" / "lock.py")
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)

in_venv = pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="the suite runs outside a venv: no set-up to compare")


def _venv_distributions():
    # What pip installed into this venv's site-packages, read from there: not a --target overlay on
    # PYTHONPATH, and not the copies setuptools vendors (setuptools/_vendor, on sys.path once anything
    # in the run has imported setuptools: their packaging, wheel, jaraco-* are no install of ours).
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return metadata.distributions(path=paths)


@in_venv
def test_every_installed_distribution_is_pinned_and_every_pin_installed():
    pins = lock.parse_lock(lock.LOCK.read_text())
    installed = {
        lock.normalize(d.metadata["Name"]): lock._LOCAL.sub("", d.version)
        for d in _venv_distributions()
        if lock.normalize(d.metadata["Name"]) != "ckptstore"
    }
    unpinned = sorted(set(installed) - set(pins))
    missing = sorted(set(pins) - set(installed))
    moved = sorted(f"{n} {installed[n]} (lock: {pins[n]})" for n in set(pins) & set(installed) if installed[n] != pins[n])
    assert not (unpinned or missing or moved), (
        f"the venv at {sys.prefix} is not the lock's: installed but not pinned {unpinned}; "
        f"pinned but not installed {missing}; other versions {moved}. "
        "`make clean setup` rebuilds it; `make lock` re-pins after a change to pyproject.toml"
    )


@in_venv
def test_pip_check_passes_in_the_set_up_venv():
    r = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_lock_pins_torch_to_the_tested_cpu_build_and_every_extra_make_installs():
    pins = lock.parse_lock(lock.LOCK.read_text())
    assert pins["torch"] == "2.13.0"
    # One distribution each extra `make test` installs brings in.
    for name in ("moto", "pytest", "deepspeed", "megatron-core", "transformers", "lightning", "torchtitan",
                 "botocore", "pip", "setuptools", "wheel"):
        assert name in pins, name
    assert lock.EXTRAS.split(",") == ["demo", "test", "integrations", "torchtitan"]


def test_parse_lock_refuses_what_is_not_an_exact_pin():
    assert lock.parse_lock("# c\nFoo_Bar==1.2  # why\n\nbaz==3\n") == {"foo-bar": "1.2", "baz": "3"}
    for bad in ("foo>=1\n", "foo\n", "foo==1\nFOO==2\n", "-e .\n"):
        with pytest.raises(ValueError):
            lock.parse_lock(bad)


def test_diff_names_what_moved_appeared_and_went():
    lines = lock.diff({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "2.1", "d": "4"})
    assert lines == ["  moved   b 2 -> 2.1", "  dropped c 3", "  added   d 4"]
