"""The getting-started pages run as a newcomer runs them: in order, in a fresh virtual environment
with only the installs they show, against the server and the bucket they start and create.

tests/test_doc_blocks.py runs each page in this test environment (every extra installed, its own
servers); a page could pass there and still fail a newcomer (a bucket another block never made,
a `ckptstore` not on the PATH, a module the documented extra does not install). Here, in one empty
folder and one shell-like environment (no cloud settings, no checkout on the path):

1. README.md, top to bottom: its install block (a venv, torch, `ckptstore[s3]`), the local S3
   server and bucket it starts and creates, its Python block, its CLI synopsis;
2. docs/quickstart.md up to its Google Cloud Storage section: the install block (`ckptstore[demo]`,
   `ckptstore demo`), the local-directory blocks, the S3 section with its own server and bucket,
   and the `ckptstore` command lines, run as the venv's console script.

`ckptstore` itself is this work tree, built into a wheel: the install lines get the wheel in
place of the package name (`pip install 'ckptstore[s3]'` installs `WHEEL[s3]`); everything else
is the page's text. torch 2.13.0 comes from the local wheel pip finds (the machine's pip
configuration), other packages from the package index or pip's cache, at the versions of
requirements/lock.txt (``PIP_CONSTRAINT``): what a newcomer would have got on the day the lock
was made. The later sections of the quickstart (GCS, Azure, FSDP, ...) need more installs;
test_doc_blocks.py runs them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .doc_blocks import ROOT, read_blocks
from .doc_runner import Newcomer, PageRun

pytestmark = pytest.mark.slow  # a fresh venv: torch and the demo extra installed (minutes)

#: Where the newcomer's run of the quickstart stops: what follows needs installs of its own.
QUICKSTART_UNTIL = "## Google Cloud Storage"


def build_wheel(out: Path) -> Path:
    """The work tree as a wheel (built from a copy: the checkout gets no build/ or egg-info)."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "ckptstore", src / "ckptstore", ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = out.glob("ckptstore-*.whl")
    return wheel


def newcomer_env(home: Path) -> dict:
    """A shell a newcomer has: the machine's PATH (not this venv's), an empty home, no cloud or
    Python settings of the test run; pip configured as the machine configures it."""
    drop = ("AWS_", "AZURE_", "GOOGLE_", "GCLOUD", "CLOUDSDK_", "STORAGE_EMULATOR_HOST", "CKPTSTORE_",
            "PYTHON", "VIRTUAL_ENV", "PYTEST", "COV_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    here = [str(Path(sys.executable).parent), str(ROOT)]
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and not any(p.startswith(h) for h in here))
    cache = Path(os.environ.get("PIP_CACHE_DIR") or Path.home() / ".cache" / "pip")
    no_proxy = ",".join(x for x in ("127.0.0.1", "localhost", env.get("NO_PROXY", "")) if x)
    # The pages' installs at the versions the suite is pinned to (requirements/lock.txt), so that an
    # upstream release cannot change what this test installs; `make lock-check` reports drift.
    env.update(HOME=str(home), PIP_CACHE_DIR=str(cache), PIP_NO_COMPILE="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_CONSTRAINT=str(ROOT / "requirements" / "lock.txt"),
               PYTHONUNBUFFERED="1", NO_PROXY=no_proxy, no_proxy=no_proxy)
    return env


def newcomer_blocks() -> list:
    readme = read_blocks("README.md")
    text = (ROOT / "docs/quickstart.md").read_text(encoding="utf-8").splitlines()
    stop = text.index(QUICKSTART_UNTIL) + 1
    return readme + [b for b in read_blocks("docs/quickstart.md") if b.line < stop]


def test_the_readme_and_the_quickstart_run_as_a_newcomer_runs_them(tmp_path):
    wheel = build_wheel(tmp_path / "wheel")
    folder, home = tmp_path / "newcomer", tmp_path / "home"
    folder.mkdir()
    home.mkdir()
    env = newcomer_env(home)
    with PageRun("README.md", folder, env, blocks=newcomer_blocks(), newcomer=Newcomer(wheel)) as run:
        run.run()
    slowest = sorted(run.seconds.items(), key=lambda kv: -kv[1])[:6]
    print("slowest blocks:", ", ".join(f"{w} {t:.0f} s" for w, t in slowest))
    kinds = [k for _, k in run.ran]
    assert kinds.count("server") == 2 and "python" in kinds, run.ran
    ran = {w for w, _ in run.ran}
    installs = [b.where for b in newcomer_blocks() if b.marker.install]
    assert len(installs) == 3 and set(installs) <= ran, (installs, run.ran)
    assert all(why for _, why in run.skipped) and len(run.skipped) == 1, run.skipped  # `make demo`/`make test`
    # it ran in the environment the pages made: ckptstore from the wheel, none of the test extras
    py = folder / ".venv" / "bin" / "python"
    r = subprocess.run([str(py), "-c", "import ckptstore, torch, importlib.util as u; print(ckptstore.__file__); "
                        "print(torch.__version__); print(u.find_spec('pytest'), u.find_spec('google'))"],
                       capture_output=True, text=True, env=env, cwd=folder, timeout=120)
    where, torch_version, missing = r.stdout.split("\n")[:3]
    assert where.startswith(str(folder / ".venv")), r.stdout + r.stderr
    assert torch_version.startswith("2.13.0") and missing == "None None", r.stdout
