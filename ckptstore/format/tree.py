"""State dicts <-> (structure tree, flat tensors).

A state dict is a dict nesting dicts, lists and tuples whose leaves are
tensors or plain JSON values (int, float, str, bool, None). Tensors get a
flat key joining the path with ``.`` (``"layers.0.weight"``,
``"optim.state.3.exp_avg"``), the convention torch's own state dicts and
DCP use. Anything else is refused with a ``TypeError`` naming its path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable

import torch

_SCALARS = (bool, int, float, str, type(None))
MAX_KEY_LEN = 4096  # the manifest parser refuses longer keys


def _is_plain(v, depth=0) -> bool:
    if depth > 100:
        return False
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return type(v) in _SCALARS
    if type(v) is float:
        return True
    if type(v) is list:
        return all(_is_plain(x, depth + 1) for x in v)
    if type(v) is dict:
        return all(type(k) is str for k in v) and all(_is_plain(x, depth + 1) for x in v.values())
    return False


def _path_str(path) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def flatten(state_dict: Mapping) -> tuple[dict, dict[str, torch.Tensor]]:
    """Split a state dict into its JSON tree and its tensors by flat key."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    tensors: dict[str, torch.Tensor] = {}

    def walk(v, path, depth):
        if depth > 100:
            raise TypeError(f"{_path_str(path)}: nested more than 100 levels")
        if isinstance(v, torch.Tensor):
            key = _path_str(path)
            if len(key) > MAX_KEY_LEN:
                raise ValueError(
                    f"tensor key {key[:60]!r}... is {len(key)} characters; the limit is {MAX_KEY_LEN}"
                )
            if key in tensors:
                raise ValueError(
                    f"two tensors flatten to the key {key!r}; rename one (keys join path parts with '.')"
                )
            _check_tensor(v, key)
            tensors[key] = v
            return {"t": key}
        if _is_plain(v):
            return {"v": v}
        if isinstance(v, Mapping):
            items = []
            for k, x in v.items():
                if type(k) not in (str, int):
                    raise TypeError(
                        f"{_path_str(path + [k])}: dict keys must be str or int, got {type(k).__name__}"
                    )
                items.append([k, walk(x, path + [k], depth + 1)])
            return {"d": items}
        if isinstance(v, (list, tuple)):
            kind = "u" if isinstance(v, tuple) else "l"
            return {kind: [walk(x, path + [i], depth + 1) for i, x in enumerate(v)]}
        if type(v) is float and not math.isfinite(v):
            return {"v": v}
        raise TypeError(
            f"state_dict[{_path_str(path)!r}] is a {type(v).__module__}.{type(v).__qualname__}; "
            "only tensors and plain JSON values (int, float, str, bool, None, list, dict) can be saved "
            "(a NumPy array: torch.from_numpy(a); other values, such as NumPy RNG states: save through "
            "ckptstore.dcp, whose values load through ckptstore's allowlist, docs/dcp.md)"
        )

    tree = walk(state_dict, [], 0)
    if "d" not in tree:  # a plain dict without tensors collapses to a value node
        tree = {"d": [[k, {"v": x}] for k, x in state_dict.items()]}
    return tree, tensors


def _check_tensor(t: torch.Tensor, key: str) -> None:
    if t.layout != torch.strided:
        raise TypeError(f"tensor {key!r} has layout {t.layout}; only dense (strided) tensors can be saved")
    if t.is_quantized:
        raise TypeError(f"tensor {key!r} is quantized; dequantize it before saving")
    if t.device.type == "meta":
        raise TypeError(f"tensor {key!r} is on the meta device and has no data")
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and not _is_plain_subclass(t):
        raise TypeError(
            f"tensor {key!r} is a {type(t).__name__}; save sharded tensors through ckptstore.dcp"
        )


def _is_plain_subclass(t) -> bool:
    # Buffers and parameters of third-party subclasses that are still plain
    # dense storage are accepted; DTensor and ShardedTensor are not.
    name = type(t).__name__
    return name not in ("DTensor", "ShardedTensor", "FakeTensor", "FunctionalTensor")


def unflatten(tree: dict, get_tensor: Callable[[str], Any]) -> dict:
    """Rebuild the state dict from its tree, fetching tensors by key."""

    def build(node):
        ((kind, val),) = node.items()
        if kind == "t":
            return get_tensor(val)
        if kind == "v":
            return val
        if kind == "d":
            return {k: build(x) for k, x in val}
        if kind == "l":
            return [build(x) for x in val]
        if kind == "u":
            return tuple(build(x) for x in val)
        raise ValueError(f"unknown tree node {kind!r}")

    return build(tree)


def _leaves(node: dict, path: tuple = ()):
    """Yield ``(kind, value, path)`` for every tensor (``"t"``) and value (``"v"``) leaf, in order."""
    ((kind, val),) = node.items()
    if kind in ("t", "v"):
        yield kind, val, path
    elif kind == "d":
        for k, x in val:
            yield from _leaves(x, path + (k,))
    elif kind in ("l", "u"):
        for i, x in enumerate(val):
            yield from _leaves(x, path + (i,))


def tree_keys(tree: dict) -> list[str]:
    """Tensor keys in state-dict order."""
    return [val for kind, val, _ in _leaves(tree) if kind == "t"]


def encode_value(obj, depth: int = 0) -> dict:
    """Encode a tensor-free value (dicts, lists, tuples, JSON scalars) as a tree node.

    Tuples survive the JSON round trip (DCP's planner data maps keys to
    tuple paths). Raises ``TypeError`` for anything else.
    """
    if depth > 100:
        raise TypeError("value nested more than 100 levels")
    if _is_plain(obj):
        return {"v": obj}
    if isinstance(obj, Mapping):
        items = []
        for k, x in obj.items():
            if type(k) not in (str, int):
                raise TypeError(f"dict key {k!r} is not a str or int")
            items.append([k, encode_value(x, depth + 1)])
        return {"d": items}
    if isinstance(obj, tuple):
        return {"u": [encode_value(x, depth + 1) for x in obj]}
    if isinstance(obj, list):
        return {"l": [encode_value(x, depth + 1) for x in obj]}
    raise TypeError(f"cannot encode a {type(obj).__name__} as JSON")


def decode_value(node: dict):
    """Inverse of :func:`encode_value`."""

    def no_tensor(key):
        raise ValueError(f"unexpected tensor reference {key!r} in a value")

    return unflatten(node, no_tensor)


def leaf_values(tree: dict) -> dict[str, Any]:
    """Plain (non-tensor) leaves of a state-dict tree by dotted key, with their paths.

    A plain dict value below the root is opened up into its own leaves, the
    way DCP flattens nested dicts.
    """
    out: dict[str, Any] = {}

    def add(val, path: tuple):
        if isinstance(val, dict) and val and path:
            for k, x in val.items():
                add(x, path + (k,))
        else:
            out[_path_str(path)] = (val, path)

    for kind, val, path in _leaves(tree):
        if kind == "v":
            add(val, path)
    return out


def tensor_paths(tree: dict) -> dict[str, tuple]:
    """Tensor key -> path tuple in the state dict."""
    return {val: path for kind, val, path in _leaves(tree) if kind == "t"}
