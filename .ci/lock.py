"""Re-resolve the project's set-up and rewrite ``requirements/lock.txt``.

``make lock`` runs this: in a throw-away venv it installs the newest versions
that satisfy ``pyproject.toml`` for every extra ``make test`` installs, in one
resolver call (torch held at the pinned CPU build), runs ``pip check``, and
compares ``pip freeze`` with the checked-in lock. It prints which packages
moved, were added or dropped, and whether ``pip check`` passes; with
``--check`` (``make lock-check``) it stops there, otherwise it rewrites the
lock when ``pip check`` passes. ``--keep`` (``make lock-add``, after adding a
requirement to ``pyproject.toml``) resolves under the current pins, so that
only packages no pin covers get their newest versions and nothing else moves. Exit status: 0 when ``pip check`` passes with
the newest versions, 1 when it does not (the next upstream break, seen before
it lands), 2 on a set-up error.

The lock is a pip constraints file: ``make`` installs with
``PIP_CONSTRAINT=requirements/lock.txt`` so that build environments (the
sdists' setuptools and wheel) are pinned too.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "lock.txt"
# The extras `make test` installs (`make demo` installs a subset of the same pins).
EXTRAS = "demo,test,integrations,torchtitan"
TORCH = "torch==2.13.0"
# The CPU build's local label: the lock names the public version, which the
# on-disk +cpu wheel satisfies (it sorts above the CUDA build of the same number).
_LOCAL = re.compile(r"\+[A-Za-z0-9.]+$")


def parse_lock(text: str) -> dict[str, str]:
    """``{normalized name: version}`` of a pip constraints file of ``name==version`` lines."""
    pins: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        if m is None:
            raise ValueError(f"lock line {n} is not 'name==version': {raw!r}")
        name = normalize(m.group(1))
        if name in pins:
            raise ValueError(f"lock line {n} pins {name} a second time")
        pins[name] = m.group(2)
    return pins


def normalize(name: str) -> str:
    """PEP 503 name normalization (``Foo_Bar.baz`` -> ``foo-bar-baz``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, text=True, **kw)


def resolve_newest(python: str, workdir: Path, keep: Path | None = None) -> tuple[dict[str, str], bool, str]:
    """Install the newest allowed versions in a new venv: ``(pins, pip check passed, its output)``.

    ``keep``: a lock whose pins hold (as pip constraints) wherever they still apply, so that only
    what no pin covers (a requirement just added to pyproject.toml) gets its newest version.
    """
    venv = workdir / "venv"
    _run([python, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    env = dict(os.environ, DS_BUILD_OPS="0")
    env.pop("PIP_CONSTRAINT", None)
    if keep is not None:
        env["PIP_CONSTRAINT"] = str(keep)
    # The installers float too (unless kept): the lock pins the pip, setuptools and wheel
    # that `make` then installs first and hands to the sdists' build environments.
    _run([py, "-m", "pip", "install", "-q", "-U", "pip", "setuptools", "wheel"], env=env, check=True)
    _run([py, "-m", "pip", "install", "-q", "-e", f".[{EXTRAS}]", TORCH], cwd=ROOT, env=env, check=True)
    check = _run([py, "-m", "pip", "check"], capture_output=True)
    frozen = _run([py, "-m", "pip", "freeze", "--all", "--exclude-editable"], capture_output=True, check=True)
    pins = {}
    for line in frozen.stdout.splitlines():
        name, _, version = line.partition("==")
        if not version or normalize(name) == "ckptstore":
            continue
        pins[normalize(name)] = _LOCAL.sub("", version)
    return pins, check.returncode == 0, (check.stdout + check.stderr).strip()


def diff(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """One line per package that moved, appeared or went."""
    lines = []
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if a is None:
            lines.append(f"  added   {name} {b}")
        elif b is None:
            lines.append(f"  dropped {name} {a}")
        else:
            lines.append(f"  moved   {name} {a} -> {b}")
    return lines


def render(pins: dict[str, str]) -> str:
    head = (
        "# Exact versions of everything `make test` and `make demo` install (pip constraints).\n"
        "# Written by `make lock` (.ci/lock.py): one resolver call over the extras\n"
        f"# {EXTRAS} with {TORCH} (the CPU build), `pip check` passing.\n"
        f"# Re-resolved {_dt.date.today().isoformat()} on Python {sys.version.split()[0]}. Do not edit by hand:\n"
        "# run `make lock` (or `make lock-add` after adding a requirement) and review its diff;\n"
        "# `make lock-check` only reports drift.\n"
    )
    return head + "".join(f"{name}=={pins[name]}\n" for name in sorted(pins))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="report drift only; leave the lock as it is")
    ap.add_argument("--keep", action="store_true",
                    help="keep every pin that still applies; pin only what is new (after adding a requirement)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter the venv is made from")
    args = ap.parse_args(argv)
    if args.keep and args.check:
        ap.error("--keep and --check: --check reports the newest versions, --keep holds the pins")
    old = parse_lock(LOCK.read_text()) if LOCK.exists() else {}
    with tempfile.TemporaryDirectory(prefix="ckptstore-lock-") as tmp:
        try:
            new, ok, report = resolve_newest(args.python, Path(tmp), LOCK if args.keep and LOCK.exists() else None)
        except subprocess.CalledProcessError as e:
            print(f"lock: set-up failed: {e}", file=sys.stderr)
            return 2
    moved = diff(old, new)
    print(f"{len(moved)} of {len(new)} packages differ from {LOCK.relative_to(ROOT)}:" if moved
          else f"the newest versions match {LOCK.relative_to(ROOT)} ({len(new)} packages)")
    print("\n".join(moved))
    print(f"pip check with the newest versions: {'passes' if ok else 'FAILS'}")
    if not ok:
        print(report)
    if args.check or not ok:
        if not ok and not args.check:
            print(f"{LOCK.relative_to(ROOT)} left as it is: fix the requirement ranges first")
        return 0 if ok else 1
    LOCK.parent.mkdir(exist_ok=True)
    LOCK.write_text(render(new))
    print(f"wrote {LOCK.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
