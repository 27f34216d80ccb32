"""``ckptstore`` command line: parses flags, calls the library, prints.

Known errors print one line (``ckptstore: error: ...``) and exit 1; set
``CKPTSTORE_DEBUG=1`` for the full traceback. Errors that are the user's
input or set-up (no repository at the URL, a mistyped URL, a host that does
not resolve, a cloud's client extra not installed, credentials the store
refused) print that line alone: a traceback would not help.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from .. import __version__
from ..errors import (
    CkptStoreError,
    CredentialsRefusedError,
    HostNotResolvedError,
    MissingExtraError,
    RepositoryNotFoundError,
    StoreURLError,
)
from ..tier.admin import NotATierError
from . import commands
from .cache import TIER_LS_HELP, TIER_STEP_HELP, add_cache_commands, add_tier_options


def _storage_option(s: str):
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    k, v = s.split("=", 1)
    return k, v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptstore", description="Deduplicated PyTorch checkpoints in object stores.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _read_commands(sub)
    _gc_commands(sub)
    _transfer_commands(sub)
    add_cache_commands(sub)
    add_flush_command(sub, _common)
    return p


def add_flush_command(sub, common) -> None:
    """``flush URL --cache-dir DIR``: commit the steps saved with write-back that a tier still holds."""
    sp = sub.add_parser(
        "flush",
        help="commit the steps a node-local tier holds from write-back saves",
        description="Steps saved with write_back=True are durable in the node-local tier first and committed "
        "in the object store in the background; a process that died leaves them there, and so does one that "
        "could not commit them at exit (it prints this command, naming the steps). This uploads and "
        "commits them, in step order (a step another live process is committing is left to it), and waits. "
        "Exit 1 if one cannot be committed (it stays in the tier).",
    )
    common(sp)
    sp.add_argument("--cache-dir", metavar="DIR", required=True, help="the tier directory the steps were saved to")
    sp.set_defaults(func=commands.cmd_flush)


def _common(sp, url: bool = True) -> None:
    """The URL, ``-o KEY=VALUE`` and ``--json`` every command takes."""
    if url:
        sp.add_argument("url", metavar="URL", help="repository: s3://bucket/prefix, gs://bucket/prefix, az://container/prefix, file:///path, path, memory://name")
    sp.add_argument(
        "--storage-option", "-o", action="append", type=_storage_option, default=[], metavar="KEY=VALUE",
        help="backend option (repeatable), e.g. -o endpoint_url=http://127.0.0.1:9000",
    )
    sp.add_argument("--json", action="store_true", help="machine-readable output")


def _read_commands(sub) -> None:
    """ls, show, stats, verify."""
    sp = sub.add_parser(
        "ls",
        help="list committed steps",
        description="Committed steps: time, tensors, logical and newly stored bytes, tags, and the checkpoint "
        "names the integrations gave them (lightning:last.ckpt, deepspeed:global_step1000). 'tensors' counts "
        "what `show` lists; a step saved through DCP also holds bytes items (objects DCP pickled: optimizer "
        "param groups, extra state), counted apart as '+N bytes'.",
    )
    _common(sp)
    add_tier_options(sp, help_text=TIER_LS_HELP)
    sp.set_defaults(func=commands.cmd_ls)

    sp = sub.add_parser("show", help="tensors and metadata of one step",
                        description="Tensors (name, dtype, shape, shards, size, stored size) and metadata of one "
                        "step; a step saved through DCP also lists its bytes items (objects DCP pickled).")
    _common(sp)
    sp.add_argument("step", type=int, metavar="STEP")
    add_tier_options(sp, help_text=TIER_STEP_HELP)
    sp.set_defaults(func=commands.cmd_show)

    sp = sub.add_parser("stats", help="stored bytes, dedup and compression ratios")
    _common(sp)
    add_tier_options(sp, metadata_only=True)
    sp.set_defaults(func=commands.cmd_stats)

    sp = sub.add_parser("verify", help="check manifests and packs (and chunk contents with --read-data)")
    _common(sp)
    sp.add_argument("step", type=int, nargs="?", metavar="STEP", help="only this step")
    sp.add_argument("--read-data", action="store_true", help="read every chunk and check its hash")
    sp.set_defaults(func=commands.cmd_verify)


def _gc_commands(sub) -> None:
    """gc, rm, tag."""
    sp = sub.add_parser(
        "gc",
        help="apply retention rules and reclaim unreferenced data",
        description="Delete the steps no retention rule keeps, then the data no committed step references "
        "(once older than the grace period). A bare `gc URL` keeps only the newest step and every tagged step "
        "and deletes every other step (checkpoint names do not protect a step); add --keep-last, --keep-every, "
        "--keep-within or --keep-step to keep more. The plan is printed, and confirmed, before anything is "
        "deleted; --dry-run prints it and changes nothing.",
    )
    _common(sp)
    sp.add_argument("--keep-last", type=int, metavar="N", help="keep the newest N steps")
    sp.add_argument("--keep-every", type=int, metavar="K", help="keep steps divisible by K")
    sp.add_argument("--keep-within", metavar="DURATION", help="keep steps newer than this (e.g. 7d, 12h)")
    sp.add_argument("--keep-tag", action="append", default=[], metavar="NAME",
                    help="keep steps with this tag (repeatable; default: every tagged step)")
    sp.add_argument("--no-keep-tags", action="store_true", help="tags protect nothing unless named by --keep-tag")
    sp.add_argument("--keep-step", action="append", type=int, default=[], metavar="STEP", help="keep this step")
    sp.add_argument("--grace", metavar="DURATION", help="minimum age of unreferenced data (default: the repository's)")
    sp.add_argument("--repack", action="store_true", help="rewrite live chunks of partly used packs")
    sp.add_argument("--repack-threshold", type=float, default=0.2, metavar="SHARE",
                    help="repack when dead bytes in partly used packs exceed this share of the store (default 0.2)")
    sp.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    sp.add_argument("--yes", "-y", action="store_true", help="do not ask before deleting")
    sp.set_defaults(func=commands.cmd_gc)

    sp = sub.add_parser(
        "rm",
        help="delete one step (its data goes with the next gc)",
        description="Delete one step; its data is reclaimed by the next gc. The newest step and a tagged step "
        "(tags protect a step from gc) are deleted only with --force; in a terminal, deleting a tagged step "
        "asks first.",
    )
    _common(sp)
    sp.add_argument("step", type=int, metavar="STEP")
    sp.add_argument("--force", action="store_true", help="allow deleting the newest step or a tagged step")
    sp.set_defaults(func=commands.cmd_rm)

    sp = sub.add_parser("tag", help="name a step (tagged steps survive gc)")
    _common(sp)
    sp.add_argument("step", type=int, metavar="STEP")
    sp.add_argument("name", metavar="NAME")
    sp.set_defaults(func=commands.cmd_tag)


def _transfer_commands(sub) -> None:
    """export, import, cp, diff, demo."""
    sp = sub.add_parser("export", help="write a step as a .safetensors file or a DCP directory")
    _common(sp)
    sp.add_argument("step", type=int, metavar="STEP")
    sp.add_argument("out", metavar="OUT", help="OUT.safetensors, or a directory with --format dcp")
    sp.add_argument("--format", choices=["safetensors", "dcp"], default="safetensors",
                    help="output format (default safetensors)")
    sp.add_argument("--keys", action="append", default=[], metavar="GLOB",
                    help="export only tensors whose key matches (fnmatch; repeatable; safetensors only)")
    add_tier_options(sp)
    sp.set_defaults(func=commands.cmd_export)

    sp = sub.add_parser("import", help="save a .safetensors file, torch.save file or DCP directory as a step")
    sp.add_argument("path", metavar="FILE_OR_DIR")
    _common(sp)
    sp.add_argument("--step", type=int, required=True, metavar="N", help="step number to create")
    sp.add_argument("--format", choices=["safetensors", "torch", "dcp"],
                    help="input format (default: detected from the path)")
    sp.set_defaults(func=commands.cmd_import)

    sp = sub.add_parser(
        "cp",
        help="copy steps between repositories, moving only chunks the destination lacks",
        description="Copy steps (default: every step) from SRC_URL to DST_URL, moving only the chunks the "
        "destination lacks, as stored. Tags and checkpoint names come with the steps they point at (written "
        "once the step is in the destination; one whose step is not copied is not created), so a gc of the "
        "copy keeps the same tagged steps. A step already in the destination is skipped, so running cp again "
        "copies nothing. DST_URL is created if it holds no repository; SRC_URL must hold one.",
    )
    sp.add_argument("src", metavar="SRC_URL")
    sp.add_argument("dst", metavar="DST_URL")
    _common(sp, url=False)
    sp.add_argument("--src-option", action="append", type=_storage_option, default=[], metavar="KEY=VALUE",
                    help="backend option for the source only (repeatable; -o applies to both)")
    sp.add_argument("--dst-option", action="append", type=_storage_option, default=[], metavar="KEY=VALUE",
                    help="backend option for the destination only (repeatable; -o applies to both)")
    sp.add_argument("--step", action="append", type=int, default=[], metavar="N",
                    help="copy this step (repeatable; default: every step)")
    sp.add_argument("--verify-data", action="store_true", help="read back and hash every chunk of each copied step")
    add_tier_options(sp, help_text="node-local tier of the source (docs/tier.md): its chunks are read from it first, "
                     "hash-checked (the destination is written to the object store only)")
    sp.set_defaults(func=commands.cmd_cp)

    sp = sub.add_parser("diff", help="tensors added, removed, changed between two steps (manifests only)")
    _common(sp)
    sp.add_argument("a", type=int, metavar="STEP_A")
    sp.add_argument("b", type=int, metavar="STEP_B")
    add_tier_options(sp, help_text=TIER_STEP_HELP)
    sp.set_defaults(func=commands.cmd_diff)

    sp = sub.add_parser("demo", help="train a small model, checkpoint it into an embedded S3 server, restore it")
    sp.add_argument("--steps", type=int, default=6, help="training steps to save (default 6)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=commands.cmd_demo)


#: Errors whose message says all there is (the URL or host given): no traceback hint.
_INPUT_ERRORS = (RepositoryNotFoundError, StoreURLError, HostNotResolvedError, NotATierError, MissingExtraError,
                 CredentialsRefusedError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("ckptstore: interrupted", file=sys.stderr)
        return 130
    except (CkptStoreError, OSError, ValueError, KeyError, TypeError) as e:  # MissingExtraError included
        if os.environ.get("CKPTSTORE_DEBUG"):
            traceback.print_exc()
        msg = str(e) if not isinstance(e, KeyError) else str(e.args[0] if e.args else e)
        print(f"ckptstore: error: {msg}", file=sys.stderr)
        if not os.environ.get("CKPTSTORE_DEBUG") and not isinstance(e, _INPUT_ERRORS):
            print("  (set CKPTSTORE_DEBUG=1 for the full traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
