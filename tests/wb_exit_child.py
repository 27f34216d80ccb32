"""A script that saves with ``write_back=True`` and exits without ``flush()`` or ``close()``
(driven by tests/test_writeback_exit.py).

    python tests/wb_exit_child.py SPEC_JSON

``SPEC_JSON``: ``{"url", "storage_options", "cache_dir", "mode", "timeout"}``; ``mode`` is

``plain``  a save, then the end of the script
``async``  ``save(blocking=False)``, then the end of the script at once
``dcp``    ``dcp.save`` through ``CkptStoreWriter(..., write_back=True)`` in one process
``fail``   every pack upload to the store fails (a permanent error): nothing can commit
``hang``   the first pack upload never returns: the exit wait runs out

It prints ``SAVED`` once the save has returned; what the exit hook says goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

#: Packs over one part (5 MiB): the uploads go through the handle's I/O threads.
OPTS = dict(chunk_size=1 << 20, pack_size=12 << 20, part_size=5 << 20)


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3 << 20, generator=g), "step": seed}  # 12 MiB of incompressible floats


def main() -> None:
    spec = json.loads(sys.argv[1])
    from ckptstore.errors import StorageError
    from ckptstore.repo.repository import Repository
    from ckptstore.storage import open_store
    from ckptstore.storage.faults import FaultStore
    from ckptstore.storage.retry import RetryStore

    mode = spec["mode"]
    kw = dict(OPTS, cache_dir=spec["cache_dir"], write_back=True)
    if spec.get("timeout") is not None:
        kw["write_back_exit_timeout"] = spec["timeout"]
    if mode == "dcp":
        import torch.distributed.checkpoint as dcp

        from ckptstore.dcp import CkptStoreWriter

        w = CkptStoreWriter(spec["url"], step=1, storage_options=spec["storage_options"], **kw)
        dcp.save({"w": state(1)["w"]}, storage_writer=w, no_dist=True)
        print("SAVED", flush=True)
        return
    store = FaultStore(open_store(spec["url"], spec["storage_options"]))
    if mode == "fail":
        def refuse(op, key):
            return StorageError(f"{key}: refused by the test")

        for op in ("put", "create_multipart"):
            store.add_rule(op, "packs/*", refuse)
    if mode == "hang":
        never = threading.Event()

        def hang(op, key):
            never.wait()

        store.add_rule("create_multipart", "packs/*", hang)
    repo = Repository(RetryStore(store), **kw)
    if mode == "async":
        repo.save(state(1), step=1, blocking=False)
    else:
        repo.save(state(1), step=1)
    print("SAVED", flush=True)
    # no repo.flush(), no repo.close(): the end of a training script that forgot them


if __name__ == "__main__":
    main()
