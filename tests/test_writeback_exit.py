"""Write-back steps are never silently left behind: a handle not closed at interpreter exit commits
its pending steps there (bounded, saying so) or says which are left and the command that commits
them; a tier it cannot write is refused at open, naming the directory."""

from __future__ import annotations

import errno
import io
import json
import os
import shlex
import subprocess
import sys
import threading

import pytest
import torch

import ckptstore
from ckptstore.cli.main import main as cli
from ckptstore.repo.repository import Repository
from ckptstore.storage import open_store
from ckptstore.storage.faults import FaultStore
from ckptstore.repo.writeback import TierNotWritableError

from .helpers import SMALL
from .wb_exit_child import state

HERE = os.path.dirname(os.path.abspath(__file__))


def _run_child(s3, tmp_path, mode: str, timeout=None) -> tuple[subprocess.CompletedProcess, str]:
    cache = str(tmp_path / "tier")
    spec = {"url": s3.url, "storage_options": s3.storage_options, "cache_dir": cache, "mode": mode,
            "timeout": timeout}
    r = subprocess.run([sys.executable, os.path.join(HERE, "wb_exit_child.py"), json.dumps(spec)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "SAVED" in r.stdout, (r.stdout, r.stderr[-3000:])
    return r, cache


def _steps(s3) -> list[int]:
    with ckptstore.open(s3.url, storage_options=s3.storage_options) as repo:
        return repo.steps()


@pytest.mark.parametrize("mode", ["plain", pytest.param("async", marks=pytest.mark.slow),
                                  pytest.param("dcp", marks=pytest.mark.slow)])
def test_a_handle_left_open_commits_its_pending_steps_at_exit_saying_so(s3, tmp_path, mode):
    r, _ = _run_child(s3, tmp_path, mode)
    assert _steps(s3) == [1], r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("ckptstore: write-back:")]
    assert lines[0].startswith(f"ckptstore: write-back: step 1 not committed in {s3.url} yet; uploading and "
                               "committing before exit (at most 600 s"), r.stderr
    assert lines[-1].startswith(f"ckptstore: write-back: committed step 1 in {s3.url} ("), r.stderr
    with ckptstore.open(s3.url, storage_options=s3.storage_options) as repo:
        got = repo.load(1)
        want = state(1)
        assert torch.equal(got["w"], want["w"])
        assert repo.verify(read_data=True).ok


@pytest.mark.parametrize("mode,why", [("fail", "refused by the test"),
                                      ("hang", "still uploading after 1 s, the write_back_exit_timeout")])
def test_steps_that_cannot_commit_at_exit_are_named_with_the_command_that_commits_them(s3, tmp_path, mode, why):
    r, cache = _run_child(s3, tmp_path, mode, timeout=1.0 if mode == "hang" else None)
    assert _steps(s3) == [], "nothing may be committed"
    err = r.stderr.splitlines()
    command = f"ckptstore flush {s3.url} --cache-dir {cache}"
    i = next(i for i, x in enumerate(err) if x.startswith("ckptstore: WARNING: write-back:"))
    assert err[i].startswith(f"ckptstore: WARNING: write-back: step 1 saved with write_back=True is NOT committed "
                             f"in {s3.url} ("), r.stderr
    assert why in err[i] and f"it stays pending in the node-local tier {cache}. Commit it with:" in err[i], err[i]
    assert err[i + 1] == f"    {command}"
    # the command as printed (its options besides) commits the step
    argv = shlex.split(command)[1:]
    for k, v in [("endpoint_url", s3.server.endpoint), ("key", "testing"), ("secret", "testing")]:
        argv += ["-o", f"{k}={v}"]
    assert cli(argv) == 0
    assert _steps(s3) == [1]
    with ckptstore.open(s3.url, storage_options=s3.storage_options) as repo:
        assert torch.equal(repo.load(1)["w"], state(1)["w"])


def test_a_closed_handle_and_a_handle_with_nothing_pending_say_nothing_at_exit(tmp_path):
    from ckptstore.repo import writeback

    url = str(tmp_path / "repo")
    with ckptstore.open(url, cache_dir=tmp_path / "tier", write_back=True, **SMALL) as repo:
        repo.save({"w": torch.ones(10)}, step=1)
    assert repo.write_back not in writeback._LIVE  # the exit hook sees only handles not closed
    idle = ckptstore.open(url, cache_dir=tmp_path / "tier", write_back=True, **SMALL)
    idle.save({"w": torch.ones(10)}, step=2)
    idle.flush()
    assert idle.write_back in writeback._LIVE
    out = io.StringIO()
    assert repo.write_back.finish_at_exit(out=out) and idle.write_back.finish_at_exit(out=out)
    assert out.getvalue() == ""
    # one left open with a pending step (its upload held until the exit hook says it waits): committed
    store = FaultStore(open_store(url))
    opened = threading.Event()
    for op in ("put", "create_multipart"):
        store.add_rule(op, "packs/*", lambda op, key: None if opened.wait(60) else AssertionError("never opened"))

    class Stderr(io.StringIO):
        def write(self, text):
            if "before exit" in text:
                opened.set()
            return super().write(text)

    left = Repository(store, cache_dir=tmp_path / "tier", write_back=True, **SMALL)
    left.save({"w": torch.full((10,), 3.0)}, step=3)
    assert left.steps(pending=True) == [1, 2, 3] and left.steps() == [1, 2]
    out = Stderr()
    assert left.write_back.finish_at_exit(out=out)
    err = out.getvalue().splitlines()
    assert err[0].startswith(f"ckptstore: write-back: step 3 not committed in file://{url} yet") and \
        err[-1].startswith(f"ckptstore: write-back: committed step 3 in file://{url}"), err
    assert ckptstore.open(url).steps() == [1, 2, 3]
    idle.close()
    left.close()


def test_a_tier_that_cannot_be_written_is_refused_at_open_naming_it(tmp_path, monkeypatch):
    url = str(tmp_path / "repo")
    # a cache_dir that can never be a directory
    (tmp_path / "file").write_text("x")
    bad = tmp_path / "file" / "tier"
    with pytest.raises(TierNotWritableError, match=rf"{bad} is not writable .*a writable local disk") as ei:
        ckptstore.open(url, cache_dir=bad, write_back=True)
    assert isinstance(ei.value, OSError) and "without write_back=True" in str(ei.value)
    # a read-only file system (EROFS, as a read-only mount answers; simulated: the tests run as root)
    tier = tmp_path / "ro"
    real_open = os.open

    def read_only(path, flags, *a, **kw):
        if str(path).startswith(str(tier)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a, **kw)

    ckptstore.open(url, cache_dir=tier, write_back=True).close()  # made once, writable
    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(TierNotWritableError, match=rf"{tier} is not writable \(Read-only file system: {tier}/"):
        ckptstore.open(url, cache_dir=tier, write_back=True)
    # reading through it is still fine, and nothing was written to the store
    with ckptstore.open(url, cache_dir=tier) as repo:
        assert repo.steps() == []
    assert not (tmp_path / "repo").exists()


def test_flush_of_a_directory_that_is_no_tier_creates_nothing(tmp_path, capsys):
    typo = tmp_path / "tierr"
    assert cli(["flush", str(tmp_path / "repo"), "--cache-dir", str(typo)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ckptstore: error: {typo}: not a ckptstore node-local tier (no such directory): no step saved "
                   "with write-back can be pending there"]
    assert not typo.exists() and not (tmp_path / "repo").exists()
