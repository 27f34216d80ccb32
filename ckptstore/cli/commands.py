"""The commands behind ``ckptstore``; each takes parsed args and returns an exit code."""

from __future__ import annotations

import sys

from .. import open as open_repo
from ._format import emit_json, human_bytes, iso, table


def _storage_options(args) -> dict | None:
    opts: dict = {}
    for k, v in getattr(args, "storage_option", []):
        if k in ("endpoint_url", "region_name"):
            opts.setdefault("client_kwargs", {})[k] = v
        else:
            opts[k] = v
    return opts or None


def _open(args):
    return open_repo(args.url, storage_options=_storage_options(args))


def cmd_ls(args) -> int:
    with _open(args) as repo:
        tags_by_step: dict[int, list[str]] = {}
        for name, step in repo.tags().items():
            tags_by_step.setdefault(step, []).append(name)
        rows = []
        for step in repo.steps():
            m = repo.manifest(step)
            rows.append(
                {
                    "step": step,
                    "time": iso(m.created),
                    "tensors": len(m.tensors),
                    "logical_bytes": m.stats.get("logical_bytes", 0),
                    "new_bytes": m.stats.get("stored_bytes", 0),
                    "reused_bytes": m.stats.get("reused_bytes", 0),
                    "tags": sorted(tags_by_step.get(step, [])),
                }
            )
    if args.json:
        emit_json({"url": repo.url, "steps": rows})
        return 0
    if not rows:
        print(f"{repo.url}: no committed steps")
        return 0
    table(
        [
            [r["step"], r["time"], r["tensors"], human_bytes(r["logical_bytes"]), human_bytes(r["new_bytes"]), ",".join(r["tags"])]
            for r in rows
        ],
        ["step", "time (UTC)", "tensors", "logical", "new (stored)", "tags"],
    )
    return 0


def cmd_show(args) -> int:
    with _open(args) as repo:
        ckpt = repo.checkpoint(args.step)
        metas = [ckpt.tensor_meta(k) for k in ckpt.keys()]
        m = ckpt.manifest
    if args.json:
        emit_json(
            {
                "step": m.step,
                "created": m.created,
                "metadata": m.metadata,
                "stats": m.stats,
                "tensors": [
                    {
                        "key": t.key,
                        "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape),
                        "shards": [{"offsets": list(o), "sizes": list(s)} for o, s in t.shards],
                        "nbytes": t.nbytes,
                        "stored_bytes": t.stored_bytes,
                        "chunks": t.chunks,
                    }
                    for t in metas
                ],
            }
        )
        return 0
    print(f"step {m.step}  created {iso(m.created)} UTC  base step {m.base_step}")
    if m.metadata:
        print("metadata: " + ", ".join(f"{k}={v!r}" for k, v in m.metadata.items()))
    table(
        [
            [t.key, str(t.dtype).removeprefix("torch."), "x".join(map(str, t.shape)) or "()", len(t.shards),
             human_bytes(t.nbytes), human_bytes(t.stored_bytes)]
            for t in metas
        ],
        ["tensor", "dtype", "shape", "shards", "size", "stored"],
    )
    return 0


def cmd_stats(args) -> int:
    with _open(args) as repo:
        s = repo.stats()
    if args.json:
        emit_json(s)
        return 0
    print(f"repository        {s['url']}")
    print(f"steps             {s['steps']}")
    print(f"packs             {s['packs']}  ({human_bytes(s['stored_bytes'])} stored)")
    print(f"logical data      {human_bytes(s['logical_bytes'])} over all steps")
    print(f"unique data       {human_bytes(s['unique_raw_bytes'])} raw, {human_bytes(s['unique_stored_bytes'])} compressed")
    print(f"referenced        {human_bytes(s['referenced_bytes'])} by committed steps")
    print(f"dead in partly used packs {human_bytes(s['partial_dead_bytes'])} in {s['partial_packs']} pack(s)")
    print(f"unreferenced packs {human_bytes(s['unreferenced_pack_bytes'])} (reclaimed by gc after the grace period)")
    print(f"dedup ratio       {s['dedup_ratio']:.2f}x")
    print(f"compression ratio {s['compression_ratio']:.2f}x")
    print(f"overall           {s['total_ratio']:.2f}x (logical / stored)")
    return 0


class _Progress:
    """One self-overwriting line on stderr, only when stderr is a terminal."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()

    def __call__(self, what: str, done: int, total: int) -> None:
        if self.enabled:
            sys.stderr.write(f"\r{what}: {done}/{total}")
            if done >= total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def cmd_verify(args) -> int:
    with _open(args) as repo:
        report = repo.verify(step=args.step, read_data=args.read_data, progress=_Progress(not args.json))
    if args.json:
        emit_json(report.as_dict())
    else:
        print(report)
    return 0 if report.ok else 1


def cmd_gc(args) -> int:
    keep_tags = tuple(args.keep_tag) if (args.keep_tag or args.no_keep_tags) else True
    with _open(args) as repo:
        plan = repo.plan_gc(
            keep_last=args.keep_last,
            keep_every=args.keep_every,
            keep_within=args.keep_within,
            keep_tags=keep_tags,
            keep_steps=args.keep_step,
            grace=args.grace,
            repack=args.repack,
            repack_threshold=args.repack_threshold,
        )
        if args.dry_run:
            if args.json:
                emit_json({"plan": plan.as_dict(), "dry_run": True})
            else:
                print(plan)
                print("dry run: nothing was changed")
            return 0
        if not args.json:
            print(plan)
        if not args.yes:
            if not sys.stdin.isatty():
                print("ckptstore: error: refusing to delete without confirmation; pass --yes", file=sys.stderr)
                return 1
            answer = input("proceed? [y/N] ").strip().lower()
            if answer not in ("y", "yes"):
                print("nothing was changed")
                return 1
        result = plan.execute(progress=_Progress(not args.json))
    if args.json:
        emit_json({"plan": plan.as_dict(), "result": result.as_dict()})
    else:
        print(
            f"deleted {len(result.deleted_steps)} step(s) and {len(result.deleted_packs)} pack(s), "
            f"repacked {len(result.repacked_packs)}, aborted {result.aborted_uploads} upload(s); "
            f"freed {human_bytes(result.freed_bytes)}"
        )
        for pid, why in result.skipped_packs:
            print(f"  kept pack {pid}: {why}")
    return 0


def cmd_rm(args) -> int:
    with _open(args) as repo:
        latest = repo.latest()
        if args.step == latest and not args.force:
            print(f"ckptstore: error: step {args.step} is the newest step; pass --force to delete it",
                  file=sys.stderr)
            return 1
        repo.delete(args.step)
    if args.json:
        emit_json({"deleted": args.step})
    else:
        print(f"deleted step {args.step}; its data is reclaimed by the next gc")
    return 0


def cmd_tag(args) -> int:
    with _open(args) as repo:
        repo.tag(args.step, args.name)
    if args.json:
        emit_json({"tag": args.name, "step": args.step})
    else:
        print(f"tagged step {args.step} as {args.name}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(steps=args.steps, as_json=args.json)
