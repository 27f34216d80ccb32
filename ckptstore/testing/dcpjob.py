"""A small many-rank DCP job, for request counts and fault tests.

:func:`run_job` spawns ``world`` gloo ranks on CPU (one process each, as a
restarted job starts them); each rank builds the same state dict as an FSDP
job holds it (``tensors`` DTensors sharded along dim 0 over the ranks, one
replicated DTensor, a plain int saved as a DCP bytes item), and runs the
job's operations in order through :class:`ckptstore.dcp.CkptStoreWriter`
and :class:`~ckptstore.dcp.CkptStoreReader`:

* ``("save", step)``: the values of ``step`` (a quarter of the tensors
  change from one step to the next, so a save deduplicates against the
  previous one);
* ``("load", step)``: into zeroed tensors, then checked bit for bit against
  the values of the step loaded (``None``: the newest step, which must be
  ``expect``).

Every rank talks to the store through its own ``storage_options`` (an
endpoint of a :class:`~ckptstore.testing.requestproxy.RequestProxy` per
rank, so the proxy counts each rank's requests). A rank writes what each
operation raised, or ``"ok"``, into ``out/rank<r>.json``.

No pytest here: the tests and ``benchmarks/distributed/scale.py`` use it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .ports import free_port


def _values(step: int, rank_world: int, tensors: int, rows: int, cols: int):
    import torch

    out = {}
    for i in range(tensors):
        # a quarter of the tensors change from one step to the next: tensor i last changed at the
        # newest step t <= step with t = i (mod 4), or never (0)
        version = max(0, step - (step - i) % 4)
        g = torch.Generator().manual_seed(1000 * i + version)
        out[f"layers.{i}.weight"] = torch.randn(rows * rank_world, cols, generator=g)
    g = torch.Generator().manual_seed(7 + step)
    out["replicated.weight"] = torch.randn(rows, cols, generator=g)
    return out


def _state(values: dict, mesh, step: int, zero: bool):
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    sd = {}
    for k, v in values.items():
        place = [Replicate()] if k.startswith("replicated") else [Shard(0)]
        t = distribute_tensor(torch.zeros_like(v) if zero else v, mesh, place)
        sd[k] = t
    sd["step"] = -1 if zero else step
    return sd


def _rank(rank: int, world: int, port: int, spec: dict) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from ckptstore.dcp import CkptStoreReader, CkptStoreWriter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    so = spec["storage_options"][rank]
    opts = spec.get("options") or {}
    results = []
    try:
        for op, step in spec["ops"]:
            try:
                if op == "save":
                    sd = _state(_values(step, world, *spec["shape"]), mesh, step, zero=False)
                    w = CkptStoreWriter(spec["url"], step=step, storage_options=so, **opts)
                    try:
                        dcp.save(sd, storage_writer=w)
                    finally:
                        w.close()
                else:
                    r = CkptStoreReader(spec["url"], step=step, storage_options=so, **opts)
                    try:
                        sd = _state(_values(0, world, *spec["shape"]), mesh, 0, zero=True)
                        dcp.load(sd, storage_reader=r)
                    finally:
                        r.close()
                    got = sd["step"]
                    want = step if step is not None else spec.get("expect")
                    if want is not None and got != want:
                        raise AssertionError(f"loaded step {got}, expected {want}")
                    exp = _values(got, world, *spec["shape"])
                    for k, v in exp.items():
                        full = sd[k].full_tensor()
                        if not torch.equal(full.view(torch.int32), v.view(torch.int32)):
                            raise AssertionError(f"{k}: loaded values differ from step {got}'s")
                results.append("ok")
            except BaseException as e:  # noqa: BLE001 - reported to the parent (DCP's CheckpointException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):  # is a BaseException)
                    raise
                results.append(f"{type(e).__name__}: {e}")
                if spec.get("stop_on_error", True):
                    break
        Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if sys.exc_info()[0] is None:  # gloo's threads may abort a clean interpreter exit (see tests/dcp_workers.py)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_job(world: int, url: str, ops: list, storage_options: list[dict], out: str | os.PathLike, *,
            shape: tuple[int, int, int] = (16, 64, 256), expect: int | None = None, options: dict | None = None,
            stop_on_error: bool = True, start_method: str = "spawn") -> list[list[str]]:
    """Run ``ops`` on ``world`` spawned ranks; returns each rank's results (``"ok"`` or the error).

    ``shape``: (tensors, rows per rank, columns) of the sharded float32
    tensors (the replicated one is rows x columns). ``options``: more
    keywords for the writer and the reader. ``start_method``: ``"spawn"``
    (fresh interpreters, as a restarted job) or ``"fork"`` (a second each
    instead of the time to import torch; the caller's threads are not
    copied, and must hold no lock the ranks take).
    """
    import torch.multiprocessing as mp

    if len(storage_options) != world:
        raise ValueError("one storage_options per rank")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("rank*.json"):
        f.unlink()
    spec = {"url": url, "ops": [list(o) for o in ops], "storage_options": storage_options, "out": str(out),
            "shape": list(shape), "expect": expect, "options": options or {}, "stop_on_error": stop_on_error}
    mp.start_processes(_rank, args=(world, free_port(), spec), nprocs=world, join=True, start_method=start_method)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
