"""Where everything lives in a repository, and the small records kept there.

Every object key ckptstore writes is built here, and every key it lists is
parsed here, by one set of rules (``docs/format.md``)::

    config.json                                format version and write defaults
    packs/<id[:2]>/<id>.pack                   immutable packs of compressed chunks
    manifests/<step:020d>.json                 one per committed step, written last
    refs/tags/<name>                           tag -> step (mutable)
    refs/names/<namespace>/<quoted name>       a framework's checkpoint name -> step (mutable)
    uploads/<step:020d>/<rank>.json            a DCP rank's write-back uploads are in (read by rank 0's commit)
    leases/<uuid>.json                         savers in flight (read by GC)
    tombstones/<step:020d>-<id>.json           deleted steps, kept for the grace period
    relocations/<id[:2]>/<id>.json             where a repacked pack's chunks went
    segments/<id[:2]>/<id>.seg                 chunk tables of 2.0 and 3.0 steps (one per writer)

Tensor names never appear in a key: keys are made of step numbers, random
ids and tag names checked against :data:`TAG_RE`. The records (config,
lease, tag, tombstone, relocation) are small JSON documents built and
strictly parsed here; no module writes or parses them its own way.
"""

from __future__ import annotations

import json
import os
import re
import socket
import urllib.parse
import uuid

import numpy as np

from . import codec as _codec
from . import manifest as _m
from ..errors import FormatError
from .manifest import ChunkRef, StepRefs

CONFIG_KEY = "config.json"
MANIFEST_PREFIX = "manifests/"
PACK_PREFIX = "packs/"
TAG_PREFIX = "refs/tags/"
NAME_PREFIX = "refs/names/"
LEASE_PREFIX = "leases/"
TOMBSTONE_PREFIX = "tombstones/"
RELOCATION_PREFIX = "relocations/"
SEGMENT_PREFIX = "segments/"
UPLOAD_PREFIX = "uploads/"
UPLOAD_FORMAT = "ckptstore.upload"

CONFIG_FORMAT = "ckptstore.config"
TOMBSTONE_FORMAT = "ckptstore.tombstone"
RELOCATION_FORMAT = "ckptstore.relocation"
NAME_FORMAT = "ckptstore.name"

#: Version of the config a new repository records (3.0: it may hold 3.0
#: manifests, so a 1.x or 2.x reader refuses the whole repository).
CONFIG_VERSION = (3, 0)
#: Version of tombstone and relocation records (unchanged since 1.0, so that
#: a 1.x reader keeps following relocations of the 1.0 steps it can read).
RECORD_VERSION = (1, 0)

MAX_STEP = 10**19 - 1
#: Default GC grace period (seconds) recorded in a new repository's config.
DEFAULT_GRACE = 2 * 3600.0
#: A chunk may move through at most this many repacks before a read gives up.
MAX_RELOCATION_HOPS = 8
#: Largest config, tag, lease or relocation record read (bytes).
MAX_RECORD_BYTES = _m.MAX_MANIFEST_BYTES

TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: Namespace of checkpoint names (one per integration: ``deepspeed``, ``lightning``).
NAMESPACE_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
#: Longest checkpoint name, in characters.
MAX_NAME_CHARS = 255
#: Characters a checkpoint name keeps in its key; every other one is %XX of its UTF-8 bytes.
_NAME_SAFE = "-._="
_MANIFEST_NAME = re.compile(r"^([0-9]{20})\.json$")
_PACK_NAME = re.compile(r"^([0-9a-f]{2})/([0-9a-f]{32})\.pack$")
_RELOCATION_NAME = re.compile(r"^([0-9a-f]{2})/([0-9a-f]{32})\.json$")
_SEGMENT_NAME = re.compile(r"^([0-9a-f]{2})/([0-9a-f]{32})\.seg$")
_UPLOAD_NAME = re.compile(r"^([0-9]{20})/([0-9]{1,9})\.json$")


# ---------------------------------------------------------------- steps and names
def check_step(step) -> int:
    """A step number as an int, or ``ValueError``."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= int(step) <= MAX_STEP:
        raise ValueError(f"step must be an integer in [0, {MAX_STEP}], got {step!r}")
    return int(step)


def check_tag_name(name) -> str:
    if not isinstance(name, str) or not TAG_RE.match(name):
        raise ValueError(f"invalid tag name {name!r}: use letters, digits, '.', '_', '-' (max 128)")
    return name


def check_namespace(ns) -> str:
    if not isinstance(ns, str) or not NAMESPACE_RE.match(ns):
        raise ValueError(f"invalid name space {ns!r}: lowercase letters, digits, '_', '-' (max 32)")
    return ns


def check_name(name) -> str:
    """A checkpoint name: 1 to 255 characters, no '/', '\\' or control character, not '.' or '..'."""
    if (
        not isinstance(name, str)
        or not 0 < len(name) <= MAX_NAME_CHARS
        or name in (".", "..")
        or any(c in "/\\" or ord(c) < 32 or ord(c) == 127 for c in name)
    ):
        raise ValueError(
            f"invalid checkpoint name {name!r}: 1 to {MAX_NAME_CHARS} characters, no '/', '\\' or control characters"
        )
    return name


def new_pack_id() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------- keys
def manifest_key(step: int) -> str:
    return f"{MANIFEST_PREFIX}{step:020d}.json"


def pack_key(pack_id: str) -> str:
    return f"{PACK_PREFIX}{pack_id[:2]}/{pack_id}.pack"


def relocation_key(pack_id: str) -> str:
    return f"{RELOCATION_PREFIX}{pack_id[:2]}/{pack_id}.json"


def segment_key(segment_id: str) -> str:
    return f"{SEGMENT_PREFIX}{segment_id[:2]}/{segment_id}.seg"


def tag_key(name: str) -> str:
    return TAG_PREFIX + check_tag_name(name)


def name_key(ns: str, name: str) -> str:
    """``refs/names/<ns>/<name>``, the name percent-encoded (only ``[A-Za-z0-9-._=]`` kept as is)."""
    return f"{NAME_PREFIX}{check_namespace(ns)}/{urllib.parse.quote(check_name(name), safe=_NAME_SAFE)}"


def upload_key(step: int, rank: int) -> str:
    """Where DCP rank ``rank`` of a write-back save of ``step`` says its packs and segment are uploaded."""
    return f"{UPLOAD_PREFIX}{check_step(step):020d}/{int(rank)}.json"


def upload_prefix(step: int) -> str:
    return f"{UPLOAD_PREFIX}{check_step(step):020d}/"


def upload_of_key(key: str) -> tuple[int, int] | None:
    """(step, rank) of an ``uploads/`` key, else None."""
    m = _UPLOAD_NAME.match(key[len(UPLOAD_PREFIX):]) if key.startswith(UPLOAD_PREFIX) else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def lease_key() -> str:
    return f"{LEASE_PREFIX}{uuid.uuid4().hex}.json"


def probe_key() -> str:
    """A key for the conditional-create probe: under ``leases/``, so that one a crash left
    behind is removed by GC as a stale lease after the grace period."""
    return f"{LEASE_PREFIX}probe-{uuid.uuid4().hex}.json"


def tombstone_key(step: int) -> str:
    return f"{TOMBSTONE_PREFIX}{step:020d}-{uuid.uuid4().hex[:8]}.json"


# ---------------------------------------------------------------- key parsing
def step_of_manifest_key(key: str) -> int | None:
    """The step a ``manifests/`` key commits, or None for anything else there."""
    if not key.startswith(MANIFEST_PREFIX):
        return None
    m = _MANIFEST_NAME.match(key[len(MANIFEST_PREFIX) :])
    return int(m.group(1)) if m else None


def pack_id_of_key(key: str) -> str | None:
    """The pack id of a ``packs/`` key (in the directory its id names), else None."""
    if not key.startswith(PACK_PREFIX):
        return None
    m = _PACK_NAME.match(key[len(PACK_PREFIX) :])
    return m.group(2) if m and m.group(2)[:2] == m.group(1) else None


def pack_id_of_relocation_key(key: str) -> str | None:
    if not key.startswith(RELOCATION_PREFIX):
        return None
    m = _RELOCATION_NAME.match(key[len(RELOCATION_PREFIX) :])
    return m.group(2) if m and m.group(2)[:2] == m.group(1) else None


def segment_id_of_key(key: str) -> str | None:
    if not key.startswith(SEGMENT_PREFIX):
        return None
    m = _SEGMENT_NAME.match(key[len(SEGMENT_PREFIX) :])
    return m.group(2) if m and m.group(2)[:2] == m.group(1) else None


def tag_of_key(key: str) -> str | None:
    if not key.startswith(TAG_PREFIX):
        return None
    name = key[len(TAG_PREFIX) :]
    return name if TAG_RE.match(name) else None


def name_of_key(key: str) -> tuple[str, str] | None:
    """(namespace, name) of a ``refs/names/`` key in its one canonical spelling, else None."""
    if not key.startswith(NAME_PREFIX):
        return None
    ns, sep, quoted = key[len(NAME_PREFIX) :].partition("/")
    if not sep or not NAMESPACE_RE.match(ns):
        return None
    try:
        name = urllib.parse.unquote(quoted, errors="strict")
        check_name(name)
    except (UnicodeDecodeError, ValueError):
        return None
    return (ns, name) if urllib.parse.quote(name, safe=_NAME_SAFE) == quoted else None


# ---------------------------------------------------------------- config
def config_record(options, now: float) -> bytes:
    """The ``config.json`` of a new repository, from its write options."""
    cfg = {
        "format": CONFIG_FORMAT,
        "version": list(CONFIG_VERSION),
        "hash": _codec.HASH_NAME,
        "chunk_size": options.chunk_size,
        "pack_size": options.pack_size,
        "codec": options.codec,
        "level": options.level,
        "grace": options.grace,
        "created": now,
    }
    return json.dumps(cfg, indent=1).encode()


def parse_config(raw: bytes, url: str) -> dict:
    try:
        cfg = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise FormatError(f"{url}/{CONFIG_KEY} is not valid JSON") from None
    if not isinstance(cfg, dict) or cfg.get("format") != CONFIG_FORMAT:
        raise FormatError(f"{url}/{CONFIG_KEY} is not a ckptstore config")
    _m.check_version(cfg.get("version"), f"{url}/{CONFIG_KEY}")
    g = cfg.get("grace", DEFAULT_GRACE)
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not g >= 0:
        raise FormatError(f"{url}/{CONFIG_KEY}: 'grace' must be a non-negative number of seconds")
    if cfg.get("hash") != _codec.HASH_NAME:
        raise FormatError(f"{url}: repository uses hash {cfg.get('hash')!r}; this version knows only blake3")
    return cfg


# ---------------------------------------------------------------- leases and tags
def lease_record(step: int, now: float) -> bytes:
    return json.dumps({"step": step, "started": now, "host": socket.gethostname(), "pid": os.getpid()}).encode()


def tag_record(step: int) -> bytes:
    return json.dumps({"step": step}).encode()


def parse_tag(raw: bytes) -> int:
    """The step a tag names; ``ValueError`` (or ``KeyError``/``TypeError``) if malformed."""
    return check_step(json.loads(raw)["step"])


def name_record(ns: str, name: str, step: int, now: float) -> bytes:
    return json.dumps(
        {"format": NAME_FORMAT, "version": list(RECORD_VERSION), "namespace": ns, "name": name, "step": step, "updated": now}
    ).encode()


def parse_name(raw: bytes, ns: str, name: str) -> int:
    """The step a name record points at; ``FormatError`` if it is not the record of ``ns``/``name``."""
    where = f"name {name!r} ({ns})"
    if len(raw) > MAX_RECORD_BYTES:
        raise FormatError(f"{where}: record is too large")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise FormatError(f"{where}: record is not valid JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != NAME_FORMAT:
        raise FormatError(f"{where}: not a ckptstore name record")
    _m.check_version(doc.get("version"), where)
    if doc.get("namespace") != ns or doc.get("name") != name:
        raise FormatError(f"{where}: the record names {doc.get('name')!r} ({doc.get('namespace')})")
    try:
        return check_step(doc.get("step"))
    except ValueError as e:
        raise FormatError(f"{where}: {e}") from None


# ---------------------------------------------------------------- tombstones
def tombstone_record(step: int, manifest_raw: bytes, now: float) -> bytes:
    return json.dumps(
        {
            "format": TOMBSTONE_FORMAT,
            "version": list(RECORD_VERSION),
            "step": step,
            "deleted_at": now,
            "manifest": manifest_raw.decode("utf-8", errors="replace"),
        }
    ).encode()


def parse_tombstone(raw: bytes, key: str) -> StepRefs | None:
    """What the deleted step a tombstone keeps referenced, or None if it is unreadable (GC then ignores it)."""
    try:
        doc = json.loads(raw)
        if doc.get("format") != TOMBSTONE_FORMAT:
            return None
        _m.check_version(doc.get("version"), key)
        return _m.parse_refs(doc["manifest"].encode("utf-8"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


# ---------------------------------------------------------------- relocations
def relocation_record(pack_id: str, table: dict[str, ChunkRef]) -> bytes:
    chunks = {h: [c.pack, c.offset, c.stored_len, c.raw_len, c.codec] for h, c in table.items()}
    doc = {"format": RELOCATION_FORMAT, "version": list(RECORD_VERSION), "pack": pack_id, "chunks": chunks}
    return json.dumps(doc).encode()


def parse_relocation(raw: bytes, pack_id: str) -> dict[str, ChunkRef]:
    """Parse a relocation record: chunk hash -> new location, strictly validated."""
    if len(raw) > MAX_RECORD_BYTES:
        raise FormatError(f"relocation record of pack {pack_id} is too large")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise FormatError(f"relocation record of pack {pack_id} is not valid JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != RELOCATION_FORMAT or doc.get("pack") != pack_id:
        raise FormatError(f"relocation record of pack {pack_id} is malformed")
    _m.check_version(doc.get("version"), f"relocation record of pack {pack_id}")
    chunks = doc.get("chunks")
    if not isinstance(chunks, dict):
        raise FormatError(f"relocation record of pack {pack_id}: 'chunks' must be an object")
    out = {}
    for h, loc in chunks.items():
        if not _codec.is_hash(h) or not isinstance(loc, list) or len(loc) != 5:
            raise FormatError(f"relocation record of pack {pack_id}: bad entry for {h!r:.70}")
        pid, off, slen, rlen, cod = loc
        if (
            not _m.is_pack_id(pid)
            or any(type(x) is not int or x < 0 for x in (off, slen, rlen))
            or cod not in _codec.CODECS
            or (cod == "raw" and slen != rlen)
        ):
            raise FormatError(f"relocation record of pack {pack_id}: bad location for chunk {h[:16]}")
        out[h] = ChunkRef(h, pid, off, slen, rlen, cod)
    return out


def safety_margin(grace: float) -> float:
    """Slack between a saver's own deadline and GC's: clock skew, listing delay."""
    return min(0.1 * grace, 300.0)
