"""What one rank reads and every rank of a DCP job needs, read once and shared over the process group.

A restart of N ranks that asks for the newest step would otherwise send N
listings of ``manifests/`` and read the root manifest and ``config.json``
N times; a save would read the config and its dedup base's root N times.
At a thousand ranks that is the request pattern that gets a store to
answer 503 SlowDown. Here the DCP coordinator reads, and the bytes go to the
other ranks in one broadcast (:meth:`ckptstore.dcp.exchange.Exchanger.share`:
one status first, so a failed read raises on every rank, naming it).

Loads: DCP calls ``read_metadata()`` on every rank before any collective of
its own, and the reader cannot tell from its arguments whether the call is
part of a job (``dcp.load``) or of one process alone (``no_dist=True``, or
no process group). :func:`dcp_job` finds out from DCP's own bookkeeping:
the ``_DistWrapper`` of the ``dcp.load`` that is calling (torch 2.4 to
2.13 keep it in ``local_step``'s closure). Where it is not found, every rank
reads for itself, as before: correct, only dearer. Saves: the writer takes
the job the same way in ``set_up_storage_writer`` and shares in
``write_data``, on the group DCP saves on (an ``async_save`` on a group of
its own included), never on another.

The payload is framed without pickle: a JSON header naming the parts and
their lengths, then the parts' bytes.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import CkptStoreError

#: DCP's modules whose ``local_step`` holds the ``_DistWrapper`` of the call (load, save).
_DCP_FILES = ("state_dict_loader.py", "state_dict_saver.py")
_MAGIC = b"CKSH"


@dataclass(frozen=True)
class Job:
    """The process group a DCP call runs on, and its coordinator (a global rank)."""

    group: object
    coordinator: int
    size: int
    rank: int  # this process's rank in ``group``

    @property
    def process_group(self):
        """The group itself (DCP keeps None for the default group)."""
        return self.group if self.group is not None else dist.group.WORLD

    @property
    def src(self) -> int:
        """The coordinator's rank within the group."""
        return dist.get_group_rank(self.group, self.coordinator) if self.group is not None else self.coordinator

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.src


def dcp_job(max_depth: int = 8) -> Job | None:
    """The ``dcp.load`` or ``dcp.save`` job whose planning calls the reader or writer now
    (``read_metadata``, ``set_up_storage_writer``), or None (no process group, ``no_dist=True``,
    a world of one, or a DCP whose bookkeeping this does not recognise)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "local_step" and code.co_filename.endswith(_DCP_FILES):
            w = frame.f_locals.get("distW")
            if w is None or not getattr(w, "use_dist", False):
                return None
            try:
                size = w.get_world_size()
                job = Job(w.group, int(w.global_coordinator_rank), int(size), int(w.get_rank()))
            except (AttributeError, TypeError, ValueError, RuntimeError):
                return None
            return job if size > 1 else None
        frame = frame.f_back
    return None


def pack(header: dict, *parts: bytes | None) -> bytes:
    """``header`` (JSON) and ``parts`` (None: absent) as one payload."""
    head = dict(header, parts=[None if p is None else len(p) for p in parts])
    h = json.dumps(head, separators=(",", ":")).encode()
    return b"".join([_MAGIC, struct.pack("<I", len(h)), h, *(p for p in parts if p is not None)])


def unpack(payload: bytes, what: str) -> tuple[dict, list[bytes | None]]:
    """The header and the parts of a :func:`pack` payload."""
    try:
        if payload[:4] != _MAGIC:
            raise ValueError("bad magic")
        (n,) = struct.unpack_from("<I", payload, 4)
        header = json.loads(payload[8 : 8 + n])
        pos, parts = 8 + n, []
        for length in header.pop("parts"):
            if length is None:
                parts.append(None)
                continue
            if pos + length > len(payload):
                raise ValueError("cut short")
            parts.append(payload[pos : pos + length])
            pos += length
        if pos != len(payload):
            raise ValueError("trailing bytes")
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise CkptStoreError(f"the {what} received from the coordinator is damaged ({e})") from None
    return header, parts
