"""Export, import, copy between repositories and diff (ckptstore.repo.transfer) and their CLI."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

import ckptstore
from ckptstore.cli.main import main
from ckptstore.errors import FormatError
from ckptstore.format.layout import MANIFEST_PREFIX, PACK_PREFIX
from ckptstore.repo.repository import Repository
from ckptstore.storage import MemoryStore, open_store
from ckptstore.storage.wrappers import CountingStore

from .helpers import SMALL, assert_tree_equal, bits_equal, flat_tensors, random_tensor


def _state(seed=0):
    return {
        "model": {
            "w": random_tensor(torch.float32, (64, 300), seed),
            "h": random_tensor(torch.bfloat16, (130, 257), seed + 1),
            "e": random_tensor(torch.float16, (33,), seed + 2),
            "i": torch.arange(1000, dtype=torch.int64) * (seed + 1),
            "m": random_tensor(torch.bool, (17, 3), seed + 3),
            "u": random_tensor(torch.uint8, (5,), seed + 4),
            "s": torch.tensor(2.5, dtype=torch.float64),
        },
        "epoch": 3,
        "lr": [0.1, 0.01],
        "name": "run-1",
    }


@pytest.fixture
def repo(tmp_path):
    with ckptstore.open(str(tmp_path / "repo"), **SMALL) as r:
        yield r


# ---------------------------------------------------------------- export
def test_export_safetensors_loads_equal(repo, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    sd = _state()
    repo.save(sd, step=5, metadata={"loss": 1.5})
    out = tmp_path / "o.safetensors"
    info = repo.export(5, out)
    assert info["tensors"] == 7
    got = load_file(str(out))
    flat = flat_tensors(sd)
    assert set(got) == set(flat)
    for k, t in flat.items():
        assert bits_equal(got[k], t), k
    with safe_open(str(out), framework="pt") as f:
        meta = json.loads(f.metadata()["ckptstore"])
    assert meta["values"] == {"epoch": 3, "lr": [0.1, 0.01], "name": "run-1"}
    assert meta["metadata"] == {"loss": 1.5} and meta["step"] == 5

    # a glob subset
    sub = tmp_path / "sub.safetensors"
    repo.export(5, sub, keys="model.[hw]")
    got = load_file(str(sub))
    assert set(got) == {"model.w", "model.h"}
    assert bits_equal(got["model.h"], sd["model"]["h"])


def test_export_safetensors_in_row_blocks(repo, tmp_path, monkeypatch):
    import ckptstore.repo.transfer as tr
    from safetensors.torch import load_file

    monkeypatch.setattr(tr, "EXPORT_BLOCK_BYTES", 4096)
    sd = {"w": random_tensor(torch.float32, (200, 50), 7), "z": torch.zeros(0, 3)}
    repo.save(sd, step=1)
    repo.export(1, tmp_path / "b.safetensors")
    got = load_file(str(tmp_path / "b.safetensors"))
    assert bits_equal(got["w"], sd["w"]) and bits_equal(got["z"], sd["z"])


def test_export_safetensors_unsupported_dtype_names_tensor(repo, tmp_path):
    repo.save({"ok": torch.ones(3), "cx": torch.ones(3, dtype=torch.complex128)}, step=1)
    with pytest.raises(TypeError, match="'cx'.*complex128"):
        repo.export(1, tmp_path / "x.safetensors")
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob(".*tmp"))
    repo.export(1, tmp_path / "y.safetensors", keys="ok")  # leaving it out works


def test_export_dcp_loads_equal(repo, tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = _state(1)
    repo.save(sd, step=2)
    repo.export(2, tmp_path / "dcp", format="dcp")
    target = {"model": {k: torch.empty_like(v) for k, v in sd["model"].items()}, "epoch": 0, "lr": [0.0, 0.0],
              "name": ""}
    with pytest.warns(UserWarning):
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")))
    assert_tree_equal(target, sd)


# ---------------------------------------------------------------- import
def test_import_round_trips_all_formats(repo, tmp_path):
    sd = _state(2)
    repo.save(sd, step=1, metadata={"loss": 0.5})
    repo.export(1, tmp_path / "a.safetensors")
    repo.export(1, tmp_path / "d", format="dcp")
    torch.save(sd, tmp_path / "t.pt")

    repo.import_(tmp_path / "a.safetensors", 2)
    assert_tree_equal(repo.load(2), sd)
    assert repo.manifest(2).metadata == {"loss": 0.5}
    repo.import_(tmp_path / "d", 3)
    assert_tree_equal(repo.load(3), sd)
    repo.import_(tmp_path / "t.pt", 4)
    assert_tree_equal(repo.load(4), sd)
    # imports dedup against what is stored: no new chunk bytes
    assert all(repo.manifest(s).stats["new_bytes"] == 0 for s in (2, 3, 4))

    # a foreign safetensors file (no ckptstore metadata): flat tensors, string metadata kept
    from safetensors.torch import save_file

    flat = flat_tensors(sd)
    save_file(flat, str(tmp_path / "f.safetensors"), metadata={"source": "hf"})
    repo.import_(tmp_path / "f.safetensors", 5)
    got = repo.load(5)
    assert set(got) == set(flat) and all(bits_equal(got[k], flat[k]) for k in flat)
    assert repo.manifest(5).metadata == {"source": "hf"}


class _NotWeights:
    def __init__(self):
        self.x = 1


def test_import_torch_refuses_non_weights_objects(repo, tmp_path):
    repo.save({"w": torch.ones(2)}, step=1)
    before = sorted(i.key for i in repo.store.list(""))
    path = tmp_path / "bad.pt"
    torch.save({"w": torch.ones(2), "obj": _NotWeights()}, path)
    with pytest.raises(FormatError, match="weights_only"):
        repo.import_(path, 2)
    assert repo.steps() == [1]
    assert sorted(i.key for i in repo.store.list("")) == before
    assert main(["import", str(path), repo.url, "--step", "2"]) == 1


# ---------------------------------------------------------------- copy
def _counting_repo(url, **opts) -> Repository:
    return Repository(CountingStore(open_store(url)), **opts)


def _dedup_history(repo, n=10):
    g = torch.Generator().manual_seed(0)
    frozen = {f"f{i}": torch.randn(256, 256, generator=g) for i in range(4)}  # 4 x 256 KiB, never change
    for s in range(n):
        sd = {"frozen": frozen, "head": torch.randn(64, 256, generator=g), "step": s}
        repo.save(sd, step=(s + 1) * 10)
    return frozen


def test_copy_moves_each_unique_chunk_once(tmp_path):
    src = ckptstore.open(str(tmp_path / "src"), **SMALL)
    _dedup_history(src)
    # unique stored chunks over the source's steps
    uniq = {}
    for s in src.steps():
        for c in src.chunks(s):
            uniq[c.hash] = c.stored_len
    dst = _counting_repo(str(tmp_path / "dst"))
    res = src.copy_to(dst)
    assert res.copied == src.steps() and res.chunks_copied == len(uniq)
    assert res.bytes_copied == sum(uniq.values())
    written = dst.store.bytes_written
    manifests = sum(i.size for i in dst.store.inner.list(MANIFEST_PREFIX))
    segments = sum(i.size for i in dst.store.inner.list("segments/"))
    npacks = len(list(dst.store.inner.list(PACK_PREFIX)))
    overhead = 64 * len(uniq) + 56 * npacks + manifests + segments + 200 * len(res.copied) + 1000  # tables, leases, config
    assert sum(uniq.values()) <= written <= sum(uniq.values()) + overhead
    assert dst.verify(read_data=True).ok
    for s in src.steps():
        assert_tree_equal(dst.load(s), src.load(s))
    # a new destination inherits the source's chunking
    assert dst.config()["chunk_size"] == SMALL["chunk_size"]

    # second copy: nothing moves
    dst.store.reset()
    res2 = src.copy_to(dst)
    assert res2.copied == [] and len(res2.skipped) == 10 and "identical" in res2.skipped[0][1]
    assert res2.bytes_copied == 0
    assert dst.store.calls["upload_part"] == 0 and dst.store.calls["put_if_absent"] == 0

    # an extra source step copies only its new chunks
    sd = src.load(100)
    sd["head"] = torch.randn(64, 256)
    src.save(sd, step=110)
    dst.store.reset()
    res3 = src.copy_to(dst, steps=[110])
    assert res3.copied == [110] and res3.chunks_copied == 1  # 64 KiB head == one chunk
    assert dst.store.bytes_written < 64 * 1024 + 4096 + sum(i.size for i in dst.store.inner.list(MANIFEST_PREFIX))
    src.close()
    dst.close()


def test_copy_local_to_s3_and_back(tmp_path, s3):
    src = ckptstore.open(str(tmp_path / "src"), **SMALL)
    _dedup_history(src, n=3)
    dst = ckptstore.open(s3.url, storage_options=s3.storage_options, **SMALL)
    res = src.copy_to(dst, verify_data=True)
    assert res.copied == [10, 20, 30]
    assert dst.verify(read_data=True).ok
    assert_tree_equal(dst.load(20), src.load(20))
    back = ckptstore.open(str(tmp_path / "back"), **SMALL)
    dst.copy_to(back, steps=[30])
    assert back.steps() == [30] and back.verify(read_data=True).ok
    assert_tree_equal(back.load(30), src.load(30))
    for r in (src, dst, back):
        r.close()


def test_copy_brings_tags_and_names_with_their_steps(tmp_path):
    src = ckptstore.open(str(tmp_path / "src"), **SMALL)
    _dedup_history(src, n=4)  # steps 10..40
    src.tag(10, "best")
    src.tag(30, "final")
    src.set_name("lightning", "epoch=0.ckpt", 10)
    src.set_name("lightning", "last.ckpt", 40)
    src.set_name("deepspeed", "global_step30", 30)
    dst = _counting_repo(str(tmp_path / "dst"))
    res = src.copy_to(dst, steps=[10, 40])
    # a tag or name whose step is not copied is not created
    assert dst.tags() == {"best": 10} and res.tags == {"best": 10}
    assert dst.all_names() == {"lightning": {"epoch=0.ckpt": 10, "last.ckpt": 40}} == res.names
    assert res.moved == {} and res.refs_skipped == []
    # ... so a gc of the copy keeps the tagged step, as in the source
    assert dst.plan_gc().delete_steps == ()
    res = src.copy_to(dst)
    assert res.copied == [20, 30] and res.tags == {"final": 30}
    assert res.names == {"deepspeed": {"global_step30": 30}}
    assert dst.tags() == src.tags() and dst.all_names() == src.all_names()

    # a second copy copies nothing: no step, no tag, no name written
    dst.store.reset()
    res = src.copy_to(dst)
    assert res.copied == [] and res.tags == {} and res.names == {} and res.moved == {}
    assert dst.store.calls["put"] == 1  # the copy's lease, nothing else
    assert dst.store.calls["put_if_absent"] == 0 and dst.store.calls["upload_part"] == 0

    # a pointer moved in the source moves in the destination, and says from where
    src.tag(40, "best")
    src.set_name("lightning", "last.ckpt", 20)
    res = src.copy_to(dst)
    assert res.tags == {"best": 40} and res.names == {"lightning": {"last.ckpt": 20}}
    assert res.moved == {"tag best": 10, "name lightning:last.ckpt": 40}
    assert dst.tags() == src.tags() and dst.all_names() == src.all_names()

    # a step the destination holds with other content keeps the destination's pointers
    other = ckptstore.open(str(tmp_path / "other"), **SMALL)
    other.save({"x": torch.ones(3)}, step=30)
    res = src.copy_to(other, steps=[30])
    assert other.tags() == {} and other.all_names() == {}
    assert res.refs_skipped == [("tag final", "step 30 has different content in the destination"),
                                ("name deepspeed:global_step30", "step 30 has different content in the destination")]
    for r in (src, dst, other):
        r.close()


def test_cli_cp_reports_tags_and_names(tmp_path, capsys):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    with ckptstore.open(src, **SMALL) as repo:
        repo.save(_state(1), step=1)
        repo.save(_state(2), step=2)
        repo.tag(1, "best")
        repo.set_name("lightning", "last.ckpt", 2)
    assert main(["cp", src, dst]) == 0
    out = capsys.readouterr().out
    assert "tag best -> step 1" in out and "name lightning:last.ckpt -> step 2" in out
    assert main(["cp", src, dst, "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["copied"] == [] and j["tags"] == {} and j["names"] == {}
    assert main(["ls", dst, "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    assert [(s["tags"], s["names"]) for s in steps] == [(["best"], []), ([], ["lightning:last.ckpt"])]


def test_copy_follows_relocated_source_packs(tmp_path):
    # Copy reads chunks where a repack moved them (relocation records).
    import time

    src = ckptstore.open(str(tmp_path / "src"), grace=1.0, **SMALL)
    _dedup_history(src, n=3)
    time.sleep(1.0 + src.store.mtime_resolution + 0.2)
    result = src.plan_gc(keep_last=1, repack=True, repack_threshold=0.0).execute()
    assert result.repacked_packs and src.steps() == [30]
    dst = ckptstore.open(str(tmp_path / "dst"), **SMALL)
    src.copy_to(dst)
    assert dst.steps() == [30] and dst.verify(read_data=True).ok
    assert_tree_equal(dst.load(30), src.load(30))


# ---------------------------------------------------------------- diff
@pytest.mark.parametrize("tiles", [False, True])
def test_diff_from_manifests_only(tmp_path, tiles):
    url = f"memory://diff-{uuid.uuid4().hex}"
    try:
        repo = _counting_repo(url, tiles=tiles, **SMALL)
        w = random_tensor(torch.float32, (64, 1024), 1)  # 256 KiB = 4 chunks (tiles=False)
        repo.save({"w": w, "keep": torch.ones(10), "gone": torch.zeros(3), "shape": torch.ones(4), "epoch": 1},
                  step=1)
        w2 = w.clone()
        w2[20, 0] += 1  # second chunk only
        repo.save({"w": w2, "keep": torch.ones(10), "new": torch.ones(2, 2), "shape": torch.ones(5), "epoch": 2},
                  step=2)
        repo = _counting_repo(url)  # fresh handle: no cached manifests
        d = repo.diff(1, 2)
        assert [t["key"] for t in d["added"]] == ["new"]
        assert [t["key"] for t in d["removed"]] == ["gone"]
        assert d["unchanged"] == ["keep"]
        changed = {t["key"]: t for t in d["changed"]}
        assert changed["w"]["reason"] == "data" and changed["w"]["changed_chunks"] == 1
        tile = repo.manifest(2).tensors["w"].tile
        assert (tile is not None) == tiles
        if tile is None:
            assert changed["w"]["changed_bytes"] == 64 << 10 and changed["w"]["chunks"] == 4
        else:  # the one tile holding w[20, 0]
            assert changed["w"]["changed_bytes"] == tile[0] * tile[1] * 4
            assert changed["w"]["chunks"] == -(-64 // tile[0]) * -(-1024 // tile[1])
        assert changed["shape"]["reason"] == "shape"
        assert d["values"]["changed"] == {"epoch": {"from": 1, "to": 2}}
        # from manifests and chunk tables alone: no tensor data is read
        assert not any(k.startswith(PACK_PREFIX) for k, _, _ in repo.store.reads)
        assert all(k.startswith("segments/") for k, _, _ in repo.store.reads)
    finally:
        MemoryStore.clear(url.removeprefix("memory://"))


# ---------------------------------------------------------------- CLI
def test_cli_transfer_commands(tmp_path, capsys):
    from safetensors.torch import load_file

    url = str(tmp_path / "repo")
    with ckptstore.open(url, **SMALL) as repo:
        sd = _state(3)
        repo.save(sd, step=1)
        sd2 = _state(3)
        sd2["model"]["w"] = sd2["model"]["w"] + 1
        repo.save(sd2, step=2)

    out = tmp_path / "o.safetensors"
    assert main(["export", url, "1", str(out), "--keys", "model.w", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["tensors"] == 1 and j["format"] == "safetensors"
    assert set(load_file(str(out))) == {"model.w"}
    assert main(["export", url, "1", str(tmp_path / "all.safetensors")]) == 0
    assert "exported step 1" in capsys.readouterr().out
    assert main(["export", url, "1", str(tmp_path / "d"), "--format", "dcp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "dcp"

    assert main(["import", str(tmp_path / "all.safetensors"), url, "--step", "3", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    # dedup base is step 2, where only model.w differs from step 1
    assert j["step"] == 3 and j["format"] == "safetensors" and j["new_bytes"] == 64 * 300 * 4
    assert main(["import", str(tmp_path / "d"), url, "--step", "4"]) == 0
    assert "(dcp)" in capsys.readouterr().out
    assert main(["import", str(tmp_path / "d"), url, "--step", "4"]) == 1
    assert "already exists" in capsys.readouterr().err

    dst = str(tmp_path / "dst")
    assert main(["cp", url, dst, "--step", "1", "--step", "2", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["copied"] == [1, 2] and j["chunks_copied"] > 0
    assert main(["cp", url, dst]) == 0
    o = capsys.readouterr().out
    assert "step 1: skipped" in o and "copied 2 step(s)" in o
    assert main(["cp", url, dst, "--step", "99"]) == 1
    assert "99" in capsys.readouterr().err

    assert main(["diff", url, "1", "2", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert [t["key"] for t in j["changed"]] == ["model.w"] and len(j["unchanged"]) == 6
    assert main(["diff", dst, "1", "2"]) == 0
    o = capsys.readouterr().out
    assert "1 changed, 6 unchanged" in o and "model.w" in o


def test_cli_progress_bars_speak_the_summaries_units(monkeypatch):
    import io
    import re

    from ckptstore.cli.commands import _Progress

    class _Tty(io.StringIO):
        def isatty(self):
            return True

    err = _Tty()
    monkeypatch.setattr("sys.stderr", err)
    p = _Progress(True)
    p("export bytes", 0, 4 << 20)
    p("export bytes", 2 << 20, 4 << 20)
    p("export bytes", 4 << 20, 4 << 20)
    p("export bytes", 4 << 20, 4 << 20)  # a final call repeated (cp's): no second bar drawn at once
    p("copy bytes", 0, 0)  # nothing to copy: no bar
    p("copy bytes", 0, 0)
    p("packs", 1, 3)  # gc/verify style: counts, then a new phase
    p("packs", 3, 3)
    p.close()
    out = err.getvalue()
    # sizes as the summaries spell them (human_bytes), binary units, rate included
    assert "4.0 MiB/4.0 MiB" in out and re.search(r"\d+\.\d (B|KiB|MiB|GiB|TiB)/s\]", out), out
    assert not re.search(r"\d[kMGT]B?/s|\d[kMGT]/", out), out  # never tqdm's 4.00M or decimal MB/s
    assert out.count("export:") == 2 and out.count("100%") == 2  # one bar (start, end), then packs'
    assert "copy" not in out
    assert "packs" in out and "3/3" in out
    quiet = _Tty()
    monkeypatch.setattr("sys.stderr", quiet)
    q = _Progress(False)  # --json
    q("export bytes", 1, 2)
    q("export bytes", 2, 2)
    assert quiet.getvalue() == ""


def test_cli_cp_local_to_s3_with_dst_options(tmp_path, s3, capsys):
    src = str(tmp_path / "src")
    with ckptstore.open(src, **SMALL) as repo:
        repo.save(_state(4), step=1)
    so = s3.storage_options
    opts = [f"key={so['key']}", f"secret={so['secret']}",
            f"endpoint_url={so['client_kwargs']['endpoint_url']}",
            f"region_name={so['client_kwargs']['region_name']}"]
    argv = ["cp", src, s3.url, "--json", "--verify-data"]
    for o in opts:
        argv += ["--dst-option", o]
    assert main(argv) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["copied"] == [1]
    with ckptstore.open(s3.url, storage_options=so) as dst:
        assert dst.verify(read_data=True).ok
        assert_tree_equal(dst.load(1), _state(4))
