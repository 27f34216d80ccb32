"""Requests per save and restore: 8 ranks measured, 1,000 ranks from a model checked against them.

    python -m benchmarks.distributed.scale --requests [--ranks 8] [--json OUT]
    python -m benchmarks.distributed.scale --rate-cap 6 [--ranks 4] [--json OUT]

``--rate-cap R``: the same job's save and restore under a proxy that answers
503 SlowDown above R requests a second, with the adaptive request rate and
with ``throttle=False`` (:func:`measure_cap`).

Measured: ``ranks`` gloo ranks (``ckptstore.testing.dcpjob``, spawned for
every operation, as a restarted job starts) save a step (16 DTensors
sharded over the ranks, 32 MiB a rank, one replicated tensor, an int), save
a second one (a quarter of the tensors changed: it deduplicates against the
first), and restart to restore the newest. Every rank talks to moto through
its own endpoint of a ``RequestProxy``, which counts each request by kind
and rank.

Modelled (:func:`model`): what each operation sends, from the code's
structure. The coordinator's requests do not grow with the ranks (the
newest step, the config, the dedup base's root and the commit: one each
per job, :mod:`ckptstore.dcp.shared`); each rank's grow with its own share
only (its packs: a PUT, or a multipart upload of ``part_size`` parts, and a
HEAD each; its chunk-table segment: a PUT and a HEAD; on restore a header
and a block of its segment, and its boxes' chunks coalesced into ranges of
at most ``max_request``; a segment more than one rank needs is read once,
whole, by the coordinator and handed to them, issue 44). The model is printed beside the measurement at
``ranks`` and must come within 10% of it for every kind; then it is evaluated at 1,000 ranks (1 GiB a
rank, 64 tensors, a quarter changed a save), beside what the same job sent
before issue 33 (every rank listing the store and reading the root and the
config; a save's every rank reading the config and the base root; a
restore's every rank reading each bytes item and one GET per box).

Costs at S3 Standard's list prices (us-east-1): PUT, COPY, POST, LIST
$0.005 per 1,000; GET, HEAD and the rest $0.0004 per 1,000; DELETE free.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
import tempfile
import time
from collections import Counter

MiB = 1 << 20
GiB = 1 << 30
#: Request kinds as the tables group them.
GROUPS = {"LIST": "LIST", "LIST_UPLOADS": "LIST", "GET": "GET", "HEAD": "HEAD", "PUT": "PUT", "PART": "PART",
          "MPU_CREATE": "MPU", "MPU_COMPLETE": "MPU", "MPU_ABORT": "MPU", "DELETE": "DELETE",
          "DELETE_BATCH": "DELETE", "OTHER": "OTHER"}
COLUMNS = ("LIST", "GET", "HEAD", "PUT", "PART", "MPU", "DELETE")
PRICE = {"LIST": 0.005, "PUT": 0.005, "PART": 0.005, "MPU": 0.005, "GET": 0.0004, "HEAD": 0.0004, "DELETE": 0.0,
         "OTHER": 0.0004}


def cost(counts: dict) -> float:
    """US dollars at S3 Standard's list prices (per 1,000 requests)."""
    return sum(PRICE[k] * n / 1000 for k, n in counts.items())


def _grouped(counter) -> Counter:
    out = Counter()
    for kind, n in counter.items():
        out[GROUPS.get(kind, "OTHER")] += n
    return out


# ------------------------------------------------------------------ the model
def _upload(nbytes: int, part: int) -> Counter:
    """One object written through ParallelUploader, its size checked with HEAD."""
    c = Counter(HEAD=1)
    if nbytes <= part:
        c["PUT"] += 1
    else:
        c["MPU"] += 2
        c["PART"] += math.ceil(nbytes / part)
    return c


def _restore_data_gets(tensors: int, tensor_bytes: int, *, chunk: int, pack_size: int, max_request: int,
                       gap: int = 1 * MiB) -> int:
    """Ranged GETs of one rank's boxes of the second step (a quarter of its tensors new), as the
    reader plans them: batches of about ``max_request`` bytes, each coalesced by the real
    :func:`ckptstore.pipeline.planner.coalesce` over a simulated layout (the first save's packs, then the
    changed tensors in the second save's)."""
    from ckptstore.pipeline.planner import coalesce

    def write(which: list[int], tag: str) -> dict[int, list[tuple[str, int, int]]]:
        out, pack, off = {}, 0, 0
        for i in which:
            refs = []
            left = tensor_bytes
            while left > 0:
                n = min(chunk, left)
                if off + n > pack_size and off:
                    pack, off = pack + 1, 0
                refs.append((f"{tag}{pack}", off, off + n))
                off += n
                left -= n
            out[i] = refs
        return out

    first = write(list(range(tensors)), "a")
    changed = [i for i in range(tensors) if i % 4 == 2]
    second = write(changed, "b")
    gets, batch, size = 0, [], 0
    for i in range(tensors):
        refs = second.get(i, first[i])
        if batch and size + tensor_bytes > max_request:
            gets += len(coalesce(batch, gap, max_request))
            batch, size = [], 0
        batch += refs
        size += tensor_bytes
    if batch:
        gets += len(coalesce(batch, gap, max_request))
    return gets


def model(ranks: int, rank_bytes: int, tensors: int, changed: float = 0.25, *, pack_size: int = 256 * MiB,
          part_size: int = 16 * MiB, max_request: int = 32 * MiB, chunk: int = 4 * MiB, extra_bytes: int = 0,
          stored: float = 0.92, probe_each_save: bool = True, before: bool = False) -> dict[str, Counter]:
    """Requests of a first save, a deduplicating save and a restart's restore, by kind (see the module
    docstring). ``extra_bytes``: a replicated tensor written once a save, by one rank (new every
    save). ``stored``: stored bytes per raw byte (zstd on float32 noise: about 0.92).
    ``probe_each_save``: each save is a new process (as in the measurement, where each
    operation is a job of its own); a long-running job probes the store at its first save only.
    ``before``: what the same job sent before the metadata was shared."""
    out = {}

    def rank_writes(new: int) -> Counter:
        c = Counter()
        left = int(new * stored)
        while left > 0:  # packs of pack_size, the last one shorter
            c += _upload(min(left, pack_size), part_size)
            left -= pack_size
        c += _upload(1, part_size)  # the chunk-table segment (small)
        return c

    def save(new: int, coord: Counter, every: Counter, probe: bool) -> Counter:
        if probe and not before:
            coord = coord + Counter(PUT=2, DELETE=1)  # the conditional-create probe
        writes = [rank_writes(new) for _ in range(ranks)]
        if extra_bytes:
            writes[0] = rank_writes(new + extra_bytes)
        return coord + sum(writes, Counter()) + sum((every for _ in range(ranks)), Counter())

    # first save: the coordinator checks the step, creates the config, leases, lists, commits
    coord = Counter(HEAD=1, GET=1, PUT=1 + 1 + 1, LIST=1, DELETE=1)  # GET: config missing; PUT: config, lease, manifest
    every = Counter()
    if before:
        coord["GET"] += 1  # the config read back after creating it
        every["GET"] += 1  # every rank: config.json
    out["first save"] = save(rank_bytes, coord, every, True)

    # a save that deduplicates: config and the base root (HEAD + GET) once; each rank its base share
    coord = Counter(HEAD=1 + 1, GET=1 + 1, PUT=1 + 1, LIST=1, DELETE=1)
    every = Counter(GET=2)  # a header and a block of records of the base step's segment
    if before:
        every += Counter(GET=2, HEAD=1)  # every rank: config and the base root (HEAD + GET)
        coord -= Counter(GET=1, HEAD=1)  # the coordinator's own base read is one of them
    out["dedup save"] = save(int(rank_bytes * changed), coord, every, probe_each_save)

    # restart: the newest step, its root and the config once; each rank its segment and its boxes
    data = _restore_data_gets(tensors, rank_bytes // tensors, chunk=min(chunk, rank_bytes // tensors),
                              pack_size=pack_size, max_request=max_request)
    coord = Counter(LIST=1, HEAD=1, GET=2)
    every = Counter(GET=2 + data)  # a header and a block of its segment, then its boxes
    # the int every rank loads and the replicated tensor: one rank each (its owner in the exchange)
    # reads their chunks; the segment holding each, which its writer reads too, is read once for the
    # job by the coordinator, whole (issue 44: one GET, where the owner and the writer read a header
    # and a block each)
    n_own = 2 if extra_bytes else 1
    owners = Counter(GET=n_own * (1 + 1))
    if before:
        coord = Counter()
        every = Counter(LIST=1, HEAD=1, GET=2 + 2 + tensors + 3)  # root, config, segment, a GET a box, the int
        owners = Counter(GET=3 * ranks) if extra_bytes else Counter()  # the replicated tensor: every rank
    out["restore"] = coord + owners + sum((every for _ in range(ranks)), Counter())
    if not before:
        out["restore"]["GET"] -= 2 * n_own  # the writers' own header and block of those segments
    return out


# ------------------------------------------------------------------ the measurement
@contextlib.contextmanager
def _proxied(ranks: int, bucket: str):
    """moto behind a RequestProxy; yields ``(proxy, storage options per rank, a scratch folder)``."""
    from ckptstore.testing.moto import MotoServer
    from ckptstore.testing.requestproxy import RequestProxy

    with MotoServer() as m, tempfile.TemporaryDirectory() as tmp:
        m.create_bucket(bucket)
        with RequestProxy(m.endpoint) as p:
            so = []
            for r in range(ranks):
                o = copy.deepcopy(m.storage_options())
                o["client_kwargs"]["endpoint_url"] = p.endpoint(f"rank{r}")
                so.append(o)
            yield p, so, tmp


def _timed_job(p, ranks: int, url: str, ops, so, tmp, name: str, **kwargs):
    """Run one operation as a job of its own; its requests and seconds."""
    from ckptstore.testing.dcpjob import run_job

    p.clear()
    t0 = time.perf_counter()
    res = run_job(ranks, url, ops, so, tmp, **kwargs)
    if any(r != ["ok"] for r in res):
        raise RuntimeError(f"{name}: {res}")
    return p.requests(), time.perf_counter() - t0


def measure(ranks: int, shape=(16, 2048, 256)) -> dict:
    out = {}
    with _proxied(ranks, "bench") as (p, so, tmp):
        for name, ops, expect in (("first save", [("save", 1)], None), ("dedup save", [("save", 2)], None),
                                  ("restore", [("load", None)], 2)):
            reqs, seconds = _timed_job(p, ranks, "s3://bench/run", ops, so, tmp, name, shape=shape, expect=expect)
            per_rank = Counter(r.label for r in reqs)
            meta = Counter(r.key for r in reqs if r.kind in ("GET", "HEAD") and not r.key.startswith("run/packs/"))
            out[name] = {"counts": _grouped(Counter(r.kind for r in reqs)), "seconds": seconds,
                         "per_rank_max": max(per_rank.values()), "per_rank_min": min(per_rank.values()),
                         "metadata_reads_max": max(meta.values()) if meta else 0,
                         "metadata_most_read": meta.most_common(1)[0][0] if meta else None}
    return out


def measure_cap(ranks: int, rate: float, shape=(16, 2048, 256)) -> dict:
    """A save and a restore under a proxy answering 503 SlowDown above ``rate`` requests a second (all
    ranks together), with the adaptive request rate and with ``throttle=False``: answers throttled."""
    out = {}
    for n, (mode, opts) in enumerate((("adaptive", None), ("throttle=False", {"throttle": False}))):
        bucket = f"bench{n}"  # moto's state is the process's: a bucket each
        with _proxied(ranks, bucket) as (p, so, tmp):
            p.rate_limit(rate)
            for name, ops, expect in (("save", [("save", 1)], None), ("restore", [("load", None)], 1)):
                reqs, seconds = _timed_job(p, ranks, f"s3://{bucket}/run", ops, so, tmp, f"{mode} {name}",
                                           shape=shape, expect=expect, options=opts)
                out[f"{name}, {mode}"] = {"requests": len(reqs), "throttled": sum(1 for r in reqs if r.injected),
                                          "seconds": seconds}
    return out


def main_cap(ranks: int = 4, rate: float = 6.0, json_out: str | None = None) -> int:
    import json

    got = measure_cap(ranks, rate)
    print(f"\n{ranks} ranks, 32 MiB a rank, the store answering 503 SlowDown above {rate:g} requests/s:\n")
    print("| operation | requests | throttled | share throttled | seconds |\n|---|---|---|---|---|")
    for name, r in got.items():
        print(f"| {name} | {r['requests']} | {r['throttled']} | {r['throttled'] / r['requests']:.0%} | {r['seconds']:.0f} |")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"ranks": ranks, "rate": rate, "runs": got}, f, indent=1)
    return 0


def _row(name: str, c: Counter, extra: str = "") -> str:
    total = sum(c.values())
    return "| " + " | ".join([name, *(f"{c.get(k, 0):,}" for k in COLUMNS), f"{total:,}", f"${cost(c):.4f}", extra]) + " |"


def main(ranks: int = 8, json_out: str | None = None) -> int:
    import json

    tensors, rows, cols = 16, 2048, 256
    rank_bytes = tensors * rows * cols * 4
    print(f"measuring {ranks} ranks ({rank_bytes / MiB:.0f} MiB a rank) through the request proxy...", file=sys.stderr)
    got = measure(ranks, (tensors, rows, cols))
    mod = model(ranks, rank_bytes, tensors, 0.25, extra_bytes=rows * cols * 4)
    head = "| operation | " + " | ".join(COLUMNS) + " | total | at S3 prices | |"
    sep = "|" + "---|" * (len(COLUMNS) + 4)
    print(f"\n{ranks} ranks, measured (the model's count where it differs):\n")
    print(head + "\n" + sep)
    worst = 0.0
    for name, m in got.items():
        c, predicted = m["counts"], mod[name]
        diff = {k: predicted.get(k, 0) for k in COLUMNS if predicted.get(k, 0) != c.get(k, 0)}
        for k in diff:
            worst = max(worst, abs(predicted.get(k, 0) - c.get(k, 0)) / max(1, c.get(k, 0)))
        note = (f"per rank {m['per_rank_min']}-{m['per_rank_max']}; most-read metadata object read "
                f"{m['metadata_reads_max']}x" + (f"; model: {diff}" if diff else ""))
        print(_row(name, c, note))
    ok = worst <= 0.10
    print(f"\nthe model is within {100 * worst:.0f}% of the measurement for every kind (10% allowed): {ok}")
    big = dict(ranks=1000, rank_bytes=1 * GiB, tensors=64, changed=0.25, probe_each_save=False)
    after, before = model(**big), model(**big, before=True)
    print("\n1,000 ranks, 1 GiB a rank (about 1 TiB), 64 tensors a rank, a quarter changed a save (model):\n")
    print(head + "\n" + sep)
    for name in after:
        print(_row(f"{name}, before issue 33", before[name]))
        print(_row(f"{name}, now", after[name]))
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"ranks": ranks, "measured": {k: {**v, "counts": dict(v["counts"])} for k, v in got.items()},
                       "model_small": {k: dict(v) for k, v in mod.items()}, "model_matches": ok,
                       "model_1000": {k: dict(v) for k, v in after.items()},
                       "model_1000_before": {k: dict(v) for k, v in before.items()}}, f, indent=1)
    return 0
