"""Relocation records: where the chunks of a repacked (deleted) pack live now.

GC's repack copies the live chunks of a partly used pack into new packs and
writes one record per old pack, before deleting it; committed manifests
keep naming the old pack (they are never rewritten). Readers that find a
pack missing follow the records, pack by pack, at most
:data:`~ckptstore.format.layout.MAX_RELOCATION_HOPS` times.
"""

from __future__ import annotations

from ..errors import FormatError, ObjectNotFoundError
from ..format.layout import MAX_RELOCATION_HOPS, parse_relocation, relocation_key
from ..format.manifest import ChunkRef
from .runtime import LRUCache
from ..storage.base import ObjectStore

#: Bytes of cached relocation tables per repository handle (about 200 bytes a chunk).
RELOCATION_CACHE_BYTES = 64 << 20


class Relocations:
    """The relocation records of one repository, each read once while cached.

    Records are written once and never change, so a found record is cached
    (bounded); "no record" is not cached, since a repack may write one later.
    """

    def __init__(self, store: ObjectStore):
        self.store = store
        self._cache: LRUCache[str, dict[str, ChunkRef]] = LRUCache(
            RELOCATION_CACHE_BYTES, lambda t: 200 * len(t) + 200
        )

    def table(self, pack_id: str) -> dict[str, ChunkRef] | None:
        """The record of pack ``pack_id`` (hash -> new location), or None.

        Raises :class:`FormatError` for a record that exists but is malformed.
        """
        t = self._cache.get(pack_id)
        if t is not None:
            return t
        try:
            raw = self.store.get(relocation_key(pack_id))
        except ObjectNotFoundError:
            return None
        t = parse_relocation(raw, pack_id)
        self._cache.put(pack_id, t)
        return t

    def view(self) -> "RelocationView":
        """A lenient view for one scan (GC, verify): unreadable records count as absent."""
        return RelocationView(self)


class RelocationView:
    """Relocation lookups for one scan of the repository.

    Unreadable records count as absent (``verify`` and GC report what they
    cannot find; they do not stop on a damaged record), and absent ones are
    remembered for the rest of the scan.
    """

    def __init__(self, relocations: Relocations):
        self._relocations = relocations
        self._seen: dict[str, dict[str, ChunkRef] | None] = {}

    def table(self, pack_id: str) -> dict[str, ChunkRef] | None:
        if pack_id not in self._seen:
            try:
                self._seen[pack_id] = self._relocations.table(pack_id)
            except FormatError:
                self._seen[pack_id] = None
        return self._seen[pack_id]

    def chain(self, ref: ChunkRef, present, recorded=None) -> list[ChunkRef]:
        """``ref`` and every location relocation records move it to, in order.

        Stops at a pack in ``present``, at a pack without a record (only
        packs in ``recorded`` are looked up, when given), or after
        :data:`MAX_RELOCATION_HOPS`. The chunk is found when the last
        element's pack is in ``present``.
        """
        out = [ref]
        for _ in range(MAX_RELOCATION_HOPS):
            if ref.pack in present or (recorded is not None and ref.pack not in recorded):
                break
            table = self.table(ref.pack)
            if not table or ref.hash not in table:
                break
            ref = table[ref.hash]
            out.append(ref)
        return out

    def locate(self, ref: ChunkRef, present) -> ChunkRef | None:
        """Where the chunk lives among ``present`` packs, or None."""
        last = self.chain(ref, present)[-1]
        return last if last.pack in present else None
