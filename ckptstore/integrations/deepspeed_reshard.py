"""Re-partitioning a ZeRO step for another data-parallel size: the files a new rank asks for.

DeepSpeed refuses to load ZeRO optimizer states on another DP size
(``runtime/engine.py:_load_zero_checkpoint`` raises
``ZeRORuntimeException``) and points to its offline universal-checkpoint
conversion. ckptstore instead rebuilds, for the live engine's layout, the
very files DeepSpeed's stock loader reads, from range reads of the stored
partitions (:class:`ckptstore.repo.zero.ZeroLayout`): each new rank reads the
bytes of its own partition, not the whole checkpoint.

- ZeRO-3 partitions every parameter on its own (``ceil(numel / world)``
  elements per rank): :func:`zero3_model_file` (frozen fragments),
  :func:`zero3_optim_file`.
- ZeRO-1/2 keep one flat buffer per parameter group, cut into ``world``
  equal partitions; the parameters' offsets in it do not depend on the DP
  size (only the padding at its end does), so a new partition is one
  range of the stored buffer: :func:`zero12_model_file`,
  :func:`zero12_optim_file`. The file keeps the saved form of the base
  optimizer's state (a torch ``state_dict`` with padded partitions, or
  DeepSpeed's elastic per-group list without padding).

What cannot be re-partitioned raises ``NotImplementedError``; the engine
turns it into DeepSpeed's own ``ZeRORuntimeException``.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.distributed as dist

from ..repo import zero


# ============================================================== ZeRO-3
def zero3_model_file(stored: zero.StoredStep, layout: zero.ZeroLayout, rank: int, world: int, codecs: dict) -> dict:
    """Rank 0's model-states file with frozen partitions and the DP size of the new layout."""
    frozen_keys = {
        ref.key for ref in (layout.model0.get("frozen_param_fragments") or {}).values() if isinstance(ref, zero.TensorRef)
    }
    sd = stored.read_file(layout.model_files[0], codecs, skip=frozen_keys)
    if layout.frozen:
        frags = OrderedDict()
        for name, shape in layout.frozen.items():
            numel = math.prod(shape)
            frags[name] = zero.partition(
                lambda a, b, n=name: layout.read_frozen(n, a, b), numel, rank, world, layout._frozen_dtype(name)
            )
        sd["frozen_param_fragments"] = frags
    sd["dp_world_size"] = world
    return sd


def zero3_optim_file(stored: zero.StoredStep, layout: zero.ZeroLayout, engine, rank: int, world: int, codecs: dict) -> dict:
    """This rank's ZeRO-3 optimizer file for ``world`` ranks, built from the full stored state."""
    opt = engine.optimizer
    per_elem, other = layout.optimizer_state_keys()
    skip = set()
    for r in layout.optim:
        o = layout.optim[r]
        skip.update(ref.key for ref in o["fp32_flat_groups"])
        for st in o["optimizer_state_dict"]["state"].values():
            skip.update(st[k].key for k in per_elem)
    sd = stored.read_file(layout.optim_files[0], codecs, skip=skip)
    osd = sd["optimizer_state_dict"]
    saved_pgs = osd["optimizer_state_dict"]["param_groups"]
    live_pgs = opt.optimizer.param_groups
    if len(saved_pgs) != len(live_pgs):
        raise ValueError(
            f"step {stored.step} has {len(saved_pgs)} optimizer parameter groups, this engine {len(live_pgs)}"
        )
    names = engine.param_names
    groups = opt.fp16_groups
    sub_to_group = {g: int(opt.sub_group_to_group_id.get(g, 0)) for g in range(len(groups))}
    # torch's optimizer numbers the flat fp32 partitions group by group, in
    # sub-group order (stage3._set_fp32_optimizer_param_groups appends them so)
    order = [g for j in range(len(live_pgs)) for g in range(len(groups)) if sub_to_group[g] == j]
    index = {g: i for i, g in enumerate(order)}
    state0 = osd["optimizer_state_dict"]["state"][0] if osd["optimizer_state_dict"]["state"] else {}
    fp32_groups, state = [], {}
    for g, params in enumerate(groups):
        want = int(opt.fp32_partitioned_groups_flat[g].numel())
        parts = {k: [] for k in ["fp32", *per_elem]}
        for p in params:
            name = names.get(p)
            if name not in layout.slots:
                raise KeyError(f"step {stored.step} holds no trainable parameter {name!r} of this model")
            slot = layout.slots[name]
            if tuple(p.ds_shape) != slot.shape:
                raise ValueError(f"step {stored.step}: parameter {name!r} is {list(slot.shape)}, the model's {list(p.ds_shape)}")
            if p.partition_numel() != math.ceil(slot.numel / world):
                raise ValueError(f"parameter {name!r}: unexpected ZeRO-3 partition size {p.partition_numel()}")
            for k in parts:
                parts[k].append(
                    zero.partition(lambda a, b, n=name, kk=k: layout.read_param(n, kk, a, b), slot.numel, rank, world, torch.float32)
                )
        flat = {k: (torch.cat(v) if v else torch.empty(0)) for k, v in parts.items()}
        if flat["fp32"].numel() != want:
            raise ValueError(f"sub-group {g}: rebuilt {flat['fp32'].numel()} elements, the engine holds {want}")
        fp32_groups.append(flat["fp32"])
        st = {k: flat[k] for k in per_elem}
        for k, v in other.items():
            val = state0.get(k, v)
            st[k] = val.clone() if isinstance(val, torch.Tensor) else val
        state[index[g]] = st
    new_pgs = []
    for j, pg in enumerate(saved_pgs):
        pg = dict(pg)
        pg["params"] = [index[g] for g in order if sub_to_group[g] == j]
        new_pgs.append(pg)
    osd["optimizer_state_dict"] = {"state": state, "param_groups": new_pgs}
    osd["fp32_flat_groups"] = fp32_groups
    osd["partition_count"] = world
    return sd


# ============================================================== ZeRO-1/2
def flat_groups(engine) -> list[zero.FlatGroup]:
    """The live optimizer's flat parameter groups (DeepSpeed's ``DeepSpeedZeroOptimizer``)."""
    opt = engine.optimizer
    names = engine.param_names
    if any(opt.is_moe_group(pg) for pg in opt.optimizer.param_groups):
        raise NotImplementedError("ckptstore does not re-partition ZeRO-1/2 MoE parameter groups")
    # DeepSpeed 0.19.8 records each parameter's offset (alignment padding between parameters);
    # earlier 0.19 releases put parameters back to back.
    offsets = getattr(opt, "round_robin_bit16_offsets", None)
    metas = getattr(opt, "round_robin_bit16_meta", None)
    out = []
    for i, params in enumerate(opt.round_robin_bit16_groups):
        numels = [int(m.numel()) for m in metas[i]] if metas else [int(p.numel()) for p in params]
        offs = [int(o) for o in offsets[i]] if offsets else [sum(numels[:j]) for j in range(len(numels))]
        out.append(
            zero.FlatGroup(
                names=tuple(names[p] for p in params),
                offsets=tuple(offs),
                numels=tuple(numels),
                partition_size=int(opt.partition_size[i]),
                world=dist.get_world_size(group=opt.real_dp_process_group[i]) if dist.is_initialized() else 1,
            )
        )
    return out


def zero12_model_file(stored: zero.StoredStep, layout: zero.ZeroLayout, world: int, codecs: dict) -> dict:
    """The model-states file as saved, saying the new DP size (so DeepSpeed asks for ``world`` optimizer files)."""
    sd = stored.read_file(layout.model_files[0], codecs)
    sd["dp_world_size"] = world
    return sd


def zero12_optim_file(stored: zero.StoredStep, layout: zero.ZeroLayout, engine, rank: int, codecs: dict) -> dict:
    """DP rank ``rank``'s ZeRO-1/2 optimizer file for the live engine's layout."""
    opt = engine.optimizer
    groups = flat_groups(engine)
    saved_n = len(layout.optim[0]["single_partition_of_fp32_groups"])
    if len(groups) != saved_n:
        raise ValueError(f"step {stored.step} has {saved_n} ZeRO parameter groups, this engine {len(groups)}")
    saved_of = [_saved_group(layout, g, i, stored.step) for i, g in enumerate(groups)]
    keys = {g: layout.group_state_keys(g) for g in set(saved_of)}
    skip = set()
    for g, (per_elem, _) in keys.items():
        skip.add(layout.fp32_ref(0, g).key)
        skip.update(layout.state_of(0, g)[k].key for k in per_elem)
    sd = stored.read_file(layout.optim_files[0], codecs, skip=skip)
    osd = sd["optimizer_state_dict"]
    base = osd["base_optimizer_state"]
    saved_state = (lambda g: base[g]) if isinstance(base, list) else (lambda g: base["state"][g])
    fp32, states = [], []
    for i, group in enumerate(groups):
        g = saved_of[i]
        per_elem, _ = keys[g]
        lean = group.partition_size - group.padding(rank)
        fp32.append(layout.partition_of(group, rank, "fp32")[:lean].clone())
        st = {}
        for k, v in saved_state(g).items():
            if k in per_elem:
                t = layout.partition_of(group, rank, k)
                st[k] = t[:lean].clone() if layout.elastic else t
            else:
                st[k] = v
        states.append(st)
    if isinstance(base, list):
        osd["base_optimizer_state"] = states
    else:
        if len(base["param_groups"]) != len(groups):
            raise ValueError(f"step {stored.step}: {len(base['param_groups'])} optimizer parameter groups, this engine {len(groups)}")
        osd["base_optimizer_state"] = {"state": dict(enumerate(states)), "param_groups": base["param_groups"]}
    osd["single_partition_of_fp32_groups"] = fp32
    osd["group_paddings"] = [group.padding(rank) for group in groups]
    osd["partition_count"] = [group.world for group in groups]
    if hasattr(opt, "round_robin_bit16_padding"):
        osd["param_alignment_paddings"] = [[int(x) for x in p] for p in opt.round_robin_bit16_padding]
    else:
        osd.pop("param_alignment_paddings", None)
    osd["param_slice_mappings"] = _slice_mappings(groups, rank)
    return sd


def _saved_group(layout: zero.ZeroLayout, group: zero.FlatGroup, i: int, step: int) -> int:
    """The stored parameter group the live group ``i`` takes its states from (that of its parameters)."""
    missing = [n for n in group.names if n not in layout.slots]
    if missing:
        raise KeyError(f"step {step} holds no trainable parameter {missing[0]!r} of this model")
    saved = {layout.slots[n].group for n in group.names}
    if len(saved) != 1:
        raise NotImplementedError(f"parameter group {i} gathers parameters of stored groups {sorted(saved)}")
    return saved.pop()


def _slice_mappings(groups: list[zero.FlatGroup], rank: int) -> list:
    """``param_slice_mappings``: where each parameter's piece sits in ``rank``'s partition (as DeepSpeed saves it)."""
    from deepspeed.utils.tensor_fragment import fragment_address

    out = []
    for group in groups:
        out.append(OrderedDict((n, fragment_address(numel=k, start=at)) for n, at, k, _ in group.fragments(rank)))
    return out
