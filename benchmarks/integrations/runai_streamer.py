"""ckptstore next to Run:ai Model Streamer loading a Llama-shaped bf16 model from SeaweedFS.

A Llama-shaped model (``LlamaConfig`` of about ``--mib`` MiB of bf16 weights,
values from a seeded ``torch.randn`` per tensor, no hub) is uploaded once to
a SeaweedFS bucket twice over: as step 1 of a ckptstore repository
(default options) and as one plain ``model.safetensors`` object. Then:

Full loads, each in a fresh process, ``--runs`` rounds (loaders interleaved), medians:

``ckptstore``
    ``ckptstore.load_module(model_on_meta, "s3://bucket/ckpt")`` (hash-checked).
``ckptstore-plain``
    ``ckptstore.load_module(model_on_meta, "s3://bucket/st/model.safetensors")``: the
    plain object read by parts (not hash-checked).
``runai``
    ``SafetensorsStreamer().stream_file("s3://bucket/st/model.safetensors")`` with
    Run:ai's defaults (``AWS_ENDPOINT_URL`` and
    ``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0`` point it at SeaweedFS), its
    tensors (owned: ``owned=True``, the default) put in the model with
    ``load_state_dict(assign=True)``: no copy.

Each child reports the load's wall seconds, its process CPU seconds
(user + system, every thread, Run:ai's native ones included) and its peak
RSS (``ru_maxrss``, absolute, and above the RSS just before the load), and
afterwards checks every tensor bit for bit against the seeded values.

Bytes per tensor-parallel rank (not timed; through a
:class:`~ckptstore.testing.requestproxy.RequestProxy`, one listening port per
rank, so the bytes each rank's process GETs are counted apart), at TP=2 and
TP=8 under transformers' own ``model.tp_plan`` (colwise/rowwise):

- ckptstore and ckptstore-plain: ``load_module(..., tp_plan=model.tp_plan,
  tp_rank=r, tp_size=n)``, ranks 0 and n-1, each in its own process;
- Run:ai without its distributed mode: one process streaming the file (every
  rank does the same: Run:ai reads whole tensors, never slices);
- Run:ai's distributed mode: ``n`` processes in a ``torch.distributed`` gloo
  group on the CPU (``RUNAI_STREAMER_DIST=1``: its default, ``auto``, only
  distributes over NCCL), each rank's bytes from the store counted; every rank
  still ends up holding every tensor (received from the others).

Run:ai comes from ``pip install runai-model-streamer==0.17.0
runai-model-streamer-s3==0.17.0`` (the ``bench`` extra); with ``--runai-path
DIR`` its packages are taken from a ``pip install --target DIR`` overlay.

    nice -n 10 python -m benchmarks.integrations.runai_streamer [--mib 400] [--runs 3]
        [--chunk-kib N] [--tile-plan] [--tp 2 8] [--runai-path .runai] [--json docs/data/runai_streamer.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

BUCKET = "bench-runai"
CKPT_PREFIX = "ckpt"
ST_KEY = "st/model.safetensors"
SEED = 1234


def llama_config(mib: int):
    """A Llama-shaped config of about ``mib`` MiB of bf16 weights (hidden 1024, 12 layers at 400)."""
    from transformers import LlamaConfig

    layers = max(1, round(12 * (mib - 125) / 275))  # embeddings + head ~125 MiB, a layer ~22.6 MiB
    return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False,
                       torch_dtype="bfloat16")


def meta_model(mib: int):
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(llama_config(mib)).to(torch.bfloat16)


def reference(mib: int) -> dict:
    """The seeded weights: name -> bf16 tensor (one generator per tensor, in name order)."""
    import torch

    sd = {}
    for i, (name, p) in enumerate(sorted(meta_model(mib).state_dict().items())):
        g = torch.Generator().manual_seed(SEED + i)
        sd[name] = torch.randn(p.shape, generator=g).to(torch.bfloat16)
    return sd


def fingerprint(sd: dict) -> str:
    import torch

    h = hashlib.blake2b(digest_size=16)
    for name in sorted(sd):
        t = sd[name].detach().contiguous()
        h.update(name.encode())
        h.update(memoryview(t.view(torch.int16).numpy()))
    return h.hexdigest()


def _slice_fingerprint(sd: dict, plan: dict, rank: int, size: int) -> str:
    """The fingerprint of what rank ``rank`` of ``size`` should hold, from the full tensors."""
    from ckptstore.pipeline.tp_plan import TPPlan

    tp = TPPlan(plan, rank, size)
    out = {}
    for name, t in sd.items():
        split = tp.split(name, tuple(t.shape))
        index = split.index(tuple(t.shape), rank, size)
        out[name] = t if index is None else t[index]
    return fingerprint(out)


# ---------------------------------------------------------------- children
def _child(args) -> dict:
    model = meta_model(args.mib)
    opts = json.loads(os.environ["BENCH_STORAGE_OPTIONS"])
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    rss0 = _rss()
    t0 = time.perf_counter()
    if args.phase in ("ckptstore", "ckptstore-plain"):
        import ckptstore

        url = f"s3://{BUCKET}/{CKPT_PREFIX}" if args.phase == "ckptstore" else f"s3://{BUCKET}/{ST_KEY}"
        tp = {} if args.tp_size == 1 else dict(tp_plan=model.tp_plan, tp_rank=args.tp_rank, tp_size=args.tp_size)
        ckptstore.load_module(model, url, storage_options=opts, **tp)
    elif args.phase == "runai":
        from runai_model_streamer import SafetensorsStreamer

        if args.tp_size > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo", rank=args.tp_rank, world_size=args.tp_size)
        sd = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(f"s3://{BUCKET}/{ST_KEY}", device="cpu", is_distributed=args.tp_size > 1)
            for name, t in streamer.get_tensors():
                sd[name] = t
        model.load_state_dict(sd, assign=True, strict=True)
        del sd
    else:
        raise ValueError(args.phase)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    out = {"phase": args.phase, "wall": wall,
           "cpu": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
           "peak_rss": _hwm(), "rss_before": rss0}
    got = {k: v for k, v in model.state_dict().items()}
    assert not any(t.is_meta for t in got.values())
    out["fingerprint"] = fingerprint(got)
    out["tp_plan"] = dict(model.tp_plan)
    if args.tp_size > 1 and args.phase == "runai":
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return out


def _hwm() -> int:
    """Peak RSS of this process's address space (``VmHWM``; ``ru_maxrss`` would carry the
    parent's peak over ``exec``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _spawn(args, phase: str, env: dict, tp_rank: int = 0, tp_size: int = 1):
    cmd = [sys.executable, "-m", "benchmarks.integrations.runai_streamer", "--phase", phase, "--mib", str(args.mib),
           "--tp-rank", str(tp_rank), "--tp-size", str(tp_size)]
    cpus = args.client_cpus
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)


def _result(proc) -> dict:
    out, _ = proc.communicate(timeout=900)
    if proc.returncode:
        raise RuntimeError(f"child {proc.args[4]} failed with exit code {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------- parent
def _env(args, srv, endpoint: str | None = None, extra: dict | None = None) -> dict:
    from benchmarks.common.servers import REGION

    env = dict(os.environ)
    path = [os.getcwd()] + ([os.path.abspath(args.runai_path)] if args.runai_path else [])
    env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    ep = endpoint or srv.endpoint
    opts = dict(srv.storage_options())
    opts["endpoint_url"] = ep
    env.update({"AWS_ENDPOINT_URL": ep, "AWS_ACCESS_KEY_ID": srv.key, "AWS_SECRET_ACCESS_KEY": srv.secret,
                "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
                "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0", "RUNAI_STREAMER_LOG_LEVEL": "WARNING",
                "BENCH_STORAGE_OPTIONS": json.dumps(opts)})
    env.update(extra or {})
    return env


def _upload(args, srv, sd: dict) -> dict:
    import ckptstore
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    chunk = {"chunk_size": args.chunk_kib << 10} if args.chunk_kib else {}
    if args.tile_plan:  # tiles aligned to the model's own TP plan (the plan the TP loads below use)
        chunk["tile_plan"] = dict(meta_model(args.mib).tp_plan)
    with ckptstore.open(f"s3://{BUCKET}/{CKPT_PREFIX}", storage_options=srv.storage_options(), **chunk) as repo:
        info = repo.save(sd, step=1)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.safetensors")
        save_file(sd, path, metadata={"format": "pt"})
        size = os.path.getsize(path)
        srv.client().upload_file(path, BUCKET, ST_KEY)
    return {"logical": info.logical_bytes if hasattr(info, "logical_bytes") else None,
            "ckpt_stored": srv.prefix_bytes(CKPT_PREFIX + "/", BUCKET),  # every object of the repository
            "safetensors": size, "seconds": time.perf_counter() - t0}


def _full_loads(args, srv, want: str) -> dict:
    samples: dict[str, list] = {p: [] for p in ("ckptstore", "ckptstore-plain", "runai")}
    for r in range(args.runs):
        order = list(samples) if r % 2 == 0 else list(reversed(samples))
        for phase in order:
            res = _result(_spawn(args, phase, _env(args, srv)))
            if res["fingerprint"] != want:
                raise RuntimeError(f"{phase}: loaded weights differ from the saved ones")
            samples[phase].append(res)
            print(f"  run {r + 1} {phase:16s} {res['wall']:.2f} s  cpu {res['cpu']:.2f} s  "
                  f"peak RSS {res['peak_rss'] / 2**20:.0f} MiB", flush=True)
    return {p: {k: statistics.median(s[k] for s in v) for k in ("wall", "cpu", "peak_rss", "rss_before")}
            for p, v in samples.items()}


def _tp_bytes(args, srv, sd: dict, plan: dict) -> dict:
    from ckptstore.testing.requestproxy import RequestProxy

    out: dict = {}
    with RequestProxy(srv.endpoint) as proxy:
        def got(label: str) -> int:
            return sum(r.received for r in proxy.requests(lambda r: r.label == label))

        for n in args.tp:
            row = {}
            for phase in ("ckptstore", "ckptstore-plain"):
                per = []
                for rank in sorted({0, n - 1}):
                    label = f"{phase}-tp{n}-r{rank}"
                    res = _result(_spawn(args, phase, _env(args, srv, proxy.endpoint(label)), rank, n))
                    if res["fingerprint"] != _slice_fingerprint(sd, plan, rank, n):
                        raise RuntimeError(f"{label}: loaded slices differ from the saved tensors")
                    per.append(got(label))
                row[phase] = max(per)
            label = f"runai-tp{n}"
            _result(_spawn(args, "runai", _env(args, srv, proxy.endpoint(label))))
            row["runai"] = got(label)
            port = _free_port()
            procs = []
            for rank in range(n):
                label = f"runai-dist-tp{n}-r{rank}"
                extra = {"RUNAI_STREAMER_DIST": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
                procs.append(_spawn(args, "runai", _env(args, srv, proxy.endpoint(label), extra), rank, n))
            try:
                results = [_result(p) for p in procs]
                row["runai-dist-peak-rss"] = max(r["peak_rss"] for r in results)
                dist = [got(f"runai-dist-tp{n}-r{rank}") for rank in range(n)]
                full = fingerprint(sd)
                row["runai-dist"] = max(dist)
                row["runai-dist-min"] = min(dist)
                row["runai-dist-every-rank-holds-all"] = all(r["fingerprint"] == full for r in results)
            except RuntimeError as e:
                row["runai-dist"] = None
                row["runai-dist-error"] = str(e)
            out[n] = row
            print(f"  TP={n}: {json.dumps(row)}", flush=True)
    return out


def _free_port() -> int:
    from ckptstore.testing import free_port

    return free_port()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=400)
    ap.add_argument("--runs", type=int, default=3, help="rounds of full loads (0: only the TP bytes)")
    ap.add_argument("--chunk-kib", type=int, help="the repository's chunk size (default: ckptstore's, 4 MiB)")
    ap.add_argument("--tp", type=int, nargs="*", default=[2, 8])
    ap.add_argument("--tile-plan", action="store_true",
                    help="save with tile_plan=model.tp_plan (tiles aligned to the TP plan the TP loads use)")
    ap.add_argument("--runai-path", default=".runai" if os.path.isdir(".runai") else None)
    ap.add_argument("--json")
    ap.add_argument("--phase")
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--tp-size", type=int, default=1)
    args = ap.parse_args(argv)
    args.client_cpus = None
    if args.phase:
        print(json.dumps(_child(args)), flush=True)
        return
    from benchmarks.common.report import command_line, env_line, format_table, write_results
    from benchmarks.common.servers import seaweedfs

    sd = reference(args.mib)
    want = fingerprint(sd)
    plan = dict(meta_model(args.mib).tp_plan)
    with seaweedfs(BUCKET) as srv:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) >= 2 and srv.pid:
            from benchmarks.common.pinning import pin

            pin(srv.pid, {cpus[0]})  # the server on one core, each loader on the others
            args.client_cpus = set(cpus[1:])
        up = _upload(args, srv, sd)
        print(f"uploaded: {json.dumps(up)}", flush=True)
        full = _full_loads(args, srv, want) if args.runs else {}
        tp = _tp_bytes(args, srv, sd, plan) if args.tp else {}
    total = up["safetensors"]
    base = full.get("runai")
    rows = [] if not full else [[p, f"{v['wall']:.2f}", f"{v['wall'] / base['wall']:.2f}", f"{v['cpu']:.2f}",
             f"{v['cpu'] / base['cpu']:.2f}", f"{v['peak_rss'] / 2**20:.0f}", f"{v['peak_rss'] / base['peak_rss']:.2f}",
             f"{(v['peak_rss'] - v['rss_before']) / 2**20:.0f}"]
            for p, v in full.items()]
    print(env_line() + (f"; server pinned to CPU {cpus[0]}, loaders to {sorted(args.client_cpus)}"
                        if args.client_cpus else ""))
    print(f"model: {sum(t.nbytes for t in sd.values()) / 2**20:.0f} MiB bf16, safetensors object {total} bytes, "
          f"ckptstore step {up['ckpt_stored']} bytes stored")
    if rows:
        print(format_table(["loader", "wall s", "x runai", "cpu s", "x runai", "peak RSS MiB", "x runai",
                            "RSS added MiB"], rows))
    if tp:
        trows = []
        for n, row in tp.items():
            for k in ("ckptstore", "ckptstore-plain", "runai", "runai-dist"):
                stored = up["ckpt_stored"] if k == "ckptstore" else total
                v = row.get(k)
                trows.append([f"TP={n}", k, "-" if v is None else f"{v / 2**20:.1f}",
                              "-" if v is None else f"{v / stored:.3f}", f"{1 / n:.3f}"])
        print(format_table(["TP", "loader", "MiB read by a rank (max)", "of the stored bytes", "its share"], trows))
    if args.json:
        write_results(args.json, command_line("benchmarks.integrations.runai_streamer", argv),
                      {"upload": up, "full": full, "tp": tp})


if __name__ == "__main__":
    main()
