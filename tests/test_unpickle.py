"""The state trainers save: DCP bytes items through ckptstore's allowlist (ckptstore.format.unpickle).

NumPy arrays and RNG states, Python's random state, OrderedDict, datetime
values, dataclasses of plain values and torch's safe types load through
``CkptStoreReader`` exactly as PyTorch's ``FileSystemReader`` loads them,
and through ``Repository.load``; anything else is refused naming the type
and how to allow it; nothing outside the list is ever imported or built.
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import ckptstore
from ckptstore.dcp import CkptStoreReader, CkptStoreWriter
from ckptstore.testing import free_port
from ckptstore.format.unpickle import UnsafeValueError, load_safe

from . import state_workers as S
from .helpers import spawn

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _bytes(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


@pytest.mark.parametrize("key", list(S.trainer_values()))
def test_each_kind_of_trainer_state_loads_as_saved(key):
    want = S.trainer_values(seed=3)[key]
    S.same(load_safe(_bytes(want), key), want)


def test_loaded_rng_states_continue_the_same_streams():
    import random

    vals = S.trainer_values(seed=5)
    np.random.set_state(load_safe(_bytes(vals["np_legacy_state"]), "x"))
    a = np.random.rand(4)
    np.random.set_state(vals["np_legacy_state"])
    assert np.array_equal(a, np.random.rand(4))
    g = np.random.default_rng()
    g.bit_generator.state = load_safe(_bytes(vals["np_pcg64_state"]), "x")
    h = np.random.default_rng()
    h.bit_generator.state = vals["np_pcg64_state"]
    assert np.array_equal(g.integers(0, 1 << 60, 8), h.integers(0, 1 << 60, 8))
    random.setstate(load_safe(_bytes(vals["py_random_state"]), "x"))
    r = [random.random() for _ in range(3)]
    random.setstate(vals["py_random_state"])
    assert r == [random.random() for _ in range(3)]


@dataclasses.dataclass
class _WithProperty:
    a: int = 1

    @property
    def doubled(self):
        return 2 * self.a

    @doubled.setter
    def doubled(self, v):  # user code a pickle could reach through setattr
        self.a = v // 2


@dataclasses.dataclass
class _WithSetstate:
    a: int = 1

    def __setstate__(self, state):
        self.__dict__.update(state)


@pytest.mark.parametrize("value, name", [
    (S.Opaque(), "tests.state_workers.Opaque"),
    (_WithProperty(), "tests.test_unpickle._WithProperty"),
    (_WithSetstate(), "tests.test_unpickle._WithSetstate"),
    (np.array([1, "x"], dtype=object), "numpy.dtypes.ObjectDType"),
    (np.random.default_rng(0), "numpy.random._pickle.__generator_ctor"),
], ids=["class", "dataclass-property", "dataclass-setstate", "object-array", "np-generator-object"])
def test_anything_else_is_refused_naming_it_and_how_to_allow_it(value, name):
    with pytest.raises(UnsafeValueError) as ei:
        load_safe(_bytes(value), "bytes item 'x'")
    msg = str(ei.value)
    assert f"bytes item 'x' holds {name}" in msg
    assert f"safe_globals=[{name}]" in msg and "torch.serialization.add_safe_globals" in msg
    if "_With" in name:
        assert "It is a dataclass, but not one of plain values" in msg


def test_a_module_not_imported_is_never_imported(tmp_path, monkeypatch):
    (tmp_path / "sidefx_mod.py").write_text(textwrap.dedent(f"""
        import dataclasses, pathlib
        pathlib.Path({str(tmp_path / 'imported')!r}).write_text("yes")

        @dataclasses.dataclass
        class State:
            n: int = 0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import sidefx_mod

    data = _bytes(sidefx_mod.State(7))
    assert load_safe(data, "x") == sidefx_mod.State(7)  # imported by the trainer: a plain dataclass loads
    (tmp_path / "imported").unlink()
    del sys.modules["sidefx_mod"]
    with pytest.raises(UnsafeValueError, match=r"holds sidefx_mod.State.*not imported in this process"):
        load_safe(data, "x")
    assert "sidefx_mod" not in sys.modules and not (tmp_path / "imported").exists()


def test_a_dataclass_holding_more_than_its_fields_is_refused():
    v = S.LoopState(epoch=2)
    v.extra = "not a field"
    with pytest.raises(UnsafeValueError, match=r"LoopState holds attributes that are not its fields: \['extra'\]"):
        load_safe(_bytes({"loop": v}), "x")


def test_allowing_a_type_for_one_load_or_for_the_process(tmp_path):
    data = _bytes({"o": S.Opaque(4)})
    assert load_safe(data, "x", safe_globals=[S.Opaque]) == {"o": S.Opaque(4)}
    with pytest.raises(UnsafeValueError):  # for that load only
        load_safe(data, "x")
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([S.Opaque])
    try:
        assert load_safe(data, "x") == {"o": S.Opaque(4)}
        load_safe(_bytes(np.ones(2)), "x")
        # the process's own entry survives ckptstore's loads; ckptstore's do not linger
        assert S.Opaque in torch.serialization.get_safe_globals()
        with pytest.raises(Exception, match="numpy"):
            torch.load(io.BytesIO(_bytes(np.ones(2))), weights_only=True)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    with pytest.raises(TypeError, match="safe_globals entries"):
        CkptStoreReader(str(tmp_path / "r"), safe_globals=["tests.state_workers.Opaque"])


def test_single_process_dcp_load_matches_filesystem_reader_and_repo_load(tmp_path):
    url, fs = str(tmp_path / "repo"), str(tmp_path / "fs")
    state = {"w": torch.arange(6.0), "v": S.trainer_values(seed=1)}
    dcp.save(state, storage_writer=CkptStoreWriter(url, step=1))
    dcp.save(state, storage_writer=FileSystemWriter(fs))
    ours, theirs = {"w": torch.zeros(6), "v": S.blank_values()}, {"w": torch.zeros(6), "v": S.blank_values()}
    dcp.load(ours, storage_reader=CkptStoreReader(url))
    dcp.load(theirs, storage_reader=FileSystemReader(fs))
    S.same(ours, theirs)
    S.same(ours["v"], S.trainer_values(seed=1))
    with ckptstore.open(url) as repo:
        got = repo.load(1)
        # the values come back where DCP flattened them, in the state dict's order; a dict
        # subclass DCP flattened (OrderedDict, Counter) comes back a dict, as DCP stores it
        assert list(got) == ["w", "v"] and list(got["v"]) == list(state["v"])
        assert torch.equal(got["w"], torch.arange(6.0))
        want = S.trainer_values(seed=1)
        for k in ("ordered",):
            want[k] = dict(want[k])
        want["torch_safe"]["counter"] = dict(want["torch_safe"]["counter"])
        S.same(got["v"], want)
        # into=: only the values the destination names, as DCP loads (placeholders of any type)
        into = {"w": torch.zeros(6), "v": {"np_arr": np.zeros(1), "loop": S.LoopState(), "when": {"dt": None}}}
        repo.load(1, into=into)
        S.same(into["v"], {"np_arr": want["np_arr"], "loop": want["loop"], "when": {"dt": want["when"]["dt"]}})
        assert torch.equal(into["w"], torch.arange(6.0))
        assert repo.checkpoint(1).read_value("v.when.dt") == want["when"]["dt"]


def test_a_refused_value_fails_every_reader_until_allowed(tmp_path):
    url = str(tmp_path / "repo")
    dcp.save({"w": torch.ones(2), "obj": S.Opaque(3)}, storage_writer=CkptStoreWriter(url, step=1))
    with pytest.raises(CheckpointException, match=r"bytes item 'obj' holds tests.state_workers.Opaque"):
        dcp.load({"w": torch.zeros(2), "obj": None}, storage_reader=CkptStoreReader(url, step=1))
    sd = {"w": torch.zeros(2), "obj": None}
    dcp.load(sd, storage_reader=CkptStoreReader(url, step=1, safe_globals=[S.Opaque]))
    assert sd["obj"] == S.Opaque(3)
    with ckptstore.open(url) as repo:
        with pytest.raises(UnsafeValueError, match=r"value 'obj' holds tests.state_workers.Opaque.*safe_globals="):
            repo.load(1)
        assert repo.load(1, safe_globals=[S.Opaque])["obj"] == S.Opaque(3)
        into = {"w": torch.zeros(2)}  # a destination without the value never unpickles it
        repo.load(1, into=into)
        assert torch.equal(into["w"], torch.ones(2))


def test_repo_save_keeps_storing_json_values_only(tmp_path):
    with ckptstore.open(str(tmp_path / "repo")) as repo:
        with pytest.raises(TypeError, match=r"numpy.ndarray.*torch.from_numpy.*ckptstore.dcp"):
            repo.save({"w": torch.ones(2), "rng": np.random.get_state()}, step=1)
        assert repo.steps() == []


@pytest.mark.slow
def test_two_ranks_direct_and_exchanged_reads_match_filesystem_reader(tmp_path):
    out = tmp_path / "out.json"
    spawn(S.round_trip_worker, args=(2, free_port(), str(tmp_path / "repo"), str(tmp_path / "fs"), str(out)),
          nprocs=2)
    assert json.loads(out.read_text()) == {"checked": ["direct", "exchanged"], "world": 2}
    with ckptstore.open(str(tmp_path / "repo")) as repo:  # and the step reads whole, every rank's values in it
        got = repo.load(1)
    for key, seed in (("shared", 100), ("rank0", 0), ("rank1", 1)):
        assert got[key]["loop"] == S.trainer_values(seed=seed)["loop"]
        S.same(got[key]["np_legacy_state"], S.trainer_values(seed=seed)["np_legacy_state"])
