"""Run a framework's own checkpoint tests as written and with ckptstore plugged in, side by side.

::

    python -m benchmarks.integrations.suites.run deepspeed --src DS_CHECKOUT [--side both|stock|ckptstore] [-k EXPR]
    python -m benchmarks.integrations.suites.run lightning --src PL_CHECKOUT ...
    python -m benchmarks.integrations.suites.run torchtitan --src TORCHTITAN_CHECKOUT ...
    python -m benchmarks.integrations.suites.run compare OUT_DIR          # the table of a finished run

``--src`` is a checkout (or ``git archive``) of the framework's sources at
the installed release; nothing of it is committed here (see README.md).
Each side writes JUnit XML under ``--out`` (default
``benchmarks/results/suites/<framework>``); ``compare`` joins the two into
one line per test and a summary, printed and written as ``compare.md``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

#: framework -> (folder to run pytest in, relative to --src; test paths; files left out; environment)
SUITES = {
    "deepspeed": (
        "tests",
        ["unit/checkpoint"],
        # universal checkpoints (an offline conversion ckptstore does not
        # take part in), AutoTP and MiCS need GPUs or features out of scope
        ["test_universal_checkpoint.py", "test_autotp_uc_checkpoint.py", "test_mics_optimizer.py"],
        # CPU accelerator; LOCAL_SIZE: the CPU accelerator's device count, so 2- and 4-rank tests run
        {"DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "4", "DS_DISABLE_REUSE_DIST_ENV": "1"},
    ),
    "lightning": (
        "tests/tests_pytorch",
        ["checkpointing"],
        ["test_legacy_checkpoints.py"],
        {"PL_RUN_STANDALONE_TESTS": "0"},
    ),
    # the checkpoint manager's tests; each test's own folder is its repository
    "torchtitan": (
        "tests",
        ["unit_tests/test_checkpoint.py"],
        [],
        {"CKPTSTORE_SUITE_FRAMEWORK": "torchtitan"},
    ),
}


def run_side(framework: str, src: str, out: str, ckptstore: bool, extra: list[str], local_files: str | None = None) -> str:
    folder, paths, skip, env_extra = SUITES[framework]
    cwd = os.path.join(os.path.abspath(src), folder)
    side = "ckptstore" if ckptstore else "stock"
    xml = os.path.join(out, f"{side}.xml")
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BOOT, REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    env.pop("CKPTSTORE_SUITE_DIR", None)
    env.pop("CKPTSTORE_SUITE_LOCAL_FILES", None)
    if local_files:
        env["CKPTSTORE_SUITE_LOCAL_FILES"] = local_files
    work = None
    if ckptstore:
        work = tempfile.mkdtemp(prefix=f"ckptstore-suite-{framework}-")
        env["CKPTSTORE_SUITE_DIR"] = work
    cmd = [sys.executable, "-m", "pytest", "-p", "ckptstore_suite_plugin", "-q", "-rN", "--junitxml", xml,
           "-o", "junit_family=xunit1", "-p", "no:cacheprovider"]
    cmd += [p for p in paths]
    cmd += [arg for f in skip for arg in ("--ignore", os.path.join(paths[0], f))]
    if framework == "torchtitan" and ckptstore:
        cmd += ["-p", "ckptstore_titan_adapt"]
    cmd += extra
    print(f"[{side}] cd {cwd} && {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    with open(os.path.join(out, f"{side}.log"), "w") as log:
        rc = subprocess.call(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    print(f"[{side}] exit {rc} after {time.monotonic() - t0:.0f} s; log {out}/{side}.log", flush=True)
    if work:
        shutil.rmtree(work, ignore_errors=True)
    return xml


def outcomes(xml: str) -> dict[str, tuple[str, str]]:
    """Test id -> (outcome, first line of the failure message)."""
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        state, msg = "pass", ""
        for child in case:
            if child.tag in ("failure", "error"):
                state, msg = "fail", (child.get("message") or "").strip().splitlines()[0:1]
                msg = msg[0] if msg else ""
                break
            if child.tag == "skipped":
                state, msg = "skip", (child.get("message") or "")[:120]
        if tid in out and out[tid][0] == "fail":
            continue  # a teardown error recorded after the call keeps the failure
        out[tid] = (state, msg)
    return out


def compare(out: str) -> str:
    stock = outcomes(os.path.join(out, "stock.xml"))
    ours = outcomes(os.path.join(out, "ckptstore.xml"))
    lines = ["| test | as written | with ckptstore | ckptstore's failure |", "| --- | --- | --- | --- |"]
    for tid in sorted(set(stock) | set(ours)):
        a, b = stock.get(tid, ("-", ""))[0], ours.get(tid, ("-", ""))
        if a == "pass" and b[0] != "pass":
            lines.append(f"| `{tid}` | {a} | {b[0]} | {b[1][:160].replace('|', '/')} |")
    passing = [t for t, (s, _) in stock.items() if s == "pass"]
    both = [t for t in passing if ours.get(t, ("-",))[0] == "pass"]
    summary = (
        f"as written: {len(passing)} pass of {len(stock)} ({sum(s == 'skip' for s, _ in stock.values())} skipped); "
        f"with ckptstore: {sum(s == 'pass' for s, _ in ours.values())} pass; "
        f"of the {len(passing)} that pass as written, {len(both)} pass with ckptstore "
        f"({100 * len(both) / max(1, len(passing)):.1f}%)"
    )
    text = summary + "\n\nTests that pass as written and not with ckptstore:\n\n" + "\n".join(lines) + "\n"
    with open(os.path.join(out, "compare.md"), "w") as f:
        f.write(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("framework", choices=[*SUITES, "compare"])
    ap.add_argument("src", nargs="?", help="compare: the output folder of a run")
    ap.add_argument("--src", dest="src_opt", help="the framework's source checkout")
    ap.add_argument("--side", choices=["both", "stock", "ckptstore"], default="both")
    ap.add_argument("--out")
    ap.add_argument("-k", dest="keyword")
    ap.add_argument("--local-files", choices=["full", "stub"], help="lightning: CkptStoreCheckpointIO(local_files=...)")
    ap.add_argument("pytest_args", nargs="*")
    a = ap.parse_args(argv)
    if a.framework == "compare":
        print(compare(a.src))
        return 0
    src = a.src_opt or a.src
    if not src:
        ap.error("--src DIR is required")
    out = os.path.abspath(a.out or os.path.join(REPO_ROOT, "benchmarks", "results", "suites", a.framework))
    os.makedirs(out, exist_ok=True)
    extra = list(a.pytest_args) + (["-k", a.keyword] if a.keyword else [])
    if a.side in ("both", "stock"):
        run_side(a.framework, src, out, False, extra)
    if a.side in ("both", "ckptstore"):
        run_side(a.framework, src, out, True, extra, a.local_files)
    if a.side == "both":
        print(compare(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
