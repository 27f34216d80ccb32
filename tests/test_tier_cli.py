"""The node-local tier on the command line: --cache-dir on the read commands, ``ckptstore cache ls|stats|prune``."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import ckptstore
from ckptstore.cli.main import main
from ckptstore.tier.cache import repo_key
from ckptstore.tier.admin import canonical_url, plan_prune, scan

from .helpers import SMALL, assert_tree_equal

PACK = 64 << 10
OPTS = {**SMALL, "pack_size": PACK}


def _state(seed: int, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.w": torch.randn(128, 256, generator=g) for i in range(n)}


def _files(cache, kind: str = "*") -> list[str]:
    """A tier's files of one kind; "chunk": chunk files and decoded copies (``raw/``) alike, as the CLI counts."""
    subs = {"pack": ("packs",), "chunk": ("chunks", "raw", "bands"), "*": ("*",)}[kind]
    return sorted(p for sub in subs for p in glob.glob(os.path.join(str(cache), "repos", "*", sub, "*", "*"))
                  if os.path.isfile(p))


def _held(cache) -> int:
    return sum(os.path.getsize(p) for p in _files(cache))


def _saved(tmp_path, name="repo", seed=1, cache=None) -> tuple[str, dict]:
    url, sd = str(tmp_path / name), _state(seed)
    with ckptstore.open(url, cache_dir=cache, **OPTS) as repo:
        repo.save(sd, step=1)
    return url, sd


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[0].startswith("ckptstore: error: "), err
    return err[0].removeprefix("ckptstore: error: ")


def _drop_store_packs(url: str) -> None:
    packs = [p for p in glob.glob(os.path.join(url, "packs", "**", "*"), recursive=True) if os.path.isfile(p)]
    assert packs
    for p in packs:
        os.unlink(p)


# ---------------------------------------------------------------- --cache-dir on the read commands
def test_export_and_cp_with_cache_dir_read_the_packs_from_the_tier(tmp_path, capsys):
    cache = tmp_path / "tier"
    url, sd = _saved(tmp_path, cache=cache)
    _drop_store_packs(url)  # only the tier's copies are left: a read of the store would fail
    out = tmp_path / "out.safetensors"
    assert main(["export", url, "1", str(out)]) == 1
    assert "pack" in _one_line_error(capsys)
    assert main(["export", url, "1", str(out), "--cache-dir", str(cache), "--json"]) == 0
    assert _json(capsys)["tensors"] == len(sd)
    assert_tree_equal(load_file(str(out)), sd)
    dst = str(tmp_path / "copy")
    assert main(["cp", url, dst, "--json"]) == 1
    capsys.readouterr()
    assert main(["cp", url, dst, "--cache-dir", str(cache), "--json"]) == 0
    assert _json(capsys)["copied"] == [1]
    with ckptstore.open(dst) as copy:  # the destination is whole in its own store
        assert_tree_equal(copy.load(1), sd)
    assert _files(tmp_path / "copy-tier") == []


def test_cache_size_bounds_what_a_read_keeps(tmp_path, capsys):
    url, sd = _saved(tmp_path)  # saved without a tier: a read keeps chunk files
    stored = sum(os.path.getsize(p) for p in glob.glob(os.path.join(url, "packs", "*", "*")))
    out, cache = str(tmp_path / "out.safetensors"), tmp_path / "tier"
    budget = 256 << 10
    assert stored > 2 * budget
    assert main(["export", url, "1", out, "--cache-dir", str(cache), "--cache-size", "256KiB"]) == 0
    assert_tree_equal(load_file(out), sd)
    held = _held(cache)
    assert 0 < held <= budget + PACK, f"the tier holds {held} bytes"
    # without a budget the same read keeps every chunk (the free-space floor aside)
    assert main(["export", url, "1", out, "--cache-dir", str(tmp_path / "tier2")]) == 0
    assert _held(tmp_path / "tier2") >= stored - PACK
    capsys.readouterr()
    assert main(["export", url, "1", out, "--cache-size", "1GB"]) == 1
    assert _one_line_error(capsys) == "cache_size needs a cache_dir"


@pytest.mark.parametrize("cmd", [["ls", "{url}"], ["show", "{url}", "1"], ["stats", "{url}"],
                                 ["diff", "{url}", "1", "1"]], ids=lambda c: c[0])
def test_metadata_commands_take_cache_dir_and_answer_the_same(cmd, tmp_path, capsys):
    url, _ = _saved(tmp_path)
    argv = [a.format(url=url) for a in cmd] + ["--json"]
    assert main(argv) == 0
    plain = _json(capsys)
    assert main(argv + ["--cache-dir", str(tmp_path / "tier"), "--cache-size", "1GB"]) == 0
    assert _json(capsys) == plain


# ---------------------------------------------------------------- cache ls / stats
def _two_repos(tmp_path) -> tuple[str, str, str, dict]:
    """Two repositories in one tier: ``a`` saved through it (packs), ``b`` read through it (chunk files)."""
    cache = str(tmp_path / "tier")
    a, sd = _saved(tmp_path, "a", seed=1, cache=cache)
    b, sd_b = _saved(tmp_path, "b", seed=2)
    with ckptstore.open(b, cache_dir=cache) as repo:
        assert_tree_equal(repo.load(1), sd_b)
    return cache, a, b, sd


def test_cache_ls_lists_each_repository_with_its_files(tmp_path, capsys):
    cache, a, b, _ = _two_repos(tmp_path)
    assert main(["cache", "ls", cache, "--json"]) == 0
    doc = _json(capsys)
    by_url = {r["url"]: r for r in doc["repositories"]}
    assert set(by_url) == {canonical_url(a), canonical_url(b)}
    for url, r in by_url.items():
        mine = os.path.join(cache, "repos", repo_key(url))
        packs = glob.glob(os.path.join(mine, "packs", "*", "*"))
        chunks = [p for sub in ("chunks", "raw", "bands") for p in glob.glob(os.path.join(mine, sub, "*", "*"))]
        segments = glob.glob(os.path.join(mine, "segments", "*", "*"))  # written through with the packs
        assert (r["packs"], r["chunks"], r["segments"]) == (len(packs), len(chunks), len(segments))
        assert r["bytes"] == sum(os.path.getsize(p) for p in packs + chunks + segments)
        assert r["key"] == repo_key(url) and r["last_used"] is not None
    assert by_url[canonical_url(a)]["packs"] > 0 and by_url[canonical_url(b)]["chunks"] > 0
    assert doc["bytes"] == _held(cache)
    assert main(["cache", "ls", cache]) == 0
    text = capsys.readouterr().out
    assert canonical_url(a) in text and canonical_url(b) in text and "2 repositories" in text


def test_cache_stats_gives_totals_free_space_and_the_floor(tmp_path, capsys):
    cache, *_ = _two_repos(tmp_path)
    stray = os.path.join(cache, "repos", os.listdir(os.path.join(cache, "repos"))[0], ".tmp", "left-by-a-kill")
    with open(stray, "wb") as f:
        f.write(b"x" * 1000)
    assert main(["cache", "stats", cache, "--json"]) == 0
    st = _json(capsys)
    fs = os.statvfs(cache)
    assert st["repositories"] == 2 and st["bytes"] == _held(cache)
    assert st["packs"] == len(_files(cache, "pack")) and st["chunks"] == len(_files(cache, "chunk"))
    assert st["tmp_files"] >= 1 and st["tmp_bytes"] >= 1000
    assert st["fs_total_bytes"] == fs.f_blocks * fs.f_frsize
    assert st["floor_bytes"] == int(0.05 * st["fs_total_bytes"])
    assert st["free_above_floor"] == st["fs_free_bytes"] - st["floor_bytes"]
    assert main(["cache", "stats", cache]) == 0
    assert "free-space floor" in capsys.readouterr().out


# ---------------------------------------------------------------- cache prune
def _age(paths: list[str]) -> None:
    """Give ``paths`` distinct last-use times, the first the least recently used."""
    for i, p in enumerate(paths):
        os.utime(p, (1_000_000 + i, 1_000_000 + i))


def test_cache_prune_max_size_removes_the_least_recently_used_first(tmp_path, capsys):
    cache = tmp_path / "tier"
    url, sd = _saved(tmp_path, cache=cache)
    files = _files(cache)
    assert len(files) >= 6
    order = files[::2] + files[1::2]  # not the order of the names
    _age(order)
    sizes = {p: os.path.getsize(p) for p in files}
    limit = _held(cache) // 2
    want_gone, left = [], _held(cache)
    for p in order:
        if left <= limit:
            break
        want_gone.append(p)
        left -= sizes[p]

    assert main(["cache", "prune", str(cache), "--max-size", str(limit), "--dry-run", "--json"]) == 0
    plan = _json(capsys)["plan"]
    assert plan["freed_bytes"] == sum(sizes[p] for p in want_gone) and plan["files"] == len(want_gone)
    assert _files(cache) == files, "a dry run removes nothing"

    assert main(["cache", "prune", str(cache), "--max-size", str(limit)]) == 0
    out = capsys.readouterr().out
    assert f"removed {len(want_gone)} file(s)" in out
    assert _files(cache) == sorted(set(files) - set(want_gone)), "the least recently used went, the rest stayed"
    assert _held(cache) <= limit
    with ckptstore.open(url, cache_dir=cache) as repo:  # a pruned tier still gives the step bit-exact
        assert_tree_equal(repo.load(1), sd)


def test_cache_prune_one_repository_or_everything(tmp_path, capsys):
    cache, a, b, sd = _two_repos(tmp_path)
    b_files = [p for p in _files(cache) if f"/{repo_key(canonical_url(b))}/" in p]
    assert b_files and len(b_files) < len(_files(cache))
    assert main(["cache", "prune", cache, "--repo", a, "--json"]) == 0  # the path as given to ckptstore.open
    doc = _json(capsys)
    assert [r["url"] for r in doc["plan"]["repositories"]] == [canonical_url(a)]
    assert _files(cache) == b_files, "only a's files went"
    with ckptstore.open(a, cache_dir=cache) as repo:
        assert_tree_equal(repo.load(1), sd)  # from the store again (and kept in the tier)
    assert main(["cache", "prune", cache, "--all"]) == 0
    assert "removed" in capsys.readouterr().out
    assert _files(cache) == []
    assert os.path.isfile(os.path.join(cache, "TIER")), "the tier itself stays, for the processes using it"


def test_cache_prune_refuses_a_vague_or_contradictory_request(tmp_path, capsys):
    cache, a, b, _ = _two_repos(tmp_path)
    before = _files(cache)
    for extra, says in ([[], "say what to prune"], [["--all", "--repo", a], "--all removes everything"],
                        [["--repo", str(tmp_path / "other")], "holds nothing of"]):
        assert main(["cache", "prune", cache, *extra]) == 1
        assert says in _one_line_error(capsys)
    assert _files(cache) == before


def test_cache_commands_refuse_a_directory_that_is_not_a_tier(tmp_path, capsys):
    victim = tmp_path / "data"
    victim.mkdir()
    (victim / "keep.bin").write_bytes(b"precious")
    for argv in (["ls"], ["stats"], ["prune", "--all"]):
        assert main(["cache", argv[0], str(victim), *argv[1:]]) == 1
        assert _one_line_error(capsys) == f"{victim}: not a ckptstore node-local tier (no TIER file)"
    assert (victim / "keep.bin").read_bytes() == b"precious"
    assert main(["cache", "ls", str(tmp_path / "missing")]) == 1
    assert "no such directory" in _one_line_error(capsys)


def test_repositories_are_found_by_any_spelling_of_their_url(tmp_path):
    cache, a, b, _ = _two_repos(tmp_path)
    s = scan(cache)
    key_a = repo_key(canonical_url(a))
    for spelling in (a, a + "/", canonical_url(a), key_a):
        assert {f.key for f in plan_prune(s, repo=spelling).files} == {key_a}
    assert canonical_url("gcs://bucket/run/") == "gs://bucket/run"
    assert canonical_url("abfss://c/p") == "az://c/p" and canonical_url("s3://b/p/") == "s3://b/p"
    assert canonical_url("file:///x/y/") == "file:///x/y"
    assert canonical_url("memory://name/") == ckptstore.open("memory://name").url


def test_prune_keeps_what_a_pending_step_needs(tmp_path, capsys):
    from ckptstore.tier.cache import Tier

    cache = tmp_path / "tier"
    url, _ = _saved(tmp_path, cache=cache)
    packs = _files(cache, "pack")
    needed = os.path.basename(packs[0]).split(".")[0]
    # a step saved with write-back and not yet committed in the store needs that pack
    Tier(cache, canonical_url(url)).pending.write(7, {"step": 7, "packs": {needed: os.path.getsize(packs[0])},
                                                     "segments": {}})
    assert main(["cache", "ls", str(cache), "--json"]) == 0
    assert _json(capsys)["repositories"][0]["pending_steps"] == [7]
    assert main(["cache", "stats", str(cache), "--json"]) == 0
    st = _json(capsys)
    assert st["pending_steps"] == 1 and st["pending_bytes"] == os.path.getsize(packs[0])
    for rule in (["--max-size", "0"], ["--repo", url], ["--all"]):
        assert main(["cache", "prune", str(cache), *rule, "--json"]) == 0
        assert _json(capsys)["plan"]["kept_pending_files"] == 1
        assert _files(cache) == [packs[0]], rule


def test_prune_leaves_a_file_used_since_the_plan(tmp_path):
    cache = tmp_path / "tier"
    _saved(tmp_path, cache=cache)
    files = _files(cache)
    _age(files)
    plan = plan_prune(scan(cache), everything=True)
    os.utime(files[0], None)  # read by a process after the plan was made
    result = plan.execute()
    assert (result.removed, result.skipped) == (len(files) - 1, 1)
    assert _files(cache) == [files[0]]
