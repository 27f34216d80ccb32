"""Repository checking: report every problem found, never stop at the first.

Checks that every manifest parses, every pack a step references exists with
the size the manifest recorded (or was moved by a repack whose relocation
record covers the chunks), and with ``read_data`` that every referenced
chunk decodes to its hash. Each chunk is read once however many steps share
it.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field

from . import codec as _codec
from . import planner as _plan
from .errors import CkptStoreError, IntegrityError, ObjectNotFoundError
from .manifest import ChunkRef
from .repository import MANIFEST_PREFIX, PACK_PREFIX, RelocationTables, Repository, pack_key


@dataclass(frozen=True)
class Problem:
    """One defect: what kind, and where."""

    kind: str  # manifest | missing_pack | pack_size | chunk | config
    message: str
    step: int | None = None
    tensor: str | None = None
    pack: str | None = None
    offset: int | None = None

    def __str__(self) -> str:
        where = []
        if self.step is not None:
            where.append(f"step {self.step}")
        if self.tensor is not None:
            where.append(f"tensor {self.tensor!r}")
        if self.pack is not None:
            where.append(f"pack {self.pack}")
        if self.offset is not None:
            where.append(f"offset {self.offset}")
        return f"[{self.kind}] {', '.join(where)}: {self.message}" if where else f"[{self.kind}] {self.message}"


@dataclass(frozen=True)
class VerifyReport:
    url: str
    steps: tuple[int, ...]
    packs_checked: int
    chunks_checked: int
    read_data: bool
    problems: tuple[Problem, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {
            "url": self.url,
            "ok": self.ok,
            "steps": list(self.steps),
            "packs_checked": self.packs_checked,
            "chunks_checked": self.chunks_checked,
            "read_data": self.read_data,
            "problems": [p.__dict__ for p in self.problems],
        }

    def __str__(self) -> str:
        head = (
            f"{self.url}: {len(self.steps)} step(s), {self.packs_checked} pack(s)"
            + (f", {self.chunks_checked} chunk(s) read" if self.read_data else "")
        )
        if self.ok:
            return head + ": no problems found"
        return head + f": {len(self.problems)} problem(s)\n" + "\n".join(f"  {p}" for p in self.problems)


def verify(repo: Repository, step: int | None = None, read_data: bool = False, progress=None) -> VerifyReport:
    problems: list[Problem] = []
    progress = progress or (lambda what, done, total: None)
    try:
        repo.config()
    except CkptStoreError as e:
        problems.append(Problem("config", str(e)))

    if step is None:
        steps = []
        for info in repo.store.list(MANIFEST_PREFIX):
            name = info.key[len(MANIFEST_PREFIX):]
            if name.endswith(".json") and name[:-5].isdigit():
                steps.append(int(name[:-5]))
            else:
                problems.append(Problem("manifest", f"unexpected object {info.key}"))
    else:
        steps = [step]
    steps.sort()

    manifests = {}
    for s in steps:
        try:
            manifests[s] = repo.manifest(s)
        except CkptStoreError as e:
            problems.append(Problem("manifest", str(e), step=s))

    stored = {}
    for info in repo.store.list(PACK_PREFIX):
        name = info.key.rsplit("/", 1)[-1]
        if name.endswith(".pack"):
            stored[name[:-5]] = info.size

    # Unique chunks, with the first (step, tensor) that uses each.
    users: dict[tuple, tuple[int, str]] = {}
    tables = RelocationTables(repo)
    packs_seen: set[str] = set()
    for s, m in manifests.items():
        reported: set[str] = set()
        for key, t in m.tensors.items():
            for shard in t.shards:
                for c in shard.chunks:
                    ref = c
                    if c.pack not in stored:
                        ref = _relocate(tables, c, stored)
                        if ref is None:
                            if c.pack not in reported:
                                problems.append(
                                    Problem("missing_pack", "pack is missing and no relocation record covers it",
                                            step=s, tensor=key, pack=c.pack, offset=c.offset)
                                )
                                reported.add(c.pack)
                            continue
                    elif c.pack not in reported and stored[c.pack] != m.packs.get(c.pack, stored[c.pack]):
                        problems.append(
                            Problem("pack_size",
                                    f"pack is {stored[c.pack]} bytes, the manifest recorded {m.packs[c.pack]}",
                                    step=s, tensor=key, pack=c.pack)
                        )
                        reported.add(c.pack)
                    packs_seen.add(ref.pack)
                    users.setdefault((ref.pack, ref.offset, ref.stored_len, ref.raw_len, ref.codec, ref.hash), (s, key))

    chunks_checked = 0
    if read_data and users:
        items = list(users)
        reqs = _plan.coalesce([(p, off, off + sl) for p, off, sl, _, _, _ in items], max_gap=1 << 20, max_request=32 << 20)
        _, io, _ = repo._pools()

        def check(req: _plan.RangeRequest) -> list[Problem]:
            out = []
            try:
                (data,) = repo.store.get_ranges(pack_key(req.pack), [(req.start, req.end)])
            except (ObjectNotFoundError, ValueError) as e:
                s, key = users[items[req.items[0]]]
                return [Problem("chunk", f"cannot read: {e}", step=s, tensor=key, pack=req.pack, offset=req.start)]
            for i in req.items:
                p, off, sl, rl, codec, h = items[i]
                s, key = users[items[i]]
                try:
                    stored = memoryview(data)[off - req.start: off - req.start + sl]
                    _codec.decode_verified(codec, stored, rl, h, f"chunk {h[:16]}")
                except IntegrityError as e:
                    out.append(Problem("chunk", str(e), step=s, tensor=key, pack=p, offset=off))
            return out

        futures = [io.submit(check, r) for r in reqs]
        for n, f in enumerate(cf.as_completed(futures)):
            problems.extend(f.result())
            progress("chunks", n + 1, len(futures))
        chunks_checked = len(items)
    return VerifyReport(
        url=repo.url,
        steps=tuple(steps),
        packs_checked=len(packs_seen),
        chunks_checked=chunks_checked,
        read_data=read_data,
        problems=tuple(sorted(problems, key=lambda p: (p.step if p.step is not None else -1, p.kind, p.tensor or "", p.offset or 0))),
    )


def _relocate(tables: RelocationTables, c: ChunkRef, stored: dict) -> ChunkRef | None:
    """Where the chunk of a missing pack lives now, or None."""
    last = tables.chain(c, stored)[-1]
    return last if last.pack in stored else None
