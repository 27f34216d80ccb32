"""The machinery every repository handle reads and writes chunks with.

- :mod:`.options`: ``RepoOptions``, every tunable with its default;
- :mod:`.runtime`: a handle's thread pools, read budget, buffer pools;
- :mod:`.planner` (pure): slices to byte runs to chunks to coalesced range requests;
- :mod:`.tensors`: tensor byte views, host staging, dtype casts;
- :mod:`.fetch`: the one chunk fetcher (coalesce, GET, verify, decode, follow relocations,
  the node-local tier first);
- :mod:`.pack_writer`: the one pack writer (parts in flight, sealing, size checks);
- :mod:`.table_reader`: chunk-table segments, only the record blocks a share needs;
- :mod:`.relocations`: where a repack moved a pack's chunks;
- :mod:`.staging`: ``TensorReader``, a tensor or a slice read into any device through
  reusable host buffers.

May import: ``errors``, ``units``, ``clock``, ``progress``, :mod:`ckptstore.storage`,
:mod:`ckptstore.format` and the node-local tier's :mod:`ckptstore.tier.cache`; never the
repository's operations (:mod:`ckptstore.repo`), DCP or the integrations
(``tests/test_layers.py`` checks each module's layer).
"""
