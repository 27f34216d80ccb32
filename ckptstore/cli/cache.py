"""``ckptstore cache ls|stats|prune DIR``: what a node-local tier holds, and removing some of it.

The commands parse flags and print; scanning and planning are
:mod:`ckptstore.tier.admin`'s.
"""

from __future__ import annotations

from ..tier import admin as tier_admin
from ._format import emit_json, human_bytes, iso, table

TIER_HELP = ("node-local tier directory (docs/tier.md): chunks are read from it first, hash-checked, and chunks read "
             "from the object store are kept there; a step saved with write-back that only the tier holds yet "
             "(pending) is read from it")
TIER_LS_HELP = ("node-local tier directory (docs/tier.md): steps saved with write-back that only the tier holds yet "
                "are listed too, marked pending")
TIER_STEP_HELP = ("node-local tier directory (docs/tier.md): a step saved with write-back that only the tier holds "
                  "yet (pending) is read from it; committed steps' metadata comes from the object store")
TIER_META_HELP = ("node-local tier directory (docs/tier.md); this command reads only metadata, which the tier does "
                  "not hold: accepted so that one set of flags serves every read command")
SIZE_HELP = "most bytes the tier may hold (e.g. 200GB, 1.5TiB; default: no limit but the free-space floor)"


def add_tier_options(sp, metadata_only: bool = False, help_text: str | None = None) -> None:
    """``--cache-dir DIR`` and ``--cache-size SIZE`` of a read command."""
    sp.add_argument("--cache-dir", metavar="DIR",
                    help=help_text or (TIER_META_HELP if metadata_only else TIER_HELP))
    sp.add_argument("--cache-size", metavar="SIZE", help=SIZE_HELP)


def tier_options(args) -> dict:
    """The ``cache_dir``/``cache_size`` options of :func:`ckptstore.open` the flags ask for."""
    out = {}
    if getattr(args, "cache_dir", None) is not None:
        out["cache_dir"] = args.cache_dir
    if getattr(args, "cache_size", None) is not None:
        out["cache_size"] = args.cache_size
    return out


def add_cache_commands(sub) -> None:
    """``cache`` and its ``ls``, ``stats``, ``prune``."""
    sp = sub.add_parser(
        "cache",
        help="inspect and prune a node-local tier directory",
        description="A node-local tier (--cache-dir, ckptstore.open(url, cache_dir=...)) keeps packs and chunks "
        "of repositories on this node's disk; see docs/tier.md. These commands read or prune the directory "
        "itself; no repository is opened. A directory without the tier's TIER file is refused.",
    )
    csub = sp.add_subparsers(dest="cache_command", metavar="CACHE_COMMAND", required=True)

    c = csub.add_parser("ls", help="repositories in a tier: URL, packs, chunks, bytes, last use",
                        description="Repositories a tier holds data of: URL, packs, segments, chunks, bytes, last "
                        "use (UTC; reads touch the files they use), and the steps saved with write-back that "
                        "are not yet committed in the object store (pending).")
    _dir(c)
    c.set_defaults(func=cmd_cache_ls)

    c = csub.add_parser("stats", help="totals of a tier, its file system's free space and the free-space floor",
                        description="Bytes, packs, segments and chunks a tier holds, pending steps, temporary files (copies being written, "
                        "or left by a process that died), the file system's size and free space, and the "
                        "free-space floor every handle keeps (5% of the file system): a write to the tier "
                        "evicts when free space falls under it. cache_size is a handle's option, not recorded "
                        "in the tier.")
    _dir(c)
    c.set_defaults(func=cmd_cache_stats)

    c = csub.add_parser(
        "prune", help="remove least recently used files, or everything of a repository",
        description="Remove files from a tier: with --max-size, the least recently used ones until the tier (or, "
        "with --repo, that repository's part of it) holds at most SIZE; with --repo alone, everything of that "
        "repository; with --all, everything. Prints what it frees (--dry-run: prints it and removes nothing). "
        "Packs and segments a pending step needs (saved with write-back, not yet in the object store) are "
        "kept, whatever the rule. Only cached packs, segments and chunks are removed, never folders, pending "
        "records or files being written, so the node's "
        "processes may keep using the tier meanwhile: a reader that finds a file gone reads that chunk from "
        "the object store. Nothing in the object store is touched.",
    )
    _dir(c)
    c.add_argument("--max-size", metavar="SIZE", help="prune least recently used files down to SIZE (e.g. 50GB)")
    c.add_argument("--repo", metavar="URL", help="only this repository (its URL, as `cache ls` shows it or as "
                   "given to ckptstore.open, or its key); alone: all of it")
    c.add_argument("--all", action="store_true", help="remove every cached file of every repository")
    c.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    c.set_defaults(func=cmd_cache_prune)


def _dir(sp) -> None:
    sp.add_argument("cache_dir", metavar="DIR", help="the tier directory (the cache_dir given to ckptstore.open)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")


def cmd_cache_ls(args) -> int:
    s = tier_admin.scan(args.cache_dir)
    if args.json:
        emit_json({"cache_dir": s.cache_dir, "bytes": s.bytes, "repositories": [r.as_dict() for r in s.repos]})
        return 0
    if not s.repos:
        print(f"{s.cache_dir}: no repositories")
        return 0
    table(
        [[r.url or f"(key {r.key})", r.packs, r.segments, r.chunks, human_bytes(r.bytes),
          iso(r.last_used) if r.last_used is not None else "-", ",".join(map(str, r.pending_steps)) or "-"]
         for r in s.repos],
        ["repository", "packs", "segments", "chunks", "bytes", "last use (UTC)", "pending steps"],
    )
    n = len(s.repos)
    print(f"{n} repositor{'y' if n == 1 else 'ies'}, {human_bytes(s.bytes)} in {s.cache_dir}")
    return 0


def cmd_cache_stats(args) -> int:
    st = tier_admin.stats(args.cache_dir)
    if args.json:
        emit_json(st)
        return 0
    print(f"tier              {st['cache_dir']}")
    print(f"repositories      {st['repositories']}")
    print(f"held              {human_bytes(st['bytes'])} in {st['packs']} pack(s), {st['segments']} segment(s) "
          f"and {st['chunks']} chunk file(s)")
    if st["pending_steps"]:
        print(f"pending           {st['pending_steps']} step(s) saved with write-back, not yet in the object "
              f"store, need {human_bytes(st['pending_bytes'])} (never evicted or pruned)")
    if st["oldest_use"] is not None:
        print(f"last use          oldest {iso(st['oldest_use'])}, newest {iso(st['newest_use'])} (UTC)")
    print(f"temporary files   {st['tmp_files']} ({human_bytes(st['tmp_bytes'])}): being written, or left by a "
          "process that died")
    print(f"file system       {human_bytes(st['fs_free_bytes'])} free of {human_bytes(st['fs_total_bytes'])}")
    above = st["free_above_floor"]
    print(f"free-space floor  {human_bytes(st['floor_bytes'])} ({st['free_floor']:.0%} of the file system); "
          + (f"{human_bytes(above)} free above it" if above >= 0
             else f"{human_bytes(-above)} under it: the next write to the tier evicts"))
    return 0


def cmd_cache_prune(args) -> int:
    s = tier_admin.scan(args.cache_dir)
    plan = tier_admin.plan_prune(s, max_size=args.max_size, repo=args.repo, everything=args.all)
    if args.dry_run:
        if args.json:
            emit_json({"plan": plan.as_dict(), "dry_run": True})
        else:
            print(plan)
            print("dry run: nothing was removed")
        return 0
    result = plan.execute()
    if args.json:
        emit_json({"plan": plan.as_dict(), "result": result.as_dict()})
        return 0
    print(plan)
    print(f"removed {result.removed} file(s), freed {human_bytes(result.freed_bytes)}"
          + (f"; {result.already_gone} were already gone" if result.already_gone else "")
          + (f"; left {result.skipped} in use since the plan" if result.skipped else ""))
    return 0
