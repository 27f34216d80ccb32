"""The on-store format, as pure code: bytes in, bytes out, no I/O.

- :mod:`~ckptstore.format.codec`: chunk hashing (BLAKE3) and the codecs;
- :mod:`~ckptstore.format.tree`: a state dict's nesting as a JSON tree;
- :mod:`~ckptstore.format.pack`: a pack object's header, entries and footer;
- :mod:`~ckptstore.format.manifest`: a step's manifest (the data model and the 1.0 and 2.0 codecs);
- :mod:`~ckptstore.format.chunk_table`: 2.0 chunk-table segments;
- :mod:`~ckptstore.format.layout`: the repository's key layout (what lives where in a store).

``docs/format.md`` is the specification these implement.
"""
