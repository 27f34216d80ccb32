"""Tiles against row-major runs: save, load, compression and the bytes a slice reads.

A Llama-shaped bf16 state dict (``--layers`` decoder layers of hidden 2048, intermediate 5632,
vocab 32000: about 440 MiB at 2 layers, values from a seeded ``torch.randn``) is saved into a
fresh local repository with ``tiles=False`` (row-major runs, the layout before format 4.0) and
with the default (tiles), alternately, ``--rounds`` times. Reported per layout (medians): save
wall and CPU seconds, ``repo.load`` wall and CPU seconds (and ``load(into=...)`` of contiguous
tensors), the compression ratio of the save, the pack bytes read (``coalesce_gap=0``) by a
1/8 column slice and a 1/8 row slice of every 2-D tensor, as a fraction of their stored bytes,
and by rank 0 of TP=2 and TP=8 under Llama's plan (``o_proj``/``down_proj`` along dim 1, the
other matrices along dim 0, norms whole), as a fraction of the step's stored bytes.
Ratios (tiles / runs) come from the same run on the same machine.

With ``--state e``, the state is workload e of ``benchmarks.run`` instead (256 MiB of fp32
``randn`` in 12 matrices, ``common.workloads.build_small_state_dict``; its TP rows use the same
plan by name, so every matrix is split along dim 0).

    nice -n 10 python -m benchmarks.micro.tiles [--state llama|e] [--layers 2] [--rounds 3] [--dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import ckptstore
from ckptstore.storage import open_store
from ckptstore.storage.wrappers import CountingStore

MiB = 1 << 20


def state_dict(layers: int, hidden: int = 2048, inter: int = 5632, vocab: int = 32000) -> dict:
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g).mul_(0.02).bfloat16()

    sd = {"model.embed_tokens.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{n}.weight"] = w(hidden, hidden)
        sd[p + "mlp.gate_proj.weight"] = w(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = w(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = w(hidden, inter)
        sd[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    sd["lm_head.weight"] = w(vocab, hidden)
    return sd


def _timed(fn):
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def one_round(sd: dict, root: Path, tiles: bool) -> dict:
    path = root / f"repo-{tiles}"
    shutil.rmtree(path, ignore_errors=True)
    with ckptstore.Repository(open_store(str(path)), tiles=tiles) as repo:
        info, save_s, save_cpu = _timed(lambda: repo.save(sd, step=1))
    out: dict = {"save_s": save_s, "save_cpu_s": save_cpu, "ratio": info.compression_ratio,
                 "stored_bytes": info.stored_bytes, "chunks": info.new_chunks}
    with ckptstore.Repository(open_store(str(path))) as repo:
        loaded, out["load_s"], out["load_cpu_s"] = _timed(lambda: repo.load(1))
        assert all(torch.equal(loaded[k], v) for k, v in sd.items())
        del loaded
        into = {k: torch.empty_like(v) for k, v in sd.items()}
        _, out["load_into_s"], out["load_into_cpu_s"] = _timed(lambda: repo.load(1, into=into))
        assert all(torch.equal(into[k], v) for k, v in sd.items())
    store = CountingStore(open_store(str(path)))
    with ckptstore.Repository(store, coalesce_gap=0) as repo:
        ck = repo.checkpoint(1)
        mats = [k for k, v in sd.items() if v.dim() == 2]
        stored = sum(ck.tensor_meta(k).stored_bytes for k in mats)
        for name, index in (("col_1_8", lambda n: (slice(None), slice(n[1] // 8, n[1] // 4))),
                            ("row_1_8", lambda n: (slice(n[0] // 8, n[0] // 4),))):
            store.reset()
            for k in mats:
                ix = index(sd[k].shape)
                assert torch.equal(ck.read(k, ix), sd[k][ix])
            out[name] = sum(e - s for key, s, e in store.reads if key.startswith("packs/")) / stored
        # A tensor-parallel rank under Llama's plan (o_proj, down_proj split along dim 1, every other
        # matrix along dim 0, norms whole): its pack bytes, as a fraction of the step's stored bytes.
        everything = sum(ck.tensor_meta(k).stored_bytes for k in sd)
        for tp in (2, 8):
            store.reset()
            for k, v in sd.items():
                dim = None if v.dim() == 1 else (1 if ("o_proj" in k or "down_proj" in k) else 0)
                ix = None if dim is None else tuple(
                    slice(0, v.shape[d] // tp) if d == dim else slice(None) for d in range(v.dim()))
                assert torch.equal(ck.read(k, ix), v if ix is None else v[ix])
            out[f"tp{tp}_rank0"] = sum(e - s for key, s, e in store.reads if key.startswith("packs/")) / everything
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state", choices=("llama", "e"), default="llama")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.state == "e":
        from benchmarks.common.workloads import build_small_state_dict
        sd = build_small_state_dict()
    else:
        sd = state_dict(a.layers)
    total = sum(v.numel() * v.element_size() for v in sd.values())
    root = Path(a.dir or tempfile.mkdtemp(prefix="ckpt-tiles-"))
    runs: dict[bool, list[dict]] = {False: [], True: []}
    try:
        for _ in range(a.rounds):
            for tiles in (False, True):
                runs[tiles].append(one_round(sd, root, tiles))
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    med = {t: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for t, rs in runs.items()}
    print(f"{total / MiB:.0f} MiB ({a.state}), {a.rounds} rounds, medians (runs = tiles=False, as before format 4.0)")
    print(f"{'':16}{'runs':>12}{'tiles':>12}{'tiles/runs':>12}")
    for k in ("save_s", "save_cpu_s", "load_s", "load_cpu_s", "load_into_s", "load_into_cpu_s", "ratio",
              "chunks", "col_1_8", "row_1_8", "tp2_rank0", "tp8_rank0"):
        r, t = med[False][k], med[True][k]
        print(f"{k:16}{r:12.4g}{t:12.4g}{(t / r if r else float('nan')):12.3f}")
    result = {"state": a.state, "bytes": total, "rounds": a.rounds, "median": {str(k): v for k, v in med.items()},
              "all": {str(k): v for k, v in runs.items()}}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
