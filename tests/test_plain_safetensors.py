"""Plain ``.safetensors`` objects in a bucket, read by parts: ``load_module`` and ``lazy_state_dict``
without an import. Bytes read are counted through a :class:`CountingStore`."""

from __future__ import annotations

import json
import struct

import pytest
import torch

import ckptstore
from ckptstore import SafetensorsObject
from ckptstore.errors import FormatError
from ckptstore.format.safetensors import MAX_HEADER_BYTES
from ckptstore.repo.plain import HEADER_PROBE
from ckptstore.storage import open_store
from ckptstore.storage.wrappers import CountingStore

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

CFG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
           num_key_value_heads=4, tie_word_embeddings=False)
KEY = "models/tiny/model.safetensors"


def _meta(dtype=torch.bfloat16):
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).to(dtype)


@pytest.fixture(scope="module")
def model_bytes():
    """``(reference state dict, tp_plan, the safetensors file's bytes)``."""
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    return sd, dict(model.tp_plan), safetensors_torch.save(sd, metadata={"format": "pt"})


def _header_bytes(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def _bytes(store: CountingStore, key: str) -> int:
    return sum(e - s for k, s, e in store.reads if k == key)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_load_module_reads_a_plain_object_from_s3_by_parts(s3, model_bytes):
    ref, _, data = model_bytes
    raw = s3.store(f"s3://{s3.bucket}")
    raw.put(KEY, data)
    store = CountingStore(raw)
    with SafetensorsObject(store, KEY, piece_bytes=64 << 10) as obj:
        assert store.calls["head"] == 1 and len(store.reads) == 1  # one HEAD, one ranged read for the header
        assert obj.metadata == {"format": "pt"}
        model = _meta()
        ckptstore.load_module(model, obj)
    got = model.state_dict()
    assert got.keys() == ref.keys() and all(_same(got[k], ref[k]) for k in ref)
    # the header's read (HEADER_PROBE bytes, more than the header), then each tensor's own bytes once
    probe = min(len(data), HEADER_PROBE)
    assert _header_bytes(data) < probe
    assert store.reads[0] == (KEY, 0, probe)
    assert _bytes(store, KEY) == probe + len(data) - _header_bytes(data)
    tensors = sorted((s, e) for _, s, e in store.reads[1:])
    assert tensors[0][0] == _header_bytes(data) and tensors[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(tensors, tensors[1:]))  # no byte twice, none left out

    # and through its URL, with the store's options, as a repository URL is opened
    model = _meta()
    ckptstore.load_module(model, f"s3://{s3.bucket}/{KEY}", storage_options=s3.storage_options)
    assert all(_same(model.state_dict()[k], ref[k]) for k in ref)


def test_dim0_slices_and_tp_plans_read_only_their_rows(s3, model_bytes):
    ref, plan, data = model_bytes
    raw = s3.store(f"s3://{s3.bucket}")
    raw.put(KEY, data)
    store = CountingStore(raw)
    name = "model.layers.0.mlp.gate_proj.weight"  # [256, 128] bf16: 256 bytes a row
    with SafetensorsObject(store, KEY) as obj:
        store.reset()
        got = obj.read(name, (slice(64, 96), slice(None)))
        assert _same(got, ref[name][64:96]) and _bytes(store, KEY) == 32 * 256

        store.reset()
        model = _meta()
        ckptstore.load_module(model, obj, tp_plan=plan, tp_rank=1, tp_size=2)
        sd = model.state_dict()
        for k, full in ref.items():
            leaf = k.split(".")
            dim = 1 if ("o_proj" in leaf or "down_proj" in leaf) else 0 if full.dim() == 2 else None
            want = full if dim is None else torch.chunk(full, 2, dim)[1]
            assert _same(sd[k], want), k
        # colwise tensors: their half of the rows; rowwise (dim 1): every row, as the file lays them out
        half = sum(v.nbytes // 2 for k, v in ref.items() if v.dim() == 2 and "o_proj" not in k and "down_proj" not in k)
        whole = sum(v.nbytes for k, v in ref.items() if v.dim() == 1 or "o_proj" in k or "down_proj" in k)
        assert _bytes(store, KEY) == half + whole


def test_lazy_state_dict_over_a_plain_object_and_casts(tmp_path, model_bytes):
    pytest.importorskip("accelerate")
    from ckptstore.integrations import hf

    ref, _, data = model_bytes
    (tmp_path / "model.safetensors").write_bytes(data)
    with hf.lazy_state_dict(str(tmp_path / "model.safetensors")) as sd:
        assert sd.step is None and sd.plain is not None and set(sd) == set(ref)
        k = "model.embed_tokens.weight"
        assert sd[k].get_shape() == list(ref[k].shape) and sd[k].get_dtype() == "BF16"
        assert _same(sd[k][10:20], ref[k][10:20]) and _same(sd[k][...], ref[k])
        assert torch.equal(sd[k][:, 3:9], ref[k][:, 3:9])  # across dim 1: whole rows read, then sliced
        assert torch.equal(sd[k].materialize(dtype=torch.float32), ref[k].float())
    model = _meta(torch.float32)  # every tensor staged and cast
    ckptstore.load_module(model, str(tmp_path / "model.safetensors"), staging_bytes=16 << 10)
    assert all(torch.equal(model.state_dict()[k], ref[k].float()) for k in ref)


def _file(tensors: dict, header_edit=None, pad: int = 0) -> bytes:
    """A safetensors file built by hand: ``tensors`` name -> (dtype, shape, payload bytes)."""
    head, body = {}, b""
    for name, (dtype, shape, payload) in tensors.items():
        head[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(payload)]}
        body += payload
    if header_edit is not None:
        header_edit(head)
    h = json.dumps(head).encode() + b" " * pad
    return struct.pack("<Q", len(h)) + h + body


GOOD = {"a": ("F32", [2, 2], bytes(16)), "b": ("I8", [3], bytes(3))}


@pytest.mark.parametrize("data, match", [
    (b"\x01\x02\x03", r"too short for the 8-byte header length"),
    (struct.pack("<Q", MAX_HEADER_BYTES + 1) + bytes(64), r"over the 100000000-byte limit"),
    (struct.pack("<Q", 500) + b'{"a": 1}', r"header length 500 does not fit in the 16-byte object \(truncated\?\)"),
    (struct.pack("<Q", 11) + b'{"a": {"dty', r"not valid JSON"),
    (_file(GOOD)[:-2], r"the tensors end at byte \d+, the object has \d+ bytes \(truncated\?\)"),
    (_file(GOOD, lambda h: h["a"].update(shape=[2, 3])), r"tensor 'a': F32\[2, 3\] is 24 bytes, data_offsets"),
    (_file(GOOD, lambda h: h["b"].update(data_offsets=[12, 15])), r"tensor 'b' starts at data offset 12, expected 16"),
    (_file(GOOD, lambda h: h["a"].update(dtype="F12")), r"unsupported dtype 'F12'"),
    (_file(GOOD, lambda h: h["a"].update(extra=1)), r"exactly 'dtype', 'shape' and 'data_offsets'"),
    (_file(GOOD, lambda h: h.update(__metadata__={"k": 1})), r"__metadata__ must be an object of strings"),
    (struct.pack("<Q", 2) + b"[]", r"the header is not a JSON object"),
])
def test_truncated_or_garbled_headers_are_refused_clearly(tmp_path, data, match):
    (tmp_path / "bad.safetensors").write_bytes(data)
    store = CountingStore(open_store(str(tmp_path)))
    with pytest.raises(FormatError, match=r"bad.safetensors: not a valid safetensors file: .*" + match):
        SafetensorsObject(store, "bad.safetensors")
    assert _bytes(store, "bad.safetensors") <= min(len(data), HEADER_PROBE)  # nothing allocated past the probe


def test_a_padded_valid_header_and_a_duplicate_key(tmp_path):
    (tmp_path / "ok.safetensors").write_bytes(_file(GOOD, pad=5))
    with SafetensorsObject(open_store(str(tmp_path)), "ok.safetensors") as obj:
        assert obj.keys() == ["a", "b"] and obj.read("a").shape == (2, 2)
    dup = b'{"a": {"dtype": "I8", "shape": [1], "data_offsets": [0, 1]}, "a": {}}'
    (tmp_path / "dup.safetensors").write_bytes(struct.pack("<Q", len(dup)) + dup + b"\x00")
    with pytest.raises(FormatError, match=r"duplicate key 'a'"):
        SafetensorsObject(open_store(str(tmp_path)), "dup.safetensors")


def _shards(ref: dict, n: int = 2) -> tuple[dict[str, bytes], bytes]:
    """``ref`` cut into ``n`` safetensors files and the index naming them (Hugging Face's layout)."""
    names = sorted(ref)
    files, weight_map = {}, {}
    for i in range(n):
        f = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = {k: ref[k] for k in names[i::n]}
        files[f] = safetensors_torch.save(part)
        weight_map.update({k: f for k in part})
    index = json.dumps({"metadata": {"total_size": sum(v.nbytes for v in ref.values())}, "weight_map": weight_map})
    return files, index.encode()


def test_a_sharded_model_loads_through_its_index_from_s3(s3, model_bytes):
    from ckptstore.integrations import hf

    ref, plan, _ = model_bytes
    files, index = _shards(ref)
    raw = s3.store(f"s3://{s3.bucket}")
    for f, data in files.items():
        raw.put(f"models/sharded/{f}", data)
    raw.put("models/sharded/model.safetensors.index.json", index)
    url = f"s3://{s3.bucket}/models/sharded/model.safetensors.index.json"
    model = _meta()
    ckptstore.load_module(model, url, storage_options=s3.storage_options, tp_plan=plan, tp_rank=0, tp_size=2)
    for k, full in ref.items():
        leaf = k.split(".")
        dim = 1 if ("o_proj" in leaf or "down_proj" in leaf) else 0 if full.dim() == 2 else None
        assert _same(model.state_dict()[k], full if dim is None else torch.chunk(full, 2, dim)[0]), k

    store = CountingStore(raw)
    with ckptstore.open_safetensors(url, s3.storage_options) as shards:
        assert set(shards.keys()) == set(ref) and shards.metadata["total_size"] > 0
    with hf.lazy_state_dict(url, storage_options=s3.storage_options) as sd:
        assert set(sd) == set(ref) and _same(sd["lm_head.weight"][5:9], ref["lm_head.weight"][5:9])
    from ckptstore.repo.plain import SafetensorsShards

    with SafetensorsShards(store, "models/sharded/model.safetensors.index.json") as shards:
        store.reset()
        shards.read("model.norm.weight")
        (key, s, e), = store.reads  # one range of the file holding it, nothing else
    holder = next(f for f, data in files.items() if "model.norm.weight" in safetensors_torch.load(data))
    assert key == f"models/sharded/{holder}" and e - s == ref["model.norm.weight"].nbytes


@pytest.mark.parametrize("index, match", [
    (b'{"weight_map": {"a": "../up.safetensors"}}', r"names '../up.safetensors', not a .safetensors file beside"),
    (b'{"weight_map": {"c": "ok.safetensors"}}', r"weight_map puts tensor 'c' in ok.safetensors, which has no such"),
    (b'{"weight_map": {}}', r"no weight_map of tensor names to files"),
    (b'{"weight_map": ', r"not valid JSON"),
])
def test_bad_indexes_are_refused(tmp_path, index, match):
    (tmp_path / "ok.safetensors").write_bytes(_file(GOOD))
    (tmp_path / "model.safetensors.index.json").write_bytes(index)
    with pytest.raises(FormatError, match=match):
        ckptstore.open_safetensors(str(tmp_path / "model.safetensors.index.json"))
