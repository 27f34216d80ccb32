"""torch.distributed.checkpoint storage backend.

``CkptStoreWriter`` and ``CkptStoreReader`` plug ckptstore into DCP's
planners, so FSDP/DTensor state dicts, multi-rank saves and resharding on
load work as DCP users expect::

    import torch.distributed.checkpoint as dcp
    from ckptstore.dcp import CkptStoreWriter, CkptStoreReader

    dcp.save(sd, storage_writer=CkptStoreWriter("s3://bucket/run", step=1000))
    dcp.load(sd, storage_reader=CkptStoreReader("s3://bucket/run", step=1000))

Save: the coordinator checks the step is free and picks the dedup base in
``prepare_global_plan``; every rank chunks, hashes, compresses and uploads
its own items into its own packs in ``write_data`` (chunks already in the
dedup base are referenced, not uploaded); the coordinator's ``finish``
builds the step's one manifest from all ranks' results and commits it with
an exclusive create, like :meth:`Repository.save`. DCP's bytes items (values
DCP serializes itself) are stored as opaque chunks; DCP's metadata is kept
in the manifest as JSON and rebuilt by ``read_metadata``. No pickle is
written or read by this module.

Load: each read item becomes a box of one stored shard; the range-reading
loader fetches only the chunks covering it (coalesced, concurrent,
verified) and writes into the destination tensor. A box several ranks read
(replicated state) is fetched once per job: the coordinator gives each
piece of it to one of those ranks, balanced by bytes, and the owner sends
it to the others over the process group (:mod:`ckptstore.dcp.exchange`,
``CkptStoreReader(exchange_replicated=...)``). On save, replicated items
that DCP's dedup left to one rank are rebalanced the same way
(:func:`balance_save_plans`).

A step saved here is an ordinary step (``repo.checkpoint(step).read``,
``repo.load`` assemble shards); a step saved with ``repo.save`` loads
through ``CkptStoreReader``.
"""

from .ids import split_checkpoint_id
from .metadata import build_manifest, metadata_from_manifest
from .exchange import RankReadError

#: Names of the writer and the reader, imported on first use, so that importing
#: ``ckptstore.dcp`` for its ids or metadata helpers stays cheap.
_LAZY = {"CkptStoreReader": "reader", "ExchangeOptions": "reader", "CkptStoreWriter": "writer",
         "RankWriteError": "writer", "balance_save_plans": "writer"}


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where == "reader":
        from . import reader as mod
    elif where == "writer":
        from . import writer as mod
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(mod, name)


__all__ = ["CkptStoreWriter", "CkptStoreReader", "ExchangeOptions", "RankReadError", "RankWriteError", "split_checkpoint_id",
           "balance_save_plans", "build_manifest", "metadata_from_manifest"]
