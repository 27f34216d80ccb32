"""Run a framework's own checkpoint tests as written and with ckptstore plugged in, side by side.

::

    python -m benchmarks.integrations.suites.run deepspeed --src DS_CHECKOUT [--side both|stock|ckptstore] [-k EXPR]
    python -m benchmarks.integrations.suites.run lightning --src PL_CHECKOUT ...
    python -m benchmarks.integrations.suites.run torchtitan --src TORCHTITAN_CHECKOUT ...
    python -m benchmarks.integrations.suites.run megatron --src MEGATRON_LM_CHECKOUT [--ranks 2] [--overlay DIR] ...
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
    # Megatron-Core's dist_checkpointing tests: one pytest process per rank (as Megatron runs
    # them under torchrun), gloo on the CPU (boot/ckptstore_megatron_cpu.py)
    "megatron": (
        "",
        ["tests/unit_tests/dist_checkpointing"],
        [],
        {"CKPTSTORE_SUITE_FRAMEWORK": "megatron"},
    ),
}


def run_side(framework: str, src: str, out: str, ckptstore: bool, extra: list[str], local_files: str | None = None,
             ranks: int = 1, path: list[str] = (), test_timeout: float = 0, run_timeout: float = 0,
             tests: list[str] | None = None) -> str:
    folder, paths, skip, env_extra = SUITES[framework]
    if tests:
        paths = list(tests)
    cwd = os.path.join(os.path.abspath(src), folder)
    side = "ckptstore" if ckptstore else "stock"
    xml = os.path.join(out, f"{side}.xml")
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BOOT, REPO_ROOT, *path, env.get("PYTHONPATH", "")) if p)
    if test_timeout:
        env["CKPTSTORE_SUITE_TEST_TIMEOUT"] = str(test_timeout)
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
    if framework == "megatron":
        cmd += ["--continue-on-collection-errors"]  # a test file needing a GPU package fails alone
    if framework == "torchtitan" and ckptstore:
        cmd += ["-p", "ckptstore_titan_adapt"]
    cmd += extra
    print(f"[{side}] cd {cwd} && {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    if ranks > 1:
        rc = _run_ranks(cmd, cwd, env, out, side, ranks, run_timeout)
    else:
        with open(os.path.join(out, f"{side}.log"), "w") as log:
            rc = subprocess.call(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 timeout=run_timeout or None)
    print(f"[{side}] exit {rc} after {time.monotonic() - t0:.0f} s; log {out}/{side}.log", flush=True)
    if work:
        shutil.rmtree(work, ignore_errors=True)
    return xml


def _run_ranks(cmd: list[str], cwd: str, env: dict, out: str, side: str, ranks: int, run_timeout: float) -> int:
    """``cmd`` (a pytest run writing ``{side}.xml``) once per rank, as torchrun starts Megatron's tests.

    Each rank writes ``{side}.rank<R>.xml`` and ``{side}.rank<R>.log``; the
    side's ``{side}.xml`` has each test once: failed if it failed on any
    rank (with that rank's message), else rank 0's outcome. The ranks share
    a ``--basetemp`` parent (Megatron's ``tmp_path_dist_ckpt`` is the parent
    of the base temporary folder). ``run_timeout``: the whole side is
    stopped after that many seconds (each rank's XML so far is lost then:
    pytest writes it at the end).
    """
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = tempfile.mkdtemp(prefix=f"ckptstore-suite-{side}-tmp-")
    os.makedirs(os.path.join(base, "bt"))
    env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(ranks),
               LOCAL_WORLD_SIZE=str(ranks), OMP_NUM_THREADS="1")
    xml = os.path.join(out, f"{side}.xml")
    procs, logs = [], []
    for r in range(ranks):
        rcmd = [a if a != xml else os.path.join(out, f"{side}.rank{r}.xml") for a in cmd]
        rcmd += ["--basetemp", os.path.join(base, "bt", f"rank{r}")]
        log = open(os.path.join(out, f"{side}.rank{r}.log" if r else f"{side}.log"), "w")
        logs.append(log)
        renv = dict(env, RANK=str(r), LOCAL_RANK=str(r), CKPTSTORE_SUITE_RANK=str(r),
                    CKPTSTORE_SUITE_OUTCOMES=os.path.join(out, f"{side}.rank{r}.jsonl"))
        if os.path.exists(renv["CKPTSTORE_SUITE_OUTCOMES"]):
            os.remove(renv["CKPTSTORE_SUITE_OUTCOMES"])
        procs.append(subprocess.Popen(rcmd, cwd=cwd, env=renv, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    deadline = time.monotonic() + run_timeout if run_timeout else None
    rc = 0

    def stop():
        for q in procs:
            if q.poll() is None:
                os.killpg(q.pid, 9)

    import signal

    # a SIGTERM (e.g. `timeout` around this run) stops the ranks too: they run in sessions of their own
    previous = signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(143)))
    try:
        for p in procs:
            try:
                left = None if deadline is None else max(1.0, deadline - time.monotonic())
                rc = p.wait(timeout=left) or rc
            except subprocess.TimeoutExpired:
                print(f"[{side}] past --run-timeout: stopping the ranks", flush=True)
                stop()
                rc = 124
    finally:
        stop()
        signal.signal(signal.SIGTERM, previous)
    for log in logs:
        log.close()
    shutil.rmtree(base, ignore_errors=True)
    for r in range(ranks):  # a rank stopped before pytest wrote its XML: its outcomes as they came
        rx = os.path.join(out, f"{side}.rank{r}.xml")
        if not os.path.exists(rx) and os.path.exists(os.path.join(out, f"{side}.rank{r}.jsonl")):
            jsonl_to_junit(os.path.join(out, f"{side}.rank{r}.jsonl"), rx)
            print(f"[{side}] rank {r}: no JUnit XML (stopped); outcomes from {side}.rank{r}.jsonl", flush=True)
    merge_ranks([os.path.join(out, f"{side}.rank{r}.xml") for r in range(ranks)], xml)
    return rc


def jsonl_to_junit(src: str, dest: str) -> None:
    """The plugin's per-phase JSON lines as JUnit XML (classname and name as pytest's xunit1 writes them)."""
    import json

    cases: dict[str, ET.Element] = {}
    for line in open(src):
        try:
            d = json.loads(line)
        except ValueError:
            continue
        path, _, rest = d["nodeid"].partition("::")
        parts = rest.split("::")
        cls = ".".join([path[:-3].replace("/", ".")] + parts[:-1]) if path.endswith(".py") else path
        case = cases.setdefault(d["nodeid"], ET.Element("testcase", classname=cls, name=parts[-1]))
        if d["outcome"] == "failed":
            ET.SubElement(case, "failure" if d["when"] == "call" else "error", message=d["message"])
        elif d["outcome"] == "skipped":
            ET.SubElement(case, "skipped", message=d["message"])
    root = ET.Element("testsuites")
    suite = ET.SubElement(root, "testsuite", name="pytest", tests=str(len(cases)))
    suite.extend(cases.values())
    ET.ElementTree(root).write(dest)


def merge_ranks(xmls: list[str], dest: str) -> None:
    """One JUnit XML of per-rank XMLs: a test fails if it failed on any rank (the first such rank's entry)."""
    cases: dict[str, ET.Element] = {}
    order: list[str] = []
    for i, path in enumerate(xmls):
        if not os.path.exists(path):
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            tid = f"{case.get('classname')}::{case.get('name')}"
            failed = any(c.tag in ("failure", "error") for c in case)
            if tid not in cases:
                order.append(tid)
                cases[tid] = case
            elif failed and not any(c.tag in ("failure", "error") for c in cases[tid]):
                for c in case:
                    if c.tag in ("failure", "error"):
                        c.set("message", f"[rank {i}] " + (c.get("message") or ""))
                cases[tid] = case
    root = ET.Element("testsuites")
    suite = ET.SubElement(root, "testsuite", name="pytest", tests=str(len(order)))
    for tid in order:
        suite.append(cases[tid])
    ET.ElementTree(root).write(dest)


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
    ap.add_argument("--tests", action="append", default=None,
                    help="test files or folders (relative to the run's folder) instead of the suite's")
    ap.add_argument("--ranks", type=int, default=None, help="megatron: pytest processes, one per rank (default 2)")
    ap.add_argument("--overlay", action="append", default=[],
                    help="a folder put on PYTHONPATH before the venv's packages (e.g. the megatron-core 0.19 overlay)")
    ap.add_argument("--test-timeout", type=float, default=None, help="seconds one test may run (megatron: 300)")
    ap.add_argument("--run-timeout", type=float, default=0, help="seconds one side may run (0: no limit)")
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
    megatron = a.framework == "megatron"
    opts = dict(ranks=a.ranks or (2 if megatron else 1), path=[os.path.abspath(p) for p in a.overlay],
                test_timeout=a.test_timeout if a.test_timeout is not None else (300 if megatron else 0),
                run_timeout=a.run_timeout, tests=a.tests)
    if a.side in ("both", "stock"):
        run_side(a.framework, src, out, False, extra, **opts)
    if a.side in ("both", "ckptstore"):
        run_side(a.framework, src, out, True, extra, a.local_files, **opts)
    if a.side == "both":
        print(compare(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
