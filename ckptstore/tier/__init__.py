"""The node-local tier: a directory on the node's disk, shared by its processes (``docs/tier.md``).

- :mod:`.cache`: ``Tier``, one repository's folder in a ``cache_dir`` (chunk and pack
  copies, hash-checked on read; the budget and eviction; the pending records of
  write-back saves);
- :mod:`.admin`: scanning a tier directory, the pure ``plan_prune`` -> ``PrunePlan`` ->
  ``execute`` behind ``ckptstore cache``.

The policies that use the tier live above the layers they need:
:mod:`ckptstore.repo.writeback` (saves that return once the step is durable in the tier
and commit in the store in the background: it uses the commit protocol) and
:mod:`ckptstore.dcp.replicas` (copies of each save's packs in a peer node's tier, and a
node's fill from its peers before a DCP load: it uses the exchange).

May import: ``errors``, ``units``, :mod:`ckptstore.storage` and :mod:`ckptstore.format`
only; it sits below the handle's machinery (:mod:`ckptstore.pipeline` reads through the
tier), so it never imports the pipeline, the repository, DCP, the integrations or the CLI.
"""
