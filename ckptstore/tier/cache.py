"""The node-local tier: a directory on a node's own disk holding a repository's packs and chunks.

Every process of a node that opens a repository with the same ``cache_dir``
shares one tier, concurrently and across restarts (``docs/tier.md``)::

    <cache_dir>/
      TIER                         "ckptstore.tier.cache 1": what this folder is
      NODE                         a random id naming this tier to its peers (ckptstore.dcp.replicas)
      repos/<key>/                 one repository: key = BLAKE3 of its canonical URL (32 hex digits)
        repo.json                  {"url": ...} (for people and `ckptstore cache ls`)
        packs/<id[:2]>/<id>.pack   whole packs a save wrote (write-through), byte for byte the store's
        chunks/<h[:2]>/<h>         chunks read from the store, in their stored (compressed) form
        raw/<h[:2]>/<h>            chunks decoded (their raw bytes), kept by saves (cache_decoded: by default
                                   while the budget has room, see Tier.keep_decoded): loads read them
                                   straight into their destinations, then hash them there
        bands/<n[:2]>/<n>          a tiled tensor's decoded copies: a band of its rows each, in the
                                   tensor's layout, with its own digest (ckptstore.tier.bands)
        segments/<id[:2]>/<id>.seg chunk tables a save wrote (through, or committed from wb/)
        wb/packs/..., wb/segments/...  the packs and chunk tables of pending write-back steps:
                                   out of eviction's and prune's reach; moved to packs/ and
                                   segments/ (one rename each) once the step is committed
        pending/<step:020d>.json   a step saved with write-back, not yet committed in the store
        pending/<step:020d>.claim  the process uploading it (host, pid)
        recent/<step:020d>.<r>.json  the packs a save through this tier wrote: eviction takes the
                                   packs of the newest RECENT_STEPS steps last
        .tmp/                      files being written; published by rename or an exclusive link

It is keyed by repository and content, never by rank or process: a pack is
named by its random id, a chunk by its hash, so what one process publishes
any other reads, and a file is never rewritten in place. Nothing here is
trusted: every chunk read from the tier is decoded and checked against its
hash by the fetcher like any other, and one that fails (a damaged or
truncated file) is a miss, and the chunk comes from the object store: a
bad chunk file is removed (:meth:`Tier.discard_chunk`), a truncated pack
copy too (:meth:`Tier.discard_pack`); a pack copy with a bad chunk stays,
and the chunk read from the store is kept as a chunk file, which reads
look at first.

Bounded: the tier keeps under ``cache_size`` bytes and leaves ``free_floor``
of its file system free; past either, the least recently used files (reads
touch a file's modification time) are removed. A write that fails for lack
of space (ENOSPC) turns the tier's writes off for this handle with a
warning; saves and loads go on against the object store alone.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import threading
import uuid

from ..format import codec as _codec
from ..format.layout import segment_key
from ..storage.local import LocalStore
from ..units import parse_size

log = logging.getLogger(__name__)

TIER_MARK = "ckptstore.tier.cache 1"
#: Errors that turn a handle's tier writes off (no space, read-only, not allowed); others lose one copy.
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)
#: Temporary files older than this (seconds) are a dead process's, removed by the next handle that writes.
STALE_TMP = 3600.0
#: Default share of the tier's file system always left free.
FREE_FLOOR = 0.05
#: Eviction takes the packs of this many newest saved steps (per repository) last.
RECENT_STEPS = 2
#: Decoded bytes a handle keeps (``Tier.keep_decoded``) between two looks at the file system's free space.
ROOM_RECHECK = 256 << 20
RECENT_NAME = re.compile(r"^([0-9]{20})\.[0-9a-f]{8}\.json$")

def repo_key(url: str) -> str:
    """The tier's folder name for a repository: 32 hex digits of the BLAKE3 of its canonical URL."""
    return _codec.hash_bytes(url.rstrip("/").encode("utf-8"))[:32]


class Tier:
    """One repository's files in a node-local tier directory; see the module docstring.

    Parameters
    ----------
    cache_dir:
        The tier's directory, shared by every process of the node that names it.
    url:
        The repository's canonical URL (``repo.url``).
    cache_size:
        Most bytes the tier may hold over all its repositories (``"200GB"`` or
        bytes); None: no limit but the free-space floor.
    free_floor:
        Share of the file system to leave free (default 5%).
    decoded:
        Whether saves through this handle also keep each new chunk decoded
        (``raw/``), for loads to read straight into their destinations:
        None (the default, ``cache_decoded=None``) while the budget has room
        (:meth:`keep_decoded`), True always (within the budget, by eviction),
        False never.
    """

    def __init__(self, cache_dir, url: str, cache_size=None, free_floor: float = FREE_FLOOR,
                 decoded: bool | None = None):
        self.cache_dir = os.path.abspath(os.fspath(cache_dir))
        if decoded not in (None, True, False):
            raise ValueError(f"cache_decoded must be None (while the tier has room), True or False, got {decoded!r}")
        self.decoded = decoded
        self.url = url
        self.cache_size = None if cache_size is None else parse_size(cache_size)
        if not 0 <= free_floor < 1:
            raise ValueError(f"free_floor must be in [0, 1), got {free_floor}")
        self.free_floor = free_floor
        self.root = os.path.join(self.cache_dir, "repos", repo_key(url))
        # Cached files need no fsync: a torn one fails its hash check and is a miss.
        self.store = LocalStore(self.root, fsync=False)
        self._lock = threading.Lock()
        self._writable = True
        self._added = 0  # bytes this handle published since the tier was last scanned
        self._usage: int | None = None  # the tier's bytes as last scanned, plus what this handle added since
        self._room: int | None = None  # bytes the file system has above the free floor, as last checked
        self._room_spent = 0  # decoded bytes admitted since then
        self._reserved = 0  # room the save under way reserved for its own files (note_step, make_room)
        self._admitted = 0  # decoded copies said yes to and not yet published (keep_decoded -> put_raw)
        self.stats = {"tier_misses": 0, "discarded": 0, "evicted": 0}
        self._prepared = False
        self._pending: PendingSteps | None = None

    # ------------------------------------------------------------ setup
    def prepare(self) -> None:
        """Create the tier's folders and marks (on the first write only)."""
        if self._prepared:
            return
        os.makedirs(self.root, exist_ok=True)
        mark = os.path.join(self.cache_dir, "TIER")
        if not os.path.exists(mark):
            _publish_bytes(self.cache_dir, mark, TIER_MARK.encode() + b"\n")
        info = os.path.join(self.root, "repo.json")
        if not os.path.exists(info):
            _publish_bytes(self.root, info, json.dumps({"url": self.url}).encode())
        self._prepared = True
        remove_stale_tmp(self.root)



    @property
    def writable(self) -> bool:
        return self._writable

    def copy_failed(self, e: BaseException) -> None:
        """A copy into the tier failed: out of space turns writes off; anything else loses that copy only."""
        if isinstance(e, OSError) and e.errno in SPACE_ERRNOS:
            self.disable_writes(e)
        else:
            log.warning("ckptstore: node-local tier %s: a copy was abandoned: %s", self.cache_dir, e)

    def disable_writes(self, why: BaseException | str) -> None:
        """Stop writing to the tier for this handle (a full disk); reads go on."""
        if self._writable:
            self._writable = False
            log.warning("ckptstore: node-local tier %s: writes turned off for this handle: %s", self.cache_dir, why)

    @property
    def pending(self) -> "PendingSteps":
        """This repository's steps saved with write-back and not yet in the store."""
        if self._pending is None:
            self._pending = PendingSteps(self)
        return self._pending

    # ------------------------------------------------------------ paths
    def pack_path(self, pack_id: str) -> str:
        return os.path.join(self.root, "packs", pack_id[:2], f"{pack_id}.pack")

    def chunk_path(self, h: str) -> str:
        return os.path.join(self.root, "chunks", h[:2], h)

    def wb_pack_path(self, pack_id: str) -> str:
        return os.path.join(self.root, "wb", "packs", pack_id[:2], f"{pack_id}.pack")

    def has_pack(self, pack_id: str) -> bool:
        return os.path.isfile(self.pack_path(pack_id)) or os.path.isfile(self.wb_pack_path(pack_id))

    def pack_source(self, pack_id: str) -> LocalStore | None:
        """The store whose ``packs/`` key holds this pack's copy: the cache, a pending step's, or None."""
        if os.path.isfile(self.pack_path(pack_id)):
            return self.store
        if os.path.isfile(self.wb_pack_path(pack_id)):
            return self.pending.durable
        return None

    def has_chunk(self, h: str) -> bool:
        return os.path.isfile(self.chunk_path(h))

    def raw_path(self, h: str) -> str:
        return os.path.join(self.root, "raw", h[:2], h)

    def keeps_decoded(self) -> bool:
        """Whether any save kept decoded chunks here (one stat per read, not one per chunk)."""
        return os.path.isdir(os.path.join(self.root, "raw"))

    def read_raw_into(self, h: str, dest) -> bool:
        """A decoded chunk file read straight into ``dest`` (exactly its length), or False (missing or
        not that long: removed). The caller checks the hash of what landed in ``dest``."""
        path = self.raw_path(h)
        mv = memoryview(dest).cast("B")
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:  # one stat, one read, and the LRU touch on the descriptor (a tile is a file each)
            size = os.fstat(fd).st_size
            got = 0
            while size == mv.nbytes and got < size:
                k = os.preadv(fd, [mv[got:]], got)
                if k <= 0:
                    break
                got += k
            if size == mv.nbytes and got == size:
                _touch(fd)
        except OSError:
            got, size = -1, -1
        finally:
            os.close(fd)
        if size != mv.nbytes or got != size:
            self.discard_raw(h)
            return False
        return True

    def keep_decoded(self, nbytes: int) -> bool:
        """Whether a save keeps a decoded copy of a new chunk of ``nbytes`` (``cache_decoded``).

        With the default (None) a decoded copy is kept only where the budget
        has room for it beside the compact copies: the tier's bytes, the room
        the save reserved for its own files at its start (``note_step``'s
        ``expect``, ``make_room``; without a reservation, ``nbytes`` more for
        the chunk's pack copy) and the copy stay within ``cache_size``, and the
        file system keeps ``4 * nbytes`` above the free-space floor. So decoded
        copies take only room nothing else needs at the time of the save and
        never make a save evict; later saves' files evict them like any other
        file, least recently used first (the packs of the newest steps last).
        True keeps them always (eviction keeps the budget), False never.
        """
        if self.decoded is False or not self._writable:
            return False
        if self.decoded is True:
            with self._lock:
                self._admitted += nbytes
            return True
        with self._lock:
            if self._usage is None:
                self._usage = sum(f[1] for f in tier_files(self.cache_dir))
            # the save's own files are reserved (note_step's ``expect``, make_room's ``nbytes``): a decoded
            # copy needs only its own room; without a reservation, room for its compact copy too
            extra = nbytes if self._reserved else 2 * nbytes
            if self.cache_size is not None and (self._usage + self._reserved + self._admitted + extra
                                                > self.cache_size):
                return False
            if self._room is None or self._room_spent >= ROOM_RECHECK:
                try:
                    st = os.statvfs(self.cache_dir)
                except OSError:
                    return False
                self._room = st.f_bavail * st.f_frsize - int(self.free_floor * st.f_blocks * st.f_frsize)
                self._room_spent = 0
            if self._room < 4 * nbytes:
                return False
            self._room -= 2 * nbytes
            self._room_spent += 2 * nbytes
            self._admitted += nbytes  # until put_raw has published it (on another thread)
            return True

    def put_raw(self, h: str, data) -> None:
        """Keep a chunk decoded (its raw bytes) for loads to read in place; never raises. Each call
        follows a :meth:`keep_decoded` that said yes, whose bytes it then stops holding in reserve."""
        path = self.raw_path(h)
        try:
            if not os.path.isfile(path):
                self._publish(path, data)
        finally:
            self.admitted_done(memoryview(data).nbytes)

    def admitted_done(self, nbytes: int) -> None:
        """A decoded copy :meth:`keep_decoded` admitted is written (or given up): its room is no longer held."""
        with self._lock:
            self._admitted = max(0, self._admitted - nbytes)

    def discard_raw(self, h: str) -> None:
        self._unlink(self.raw_path(h))

    def discard_file(self, path: str) -> None:
        """Remove a damaged file of this tier (counted as discarded)."""
        self._unlink(path)

    # ------------------------------------------------------------ reads
    def read_chunk(self, h: str, stored_len: int) -> bytes | None:
        """A chunk's stored bytes from the tier, or None (missing, or not ``stored_len`` long: removed)."""
        path = self.chunk_path(h)
        try:
            with open(path, "rb") as f:
                data = f.read(stored_len + 1)
        except OSError:
            return None
        if len(data) != stored_len:
            self.discard_chunk(h)
            return None
        _touch(path)
        return data

    def mark_pack_read(self, pack_id: str) -> None:
        _touch(self.pack_path(pack_id))

    def pack_paths(self, pack_id: str) -> tuple[str, ...]:
        """Where this tier may hold a pack's copy, in the order to try: cached, a pending step's,
        cached again (a pending pack moves there, one rename, once its step commits)."""
        return (self.pack_path(pack_id), self.wb_pack_path(pack_id), self.pack_path(pack_id))

    def pack_size(self, pack_id: str) -> int:
        """Bytes of this tier's copy of a pack, 0 when it has none."""
        for path in (self.pack_path(pack_id), self.wb_pack_path(pack_id)):
            try:
                return os.stat(path).st_size
            except OSError:
                continue
        return 0

    # ------------------------------------------------------------ identity
    def node_id(self) -> str:
        """This tier's identity: a random id kept in ``<cache_dir>/NODE``, the same for every process
        sharing the directory, a new one for a directory that was wiped. Ranks with the same id
        are on one node as far as peer replicas are concerned."""
        path = os.path.join(self.cache_dir, "NODE")
        for _ in range(3):
            try:
                with open(path, "rb") as f:
                    text = f.read(64).decode("ascii", "replace").strip()
                if re.fullmatch(r"[0-9a-f]{32}", text):
                    return text
            except FileNotFoundError:
                pass
            os.makedirs(self.cache_dir, exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
            with open(tmp, "wb") as f:
                f.write(uuid.uuid4().hex.encode() + b"\n")
            try:
                os.link(tmp, path)  # exclusive: the first process to publish names the node
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        raise OSError(f"node-local tier {self.cache_dir}: NODE holds no valid id")

    # ------------------------------------------------------------ writes
    def put_chunk(self, h: str, stored) -> None:
        """Keep a chunk read from the store (stored form), unless present; never raises for the tier's sake."""
        if not self.has_chunk(h):
            self._publish(self.chunk_path(h), stored)  # exclusive: another process may have published it first

    def publish_pack(self, pack_id: str, data) -> bool:
        """Keep a whole pack received from a peer (checked chunk by chunk when read); False if not kept."""
        if self.has_pack(pack_id):
            return True
        return self._publish(self.pack_path(pack_id), data)

    def put_segment(self, segment_id: str, data) -> bool:
        """Keep a chunk-table segment a direct save wrote to the store (write-through): read from here
        first, checked against the manifest's digest like the store's copy; False if not kept."""
        path = os.path.join(self.root, segment_key(segment_id))
        return os.path.isfile(path) or self._publish(path, data)

    def _publish(self, path: str, data) -> bool:
        """Write a whole file under ``.tmp/`` and publish it by an exclusive link; never raises."""
        return self.publish_parts(path, [data])

    def publish_parts(self, path: str, parts) -> bool:
        """:meth:`_publish` of the file whose bytes are ``parts`` (buffers) one after another."""
        if not self._writable:
            return False
        try:
            self.prepare()
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = os.path.join(self.store.tmp_dir(), f"{os.path.basename(path)[:16]}.{uuid.uuid4().hex[:8]}")
            with open(tmp, "wb") as f:
                for data in parts:
                    f.write(data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        except OSError as e:
            self.copy_failed(e)
            return False
        self.added(sum(memoryview(data).nbytes for data in parts))
        return True

    def pack_store(self) -> LocalStore:
        """The store a save writes its packs through to (under ``packs/``, like the repository's keys)."""
        self.prepare()
        return self.store

    def added(self, nbytes: int) -> None:
        """Account bytes published: past the budget (or every so often, for other processes' files) evict."""
        with self._lock:
            if self._usage is None:
                self._usage = sum(f[1] for f in tier_files(self.cache_dir))
            self._usage += nbytes
            self._added += nbytes
            over = self.cache_size is not None and self._usage > self.cache_size
            due = over or self._added >= self._check_every()
            if due:
                self._added = 0
        if due:
            self.enforce_budget()

    def _check_every(self) -> int:
        if self.cache_size:
            return max(1 << 20, self.cache_size // 20)
        return 256 << 20

    def discard_pack(self, pack_id: str) -> None:
        """Remove a cached pack copy that failed a check (never a pending step's: it is the only copy)."""
        self._unlink(self.pack_path(pack_id))

    def discard_chunk(self, h: str) -> None:
        self._unlink(self.chunk_path(h))

    def _unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("ckptstore: node-local tier: could not remove %s: %s", path, e)
            return
        with self._lock:
            self.stats["discarded"] += 1

    def note_step(self, step: int, packs=(), expect: int = 0) -> None:
        """Record that a save of ``step`` writes (empty ``packs``: is starting to) or wrote ``packs``
        into this tier: eviction takes the packs of the newest steps last, and an older step's first
        (a save under way counts as a step). Records of older steps are removed. Never raises.

        ``expect``: at the start, the most bytes the save may write here (its raw size): decoded copies
        (:meth:`keep_decoded`) leave room for them until the save has written them (``packs``)."""
        with self._lock:
            self._reserved = 0 if packs else int(expect)  # a new save's reservation replaces a failed one's
        if not self._writable:
            return
        folder = os.path.join(self.root, "recent")
        try:
            os.makedirs(folder, exist_ok=True)
            _publish_bytes(folder, os.path.join(folder, f"{step:020d}.{uuid.uuid4().hex[:8]}.json"),
                           json.dumps(sorted(packs)).encode())
            names = [n for n in os.listdir(folder) if RECENT_NAME.match(n)]
            steps = sorted({n[:20] for n in names})
            old = set(steps[: -2 * RECENT_STEPS])
            for n in names:
                if n[:20] in old:
                    try:
                        os.unlink(os.path.join(folder, n))
                    except FileNotFoundError:
                        pass
        except OSError as e:
            log.debug("ckptstore: node-local tier: could not record step %d's packs: %s", step, e)

    # ------------------------------------------------------------ budget
    def make_room(self, nbytes: int) -> int:
        """Before a write-back save of up to ``nbytes``: evict cached files until the tier and the save
        fit in ``cache_size`` (pending files stay); bytes freed. A save's files are counted only once
        its step is committed (they live under ``wb/`` until then), so room is made first."""
        if self.cache_size is None:
            return 0
        freed, used = evict(self.cache_dir, max(0, self.cache_size - nbytes), self.free_floor, target=1.0,
                            stats=self.stats, lock=self._lock)
        with self._lock:
            self._usage = used
            self._reserved = nbytes  # the save's pending files: decoded copies leave room for them
        return freed

    def enforce_budget(self) -> int:
        """Remove least recently used files until under ``cache_size`` and above the free floor; bytes freed."""
        freed, used = evict(self.cache_dir, self.cache_size, self.free_floor, stats=self.stats, lock=self._lock)
        with self._lock:
            self._usage = used
        return freed


# ---------------------------------------------------------------- write-back: pending steps
PENDING_FORMAT = "ckptstore.tier.cache.pending"
PENDING_NAME = re.compile(r"^([0-9]{20})\.json$")
RANK_RECORD_NAME = re.compile(r"^([0-9]{20})\.rank([0-9]{1,9})\.json$")


class PendingSteps:
    """The pending steps of one repository in a tier (``pending/``); see :mod:`ckptstore.repo.writeback`.

    A pending record is written last, fsynced and renamed into place, after
    the step's packs and segment are fsynced in the tier: it is the step's
    local commit. It is removed once the step is committed in the store. A
    process uploading a step holds a claim (an exclusive link of a file
    naming its host and pid); a claim whose process is gone is taken over.
    """

    def __init__(self, tier: "Tier"):
        self.tier = tier
        self.dir = os.path.join(tier.root, "pending")
        #: Where a write-back save writes its packs and segment (``wb/``), fsynced.
        self.durable = LocalStore(os.path.join(tier.root, "wb"), fsync=True)
        self._records = LocalStore(tier.root, fsync=True)

    @staticmethod
    def name(step: int, rank: int | None = None) -> str:
        """A record's name: ``<step:020d>`` (a step's), or ``<step:020d>.rank<r>`` (one DCP rank's uploads)."""
        return f"{step:020d}" if rank is None else f"{step:020d}.rank{int(rank)}"

    @classmethod
    def _n(cls, which) -> str:
        return cls.name(which) if isinstance(which, int) else which

    def path(self, which) -> str:
        return os.path.join(self.dir, f"{self._n(which)}.json")

    def write(self, which, record: dict) -> None:
        self.tier.prepare()
        os.makedirs(self.dir, exist_ok=True)
        data = json.dumps({"format": PENDING_FORMAT, "version": 1, **record}).encode()
        self._records.put(f"pending/{self._n(which)}.json", data)  # fsynced temp file, renamed, directory fsynced

    def names(self) -> list[str]:
        """Every record's name, in step order (a step's record after its ranks')."""
        try:
            files = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        out = [f[: -len(".json")] for f in files if PENDING_NAME.match(f) or RANK_RECORD_NAME.match(f)]
        return sorted(out, key=lambda n: (n[:20], n[20:] == ""))

    def steps(self) -> list[int]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(PENDING_NAME.match, names) if m)

    def read(self, which) -> dict | None:
        try:
            with open(self.path(which), "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict) or doc.get("format") != PENDING_FORMAT or doc.get("step") != int(self._n(which)[:20]):
            return None
        return doc

    def remove(self, which) -> None:
        for path in (self.path(which), self._claim_path(which)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def settle(self, keys) -> int:
        """Move a committed step's files from ``wb/`` into the cache (``packs/``, ``segments/``); bytes moved."""
        moved = 0
        for key in keys:
            src = os.path.join(self.durable.root, key)
            dst = os.path.join(self.tier.root, key)
            try:
                size = os.path.getsize(src)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.replace(src, dst)
                moved += size
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("ckptstore: node-local tier: could not move %s into the cache: %s", key, e)
        return moved

    def packs(self) -> set[str]:
        """Ids of packs and segments some pending step still needs (never evicted)."""
        out: set[str] = set()
        for name in self.names():
            rec = self.read(name)
            if rec:
                out.update(rec.get("packs", {}))
                out.update(rec.get("segments", {}))
        return out

    # -- claims
    def _claim_path(self, which) -> str:
        return os.path.join(self.dir, f"{self._n(which)}.claim")

    def claim(self, which) -> bool:
        """Take a record for this process; False if a live process holds it."""
        path = self._claim_path(which)
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        for _ in range(2):
            tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
            with open(tmp, "w") as f:
                json.dump(me, f)
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                holder = self._holder(path)
                if holder == me:
                    return True
                if holder is not None and (holder.get("host") != me["host"] or _alive(holder.get("pid"))):
                    return False
                try:
                    os.unlink(path)  # the holder is gone: take it over
                except FileNotFoundError:
                    pass
            finally:
                os.unlink(tmp)
        return False

    def release(self, which) -> None:
        path = self._claim_path(which)
        if self._holder(path) == {"host": socket.gethostname(), "pid": os.getpid()}:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    @staticmethod
    def _holder(path: str) -> dict | None:
        try:
            with open(path) as f:
                doc = json.load(f)
            return doc if isinstance(doc, dict) else None
        except (OSError, ValueError):
            return None


def _alive(pid) -> bool:
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------- whole-tier operations
def tier_files(cache_dir: str):
    """Every cached file of a tier: (path, size, mtime, repo key, kind), kind "pack", "segment" or "chunk"."""
    repos = os.path.join(cache_dir, "repos")
    try:
        keys = os.listdir(repos)
    except FileNotFoundError:
        return
    for key in keys:
        for kind, sub in (("pack", "packs"), ("segment", "segments"), ("chunk", "chunks"), ("chunk", "raw"), ("chunk", "bands"),
                          ("pack", os.path.join("wb", "packs")), ("segment", os.path.join("wb", "segments"))):
            top = os.path.join(repos, key, sub)
            try:
                shards = os.listdir(top)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for shard in shards:
                try:
                    entries = list(os.scandir(os.path.join(top, shard)))
                except (FileNotFoundError, NotADirectoryError):
                    continue
                for e in entries:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    yield e.path, st.st_size, st.st_mtime, key, kind


def evict(cache_dir: str, cache_size: int | None, free_floor: float = FREE_FLOOR, target: float = 0.9,
          stats: dict | None = None, lock=None) -> tuple[int, int]:
    """Remove least recently used tier files until the tier is under budget: (bytes freed, bytes left).

    Over ``cache_size`` (or under the free-space floor) it frees down to
    ``target`` of the limit, so that it does not run again at once.
    """
    recent = recent_packs(cache_dir)
    # least recently used first, the packs of each repository's newest saved steps last
    files = sorted(tier_files(cache_dir),
                   key=lambda f: (f[4] == "pack" and os.path.basename(f[0]).split(".")[0] in recent, f[2]))
    used = sum(f[1] for f in files)
    protected = pending_ids(cache_dir)
    try:
        st = os.statvfs(cache_dir)
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    except OSError:
        free, total = None, None
    need = 0
    if cache_size is not None and used > cache_size:
        need = max(need, used - int(cache_size * target))
    if free is not None and total and free < free_floor * total:
        need = max(need, int(free_floor * total / target) - free)
    freed = 0
    for path, size, _, _, kind in files:
        if freed >= need:
            break
        if is_pending_file(path) or kind != "chunk" and os.path.basename(path).split(".")[0] in protected:
            continue  # a pending step needs it until it is in the store
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            log.warning("ckptstore: node-local tier: could not evict %s: %s", path, e)
            continue
        freed += size
        if stats is not None:
            if lock is not None:
                with lock:
                    stats["evicted"] += 1
            else:
                stats["evicted"] += 1
    return freed, used - freed


def _repo_folders(cache_dir: str, sub: str, absent=(FileNotFoundError, NotADirectoryError)):
    """``(folder, file names)`` of folder ``sub`` of each repository in a tier that has one; a folder
    whose listing raises one of ``absent`` counts as missing (any other error is raised)."""
    repos = os.path.join(cache_dir, "repos")
    try:
        keys = os.listdir(repos)
    except absent:
        return
    for key in keys:
        folder = os.path.join(repos, key, sub)
        try:
            names = os.listdir(folder)
        except absent:
            continue
        yield folder, names


def recent_packs(cache_dir: str, steps: int = RECENT_STEPS) -> set[str]:
    """The packs the newest ``steps`` saved steps of each repository wrote into the tier."""
    out: set[str] = set()
    for folder, names in _repo_folders(cache_dir, "recent", absent=OSError):  # a preference only
        names = [n for n in names if RECENT_NAME.match(n)]
        newest = set(sorted({n[:20] for n in names})[-steps:])
        for n in names:
            if n[:20] in newest:
                try:
                    with open(os.path.join(folder, n), "rb") as f:
                        out.update(p for p in json.loads(f.read()) if isinstance(p, str))
                except (OSError, ValueError):
                    continue
    return out


def remove_stale_tmp(root: str, age: float = STALE_TMP) -> int:
    """Remove temporary files a dead process left (older than ``age`` seconds) in a repository's folders."""
    import time

    removed = 0
    now = time.time()
    for folder in (os.path.join(root, ".tmp"), os.path.join(root, "wb", ".tmp")):
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            try:
                if e.is_file(follow_symlinks=False) and now - e.stat(follow_symlinks=False).st_mtime > age:
                    os.unlink(e.path)
                    removed += 1
            except OSError:
                continue
    return removed


def is_pending_file(path: str) -> bool:
    """Whether a tier file is a pending write-back step's (under ``wb/``): never evicted or pruned.

    A write-back save writes there from its first byte, before its pending
    record exists, so no eviction can take a pack it is still writing.
    """
    return f"{os.sep}wb{os.sep}" in path


def pending_ids(cache_dir: str) -> set[str]:
    out: set[str] = set()
    for folder, names in _repo_folders(cache_dir, "pending"):
        for name in names:
            if PENDING_NAME.match(name) or RANK_RECORD_NAME.match(name):
                try:
                    with open(os.path.join(folder, name), "rb") as f:
                        doc = json.loads(f.read())
                    out.update(doc.get("packs", {}))
                    out.update(doc.get("segments", {}))
                except (OSError, ValueError, AttributeError):
                    continue
    return out


def usage(cache_dir: str) -> dict:
    """Bytes and files of a tier by repository: {key: {"url", "packs", "chunks", "bytes", "files"}}."""
    out: dict[str, dict] = {}
    for _, size, _, key, kind in tier_files(cache_dir):
        r = out.setdefault(key, {"url": _repo_url(cache_dir, key), "packs": 0, "segments": 0, "chunks": 0,
                                 "bytes": 0, "files": 0})
        r[kind + "s"] += 1
        r["bytes"] += size
        r["files"] += 1
    return out


def is_tier(cache_dir: str) -> bool:
    try:
        with open(os.path.join(cache_dir, "TIER"), "rb") as f:
            return f.read(64).decode("utf-8", "replace").startswith("ckptstore.tier.cache ")
    except OSError:
        return False


def _repo_url(cache_dir: str, key: str) -> str | None:
    try:
        with open(os.path.join(cache_dir, "repos", key, "repo.json"), "rb") as f:
            doc = json.loads(f.read(65536))
        return doc.get("url") if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def _touch(path) -> None:
    """Set a file's times to now (a path, or an open descriptor where the platform can)."""
    try:
        if isinstance(path, int) and os.utime not in os.supports_fd:
            return
        os.utime(path, None)
    except OSError:
        pass


def _publish_bytes(folder: str, path: str, data: bytes) -> None:
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


__all__ = ["Tier", "PendingSteps", "parse_size", "repo_key", "evict", "usage", "tier_files", "is_tier", "pending_ids",
           "is_pending_file", "PENDING_NAME"]
