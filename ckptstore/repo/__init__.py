"""A repository and the operations on it: the metadata, saving, reading, checking, cleaning, copying.

- :mod:`.catalog`: ``Catalog``, config, steps, manifests, tags, names, leases, listings;
- :mod:`.chunks`: the chunk pipeline of a save (``ChunkWriter``);
- :mod:`.save`: the one commit protocol (``StepCommit``) and a save around it;
- :mod:`.reader`: ``Checkpoint``, range reads and loads of one step;
- :mod:`.verify`: checks that report every problem;
- :mod:`.gc_refs`, :mod:`.gc`: what references what, ``plan_gc`` -> ``GCPlan`` ->
  ``execute``, repack;
- :mod:`.transfer`: export, import, ``cp``, ``diff``;
- :mod:`.zero`: how a DeepSpeed save is kept in a step (ZeRO consolidation and
  re-partitioning by range reads; torch only, never DeepSpeed);
- :mod:`.writeback`: write-back saves (durable in the node-local tier first, committed in
  the store in the background, through ``StepCommit``);
- :mod:`.repository`: ``Repository``, the public facade, and ``open``.

May import: ``errors``, ``units``, ``clock``, ``progress``, :mod:`ckptstore.storage`,
:mod:`ckptstore.format`, :mod:`ckptstore.pipeline` and :mod:`ckptstore.tier` (the
node-local cache, below the pipeline); never DCP, the integrations, the testing helpers
or the CLI.
"""
