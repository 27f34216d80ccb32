"""The commands behind ``ckptstore``; each takes parsed args and returns an exit code."""

from __future__ import annotations

import os
import sys

from .. import open as open_repo
from ..progress import Bars
from ..tier.cache import is_tier
from ..tier.admin import NotATierError
from ._format import emit_json, human_bytes, iso, table
from .cache import tier_options


def _storage_options(args, url: str | None = None) -> dict | None:
    """``-o KEY=VALUE`` pairs as the backend of ``url`` expects them.

    S3 (s3fs's option names) takes the endpoint and region inside ``client_kwargs``; GCS takes
    ``endpoint_url`` directly.
    """
    url = url if url is not None else getattr(args, "url", "") or ""
    s3 = url.startswith("s3://")
    opts: dict = {}
    for k, v in getattr(args, "storage_option", []):
        if s3 and k in ("endpoint_url", "region_name"):
            opts.setdefault("client_kwargs", {})[k] = v
        else:
            opts[k] = v
    return opts or None


def _open(args):
    return open_repo(args.url, storage_options=_storage_options(args), **tier_options(args))


def cmd_ls(args) -> int:
    with _open(args) as repo:
        repo.require_repository()  # a mistyped URL is not an empty repository
        tags_by_step: dict[int, list[str]] = {}
        for name, step in repo.tags().items():
            tags_by_step.setdefault(step, []).append(name)
        names_by_step: dict[int, list[str]] = {}
        for ns, names in repo.all_names().items():
            for name, step in names.items():
                names_by_step.setdefault(step, []).append(f"{ns}:{name}")
        rows = []
        pending = set(repo.pending_steps())  # with --cache-dir: steps saved with write-back, local only
        for step in repo.steps(pending=True):
            m = repo.manifest(step)
            nbytes_items = len(_bytes_items(m))
            rows.append(
                {
                    "step": step,
                    "pending": step in pending,
                    "time": iso(m.created),
                    # what `show` lists: tensors; DCP's bytes items (pickled objects) apart
                    "tensors": len(m.tensors) - nbytes_items,
                    "bytes_items": nbytes_items,
                    "logical_bytes": m.stats.get("logical_bytes", 0),
                    "new_bytes": m.stats.get("stored_bytes", 0),
                    "reused_bytes": m.stats.get("reused_bytes", 0),
                    "tags": sorted(tags_by_step.get(step, [])),
                    "names": sorted(names_by_step.get(step, [])),
                }
            )
    if args.json:
        emit_json({"url": repo.url, "steps": rows})
        return 0
    if not rows:
        print(f"{repo.url}: no committed steps")
        return 0
    head = ["step", "time (UTC)", "tensors", "logical", "new (stored)", "tags", "names"]
    cells = [
        [r["step"], r["time"], f"{r['tensors']} +{r['bytes_items']} bytes" if r["bytes_items"] else r["tensors"],
         human_bytes(r["logical_bytes"]), human_bytes(r["new_bytes"]),
         ",".join(r["tags"]), ",".join(r["names"])]
        for r in rows
    ]
    if pending:
        head.append("where")
        for r, c in zip(rows, cells):
            c.append("tier only (pending)" if r["pending"] else "store")
    table(cells, head)
    return 0


def _bytes_items(m) -> list[str]:
    """The keys of a DCP step's bytes items (objects DCP pickled, stored beside the tensors)."""
    return list((m.dcp or {}).get("bytes", []))


def cmd_show(args) -> int:
    with _open(args) as repo:
        ckpt = repo.checkpoint(args.step)
        metas = [ckpt.tensor_meta(k) for k in ckpt.keys()]
        m = ckpt.manifest
        items = [(k, m.tensors[k]) for k in _bytes_items(m) if k in m.tensors]
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
                "bytes_items": [{"key": k, "nbytes": e.nbytes, "stored_bytes": e.stored_bytes} for k, e in items],
            }
        )
        return 0
    print(f"step {m.step}  created {iso(m.created)} UTC  base step {m.base_step}")
    if m.metadata:
        print("metadata: " + ", ".join(f"{k}={v!r}" for k, v in m.metadata.items()))
    print(f"{len(metas)} tensor{'s' if len(metas) != 1 else ''}"
          + (f", {len(items)} DCP bytes item{'s' if len(items) != 1 else ''} (objects DCP pickled: "
             "optimizer param groups, extra state...)" if items else ""))
    table(
        [
            [t.key, str(t.dtype).removeprefix("torch."), "x".join(map(str, t.shape)) or "()", len(t.shards),
             human_bytes(t.nbytes), human_bytes(t.stored_bytes)]
            for t in metas
        ],
        ["tensor", "dtype", "shape", "shards", "size", "stored"],
    )
    if items:
        table([[k, human_bytes(e.nbytes), human_bytes(e.stored_bytes)] for k, e in items],
              ["bytes item", "size", "stored"])
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


def _Progress(enabled: bool) -> Bars:
    """Bars on stderr in a terminal; none under ``--json`` (or off a terminal)."""
    return Bars(enabled)


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
        tags = sorted(name for name, step in repo.tags().items() if step == args.step)
        if tags and not args.force:
            # Tags protect a step from gc; rm should not drop one without a word either.
            what = f"step {args.step} is tagged {', '.join(tags)}"
            if args.json or not sys.stdin.isatty():
                print(f"ckptstore: error: {what}; pass --force to delete it", file=sys.stderr)
                return 1
            answer = input(f"{what}; delete it anyway? [y/N] ").strip().lower()
            if answer not in ("y", "yes"):
                print("nothing was changed")
                return 1
        repo.delete(args.step)
    if args.json:
        emit_json({"deleted": args.step, "tags": tags})
    else:
        print(f"deleted step {args.step}; its data is reclaimed by the next gc"
              + (f" (tag{'s' if len(tags) > 1 else ''} {', '.join(tags)} now name{'' if len(tags) > 1 else 's'} "
                 "no step)" if tags else ""))
    return 0


def cmd_tag(args) -> int:
    with _open(args) as repo:
        repo.tag(args.step, args.name)
    if args.json:
        emit_json({"tag": args.name, "step": args.step})
    else:
        print(f"tagged step {args.step} as {args.name}")
    return 0


def install_hint(extra: str, package_dir: str | None = None) -> str:
    """The command that adds ``extra`` to this installation of ckptstore.

    Run from a checkout (``pip install -e .``, as ``make`` installs it, or
    the source tree on ``sys.path``) that is ``pip install -e '.[extra]'`` in
    the checkout, not the PyPI spelling. ``package_dir`` is the folder of the
    ``ckptstore`` package (this one's when None): a checkout has ckptstore's
    ``pyproject.toml`` next to it.
    """
    from pathlib import Path

    pkg = Path(package_dir) if package_dir is not None else Path(__file__).resolve().parent.parent
    project = pkg.parent / "pyproject.toml"
    try:
        checkout = project.is_file() and 'name = "ckptstore"' in project.read_text(encoding="utf-8")
    except OSError:
        checkout = False
    if checkout:
        return f"pip install -e '.[{extra}]' (in the checkout {pkg.parent})"
    return f"pip install 'ckptstore[{extra}]'"


def cmd_demo(args) -> int:
    # The demo's embedded S3 server is moto's, an optional dependency.
    try:
        import moto.server  # noqa: F401
    except ImportError:
        print("ckptstore demo runs an embedded S3 server (moto), which is not installed: "
              + install_hint("demo"), file=sys.stderr)
        return 2
    from .demo import run_demo

    return run_demo(steps=args.steps, as_json=args.json)


# ------------------------------------------------------------------ transfer commands
def cmd_export(args) -> int:
    progress = _Progress(not args.json)
    with _open(args) as repo:
        try:
            if args.format == "dcp":
                if args.keys:
                    raise ValueError("--keys works only with --format safetensors")
                out = repo.export(args.step, args.out, format="dcp")
            else:
                out = repo.export(args.step, args.out, format="safetensors", keys=args.keys or None,
                                  progress=progress)
        finally:
            progress.close()
    out["format"] = args.format
    if args.json:
        emit_json(out)
    else:
        print(f"exported step {out['step']} ({out['tensors']} tensors, {human_bytes(out['bytes'])}) "
              f"to {out['path']} ({args.format})")
    return 0


def cmd_import(args) -> int:
    from ..repo.transfer import detect_format

    progress = _Progress(not args.json)
    with _open(args) as repo:  # the URL is checked before the file is read
        fmt = args.format or detect_format(args.path)
        try:
            info = repo.import_(args.path, args.step, format=fmt, progress=progress)
        finally:
            progress.close()
    if args.json:
        emit_json({"format": fmt, **info.as_dict()})
    else:
        print(f"imported {args.path} ({fmt}) as step {info.step}: {info.tensors} tensors, "
              f"{human_bytes(info.logical_bytes)} logical, {human_bytes(info.stored_bytes)} new stored")
    return 0


def _options_from(pairs, url: str) -> dict | None:
    class _A:
        storage_option = pairs

    return _storage_options(_A, url)


def cmd_cp(args) -> int:
    common = list(args.storage_option)
    src_opts = _options_from(common + list(args.src_option), args.src)
    dst_opts = _options_from(common + list(args.dst_option), args.dst)
    progress = _Progress(not args.json)
    with open_repo(args.src, storage_options=src_opts, **tier_options(args)) as src, \
            open_repo(args.dst, storage_options=dst_opts) as dst:
        try:
            res = src.copy_to(dst, steps=args.step or None, progress=progress, verify_data=args.verify_data)
        finally:
            progress.close()
    if args.json:
        emit_json({"src": src.url, "dst": dst.url, **res.as_dict()})
        return 0
    for step, why in res.skipped:
        print(f"step {step}: skipped, {why}")
    print(
        f"copied {len(res.copied)} step(s): {res.chunks_copied} chunk(s), {human_bytes(res.bytes_copied)} stored "
        f"in {len(res.packs)} new pack(s); {res.chunks_reused} chunk reference(s) reused what the destination had"
    )
    pointed = [(f"tag {n}", s) for n, s in sorted(res.tags.items())]
    pointed += [(f"name {ns}:{n}", s) for ns, names in sorted(res.names.items()) for n, s in sorted(names.items())]
    for label, step in pointed:
        was = res.moved.get(label)
        print(f"{label} -> step {step}" + (f" (moved from step {was})" if was is not None else ""))
    for label, why in res.refs_skipped:
        print(f"{label}: not copied, {why}")
    return 0


def cmd_diff(args) -> int:
    with _open(args) as repo:
        d = repo.diff(args.a, args.b)
    if args.json:
        emit_json(d)
        return 0
    print(f"step {d['a']} -> step {d['b']}: {len(d['added'])} added, {len(d['removed'])} removed, "
          f"{len(d['changed'])} changed, {len(d['unchanged'])} unchanged")
    rows = [["+", t["key"], f"{t['dtype']}{t['shape']}", human_bytes(t["bytes"])] for t in d["added"]]
    rows += [["-", t["key"], f"{t['dtype']}{t['shape']}", human_bytes(t["bytes"])] for t in d["removed"]]
    rows += [
        ["~", t["key"], t["reason"] if t["reason"] != "data" else f"{t['changed_chunks']}/{t['chunks']} chunks",
         human_bytes(t["changed_bytes"])]
        for t in d["changed"]
    ]
    if rows:
        table(rows, ["", "tensor", "change", "bytes"])
    v = d["values"]
    for k, x in v["added"].items():
        print(f"+ value {k} = {x!r}")
    for k, x in v["removed"].items():
        print(f"- value {k} (was {x!r})")
    for k, x in v["changed"].items():
        print(f"~ value {k}: {x['from']!r} -> {x['to']!r}")
    return 0


def cmd_flush(args) -> int:
    if not is_tier(args.cache_dir):  # a mistyped DIR: no tier made there (a write-back handle creates one)
        why = "no such directory" if not os.path.isdir(args.cache_dir) else "no TIER file"
        raise NotATierError(f"{os.path.abspath(args.cache_dir)}: not a ckptstore node-local tier ({why}): no "
                            "step saved with write-back can be pending there")
    with open_repo(args.url, storage_options=_storage_options(args), cache_dir=args.cache_dir, write_back=True) as repo:
        before = repo.pending_steps()
        repo.flush()  # a failure is one line, exit 1 (cli.main)
        committed = [s for s in before if s in set(repo.steps())]
        left = repo.pending_steps()
    if args.json:
        emit_json({"url": repo.url, "committed": committed, "pending": left})
        return 0
    if not before:
        print(f"{repo.url}: no pending step in {args.cache_dir}")
    else:
        print(f"{repo.url}: committed step{'s' if len(committed) != 1 else ''} {', '.join(map(str, committed))}")
    if left:
        print(f"still pending (another process is committing them): {', '.join(map(str, left))}")
    return 0
