"""The ckptstore command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.cli.commands import install_hint
from ckptstore.cli.main import main

from .helpers import SMALL

ROOT = Path(__file__).resolve().parent.parent


def _repo(tmp_path):
    url = str(tmp_path / "repo")
    with ckptstore.open(url, **SMALL) as repo:
        repo.save({"w": torch.randn(100, 100), "b": torch.zeros(100), "epoch": 1}, step=1, metadata={"loss": 2.5})
        repo.save({"w": torch.randn(100, 100), "b": torch.zeros(100), "epoch": 2}, step=2)
        repo.tag(1, "best")
        repo.set_name("lightning", "last.ckpt", 2)
        repo.set_name("deepspeed", "global_step2", 2)
    return url


def test_ls_show_stats_json(tmp_path, capsys):
    url = _repo(tmp_path)
    assert main(["ls", url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in out["steps"]] == [1, 2]
    assert out["steps"][0]["tags"] == ["best"]
    assert out["steps"][0]["names"] == [] and out["steps"][1]["names"] == ["deepspeed:global_step2", "lightning:last.ckpt"]
    assert out["steps"][0]["logical_bytes"] == 40_400
    assert main(["show", url, "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["metadata"] == {"loss": 2.5}
    assert {t["key"]: t["shape"] for t in out["tensors"]} == {"w": [100, 100], "b": [100]}
    assert main(["stats", url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 2 and out["dedup_ratio"] > 1.0


def test_human_output_and_errors(tmp_path, capsys):
    url = _repo(tmp_path)
    assert main(["ls", url]) == 0
    out = capsys.readouterr().out
    assert "best" in out and "step" in out and "lightning:last.ckpt" in out
    assert main(["show", url, "2"]) == 0
    assert "w" in capsys.readouterr().out
    assert main(["show", url, "9"]) == 1
    err = capsys.readouterr().err
    assert "step 9 is not committed" in err and "Traceback" not in err


def test_demo_without_moto_says_what_to_install():
    # As after a plain `pip install ckptstore`: moto cannot be imported.
    hide = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'moto' or name.startswith('moto.'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from ckptstore.cli.main import main\n"
        "sys.exit(main(['demo']))\n"
    )
    r = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(install_hint("demo")), r.stderr


def test_install_hint_names_the_checkout_for_an_editable_install(tmp_path):
    # `pip install -e .` (a checkout, as make installs it) then `ckptstore demo`:
    # the fix is `pip install -e '.[demo]'` there, not the PyPI spelling.
    checkout = tmp_path / "ckpt store"
    (checkout / "ckptstore").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text('[project]\nname = "ckptstore"\n')
    assert install_hint("demo", str(checkout / "ckptstore")) == (
        f"pip install -e '.[demo]' (in the checkout {checkout})")
    site = tmp_path / "site-packages"
    (site / "ckptstore").mkdir(parents=True)
    assert install_hint("demo", str(site / "ckptstore")) == "pip install 'ckptstore[demo]'"
    (site / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert install_hint("demo", str(site / "ckptstore")) == "pip install 'ckptstore[demo]'"
    # These tests run from this checkout.
    assert install_hint("test") == f"pip install -e '.[test]' (in the checkout {ROOT})"


@pytest.mark.slow  # the demo in its own process, with its own moto server
def test_console_script_demo_runs():
    r = subprocess.run(
        [sys.executable, "-m", "ckptstore.cli.main", "demo", "--steps", "3", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    steps = report["steps"]
    assert len(steps) == 3 and report["restore_equal"] and report["slice"]["equal"]
    # frozen layers are reused after the first step
    assert steps[1]["reused_bytes"] > 0.7 * steps[1]["logical_bytes"]
    assert report["slice"]["bytes_fetched"] < report["slice"]["tensor_bytes"] / 10


def _o(opts: dict) -> list[str]:
    return [a for k, v in opts.items() for a in ("-o", f"{k}={v}")]


def test_storage_options_reach_s3_and_gcs_as_each_backend_takes_them(gcs_env, s3, capsys):
    # `-o endpoint_url=...` goes into client_kwargs for S3, to GCS as it is.
    for url, opts in (gcs_env, (s3.url, s3.storage_options)):
        with ckptstore.open(url, storage_options=opts) as repo:
            repo.save({"w": torch.arange(4.0)}, step=3)
        flat = {k: v for k, v in opts.items() if k != "client_kwargs"}
        flat.update(opts.get("client_kwargs", {}))
        flat = {k: v for k, v in flat.items() if isinstance(v, str)}
        capsys.readouterr()
        assert main(["ls", url, "--json", *_o(flat)]) == 0, url
        assert [s["step"] for s in json.loads(capsys.readouterr().out)["steps"]] == [3], url


def test_version_is_the_installed_one(capsys):
    import importlib.metadata

    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    else:
        raise AssertionError("--version did not exit")
    out = capsys.readouterr().out.strip()
    assert out == f"ckptstore {ckptstore.__version__}"
    assert ckptstore.__version__ == importlib.metadata.version("ckptstore")


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptstore: error: "), captured.err
    return lines[0].removeprefix("ckptstore: error: ")


READ_COMMANDS = [
    ["ls", "{url}"], ["ls", "{url}", "--json"], ["show", "{url}", "1"], ["stats", "{url}"],
    ["verify", "{url}"], ["verify", "{url}", "1", "--read-data"], ["diff", "{url}", "1", "2"],
    ["export", "{url}", "1", "{out}"], ["cp", "{url}", "{dst}"], ["gc", "{url}", "--dry-run"],
    ["gc", "{url}", "--yes"], ["rm", "{url}", "1"], ["tag", "{url}", "1", "best"],
]


@pytest.mark.parametrize("cmd", READ_COMMANDS, ids=lambda c: "-".join(a for a in c if "{" not in a))
@pytest.mark.parametrize("where", ["missing", "empty dir"])
def test_read_commands_fail_on_a_location_without_a_repository(cmd, where, tmp_path, capsys):
    url = tmp_path / "runs" / "exp1"
    if where == "empty dir":
        url.mkdir(parents=True)
    out, dst = tmp_path / "out.safetensors", tmp_path / "copy"
    argv = [a.format(url=url, out=out, dst=dst) for a in cmd]
    assert main(argv) == 1
    assert _one_line_error(capsys) == f"no ckptstore repository at file://{url} (no config.json); save a step to create one"
    # nothing was created: not the location, not its .tmp/, not the output or the copy's destination
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == (
        ["runs", "runs/exp1"] if where == "empty dir" else []
    )


@pytest.mark.parametrize("argv,extra", [
    (["ls", "az://c/x"], ("azure.storage.blob", "az", "azure")),
    (["cp", "{src}", "gs://bucket/copy"], ("google.auth", "gs", "gcs")),
    (["ls", "s3://bucket/x", "--json"], ("botocore", "s3", "s3")),
])
def test_a_missing_cloud_extra_is_one_line_naming_the_install(argv, extra, tmp_path, monkeypatch, capsys):
    # As after `pip install 'ckptstore[s3]'` (or a plain install): the cloud's client cannot be imported.
    module, scheme, name = extra
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.delenv("CKPTSTORE_DEBUG", raising=False)
    src = _repo(tmp_path) if "{src}" in argv else ""
    assert main([a.format(src=src) for a in argv]) == 1
    assert _one_line_error(capsys) == (
        f"{scheme}:// URLs need {module}, which is not installed: pip install 'ckptstore[{name}]'")
    # the traceback is there for whoever asks for it
    monkeypatch.setenv("CKPTSTORE_DEBUG", "1")
    assert main([a.format(src=src) for a in argv]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "MissingExtraError" in err


def test_a_missing_cloud_extra_exits_1_without_a_traceback_from_the_console_script(tmp_path):
    hide = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'google' or name.startswith('google.'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from ckptstore.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CKPTSTORE_DEBUG"}
    r = subprocess.run([sys.executable, "-c", hide, "ls", "gs://bucket/runs/exp1"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == [
        "ckptstore: error: gs:// URLs need google.auth, which is not installed: pip install 'ckptstore[gcs]'"]


@pytest.mark.parametrize("url", ["s3:/my-bucket/runs/exp1", "gs:/bucket/x", "s3:bucket", "az:/"])
def test_a_mistyped_url_fails_saying_what_was_meant_and_creates_nothing(url, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv in (["ls", url], ["verify", url], ["import", str(tmp_path / "none.safetensors"), url, "--step", "1"]):
        assert main(argv) == 1
        assert "did you mean '" in _one_line_error(capsys)
    assert list(tmp_path.iterdir()) == []
    # the Python API refuses it too, so a save never lands in ./s3:/...
    with pytest.raises(ckptstore.errors.StoreURLError, match="did you mean"):
        ckptstore.open(url)


def test_a_plain_relative_path_still_saves(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with ckptstore.open("runs/exp1") as repo:
        repo.save({"w": torch.ones(2)}, step=1)
    assert (tmp_path / "runs" / "exp1" / "config.json").exists()
    assert main(["ls", "runs/exp1", "--json"]) == 0
    assert [s["step"] for s in json.loads(capsys.readouterr().out)["steps"]] == [1]


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_gc_help_says_what_a_bare_gc_keeps_and_a_bare_gc_keeps_that(tmp_path, capsys):
    text = _help("gc", capsys)
    assert "A bare `gc URL` keeps only the newest step and every tagged step" in text
    assert "checkpoint names do not protect a step" in text
    url = str(tmp_path / "repo")
    with ckptstore.open(url, **SMALL) as repo:
        for s in (1, 2, 3, 4):
            repo.save({"w": torch.full((10,), float(s))}, step=s)
        repo.tag(2, "best")
        repo.set_name("lightning", "epoch=2.ckpt", 3)
    assert main(["gc", url, "--yes"]) == 0
    capsys.readouterr()
    with ckptstore.open(url) as repo:
        assert repo.steps() == [2, 4]


def test_cp_help_says_tags_and_names_come_with_their_steps(capsys):
    text = _help("cp", capsys)
    assert "Tags and checkpoint names come with the steps they point at" in text
    assert "one whose step is not copied is not created" in text and "running cp again copies nothing" in text


class _Tty:
    """A terminal stand-in for stderr (bars are drawn only on a terminal)."""

    def __init__(self):
        import io

        self.buf = io.StringIO()

    def isatty(self):
        return True

    def write(self, s):
        return self.buf.write(s)

    def flush(self):
        pass

    def take(self) -> str:
        out = self.buf.getvalue()
        self.buf.seek(0)
        self.buf.truncate()
        return out


def test_import_and_cp_show_progress_and_a_second_cp_moves_nothing(tmp_path, monkeypatch):
    import re

    from safetensors.torch import save_file

    f = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(512, 1024), "b": torch.randn(1024)}, str(f))
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    tty = _Tty()
    monkeypatch.setattr("sys.stderr", tty)
    assert main(["import", str(f), src, "--step", "1"]) == 0
    err = tty.take()
    assert "save: 100%" in err and "2.0 MiB/2.0 MiB" in err  # 512x1024 + 1024 float32
    assert main(["cp", src, dst]) == 0
    err = tty.take()
    assert err.count("copy: 100%") == 1, err  # one bar, not redrawn at its end
    assert main(["cp", src, dst]) == 0
    assert "copy" not in tty.take()  # nothing to move: no bar, no rate from bytes skipped
    assert main(["import", str(f), src, "--step", "2", "--json"]) == 0
    assert tty.take() == ""  # --json: no bars
    assert not re.search(r"\d[kMGT]B?/s", err)


def test_rm_of_a_tagged_step_needs_force_as_gc_protects_tags(tmp_path, monkeypatch, capsys):
    url = _repo(tmp_path)  # step 1 is tagged "best", step 2 is the newest
    with ckptstore.open(url) as repo:
        repo.save({"w": torch.ones(3)}, step=3)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)
    assert main(["rm", url, "1"]) == 1
    assert _one_line_error(capsys) == "step 1 is tagged best; pass --force to delete it"
    assert main(["rm", url, "1", "--json"]) == 1
    capsys.readouterr()
    assert ckptstore.open(url).steps() == [1, 2, 3]
    # in a terminal it asks; anything but yes changes nothing
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    assert main(["rm", url, "1"]) == 1
    assert ckptstore.open(url).steps() == [1, 2, 3]
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    assert main(["rm", url, "1"]) == 0
    assert "tag best now names no step" in capsys.readouterr().out
    assert ckptstore.open(url).steps() == [2, 3]
    # --force without asking; an untagged step needs nothing
    with ckptstore.open(url) as repo:
        repo.tag(2, "keep")
    monkeypatch.setattr("builtins.input", lambda prompt: pytest.fail("asked"))
    assert main(["rm", url, "2", "--force", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"deleted": 2, "tags": ["keep"]}
    with ckptstore.open(url) as repo:
        repo.save({"w": torch.ones(3)}, step=4)
    assert main(["rm", url, "3"]) == 0
    assert ckptstore.open(url).steps() == [4]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_ls_and_show_count_the_same_tensors_and_name_dcp_bytes_items_apart(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import CkptStoreWriter

    url = str(tmp_path / "repo")
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    # DCP keeps what is not a tensor (the optimizer's param groups) as pickled bytes items
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.save(sd, storage_writer=CkptStoreWriter(url, step=1), no_dist=True)
    man = ckptstore.open(url).manifest(1)
    nbytes = len(man.dcp["bytes"])
    assert nbytes > 0
    assert main(["ls", url, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["steps"]
    assert main(["show", url, "1", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert row["tensors"] == len(shown["tensors"]) == len(man.tensors) - nbytes
    assert row["bytes_items"] == len(shown["bytes_items"]) == nbytes
    assert {b["key"] for b in shown["bytes_items"]} == set(man.dcp["bytes"])
    # the tables say the same
    assert main(["ls", url]) == 0
    assert f" {row['tensors']} +{nbytes} bytes " in capsys.readouterr().out
    assert main(["show", url, "1"]) == 0
    out = capsys.readouterr().out
    assert f"{row['tensors']} tensors, {nbytes} DCP bytes items" in out and "bytes item" in out
