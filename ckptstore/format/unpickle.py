"""The one allowlist of what ckptstore unpickles: DCP bytes items (values DCP ``torch.save``s).

ckptstore's own format holds no pickle. DCP's bytes items do: a value that
is not a tensor (an optimizer's ``step``, a dataloader's state, RNG states)
is stored as the bytes of ``torch.save(value)``, and torch 2.13's
``DefaultLoadPlanner.load_bytes`` unpickles them with ``weights_only=False``,
where a stored pickle could import and run anything. So before a bytes item
reaches a planner (``CkptStoreReader``) or a caller (``Repository.load`` of a
step saved through DCP), :func:`load_safe` loads it with torch's restricted
unpickler (``torch.load(weights_only=True)``) and this allowlist on top of
torch's own safe types (tensors, dtypes, ``torch.Size``, ``OrderedDict``,
``Counter``, ``set``, ...):

- NumPy arrays, dtypes and scalars (``numpy._core.multiarray._reconstruct``
  and ``scalar``, also under NumPy 1.x's ``numpy.core`` names; ``ndarray``;
  ``dtype`` and its classes) except those of object dtype, whose elements
  would bypass the list: so NumPy's RNG states load, the legacy
  ``np.random.get_state()`` tuple and ``Generator.bit_generator.state`` dicts;
- ``datetime.datetime``, ``date``, ``time``, ``timedelta``, ``timezone``;
- dataclasses of plain values (:func:`auto_dataclass` says which: classes of
  modules the process has already imported, never importing one);
- what the caller allows (``safe_globals=``), and what the process allows
  with ``torch.serialization.add_safe_globals``.

Python's ``random.getstate()`` is a tuple of ints and loads as it is. A
value holding anything else is refused with :class:`UnsafeValueError`
naming the type and the three ways to allow it.

The list is lent to torch's unpickler for the duration of one load, under a
lock: only the entries the process has not allowed itself are added, and
only those are removed afterwards, so a process's own ``add_safe_globals``
survives (``torch.serialization.safe_globals`` would remove them). Another
thread's ``torch.load(weights_only=True)`` in that window sees the wider list.
"""

from __future__ import annotations

import dataclasses
import io
import pickletools
import re
import sys
import threading
import zipfile
from typing import Any, Iterable

import torch

from ..errors import FormatError

__all__ = ["UnsafeValueError", "default_safe_globals", "load_safe", "auto_dataclass", "check_safe_globals"]

_LOCK = threading.Lock()
_MAX_DEPTH = 100
# What a dataclass admitted by rule may not define anywhere in its MRO: each
# would run the class's own code while the pickle builds the object.
_RISKY = ("__new__", "__setstate__", "__reduce__", "__reduce_ex__", "__getattr__", "__getattribute__",
          "__setattr__", "__delattr__", "__del__")
_NUMPY_DTYPE_CHARS = "?bBhHiIlLqQpPefdgFDGSUV"
_HOW = ("CkptStoreReader(..., safe_globals=[{name}]) or repo.load(..., safe_globals=[{name}]) for one reader or "
        "load, or torch.serialization.add_safe_globals([{name}]) for the whole process")


class UnsafeValueError(FormatError, TypeError):
    """A stored pickle names a type or function outside the allowlist; nothing was built from it."""


def _numpy_entries() -> list:
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # NumPy 2 moved numpy.core to numpy._core
    out: list = [np.ndarray, np.dtype]
    for fn in (core.multiarray._reconstruct, core.multiarray.scalar):
        # under both names: a pickle written by NumPy 1.x names numpy.core.multiarray
        out += [(fn, f"numpy._core.multiarray.{fn.__name__}"), (fn, f"numpy.core.multiarray.{fn.__name__}")]
    kinds = {type(np.dtype(c)) for c in _NUMPY_DTYPE_CHARS}
    kinds |= {type(np.dtype("M8[ns]")), type(np.dtype("m8[ns]"))}
    # Object dtype stays out: an object array's elements are whatever its pickle names.
    kinds.discard(type(np.dtype("O")))
    return out + sorted(kinds, key=lambda k: k.__name__)


def default_safe_globals() -> list:
    """ckptstore's allowlist beyond torch's own safe types, in ``add_safe_globals`` form.

    Entries are classes and functions, or ``(object, "module.name")`` pairs
    where a pickle names the object by another path.
    """
    import datetime

    return _numpy_entries() + [datetime.datetime, datetime.date, datetime.time, datetime.timedelta,
                               datetime.timezone]


def _refusal(cls: type) -> str | None:
    """Why ``cls`` is not a dataclass of plain values admitted by rule, or None when it is."""
    if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
        return "it is not a dataclass"
    frozen = cls.__dataclass_params__.frozen
    for k in cls.__mro__[:-1]:
        own = vars(k)
        if "__dataclass_fields__" not in own:
            return f"its base {k.__module__}.{k.__qualname__} is not a dataclass"
        if "__slots__" in own:
            return "it has __slots__"
        for name in _RISKY:
            if name in own and not (frozen and name in ("__setattr__", "__delattr__")):
                return f"it defines {name}"
        for name, v in own.items():
            if name not in ("__dict__", "__weakref__") and (hasattr(type(v), "__set__") or hasattr(type(v), "__delete__")):
                return f"its attribute {name} is a data descriptor (a property or similar)"
    return None


def _find(path: str):
    """The object a pickle's ``module.qualname`` names, from modules already imported (never importing)."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        mod = sys.modules.get(".".join(parts[:i]))
        if mod is None:
            continue
        obj = mod
        for p in parts[i:]:
            if p.startswith("<"):
                return None
            obj = getattr(obj, p, None)
            if obj is None:
                return None
        return obj
    return None


def auto_dataclass(path: str) -> type | None:
    """The dataclass a pickle names by ``module.qualname``, if the rule admits it without listing.

    Admitted: a class of a module this process has already imported (the
    name is never imported), made by ``@dataclass`` as is every base but
    ``object``, without ``__slots__``, with no ``__new__``, ``__setstate__``,
    ``__reduce__``/``__reduce_ex__``, ``__getattr__``/``__getattribute__``,
    ``__setattr__``/``__delattr__`` (but a frozen dataclass's own),
    ``__del__``, and no data descriptor such as a property: unpickling it
    then runs none of its code (the object is made with ``object.__new__``
    and its ``__dict__`` filled). After the load, every such object must
    hold its fields and nothing else.
    """
    cls = _find(path)
    return cls if cls is not None and _refusal(cls) is None else None


def _named_globals(data: bytes) -> set[str]:
    """The ``module.name`` of every GLOBAL in a ``torch.save`` zip's pickle (empty if it is not one).

    torch.save writes pickle protocol 2, whose globals are all GLOBAL
    opcodes; this only proposes candidates to :func:`auto_dataclass`, the
    restricted unpickler still checks every one.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            name = next((n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if name is None:
                return set()
            pkl = z.read(name)
        return {arg.replace(" ", ".", 1) for op, arg, _ in pickletools.genops(pkl) if op.name == "GLOBAL"}
    except Exception:  # not a zip, or a pickle pickletools cannot walk: no candidates
        return set()


def check_safe_globals(extra: Iterable | None) -> list:
    """``extra`` as a list, each entry checked to be an ``add_safe_globals`` entry."""
    out = []
    for e in extra or ():
        if isinstance(e, tuple):
            if len(e) != 2 or not isinstance(e[1], str):
                raise TypeError(f"safe_globals entries are classes, functions or (object, 'module.name') pairs, got {e!r}")
        elif not callable(e):
            raise TypeError(f"safe_globals entries are classes, functions or (object, 'module.name') pairs, got {e!r}")
        out.append(e)
    return out


def _check_dataclasses(obj, admitted: set, what: str, depth: int = 0) -> None:
    """Every object of a class admitted by rule holds its fields and nothing else."""
    if depth > _MAX_DEPTH:
        raise UnsafeValueError(f"{what}: the value nests more than {_MAX_DEPTH} levels")
    t = type(obj)
    if t in admitted:
        names = {f.name for f in dataclasses.fields(obj)}
        extra = [k for k in vars(obj) if k not in names]
        if extra:
            raise UnsafeValueError(f"{what}: the stored {t.__module__}.{t.__qualname__} holds attributes that are "
                                   f"not its fields: {sorted(extra, key=repr)[:5]}")
        children = vars(obj).values()
    elif isinstance(obj, dict):
        children = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = obj
    else:
        return
    for c in children:
        _check_dataclasses(c, admitted, what, depth + 1)


_GLOBAL_RE = re.compile(r"GLOBAL (\S+) was not an allowed global")
_CLASS_RE = re.compile(r"got <class '([^']+)'>")
_FUNC_RE = re.compile(r"unrecognized function <(?:built-in )?(?:function|method) (\S+)")


def _refused_name(msg: str) -> str | None:
    for rx in (_GLOBAL_RE, _CLASS_RE, _FUNC_RE):
        m = rx.search(msg)
        if m:
            return m.group(1).rstrip(">")
    return None


def _error(what: str, e: BaseException) -> UnsafeValueError:
    msg = str(e).strip()
    first = msg.splitlines()[0] if msg else type(e).__name__
    name = _refused_name(msg)
    if name is None:
        return UnsafeValueError(
            f"{what} is not loadable with torch.load(weights_only=True) and ckptstore's allowlist, so it is "
            f"not unpickled (DCP's own planner would unpickle it unrestricted). torch said: {first}")
    why = ""
    cls = _find(name)
    if cls is not None and dataclasses.is_dataclass(cls) and isinstance(cls, type):
        why = f" It is a dataclass, but not one of plain values that loads without listing: {_refusal(cls)}."
    elif cls is None and "." in name and name.split(".")[0] not in sys.modules:
        why = " (Its module is not imported in this process.)"
    return UnsafeValueError(
        f"{what} holds {name}, which is not on ckptstore's allowlist of types it unpickles (tensors and torch's "
        "safe types, NumPy arrays, dtypes and scalars but of object dtype, RNG states, OrderedDict, datetime "
        f"values, dataclasses of plain values), so it is not unpickled.{why} If you trust {name}, allow it: "
        + _HOW.format(name=name) + ".")


def load_safe(data: bytes, what: str, safe_globals: Iterable | None = None) -> Any:
    """The value ``torch.save`` wrote as ``data``, through torch's restricted unpickler and the allowlist.

    Parameters
    ----------
    data:
        The bytes of one ``torch.save`` (a DCP bytes item).
    what:
        Names the value in errors (repository, step, item).
    safe_globals:
        More classes and functions to allow for this load, in the form of
        ``torch.serialization.add_safe_globals``.

    Raises
    ------
    UnsafeValueError
        The pickle names something outside the allowlist (the message names
        it and how to allow it), or is no loadable ``torch.save`` output.
    """
    extra = check_safe_globals(safe_globals)
    candidates = [(cls, n) for n in _named_globals(data) if (cls := auto_dataclass(n)) is not None]
    entries = default_safe_globals() + extra + candidates
    with _LOCK:
        have = set(torch.serialization.get_safe_globals())
        added = [e for e in entries if e not in have]
        torch.serialization.add_safe_globals(added)
        try:
            value = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as e:
            raise _error(what, e) from None
        finally:
            if added:  # remove ours only, keeping what another thread added meanwhile
                gone = set(added)
                keep = [e for e in torch.serialization.get_safe_globals() if e not in gone]
                torch.serialization.clear_safe_globals()
                torch.serialization.add_safe_globals(keep)
    if candidates:
        _check_dataclasses(value, {c for c, _ in candidates}, what)
    return value
