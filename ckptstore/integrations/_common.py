"""Helpers shared by the integrations (no framework imports)."""

from __future__ import annotations

from ..errors import CkptStoreError


def unwrap_checkpoint_exception(e, what: str) -> BaseException:
    """DCP's ``CheckpointException`` (a ``BaseException``) -> the first failing rank's own error.

    The error keeps its type (``StepExistsError``, ``StorageError``, ...)
    and says which rank failed; a failure that is not an ``Exception``
    becomes a :class:`CkptStoreError`.
    """
    failures = getattr(e, "failures", None) or {}
    for rank in sorted(failures):
        item = failures[rank]
        exc = item[0] if isinstance(item, tuple) else item
        if isinstance(exc, Exception):
            msg = f"{what}: rank {rank}: {exc}"
            try:
                return type(exc)(msg)
            except Exception:
                return CkptStoreError(msg)
    return CkptStoreError(f"{what} failed: {e}")


# ---------------------------------------------------------------- stand-in files
# A stand-in is the small file an integration leaves where a framework
# expects a checkpoint file whose bytes live in a repository. Its first
# bytes are two values in pickle protocol 2, written by hand below: torch's
# MAGIC_NUMBER (an int) and a one-line message (a str). torch.load of the
# file (weights_only True or False) takes it for its legacy format, reads
# the magic number, then the "protocol version", and raises
# ``RuntimeError: Invalid protocol version: <message>``: one line saying
# what the file stands for and how to read it. The stand-in's JSON record
# follows on its own line. ckptstore parses these bytes itself and never
# unpickles anything.
_TORCH_MAGIC = 0x1950A86A20F9469CFC6C
_STANDIN_HEAD = b"\x80\x02\x8a\x0a" + _TORCH_MAGIC.to_bytes(10, "little") + b".\x80\x02X"
STANDIN_MAX = 16384


def standin_bytes(message: str, record: dict) -> bytes:
    """The bytes of a stand-in file: torch's one-line refusal ``message``, then ``record`` as JSON."""
    import json

    msg = " ".join(message.split()).encode("utf-8")
    body = json.dumps(record, sort_keys=True).encode("utf-8")
    raw = _STANDIN_HEAD + len(msg).to_bytes(4, "little") + msg + b".\n" + body + b"\n"
    if len(raw) > STANDIN_MAX:
        raise ValueError(f"stand-in record is {len(raw)} bytes, over {STANDIN_MAX}")
    return raw


def parse_standin(raw: bytes) -> dict | None:
    """The JSON record of a stand-in's bytes, or None if they are not a stand-in."""
    import json

    if len(raw) > STANDIN_MAX or not raw.startswith(_STANDIN_HEAD):
        return None
    at = len(_STANDIN_HEAD)
    n = int.from_bytes(raw[at : at + 4], "little")
    at += 4 + n
    if raw[at : at + 2] != b".\n":
        return None
    try:
        doc = json.loads(raw[at + 2 :])
    except (ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None
