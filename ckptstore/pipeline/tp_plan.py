"""Tensor-parallel plans: which slice of each stored tensor one TP rank reads (pure, no I/O).

A plan maps parameter or module names (``*`` stands for one dotted name
component, as in Hugging Face's ``tp_plan``: ``"model.layers.*.mlp.down_proj"``)
to how the tensors under them are split over ``tp_size`` ranks:

- an int: split along that dimension (negative counts from the end);
- ``None``, ``"replicated"`` or ``"replicate"``: every rank reads the whole tensor;
- a Hugging Face style name (transformers' ``ALL_PARALLEL_STYLES``, as
  ``model.tp_plan`` and ``config.base_model_tp_plan`` hold them):
  ``colwise`` (and ``colwise_rep``, ``colwise_gather_output``,
  ``local_colwise``): weight and bias split along dim 0 (the output
  features of an ``nn.Linear`` weight, ``ndim - 2``); ``rowwise`` (and
  ``rowwise_rep``, ``rowwise_split_input``, ``local_rowwise``): weight split
  along its last dim (the input features), bias replicated;
  ``embedding_rowwise`` / ``embedding_colwise``: dim 0 / dim 1; the
  replicated styles (``sequence_parallel``, ``replicated_with_grad_allreduce``,
  ``all_reduce``, ``gather``, ``local``): whole tensors.

An entry names a tensor (``"lm_head.weight"``) or the module holding it
(``"lm_head"``, applying to its weight and bias); an entry naming the
tensor wins over one naming its module. Rank ``r`` of ``n`` reads the
``r``-th of ``n`` equal, contiguous blocks along the split dimension; a
dimension ``n`` does not divide is refused (as are styles whose layout is
not one block per rank: packed, strided, expert styles).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import TPPlanError

_COLWISE = frozenset({"colwise", "colwise_rep", "colwise_gather_output", "local_colwise"})
_ROWWISE = frozenset({"rowwise", "rowwise_rep", "rowwise_split_input", "local_rowwise"})
_REPLICATED = frozenset({"replicated", "replicate", "sequence_parallel", "replicated_with_grad_allreduce",
                         "all_reduce", "gather", "local"})
_EMBEDDING = {"embedding_rowwise": 0, "embedding_colwise": 1}
#: Every style name a plan may use.
STYLES = tuple(sorted(_COLWISE | _ROWWISE | _REPLICATED | set(_EMBEDDING)))


@dataclass(frozen=True)
class Split:
    """How one tensor is read by one rank: ``dim`` None is the whole tensor.

    Attributes
    ----------
    dim: the split dimension (non-negative), or None (replicated).
    pattern: the plan entry that decided it (None: no entry matched, replicated).
    """

    dim: int | None
    pattern: str | None = None

    def index(self, shape: Sequence[int], rank: int, size: int) -> tuple[slice, ...] | None:
        """The slice of a tensor of ``shape`` rank ``rank`` of ``size`` reads (None: all of it)."""
        if self.dim is None or size == 1:
            return None
        n = shape[self.dim] // size
        return (slice(None),) * self.dim + (slice(rank * n, (rank + 1) * n),)

    def local_shape(self, shape: Sequence[int], size: int) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(shape)
        return tuple(n // size if d == self.dim else n for d, n in enumerate(shape))


def _compile(pattern: str) -> re.Pattern:
    if not isinstance(pattern, str) or not pattern or pattern.startswith(".") or pattern.endswith(".") \
            or ".." in pattern:
        raise TPPlanError(f"tp_plan key {pattern!r} is not a dotted module or parameter name")
    return re.compile(r"[^.]+".join(re.escape(p) for p in pattern.split("*")) + r"\Z")


def _check_spec(pattern: str, spec) -> None:
    if spec is None or (isinstance(spec, int) and not isinstance(spec, bool)):
        return
    if isinstance(spec, str) and spec in STYLES:
        return
    raise TPPlanError(
        f"tp_plan[{pattern!r}] = {spec!r} is not a split: give a dimension (int), None or 'replicated', "
        f"or one of the Hugging Face styles {', '.join(STYLES)} (packed, strided and expert styles "
        "are not one block per rank)")


class TPPlan:
    """A parsed plan for one rank (see the module docstring).

    Parameters
    ----------
    plan: pattern -> split (int dim, None, or a style name).
    tp_rank, tp_size: this rank's position, ``0 <= tp_rank < tp_size``.
    """

    def __init__(self, plan: Mapping[str, object], tp_rank: int, tp_size: int):
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise TPPlanError(f"tp_size must be a positive int, got {tp_size!r}")
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
            raise TPPlanError(f"tp_rank must be an int in [0, {tp_size}), got {tp_rank!r}")
        if not isinstance(plan, Mapping):
            raise TPPlanError(f"tp_plan must be a dict of name pattern -> split, got {type(plan).__name__}")
        self.rank, self.size = tp_rank, tp_size
        self.entries: list[tuple[str, re.Pattern, object]] = []
        for pattern, spec in plan.items():
            _check_spec(pattern, spec)
            self.entries.append((pattern, _compile(pattern), spec))

    def _resolve(self, pattern: str, spec, name: str, ndim: int) -> int | None:
        leaf = name.rpartition(".")[2]
        if spec is None or (isinstance(spec, str) and spec in _REPLICATED):
            return None
        if isinstance(spec, str):
            if spec in _COLWISE:
                dim = ndim - 2 if ndim >= 2 else 0
            elif spec in _ROWWISE:
                if leaf == "bias":
                    return None
                dim = ndim - 1
            else:
                dim = _EMBEDDING[spec]
            if ndim == 0 or dim >= ndim:
                raise TPPlanError(f"tp_plan[{pattern!r}] = {spec!r} splits dim {dim}, but {name} has {ndim} dims")
            return dim
        dim = spec + ndim if spec < 0 else spec
        if not 0 <= dim < ndim:
            raise TPPlanError(
                f"tp_plan[{pattern!r}] = {spec}: {name} has {ndim} dims, so there is no dim {spec} to split "
                "(name the tensor, e.g. 'o_proj.weight', to give its bias another split)")
        return dim

    def split(self, name: str, shape: Sequence[int]) -> Split:
        """The split of tensor ``name`` (a module's tensor name) of the stored ``shape``."""
        module = name.rpartition(".")[0]
        for level in (name, module):
            hits = [(p, s) for p, rx, s in self.entries if level and rx.match(level)]
            if not hits:
                continue
            dims = {p: self._resolve(p, s, name, len(shape)) for p, s in hits}
            if len(set(dims.values())) > 1:
                raise TPPlanError(f"{name} is matched by tp_plan entries that split it differently: "
                                  + ", ".join(f"{p!r} -> dim {d}" for p, d in dims.items()))
            dim = next(iter(dims.values()))
            pattern = next(iter(dims))
            if dim is not None and shape[dim] % self.size:
                raise TPPlanError(f"tp_plan[{pattern!r}]: {name} has size {shape[dim]} along dim {dim}, "
                                  f"which tp_size {self.size} does not divide")
            return Split(dim, pattern)
        return Split(None)

    def unmatched(self, names) -> list[str]:
        """The entries that name none of ``names`` (every tensor and module name of the model)."""
        names = list(names)
        return [p for p, rx, _ in self.entries if not any(rx.match(n) for n in names)]
