"""The interpreter that runs a page's blocks for tests/test_doc_blocks.py.

Two modes, both run with the page's scratch folder as the working
directory (a reader runs the blocks from a folder of their own):

``--serve FD``
    One interpreter for a session of a page: reads requests as JSON lines
    on stdin, answers each with a JSON line on file descriptor ``FD``.
    ``{"op": "python", "path", "line", "code", "env"}`` executes a block in
    the session's namespace; ``{"op": "cli", "argv", "env", "overlay"}``
    runs ``ckptstore ARGV`` in this process (as the console script would,
    without a process start per command). ``env`` holds the variables a
    shell block exported since the last request; ``overlay`` the ones a
    command line sets for that command only.

``--script FILE --results DIR``
    One rank of a multi-rank session under ``torchrun``: executes the
    blocks listed in FILE in order, then writes ``DIR/rank-N.json``.

Blocks are compiled with the page as their file name and their own line
numbers, so a traceback points at the line of the page.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def run_python(ns: dict, path: str, line: int, code: str) -> None:
    """Execute one block in ``ns``, its line numbers those of the page."""
    exec(compile("\n" * (line - 1) + code, path, "exec"), ns)


def run_cli(argv: list[str], overlay: dict) -> int:
    """``ckptstore ARGV`` with ``overlay`` set in the environment for the call."""
    from ckptstore.cli.main import main

    saved = {k: os.environ.get(k) for k in overlay}
    os.environ.update(overlay)
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse errors, --help
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    sys.stdout.flush()
    sys.stderr.flush()
    return int(rc or 0)


def _namespace() -> dict:
    # What a reader's script sees: its own __main__ and the folder it runs in on sys.path.
    sys.path[0] = os.getcwd()
    return {"__name__": "__main__", "__builtins__": __builtins__}


def serve(fd: int) -> None:
    ns = _namespace()
    out = os.fdopen(fd, "w", buffering=1)
    for raw in sys.stdin:
        req = json.loads(raw)
        os.environ.update(req.get("env") or {})
        reply: dict = {"ok": True}
        try:
            if req["op"] == "python":
                run_python(ns, req["path"], req["line"], req["code"])
            elif req["op"] == "cli":
                reply["rc"] = run_cli(req["argv"], req.get("overlay") or {})
                reply["ok"] = reply["rc"] == 0
            else:
                raise ValueError(f"unknown request {req['op']!r}")
        except BaseException:  # noqa: BLE001 - reported to the test, which fails naming the block
            reply = {"ok": False, "error": traceback.format_exc()}
        sys.stdout.flush()
        sys.stderr.flush()
        out.write(json.dumps(reply) + "\n")


def script(blocks_file: str, results: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    with open(blocks_file, encoding="utf-8") as f:
        blocks = json.load(f)
    ns = _namespace()
    result: dict = {"ok": True}
    for b in blocks:
        try:
            run_python(ns, b["path"], b["line"], b["code"])
        except BaseException:  # noqa: BLE001
            result = {"ok": False, "line": b["line"], "error": traceback.format_exc()}
            break
    with open(os.path.join(results, f"rank-{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    if not result["ok"]:
        os._exit(1)
    # Leave together, then without interpreter finalization: a gloo group
    # torn down during finalization can abort the process (see
    # tests/ds_workers.shutdown), which is the harness's concern, not the page's.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    os._exit(0)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--serve"]:
        serve(int(argv[1]))
    elif argv[:1] == ["--script"] and argv[2:3] == ["--results"]:
        script(argv[1], argv[3])
    else:
        raise SystemExit("usage: doc_worker.py --serve FD | --script FILE --results DIR")


if __name__ == "__main__":
    main(sys.argv[1:])
