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
    print(f"dedup ratio       {s['dedup_ratio']:.2f}x")
    print(f"compression ratio {s['compression_ratio']:.2f}x")
    print(f"overall           {s['total_ratio']:.2f}x (logical / stored)")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(steps=args.steps, as_json=args.json)
