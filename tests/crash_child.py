"""A saver to be killed with SIGKILL mid-save (driven by tests/test_crash.py).

    python tests/crash_child.py URL STEP SEED [STORAGE_OPTIONS_JSON] [direct]

Opens the repository with small chunk, pack and part sizes (so packs go
through multipart uploads of several parts), builds a deterministic state
dict from SEED (see :func:`build_state`), and saves it as STEP. Hooks in a
FaultStore print phase markers to stdout (flushed) so the parent knows
where the save is:

``PHASE pack``       the first multipart part upload starts
``PHASE multipart``  the third part of some pack starts (parts 1-2 are in flight or done); with
                     CKPTSTORE_CRASH_HOLD=multipart the hook then sleeps, that part unwritten
``PHASE commit``     the manifest's exclusive create is about to run; the hook
                     then sleeps so the parent kills the saver before the
                     manifest is written

and ``DONE`` when the save returned (the parent does not expect it).

With ``direct`` (a local directory only) the store is a bare
:class:`~ckptstore.storage.local.LocalStore` whose packs take the direct
path (chunk pieces written at their offsets, no parts): the markers then
count those writes instead of parts (a wrapper store would turn the direct
path off).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch

MiB = 1 << 20
CHILD_OPTS = dict(chunk_size=256 << 10, pack_size=16 * MiB, part_size=5 * MiB)
COMMIT_SLEEP = 60.0


def build_state(seed: int, mib: int = 64) -> dict:
    """A deterministic state dict of about ``mib`` MiB from ``seed``.

    Half random bits (incompressible), a quarter gaussian float32 (compresses
    a little), a quarter low-entropy int data, plus plain values.
    """
    g = torch.Generator().manual_seed(seed)
    n = mib * MiB
    rnd = torch.randint(0, 256, (n // 2,), dtype=torch.uint8, generator=g)
    gauss = torch.randn(n // 16, generator=g)  # n/4 bytes
    ints = torch.randint(0, 7, (n // 32,), dtype=torch.int64, generator=g)  # n/4 bytes
    return {
        "model": {
            "embed": rnd.view(torch.bfloat16).reshape(-1, 1024),
            "layer.weight": gauss.reshape(-1, 512),
            "layer.bias": torch.randn(512, generator=g),
        },
        "optim": {"counts": ints, "step": seed},
        "seed": seed,
    }


def _phased_local_store(root: str, on_write, on_commit):
    """A LocalStore calling ``on_write`` before each positional write into a pack, ``on_commit`` before a manifest."""
    from ckptstore.storage.local import LocalStore

    class PhasedLocalStore(LocalStore):
        def create_multipart(self, key, part_size):
            mpu = super().create_multipart(key, part_size)
            if key.startswith("packs/"):
                write_at = mpu.write_at

                def traced(offset, buffers):
                    on_write("write_at", key)
                    return write_at(offset, buffers)

                mpu.write_at = traced
            return mpu

        def put_if_absent(self, key, data):
            if key.startswith("manifests/"):
                on_commit("put_if_absent", key)
            return super().put_if_absent(key, data)

    store = PhasedLocalStore(root)
    assert store.positional_multipart
    return store


def main(argv: list[str]) -> int:
    from ckptstore.repo.repository import Repository
    from ckptstore.storage import open_store
    from ckptstore.storage.faults import FaultStore

    url, step, seed = argv[0], int(argv[1]), int(argv[2])
    so = json.loads(argv[3]) if len(argv) > 3 and argv[3] else None
    state = build_state(seed)

    out_lock = threading.Lock()
    printed: set[str] = set()
    parts: dict[str, int] = {}

    def mark(phase: str) -> None:
        with out_lock:
            if phase in printed:
                return
            printed.add(phase)
            sys.stdout.write(f"PHASE {phase}\n")
            sys.stdout.flush()

    def on_part(op, key):
        with out_lock:
            parts[key] = parts.get(key, 0) + 1
            n = parts[key]
        mark("pack")
        if n >= 3 and "multipart" not in printed:
            mark("multipart")
            if os.environ.get("CKPTSTORE_CRASH_HOLD") == "multipart":
                # the parent kills us here: this part not yet written, so the upload cannot complete
                # first, however fast the other parts go (a killed-mid-multipart test must see it open)
                time.sleep(COMMIT_SLEEP)
        return None

    def on_commit(op, key):
        mark("commit")
        time.sleep(COMMIT_SLEEP)  # the parent kills us here, before the manifest exists
        return None

    direct = len(argv) > 4 and argv[4] == "direct"
    if direct:
        store = _phased_local_store(url, on_part, on_commit)
    else:
        store = FaultStore(open_store(url, so))
        store.add_rule("upload_part", "packs/*", on_part)
        store.add_rule("put_if_absent", "manifests/*", on_commit)
    # The child never commits (it is killed first); a long grace keeps its
    # stale-base check from refusing before the commit marker on a slow host.
    repo = Repository(store, grace=3600.0, **CHILD_OPTS)
    sys.stdout.write(f"START pid={os.getpid()}\n")
    sys.stdout.flush()
    repo.save(state, step=step, metadata={"seed": seed})
    sys.stdout.write("DONE\n")
    sys.stdout.flush()
    repo.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
