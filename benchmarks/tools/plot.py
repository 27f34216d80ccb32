"""Charts for docs/performance.md from the benchmark JSON files.

    .venv/bin/python -m benchmarks.tools.plot [--data docs/data] [--out docs/img]

Reads (any that is missing is skipped with a message):

- ``save_load_1gib.json`` (the retired ``benchmarks.save_load``; see docs/data/README.md)
  -> ``save_load_1gib.png``: save and load seconds per method, 1 GiB fp32.
- ``dcp_compare_1gib.json`` (``python -m benchmarks.distributed.dcp_compare --json``)
  -> ``dcp_compare_1gib.png``: seconds per backend (save, re-save, load) and
  bytes stored, multi-rank DCP.
- ``codec_real.json`` (``python -m benchmarks.micro.codec_real --json``)
  -> ``codec_real.png``: compression ratio of real weights and optimizer
  state, plain zstd against ckptstore's codec.

Needs matplotlib (not a dependency of ckptstore): ``.venv/bin/pip install matplotlib``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..common.measure import MiB

# One colour per kind of operation, used in every chart.
C_SAVE = "#4C72B0"
C_RESAVE = "#55A868"
C_LOAD = "#DD8452"
C_LOAD2 = "#C44E52"
C_ZSTD = "#8C8C8C"
C_CKPT = "#4C72B0"


def _import_pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.stderr.write(
            "benchmarks.tools.plot needs matplotlib, which ckptstore does not depend on.\n"
            "Install it into the venv:  .venv/bin/pip install matplotlib\n"
        )
        raise SystemExit(2)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _load(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _save(plt, fig, doc: dict, note: str, out: str, name: str) -> str:
    """Footer (versions, time, ``note``), layout, write ``out/name``; returns the path."""
    _footer(fig, doc, note)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = os.path.join(out, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label_bars(ax, bars, fmt="{:.2f}", suffix=" s"):
    for b in bars:
        w = b.get_width()
        if w != w:  # NaN: no bar
            continue
        ax.text(w, b.get_y() + b.get_height() / 2, " " + fmt.format(w) + suffix,
                va="center", ha="left", fontsize=8)


def _footer(fig, doc: dict, extra: str = "") -> None:
    env = doc.get("env", {})
    bits = []
    if env:
        bits.append(f"torch {env.get('torch', '?')}, {env.get('cpus', '?')} CPUs")
    if doc.get("time"):
        bits.append(f"run {doc['time'][:10]}")
    if extra:
        bits.append(extra)
    fig.text(0.01, 0.01, "; ".join(bits), fontsize=7, color="#555555", ha="left", va="bottom")


def plot_save_load(plt, doc: dict, out: str) -> str:
    rows = {(r["section"], r["operation"]): r for r in doc["rows"]}

    def sec(section, op):
        r = rows.get((section, op))
        return float("nan") if r is None else r["seconds"]

    methods = [
        ("torch.save / torch.load", "torch", "torch.save + fsync", None, "torch.load(weights_only=True)", None),
        ("DCP FileSystemWriter/Reader", "dcp", "dcp.save(FileSystemWriter)", None,
         None, "dcp.load(FileSystemReader) in place"),
        ("ckptstore, local dir", "ckpt-local", "save step 1", "save step 2 (same data)",
         "load(1)", "load(1, into=preallocated)"),
        ("ckptstore, moto S3 (loopback)", "ckpt-s3moto", "save step 1", "save step 2 (same data)",
         "load(1)", "load(1, into=preallocated)"),
    ]
    series = [
        ("save (first)", C_SAVE, lambda m: sec(m[1], m[2])),
        ("re-save, unchanged data (dedup)", C_RESAVE, lambda m: sec(m[1], m[3]) if m[3] else float("nan")),
        ("load, new tensors", C_LOAD, lambda m: sec(m[1], m[4]) if m[4] else float("nan")),
        ("load in place", C_LOAD2, lambda m: sec(m[1], m[5]) if m[5] else float("nan")),
    ]
    fig, ax = plt.subplots(figsize=(9, 5.2))
    h = 0.2
    ys = list(range(len(methods)))
    for i, (name, color, get) in enumerate(series):
        vals = [get(m) for m in methods]
        bars = ax.barh([y + (i - 1.5) * h for y in ys], vals, height=h, color=color, label=name)
        _label_bars(ax, bars)
    ax.set_yticks(ys)
    ax.set_yticklabels([m[0] for m in methods])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("wall seconds (log scale; lower is better)")
    gib = doc.get("data", {}).get("logical_bytes", 0) / (1 << 30)
    ntens = doc.get("data", {}).get("tensors", "?")
    ax.set_title(f"Save and load, {gib:.2f} GiB of fp32 randn ({ntens} tensors), one process")
    ax.legend(loc="upper right", fontsize=8, framealpha=0.95)
    ax.grid(axis="x", which="both", alpha=0.3)
    xmin, xmax = ax.get_xlim()
    ax.set_xlim(xmin, xmax * 4)
    return _save(plt, fig, doc, "moto rows measure moto's CPU as much as ckptstore's", out, "save_load_1gib.png")


def plot_dcp_compare(plt, doc: dict, out: str) -> str:
    backends: list[str] = []
    for r in doc["rows"]:
        if r["backend"] not in backends:
            backends.append(r["backend"])
    label = {
        "dcp-fs": "DCP FileSystem",
        "dcp-fs-zstd": "DCP FileSystem + zstd ext.",
        "ckpt-local": "ckptstore, local dir",
        "ckpt-s3": "ckptstore, moto S3",
        "dcp-fsspec-s3": "DCP FsspecWriter, moto S3",
    }

    def pick(backend, kind, resave=False):
        for r in doc["rows"]:
            if r["backend"] != backend or r["kind"] != kind:
                continue
            is_resave = "step 2" in r["operation"]
            if is_resave == resave:
                return r
        return None

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 5), gridspec_kw={"width_ratios": [3, 2]})
    h = 0.27
    ys = list(range(len(backends)))
    series = [("dcp.save (first)", C_SAVE, "save", False),
              ("dcp.save, unchanged data (dedup)", C_RESAVE, "save", True),
              ("dcp.load (in place)", C_LOAD, "load", False)]
    for i, (name, color, kind, resave) in enumerate(series):
        vals = []
        for b in backends:
            r = pick(b, kind, resave)
            vals.append(float("nan") if r is None else r["seconds"])
        bars = ax.barh([y + (i - 1) * h for y in ys], vals, height=h, color=color, label=name)
        _label_bars(ax, bars)
    ax.set_yticks(ys)
    ax.set_yticklabels([label.get(b, b) for b in backends])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("wall seconds, slowest rank (log scale; lower is better)")
    ax.legend(loc="upper right", fontsize=8, framealpha=0.95)
    ax.grid(axis="x", which="both", alpha=0.3)
    xmin, xmax = ax.get_xlim()
    ax.set_xlim(xmin, xmax * 4)

    stored = []
    for b in backends:
        r = pick(b, "save", False)
        stored.append(float("nan") if r is None or r.get("stored_bytes") is None else r["stored_bytes"] / MiB)
    bars = ax2.barh(ys, stored, height=0.5, color=C_SAVE)
    _label_bars(ax2, bars, fmt="{:.0f}", suffix=" MiB")
    ax2.set_yticks(ys)
    ax2.set_yticklabels([])
    ax2.invert_yaxis()
    ax2.set_xlabel("MiB stored by the first save")
    ax2.set_xlim(0, max(s for s in stored if s == s) * 1.35)
    ax2.grid(axis="x", alpha=0.3)
    ax2.set_title("bytes stored", fontsize=10)

    d = doc.get("data", {})
    gib = d.get("logical_bytes", 0) / (1 << 30)
    fig.suptitle(f"torch.distributed.checkpoint, {d.get('ranks', '?')} ranks (gloo, CPU), "
                 f"{gib:.2f} GiB fp32 randn as Shard(0) DTensors")
    return _save(plt, fig, doc, "re-save of unchanged data stores only a manifest (~75 KiB); S3 = moto on loopback",
                 out, "dcp_compare_1gib.png")


def plot_codec_real(plt, rows: list, out: str) -> str:
    names = [r["data"] for r in rows]
    ys = list(range(len(rows)))
    h = 0.38
    fig, ax = plt.subplots(figsize=(9, 4.6))
    b1 = ax.barh([y - h / 2 for y in ys], [r["zstd_ratio"] for r in rows], height=h, color=C_ZSTD,
                 label="zstd level 1 on the raw bytes")
    b2 = ax.barh([y + h / 2 for y in ys], [r["ckptstore_ratio"] for r in rows], height=h, color=C_CKPT,
                 label="ckptstore codec (bgz: byte-grouped planes + zstd)")
    _label_bars(ax, b1, fmt="{:.3f}", suffix="x")
    _label_bars(ax, b2, fmt="{:.3f}", suffix="x")
    ax.set_yticks(ys)
    ax.set_yticklabels([f"{n}\n{r['bytes'] / MiB:.0f} MiB" for n, r in zip(names, rows)], fontsize=9)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xlim(1.0, max(max(r["zstd_ratio"], r["ckptstore_ratio"]) for r in rows) * 1.12)
    ax.set_xlabel("compression ratio (raw bytes / stored bytes; higher is better)")
    ax.set_title("Compression of real weights (all-MiniLM-L6-v2) and AdamW state, 4 MiB chunks")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.text(0.01, 0.01, "python -m benchmarks.micro.codec_real; one thread", fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = os.path.join(out, "codec_real.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tools.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=os.path.join("docs", "data"), help="folder of benchmark JSONs (default docs/data)")
    ap.add_argument("--out", default=os.path.join("docs", "img"), help="folder for the PNGs (default docs/img)")
    args = ap.parse_args(argv)
    plt = _import_pyplot()
    plt.rcParams.update({"font.size": 9, "svg.hashsalt": "ckptstore"})
    os.makedirs(args.out, exist_ok=True)
    jobs = [
        ("save_load_1gib.json", plot_save_load),
        ("dcp_compare_1gib.json", plot_dcp_compare),
        ("codec_real.json", plot_codec_real),
    ]
    made = 0
    for name, fn in jobs:
        src = os.path.join(args.data, name)
        if not os.path.exists(src):
            print(f"skip {name}: {src} not found")
            continue
        path = fn(plt, _load(src), args.out)
        print(f"wrote {path}")
        made += 1
    return 0 if made else 1


if __name__ == "__main__":
    sys.exit(main())
