"""``ckptstore demo``: the whole loop on an embedded S3 server, in one command.

Starts moto's S3 server on a free loopback port, trains a small model with
its embedding and first block frozen, saves model and optimizer state every
step, prints what each save uploaded, reads one slice of one tensor
(showing bytes fetched against the tensor's size), restores the last step
into a fresh model and checks it equals the trained one.
"""

from __future__ import annotations

import time

import torch

from ..repo.repository import Repository
from ..storage.s3 import S3Store
from ..storage.wrappers import CountingStore
from ..testing.moto import MotoServer
from ._format import emit_json, table

MB = 1e6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(16384, 256),  # frozen
        torch.nn.Linear(256, 1024),      # frozen
        torch.nn.GELU(),
        torch.nn.Linear(1024, 256),      # trained
        torch.nn.GELU(),
        torch.nn.Linear(256, 512),       # trained
    )


def run_demo(steps: int = 6, as_json: bool = False) -> int:
    say = (lambda *a: None) if as_json else print
    report: dict = {"steps": []}
    with MotoServer() as server:
        server.create_bucket("demo")
        url = "s3://demo/runs/exp1"
        say(f"moto S3 server on {server.endpoint}; repository {url}")
        store = CountingStore(S3Store("demo/runs/exp1", server.storage_options()))
        repo = Repository(store, chunk_size=256 << 10, pack_size=16 << 20, part_size=5 << 20)
        model = _model()
        for p in list(model[0].parameters()) + list(model[1].parameters()):
            p.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        rows = []
        for step in range(1, steps + 1):
            x = torch.randint(0, 16384, (64, 16), generator=gen)
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), (x.roll(1, dims=1) % 512).reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            info = repo.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=step,
                             metadata={"loss": loss.item()})
            rows.append([step, f"{info.logical_bytes / MB:.2f}", f"{info.uploaded_bytes / MB:.2f}",
                         f"{info.reused_bytes / MB:.2f}", f"{info.compression_ratio:.2f}", f"{info.seconds:.2f}"])
            report["steps"].append(info.as_dict() | {"loss": loss.item()})
        if not as_json:
            table(rows, ["step", "logical MB", "uploaded MB", "reused MB", "compression", "seconds"])

        # One slice of one tensor: only the chunks covering it are fetched.
        ckpt = repo.checkpoint(steps)
        key = "model.0.weight"
        meta = ckpt.tensor_meta(key)
        store.reset()
        t0 = time.perf_counter()
        rows_slice = ckpt.read(key, (slice(1000, 1064), slice(None)))
        dt = time.perf_counter() - t0
        ok_slice = torch.equal(rows_slice, model.state_dict()[key.removeprefix("model.")][1000:1064])
        say(
            f"\nread {key}[1000:1064, :] ({tuple(rows_slice.shape)}): fetched {store.bytes_read / MB:.3f} MB "
            f"of pack data for a {meta.nbytes / MB:.2f} MB tensor in {dt * 1000:.0f} ms; equal: {ok_slice}"
        )
        report["slice"] = {"key": key, "bytes_fetched": store.bytes_read, "tensor_bytes": meta.nbytes, "equal": ok_slice}

        # Restore into a fresh model in place.
        fresh = _model()
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        t0 = time.perf_counter()
        sd = fresh.state_dict()
        restored = repo.load(steps, into={"model": sd})["model"]
        dt = time.perf_counter() - t0
        trained = model.state_dict()
        equal = all(torch.equal(restored[k], trained[k]) for k in trained) and all(
            torch.equal(fresh.state_dict()[k], trained[k]) for k in trained
        )
        say(f"restored step {steps} into a fresh model in {dt:.2f} s; equal to the trained model: {equal}")
        report["restore_equal"] = equal
        st = repo.stats()
        say(
            f"repository: {st['steps']} steps, {st['packs']} packs, {st['stored_bytes'] / MB:.2f} MB stored for "
            f"{st['logical_bytes'] / MB:.2f} MB logical ({st['total_ratio']:.2f}x)"
        )
        report["stats"] = st
        repo.close()
    if as_json:
        emit_json(report)
    return 0 if (equal and ok_slice) else 1
