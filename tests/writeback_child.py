"""A write-back saver that kills itself (SIGKILL) at a chosen phase (driven by tests/test_writeback.py).

    python tests/writeback_child.py URL CACHE_DIR STEP SEED PHASE

Phases, in the order a write-back save meets them:

``tier``     while the step's packs are being written into the tier (before its pending record)
``pending``  right after the pending record is written: the save has returned nothing yet, but the
             step is durable in the tier (its local commit)
``upload``   in the background, during the second part upload of a pack to the store
``commit``   in the background, as the manifest's exclusive create in the store is about to run
``none``     no kill: save, flush, exit 0

It prints ``PHASE <name>`` (flushed) just before killing itself.
"""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.crash_child import CHILD_OPTS, build_state  # noqa: E402


def die(phase: str) -> None:
    print(f"PHASE {phase}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    url, cache, step, seed, phase = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    from ckptstore.repo.repository import Repository
    from ckptstore.storage import open_store
    from ckptstore.storage.faults import FaultStore

    store = FaultStore(open_store(url))
    calls = {"parts": 0}

    def on_part(op, key):
        calls["parts"] += 1
        if phase == "upload" and calls["parts"] == 2:
            die("upload")
        return None

    def on_commit(op, key):
        if phase == "commit":
            die("commit")
        return None

    store.add_rule("upload_part", "packs/*", on_part)
    store.add_rule("put_if_absent", "manifests/*", on_commit)
    repo = Repository(store, cache_dir=cache, write_back=True, **CHILD_OPTS)
    wb = repo.write_back
    if phase == "tier":
        real = wb.store.create_multipart
        writes = {"n": 0}

        def create(key, part_size):
            mpu = real(key, part_size)
            write_at = mpu.write_at

            def counted(offset, buffers):
                writes["n"] += 1
                if writes["n"] == 20:
                    die("tier")
                return write_at(offset, buffers)

            mpu.write_at = counted
            return mpu

        wb.store.create_multipart = create
    if phase == "pending":
        real_write = wb.records.write

        def write(step_, record):
            real_write(step_, record)
            die("pending")

        wb.records.write = write
    repo.save(build_state(seed), step=step)
    repo.flush()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
