"""The ckptstore command line."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import ckptstore
from ckptstore.cli.main import main

from .helpers import SMALL


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
    assert len(lines) == 1 and "pip install 'ckptstore[demo]'" in lines[0], r.stderr


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
    # `-o endpoint_url=...` goes into client_kwargs for s3fs, to gcsfs as it is.
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
