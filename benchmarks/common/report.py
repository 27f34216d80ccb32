"""Byte sizes as text, tables, the command line, the environment, the results file."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time

from .measure import MiB, loadavg


def human(n: int) -> str:
    """``123 B``, ``45.6 KiB`` (under 10 MiB) or ``789.0 MiB``."""
    if n < 10 * 1024:
        return f"{n} B"
    if n < 10 * MiB:
        return f"{n / 1024:.1f} KiB"
    return f"{n / MiB:.1f} MiB"


def mib(n: int) -> str:
    """Always in MiB: ``12.3 MiB``."""
    return f"{n / MiB:.1f} MiB"


def format_table(head: list[str], rows: list[list[str]], left: int = 1, groups: list | None = None,
                 rule: bool = True) -> str:
    """Columns padded to their widest cell: the first ``left`` left-aligned, the others right-aligned.

    ``groups`` (one value per row) puts a blank line wherever the value
    changes; ``rule`` draws a line of dashes under the header.
    """
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]

    def fmt(cells):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [fmt(head)] + (["  ".join("-" * w for w in widths)] if rule else [])
    prev = None
    for i, r in enumerate(rows):
        if groups is not None:
            if i and groups[i] != prev:
                out.append("")
            prev = groups[i]
        out.append(fmt(r))
    return "\n".join(out)


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that ran: the interpreter, ``-m module`` and the arguments, shell-quoted."""
    args = sys.argv[1:] if argv is None else argv
    return f"{sys.executable} -m {module}" + "".join(" " + shlex.quote(a) for a in args)


def env_info() -> dict:
    """Versions and machine, as every benchmark's JSON records them."""
    import torch

    import ckptstore

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ckptstore": ckptstore.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def env_line(threads: str | None = None) -> str:
    """``python X, torch Y, ckptstore Z, N CPUs, <threads>, load average at start L``."""
    e = env_info()
    threads = threads if threads is not None else f"torch threads {e['torch_threads']}"
    return (f"python {e['python']}, torch {e['torch']}, ckptstore {e['ckptstore']}, {e['cpus']} CPUs, "
            f"{threads}, load average at start {loadavg()}")


def write_results(path: str, command: str, fields: dict) -> None:
    """Write a benchmark's JSON: command, argv, time, env, ``fields``, load average at the end."""
    doc = {"command": command, "argv": sys.argv, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "env": env_info(),
           **fields, "loadavg_end": loadavg()}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"results written to {path}")


def git_commit() -> str | None:
    """The checkout's commit (``<sha>`` plus ``+changes`` when the tree differs from it), or None."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+changes" if dirty else "")
