"""The checkpoint repository: the public facade over the pipelines.

Create with :func:`open` (``ckptstore.open``). Where each part lives:

- :mod:`ckptstore.format.layout`: object keys and small records (``docs/format.md``);
- :mod:`ckptstore.repo.catalog`: config, steps, manifests, tags, leases (:class:`Catalog`,
  the base class of :class:`Repository`);
- :mod:`ckptstore.repo.save`: the chunk pipeline and the commit protocol;
- :mod:`ckptstore.repo.reader`: :class:`Checkpoint`, range reads and loads;
- :mod:`ckptstore.pipeline.fetch` / :mod:`ckptstore.pipeline.pack_writer`: the one chunk fetcher and
  the one pack writer;
- :mod:`ckptstore.repo.gc`, :mod:`ckptstore.repo.verify`, :mod:`ckptstore.repo.transfer`.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import signal
from typing import Mapping

from . import gc as _gc
from . import transfer as _transfer
from . import verify as _verify
from .catalog import Catalog
from ..clock import Clock
from ..progress import callback as progress_callback
from .reader import Checkpoint, TensorMeta, load_step, open_checkpoint
from .async_save import AsyncSaver
from .save import StepInfo, flatten_for_save, save_step
from ..storage.base import ObjectStore
from .writeback import EXIT_TIMEOUT, WRITE_BACK_STEPS, WriteBack, flush_on_signal

__all__ = ["Repository", "Checkpoint", "StepInfo", "TensorMeta", "open"]


class Repository(Catalog):
    """A checkpoint repository on one object store. Thread-safe for reads.

    Create with :func:`ckptstore.open`. Besides the methods below it has
    :class:`~ckptstore.repo.catalog.Catalog`'s: ``steps``, ``latest``,
    ``manifest``, ``delete``, ``tag``, ``tags``, ``config``, ``grace``, ``close``.
    """

    def __init__(self, store: ObjectStore, clock: Clock | None = None, write_back: bool = False,
                 write_back_steps: int = WRITE_BACK_STEPS, write_back_exit_timeout: float | None = EXIT_TIMEOUT,
                 **options):
        super().__init__(store, clock=clock, **options)
        self._async = AsyncSaver(self)
        if write_back:
            try:
                self.write_back = WriteBack(self, write_back_steps, write_back_exit_timeout,
                                            before_exit=functools.partial(_wait_async, self._async))
            except BaseException:
                super().close()  # the handle's threads: nothing else was opened
                raise

    def flush(self) -> None:
        """Wait for this handle's background work: async saves, and (write-back) every pending step's
        upload and commit in the store. Raises the first failure (a pending step stays in the tier)."""
        last = self._async.last
        if last is not None:
            last.result()
        if self.write_back is not None:
            self.write_back.flush()

    def discard_pending(self, step: int) -> None:
        """Give up a step saved with write-back that cannot be committed (refused as stale, say).

        Read it first with ``load(step)`` (it comes from the tier) to save it again.
        """
        if self.write_back is None:
            raise ValueError("discard_pending needs a handle opened with write_back=True")
        self.write_back.discard(step)

    def flush_on_signal(self, signals=(signal.SIGTERM,)) -> None:
        """Flush on SIGTERM (a preemption notice) before the previous handler runs; from the main thread."""
        flush_on_signal(self, signals)

    def close(self) -> None:
        """Wait for pending work (write-back steps: a failure is logged, the steps stay in the tier), then close."""
        if self.write_back is not None:
            self.write_back.close()
        super().close()

    # ------------------------------------------------------------ save
    def save(
        self,
        state_dict: Mapping,
        step: int,
        metadata: dict | None = None,
        blocking: bool = True,
        base: int | str | None = "latest",
        progress=None,
    ):
        """Save a state dict as a new committed step.

        Parameters
        ----------
        state_dict:
            Nested dicts/lists/tuples of tensors and plain JSON values.
        step:
            Step number; saving a step that exists raises
            :class:`StepExistsError` and changes nothing.
        metadata:
            JSON-serializable dict stored with the step.
        blocking:
            If False, copy the tensors to host memory, then return a
            ``concurrent.futures.Future`` resolving to the :class:`StepInfo`;
            the caller may modify its tensors as soon as this returns. The
            copy goes into buffers reused from the previous async save, and
            only the chunk-sized blocks whose bytes differ from that save's
            are copied; the others are referenced again without hashing
            (:mod:`ckptstore.repo.async_save`). A call while the previous
            async save is still being written waits for it, at most
            ``async_wait`` seconds (``StepInfo.waited_seconds`` says how long;
            :class:`~ckptstore.errors.SaveBacklogError` past the bound).
        base:
            Dedup base: ``"latest"`` (default), a step number, or None.
        progress:
            None (default: silent), True (a bar on stderr), or a callable
            ``progress("save bytes", done, total)`` called as each chunk of
            the state dict's bytes is done: found in the dedup base, or
            acknowledged by the store (every byte of it uploaded, not merely
            queued; :mod:`ckptstore.progress`). With ``blocking=False`` it
            reports from the background save.

        Returns
        -------
        StepInfo, or Future[StepInfo] when ``blocking=False``.
        """
        tree, tensors, step, metadata = flatten_for_save(state_dict, step, metadata)
        if not blocking:
            return self._async.submit(tree, tensors, step, metadata, base, progress)
        return save_step(self, tree, tensors, step, metadata, base, progress)

    # ------------------------------------------------------------ load
    def checkpoint(self, step: int) -> Checkpoint:
        """A read view of one committed step."""
        return open_checkpoint(self, step)

    def load(self, step: int | None = None, into: Mapping | None = None, progress=None, *,
             safe_globals=None) -> dict:
        """Load a step (default: the latest) as a state dict.

        With ``into``, tensors are read in place into the given state dict's
        tensors (same keys and shapes; another floating dtype is cast like
        DCP casts) without a second full copy, plain values are replaced,
        and ``into`` is returned. ``progress``: None (default: silent),
        True (a bar on stderr), or a callable ``progress("load bytes", done,
        total)`` called as the destination tensors are filled and verified
        (:mod:`ckptstore.progress`).

        A step saved through DCP also holds the values DCP pickled (bytes
        items: a dataloader's state, RNG states...); they are unpickled
        through ckptstore's allowlist (:mod:`ckptstore.format.unpickle`) and placed
        at their paths (with ``into``: only those whose path ``into``
        has, whatever its placeholder there, as DCP loads). ``safe_globals``: classes and functions they may
        hold besides the allowlist, as ``torch.serialization.add_safe_globals``
        takes them; anything else fails the load with
        :class:`~ckptstore.format.unpickle.UnsafeValueError` naming it. A step
        saved by :meth:`save` holds only tensors and JSON values.
        """
        return load_step(self, step, into, progress, safe_globals)

    def read_stats(self) -> dict:
        """Stored chunk bytes this handle has read, by source: ``{"tier", "peer", "store"}``."""
        with self.fetcher._lock:
            return dict(self.fetcher.read_bytes)

    # ------------------------------------------------------------ gc, verify
    def plan_gc(self, **kwargs) -> _gc.GCPlan:
        """Plan retention and garbage collection; see :func:`ckptstore.repo.gc.plan_gc`."""
        return _gc.plan_gc(self, **kwargs)

    def verify(self, step: int | None = None, read_data: bool = False, progress=None) -> _verify.VerifyReport:
        """Check manifests, packs and (with ``read_data``) every chunk; see :mod:`ckptstore.repo.verify`.

        ``progress``: None, True or a callable, as in :mod:`ckptstore.progress`.
        """
        report, close = progress_callback(progress)
        try:
            return _verify.verify(self, step=step, read_data=read_data, progress=report)
        finally:
            close()

    def stats(self) -> dict:
        """Space accounting: stored and referenced bytes, dead bytes in partly used packs, ratios."""
        return _gc.space_accounting(self)

    # ------------------------------------------------------------ transfer (see ckptstore.repo.transfer)
    def export(self, step: int, out, format: str = "safetensors", keys=None, progress=None) -> dict:
        """Write a step as a ``.safetensors`` file or (``format="dcp"``) a DCP directory.

        ``progress`` (safetensors): None, True or a callable, as in :mod:`ckptstore.progress`.
        """
        if format == "safetensors":
            report, close = progress_callback(progress)
            try:
                return _transfer.export_safetensors(self, step, out, keys_glob=keys, progress=report)
            finally:
                close()
        if format == "dcp":
            if keys is not None:
                raise ValueError("keys selects tensors only for safetensors export")
            return _transfer.export_dcp(self, step, out)
        raise ValueError(f"unknown export format {format!r}; use 'safetensors' or 'dcp'")

    def import_(self, path, step: int, **kwargs) -> StepInfo:
        """Save a .safetensors file, torch.save file or DCP directory as ``step`` (``ckptstore import``;
        ``import`` is a Python keyword, hence the underscore); see :func:`ckptstore.repo.transfer.import_file`."""
        return _transfer.import_file(self, path, step, **kwargs)

    def cp(self, dst: "Repository", steps=None, progress=None, **kwargs) -> _transfer.CopyResult:
        """Copy steps to another repository, moving only chunks it lacks (``ckptstore cp``); see
        :func:`ckptstore.repo.transfer.copy`.

        ``progress``: None, True or a callable, as in :mod:`ckptstore.progress`.
        """
        report, close = progress_callback(progress)
        try:
            return _transfer.copy(self, dst, steps=steps, progress=report, **kwargs)
        finally:
            close()

    #: The former name of :meth:`cp`.
    copy_to = cp

    def diff(self, a: int, b: int) -> dict:
        """Tensors added, removed, changed and unchanged from step ``a`` to ``b``, from manifests only."""
        return _transfer.diff(self, a, b)


def _wait_async(saver: AsyncSaver) -> None:
    """Wait for an async save still running (its failure is its own future's to report)."""
    last = saver.last
    if last is not None:
        cf.wait([last])


def open(url: str, storage_options: dict | None = None, **options) -> Repository:  # noqa: A001
    """Open (or prepare to create) the repository at ``url``.

    Parameters
    ----------
    url:
        ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``az://container/prefix``
        (also ``abfs://``, ``abfss://``), ``file:///path``, a plain path, or
        ``memory://name``.
    storage_options:
        Passed to the backend (for S3: s3fs-style options such as ``key``,
        ``secret``, ``client_kwargs={"endpoint_url": ...}``; for Azure: the
        account and credentials, such as ``account_name``, ``connection_string``).
    **options:
        :class:`~ckptstore.pipeline.options.RepoOptions` fields (``chunk_size``,
        ``pack_size``, ``part_size``, ``workers``, ``io_workers``,
        ``max_inflight_bytes``, ``grace``, ...), ``clock`` (a
        :class:`~ckptstore.clock.Clock`), and ``retry``: a
        :class:`~ckptstore.storage.retry.RetryPolicy`, or False to turn off
        the retries remote stores get by default; ``throttle``: a
        :class:`~ckptstore.storage.throttle.ThrottlePolicy` (how this
        process's request rate to the bucket falls when the store answers
        503 SlowDown / 429 and grows back), or False to never slow down
        (``docs/dcp.md``, "Many ranks"); ``cache_dir`` (a
        node-local tier, shared by the node's processes that name it:
        saves keep what they upload there and reads take each chunk from it
        first, hash-checked; see ``docs/tier.md``) and ``cache_size`` (its
        budget, ``"200GB"`` or bytes); ``cache_decoded``: whether saves also
        keep each new chunk decoded in the tier, which loads read straight
        into their destinations (about the raw size more disk): None (the
        default) where the budget has room beside the compact copies, True
        always, False never (``docs/tier.md``); ``write_back=True`` (with a
        ``cache_dir``): a save returns once the step is durable in the tier
        and is committed in the store in the background, at most
        ``write_back_steps`` (2) steps pending (:mod:`ckptstore.repo.writeback`); a
        handle not closed when the interpreter exits commits its pending steps
        then, waiting at most ``write_back_exit_timeout`` seconds (600; None: no
        limit), or says which it left and the ``ckptstore flush`` command that
        commits them. The ``cache_dir`` must be writable: checked at open.
    """
    from ..storage import open_store
    from ..storage.retry import RetryPolicy, RetryStore
    from ..storage.throttle import ThrottlePolicy

    retry = options.pop("retry", True)
    throttle = options.pop("throttle", None)
    if not (throttle is None or throttle is False or isinstance(throttle, ThrottlePolicy)):
        raise TypeError(f"throttle must be a ThrottlePolicy, None (the default policy) or False, got {throttle!r}")
    store = open_store(url, storage_options)
    store.set_throttle(throttle)
    if retry and store.remote:
        store = RetryStore(store, retry if isinstance(retry, RetryPolicy) else None)
    return Repository(store, **options)
