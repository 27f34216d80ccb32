"""Repository checking: report every problem found, never stop at the first.

Checks that every manifest parses, every pack a step references exists with
the size the manifest recorded (or was moved by a repack whose relocation
record covers the chunks), and with ``read_data`` that every referenced
chunk decodes to its hash (through the repository's one chunk fetcher,
which reports each failed chunk instead of stopping). Each chunk is read
once however many steps share it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .catalog import Catalog
from ..errors import CkptStoreError, FormatError, MissingDataError
from ..pipeline.fetch import ChunkFetcher
from ..format.layout import step_of_manifest_key
from ..format.manifest import ChunkRef


@dataclass(frozen=True)
class Problem:
    """One defect: what kind, and where."""

    kind: str  # manifest | segment | missing_pack | pack_size | chunk | config
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


def verify(cat: Catalog, step: int | None = None, read_data: bool = False, progress=None) -> VerifyReport:
    """Check one step (or every step); see the module docstring."""
    problems: list[Problem] = []
    progress = progress or (lambda what, done, total: None)
    cat.require_repository()  # "no problems found" would hide a mistyped URL
    try:
        cat.config()
    except CkptStoreError as e:
        problems.append(Problem("config", str(e)))
    steps = _steps_to_check(cat, step, problems)
    manifests = {}
    for s in steps:
        try:
            manifests[s] = cat.manifest(s)
        except CkptStoreError as e:
            problems.append(Problem("manifest", str(e), step=s))
    users, packs_seen = _check_packs(cat, manifests, problems)
    chunks_checked = 0
    if read_data and users:
        chunks_checked = _read_chunks(cat, users, problems, progress)
    return VerifyReport(
        url=cat.url,
        steps=tuple(steps),
        packs_checked=len(packs_seen),
        chunks_checked=chunks_checked,
        read_data=read_data,
        problems=tuple(sorted(problems, key=lambda p: (p.step if p.step is not None else -1, p.kind, p.tensor or "", p.offset or 0))),
    )


def _steps_to_check(cat: Catalog, step: int | None, problems: list[Problem]) -> list[int]:
    """The step asked for, or every step with a manifest (an unparsable manifest name is a problem)."""
    if step is None:
        steps = []
        for info in cat.manifest_objects():
            s = step_of_manifest_key(info.key)
            if s is None:
                problems.append(Problem("manifest", f"unexpected object {info.key}"))
            else:
                steps.append(s)
    else:
        steps = [step]
    steps.sort()
    return steps


def _check_packs(cat: Catalog, manifests: dict, problems: list[Problem]) -> tuple[dict[ChunkRef, tuple[int, str]], set[str]]:
    """Every referenced pack is there with its recorded size, or relocated.

    Returns the unique chunks, each with the first ``(step, tensor)`` that uses it,
    and the packs seen.
    """
    stored = {pid: o.size for pid, o in cat.packs().items()}
    users: dict[ChunkRef, tuple[int, str]] = {}
    relocs = cat.relocations.view()
    packs_seen: set[str] = set()
    for s, m in manifests.items():
        reported: set[str] = set()
        try:
            # 2.0: every segment's header and records, checked against the root
            shards = list(cat.tables.iter_shards(m))
        except (FormatError, MissingDataError) as e:
            problems.append(Problem("segment", str(e), step=s))
            continue
        for key, _, chunks in shards:
            for c in chunks:
                ref = c
                if c.pack not in stored:
                    ref = relocs.locate(c, stored)
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
                users.setdefault(ref, (s, key))
    return users, packs_seen


def _read_chunks(cat: Catalog, users: dict[ChunkRef, tuple[int, str]], problems: list[Problem], progress) -> int:
    """Read every unique chunk from the store and check its hash; each failure is a problem. Returns the count."""
    items = list(users)
    total = len(items)
    done = [0]
    lock = threading.Lock()  # chunks are delivered from several threads

    def count() -> None:
        with lock:
            done[0] += 1
            progress("chunks", done[0], total)

    def deliver(i: int, raw, stored) -> None:
        count()

    def on_error(i: int, err: Exception) -> None:
        r = items[i]
        s, key = users[r]
        with lock:
            problems.append(Problem("chunk", str(err), step=s, tensor=key, pack=r.pack, offset=r.offset))
        count()

    fetcher = cat.fetcher
    if fetcher.tier is not None:
        # The object store is what is verified, not this node's copies of it.
        fetcher = ChunkFetcher(cat.store, cat.runtime, cat.options, cat.relocations)
    fetcher.fetch(items, deliver, lambda i: "", on_error=on_error)
    return total
