"""The node-local tier: a directory on the node's disk, shared by its processes (``docs/tier.md``).

- :mod:`.cache`: ``Tier``, one repository's folder in a ``cache_dir`` (chunk and pack
  copies, hash-checked on read; the budget and eviction);
- :mod:`.admin`: scanning a tier directory, the pure ``plan_prune`` -> ``PrunePlan`` ->
  ``execute`` behind ``ckptstore cache``;
- :mod:`.writeback`: saves that return once the step is durable in the tier and commit
  in the store in the background;
- :mod:`.replicas`: copies of each save's packs in a peer node's tier, and a node's fill
  from its peers before a DCP load (over ``torch.distributed``).

May import: ``cache`` and ``admin`` sit below the handle's machinery
(:mod:`ckptstore.pipeline` reads through the tier); ``writeback`` uses the repository's
commit protocol (:mod:`ckptstore.repo.save`); ``replicas`` uses the exchange of
:mod:`ckptstore.dcp.exchange`. Nothing here imports the integrations.
"""
