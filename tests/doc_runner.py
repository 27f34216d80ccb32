"""Run one page's blocks as a reader would (see tests/doc_blocks.py for the markers).

:class:`PageRun` walks the blocks in page order: python blocks go to the
page's interpreter (a ``tests/doc_worker.py --serve`` process) or to their
session's; a multi-rank session runs under ``torchrun`` once its last block
is reached; shell blocks run line by line; server blocks start a process on
a free loopback port. The first failure raises :class:`BlockFailed` naming
the page, the line and what went wrong; later blocks usually depend on it.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ckptstore.testing import free_port

from .doc_blocks import ROOT, Block, Command, read_blocks, shell_commands, synopsis_commands

WORKER = str(Path(__file__).resolve().parent / "doc_worker.py")
#: Hang guards only: a block of these pages runs in seconds.
BLOCK_TIMEOUT = 300.0
SERVER_TIMEOUT = 60.0


class BlockFailed(AssertionError):
    """A block did not run as written: the message names ``page:line``."""


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def run_group(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple[int | None, str]:
    """Run ``cmd`` in a process group of its own: ``(exit status, output)``.

    On timeout the whole group is killed (torchrun's ranks, a shell's
    children) and the status is None.
    """
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


class Interpreter:
    """One ``doc_worker.py --serve`` process: a session's namespace, kept across blocks."""

    def __init__(self, name: str, folder: Path, env: dict, log: Path, python: str = sys.executable):
        self.name, self.log = name, log
        r, w = os.pipe()
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(
            [python, WORKER, "--serve", str(w)], stdin=subprocess.PIPE, stdout=self._log,
            stderr=subprocess.STDOUT, pass_fds=(w,), cwd=folder, env=env, text=True, start_new_session=True)
        os.close(w)
        self._r, self._buf = r, b""

    def request(self, msg: dict, timeout: float = BLOCK_TIMEOUT) -> dict:
        """Send one request; the reply, with ``output`` (what the block printed)."""
        start = self.log.stat().st_size
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        reply = None
        while reply is None:
            if b"\n" in self._buf:
                raw, self._buf = self._buf.split(b"\n", 1)
                reply = json.loads(raw)
                break
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                reply = {"ok": False, "error": f"no answer within {timeout:.0f} s (killed)"}
                break
            ready, _, _ = select.select([self._r], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._r, 1 << 16)
                if not chunk:
                    reply = {"ok": False, "error": f"the interpreter exited ({self.proc.wait()})"}
                self._buf += chunk
        with open(self.log, "rb") as f:
            f.seek(start)
            reply["output"] = f.read().decode(errors="replace")
        return reply

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
        os.close(self._r)
        self._log.close()


@dataclass(frozen=True)
class Newcomer:
    """How a newcomer's run differs (tests/test_newcomer.py): install blocks run, in a fresh virtual
    environment the page creates, with ``ckptstore`` from ``wheel`` (the work tree built: ``pip install
    'ckptstore[s3]'`` and ``pip install -e '.[demo]'`` install ``WHEEL[s3]``, ``WHEEL[demo]``); ``ckptstore``
    commands run as the console script the environment has; python blocks in its interpreter (``python``,
    relative to the page's folder)."""

    wheel: Path
    python: str = ".venv/bin/python"

    def install_words(self, argv: list[str]) -> list[str]:
        """A ``pip install`` line with the package this work tree builds in place of ckptstore's name."""
        if "pip" not in Path(argv[0]).name or "install" not in argv[1:3]:
            return argv
        out: list[str] = []
        for w in argv:
            extra = re.fullmatch(r"(?:ckptstore|\.)(\[[a-z0-9,]+\])?", w)
            if extra:
                if out and out[-1] == "-e":
                    out.pop()
                out.append(f"{self.wheel}{extra.group(1) or ''}")
            else:
                out.append(w)
        return out


class PageRun:
    """The blocks of one page, run in order in ``folder`` with environment ``env``.

    Attributes after :meth:`run`: ``ran`` (``page:line`` of each block run, with
    its kind), ``skipped`` (``page:line`` and the reason) and ``seconds``
    (``page:line`` -> seconds spent at that block; a multi-rank session's time
    is its last block's).

    ``blocks``: run these (of one page or several, in order) instead of the
    page's; ``newcomer``: run as a newcomer does (:class:`Newcomer`).
    """

    def __init__(self, page: str, folder: Path, env: dict, text: str | None = None, *,
                 blocks: list[Block] | None = None, newcomer: Newcomer | None = None):
        self.page, self.folder, self.env = page, folder, dict(env)
        self.blocks = read_blocks(page, text) if blocks is None else list(blocks)
        self.newcomer = newcomer
        self.python = str(folder / newcomer.python) if newcomer is not None else sys.executable
        self.harness = folder.parent / f"{folder.name}-harness"
        self.harness.mkdir(parents=True, exist_ok=True)
        self.ports: dict[str, str] = {}
        self.servers: list[tuple[Block, subprocess.Popen]] = []
        self.sessions: dict[str, Interpreter] = {}
        self.pending_env: dict[str, dict] = {}
        self.ran: list[tuple[str, str]] = []
        self.skipped: list[tuple[str, str]] = []
        self.seconds: dict[str, float] = {}
        self.ranks: dict[str, int] = {}
        self.last: dict[str, int] = {}
        for i, b in enumerate(self.blocks):
            for s in b.marker.sessions:
                self.last[s] = i
                if b.marker.ranks:
                    self.ranks[s] = b.marker.ranks

    # ------------------------------------------------------------ walk
    def run(self) -> "PageRun":
        deferred: dict[str, list[Block]] = {}
        for i, b in enumerate(self.blocks):
            if b.lang == "text":
                if b.marker.synopsis:
                    self._synopsis(b)
                continue
            if not b.runs and not (self.newcomer is not None and b.marker.install):
                self.skipped.append((b.where, b.marker.reason or ""))
                continue
            t0 = time.monotonic()
            if b.lang == "sh":
                self._server(b) if b.marker.server else self._shell(b)
            else:
                for s in b.marker.sessions or ("main",):
                    if s in self.ranks:
                        deferred.setdefault(s, []).append(b)
                        if self.last[s] == i:
                            self._ranks(s, deferred.pop(s))
                    else:
                        self._python(s, b)
                self.ran.append((b.where, "python"))
            self.seconds[b.where] = time.monotonic() - t0
        return self

    def close(self) -> None:
        for s in self.sessions.values():
            s.close()
        for _, proc in self.servers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()

    def __enter__(self) -> "PageRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ helpers
    def _code(self, b: Block) -> str:
        code = b.code
        for doc, real in self.ports.items():
            code = re.sub(rf"\b(127\.0\.0\.1|localhost):{doc}\b", rf"\g<1>:{real}", code)
        return code

    def _fail(self, where: str, what: str, detail: str = "") -> None:
        raise BlockFailed(f"{where}: {what}" + (f"\n{_tail(detail.rstrip())}" if detail.strip() else ""))

    def _session(self, name: str) -> Interpreter:
        if name not in self.sessions:
            log = self.harness / f"session-{name}.log"
            self.sessions[name] = Interpreter(name, self.folder, self.env, log, self.python)
            self.pending_env[name] = {}
        return self.sessions[name]

    def _export(self, values: dict) -> None:
        self.env.update(values)
        for pending in self.pending_env.values():
            pending.update(values)

    def _request(self, session: str, where: str, msg: dict, what: str) -> None:
        interp = self._session(session)
        msg["env"], self.pending_env[session] = self.pending_env[session], {}
        reply = interp.request(msg)
        if not reply["ok"]:
            rc = f" (exit status {reply['rc']})" if "rc" in reply else ""
            self._fail(where, f"{what}{rc}", reply.get("output", "") + "\n" + reply.get("error", ""))

    # ------------------------------------------------------------ kinds
    def _python(self, session: str, b: Block) -> None:
        label = "python block" + ("" if session == "main" else f" (session {session})")
        self._request(session, b.where, {"op": "python", "path": str(ROOT / b.page), "line": b.line,
                                         "code": self._code(b)}, f"{label} failed")

    def _shell(self, b: Block) -> None:
        for cmd in shell_commands(Block(b.page, b.line, b.lang, self._code(b), b.marker)):
            where = f"{b.page}:{cmd.line}"
            if cmd.export:
                self._export(cmd.overlay)
            elif cmd.argv[:1] in ([""], ["."], ["source"]) and cmd.argv[1:2] and cmd.argv[1].endswith("bin/activate"):
                venv = (self.folder / cmd.argv[1]).resolve().parent.parent  # what the script sets
                if not (venv / "bin" / "python").exists():
                    self._fail(where, f"`{cmd.text}`: no virtual environment at {venv}")
                self._export({"VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{self.env['PATH']}"})
            elif cmd.argv[:1] == ["ckptstore"] and self.newcomer is None:
                self._request("main", where, {"op": "cli", "argv": cmd.argv[1:], "overlay": cmd.overlay},
                              f"`{cmd.text}` failed")
            else:
                self._subprocess(where, cmd)
        self.ran.append((b.where, "sh"))

    def _subprocess(self, where: str, cmd: Command) -> None:
        argv = cmd.argv if self.newcomer is None else self.newcomer.install_words(cmd.argv)
        words = [shlex.quote(w) for w in argv]
        rc, out = run_group(["bash", "-c", " ".join(words)], self.folder, dict(self.env, **cmd.overlay), BLOCK_TIMEOUT)
        if rc is None:
            self._fail(where, f"`{cmd.text}` did not finish within {BLOCK_TIMEOUT:.0f} s (killed)", out)
        if rc != 0:
            self._fail(where, f"`{cmd.text}` failed (exit status {rc})", out)

    def _server(self, b: Block) -> None:
        cmds = shell_commands(b)
        ports = re.findall(r"(?<![\d.])(\d{4,5})(?![\d.])", cmds[0].text) if len(cmds) == 1 else []
        if len(ports) != 1:
            self._fail(b.where, "a server block holds one command naming one port")
        doc_port, real = ports[0], str(free_port())
        argv = [real if w == doc_port else w for w in cmds[0].argv]
        log = self.harness / f"server-{b.line}.log"
        try:
            with open(log, "wb") as f:
                proc = subprocess.Popen(argv, cwd=self.folder, env=dict(self.env, **cmds[0].overlay), stdout=f,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            self._fail(b.where, f"`{cmds[0].text}` could not start: {e} (`make setup` installs the local servers)")
        self.servers.append((b, proc))
        deadline = time.monotonic() + SERVER_TIMEOUT
        while True:
            if proc.poll() is not None:
                self._fail(b.where, f"`{cmds[0].text}` exited ({proc.returncode})", log.read_text(errors="replace"))
            try:
                socket.create_connection(("127.0.0.1", int(real)), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self._fail(b.where, f"`{cmds[0].text}` did not listen within {SERVER_TIMEOUT:.0f} s",
                               log.read_text(errors="replace"))
                time.sleep(0.1)
        self.ports[doc_port] = real
        self.ran.append((b.where, "server"))

    def _ranks(self, session: str, blocks: list[Block]) -> None:
        n = self.ranks[session]
        spec = self.harness / f"ranks-{session}.json"
        results = self.harness / f"ranks-{session}"
        results.mkdir(exist_ok=True)
        spec.write_text(json.dumps([{"path": str(ROOT / b.page), "line": b.line, "code": self._code(b)}
                                    for b in blocks]))
        cmd = [self.python, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", WORKER, "--script", str(spec), "--results", str(results)]
        where, label = f"{blocks[0].page}:{blocks[0].line}", f"session {session} ({n} ranks under torchrun)"
        rc, out = run_group(cmd, self.folder, self.env, BLOCK_TIMEOUT * 2)
        for rank in range(n):
            f = results / f"rank-{rank}.json"
            res = json.loads(f.read_text()) if f.exists() else None
            if res is not None and not res["ok"]:
                self._fail(f"{blocks[0].page}:{res['line']}", f"python block failed on rank {rank} of {label}",
                           res["error"])
        if rc is None:
            self._fail(where, f"{label} did not finish within {BLOCK_TIMEOUT * 2:.0f} s (killed)", out)
        if rc != 0 or any(not (results / f"rank-{k}.json").exists() for k in range(n)):
            self._fail(where, f"{label} failed (exit status {rc})", out)

    def _synopsis(self, b: Block) -> None:
        from ckptstore.cli.docgen import subcommands
        from ckptstore.cli.main import build_parser

        subs = subcommands(build_parser())
        for line, name, opts in synopsis_commands(b):
            if name not in subs:
                self._fail(f"{b.page}:{line}", f"`ckptstore {name}` is not a subcommand")
            known = {o for a in subs[name][1]._actions for o in a.option_strings}
            missing = [o for o in opts if o not in known]
            if missing:
                self._fail(f"{b.page}:{line}", f"`ckptstore {name}` has no option {', '.join(missing)}")
        self.ran.append((b.where, "synopsis"))
