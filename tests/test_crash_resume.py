"""A real training job SIGKILLed at random moments and resumed ends bit-identical to an uninterrupted one.

The short version of ``benchmarks/distributed/crash_resume.py`` (whose
docstring says what the job is and what is checked): 2 gloo ranks of a
small FSDP2 transformer with AdamW, a LR scheduler, torchdata's
``StatefulDataLoader``, dropout and the torch, NumPy and Python RNG states
in the checkpoint, saving every 4 steps (blocking, async and write-back
saves in turn) through ``CkptStoreWriter``; one kill of each kind (during
training, a blocking save, an async save, a write-back drain, and between a
save's uploads and its commit), restarting through ``CkptStoreReader``
until the last step. Seeded; reproduce a run with
``CKPTSTORE_CRASH_SEED=<seed>`` (printed first).
"""

from __future__ import annotations

import os
import random

import pytest

pytestmark = pytest.mark.slow  # a training job killed and restarted 5 times on 2 ranks


def test_killed_training_resumes_bit_identical_to_the_uninterrupted_run(tmp_path):
    pytest.importorskip("torchdata.stateful_dataloader")
    from benchmarks.distributed.crash_resume import KINDS, crash_resume

    seed = int(os.environ.get("CKPTSTORE_CRASH_SEED") or random.SystemRandom().randrange(2**32))
    print(f"\ncrash-resume: seed={seed} (reproduce with CKPTSTORE_CRASH_SEED={seed})", flush=True)
    try:
        # 64 samples of 8: an epoch every 8 steps, so resumes cross epoch boundaries too
        out = crash_resume(world=2, steps=20, save_every=4, kills=len(KINDS), seed=seed, resize=False,
                           workdir=str(tmp_path), samples=64)
    except Exception as e:
        raise AssertionError(f"seed {seed}: {e}") from e
    k = out["killed"]
    assert k["divergences"] == 0, f"seed {seed}: {k}"
    assert k["kills"] == len(KINDS) and set(k["by_kind"].values()) == {1}, f"seed {seed}: {k}"
    assert k["steps_compared"] == 5  # every committed step (4, 8, ..., 20) matched the reference bit for bit
    for r in k["records"]:  # the harness checked each resume is the newest committed step; none is ahead
        assert 0 <= r["resume"] <= r["at_step"], f"seed {seed}: {r}"
