"""What the remote stores share now that each one's client blocks.

S3 (botocore), GCS (google-auth's ``requests`` session) and Azure
(azure-storage-blob's synchronous client) each send one request per call
on the calling thread. Around that, they share three things, kept here:

- :func:`get_ranges_threaded`: :meth:`ObjectStore.get_ranges` as one
  request per range, several at once on a pool of this call's threads, with
  the checks every store makes (a range past the end is a ``ValueError``;
  empty ranges need no bytes but must lie inside the object);
- :func:`each_threaded`: one call per item (GCS's and Azure's deletes),
  several at once, the first failure reported with the item it failed on;
- :func:`stream_into`: a response body read from the socket straight into
  the caller's buffer, reporting progress as it goes (the loader decodes
  each chunk as soon as its bytes are in), and :func:`stream_range`, the
  checks around it for a ranged GET.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Callable, Sequence

from ..errors import TransientStorageError
from .base import READ_PIECE, RangeReplyError, check_range_reply, check_ranges


def get_ranges_threaded(read: Callable[[int, int], tuple[bytes, int | None]], ranges: Sequence[tuple[int, int]],
                        max_concurrency: int, size_of: Callable[[], int], where: str,
                        thread_name: str = "ckptstore-get") -> list[bytes]:
    """The bytes of each range, in order, each read by ``read(start, end)``.

    ``read`` sends one request and returns ``(bytes, size of the object or
    None)``; it raises :class:`RangeReplyError` for a range past the end
    (raised from here as a plain ``ValueError``) and anything else as its
    client raised it, for the store to classify. One range is read on the
    calling thread (the loader asks for one range per call from its own
    I/O threads); more go to a pool of at most ``max_concurrency`` threads,
    and the first failure cancels what has not started. ``size_of()`` (a
    ``head``) is asked only when empty ranges, which need no request, must
    be checked against the object's size and no reply said it.
    """
    ranges = check_ranges(ranges)
    todo = [(i, s, e) for i, (s, e) in enumerate(ranges) if e > s]
    out: list[bytes] = [b""] * len(ranges)
    size = None
    try:
        if len(todo) <= 1 or max_concurrency == 1:
            replies = [read(s, e) for _, s, e in todo]
        else:
            with cf.ThreadPoolExecutor(min(max_concurrency, len(todo)), thread_name_prefix=thread_name) as ex:
                futs = [ex.submit(read, s, e) for _, s, e in todo]
                try:
                    replies = [f.result() for f in futs]
                finally:
                    for f in futs:
                        f.cancel()
    except RangeReplyError as e:
        raise ValueError(str(e)) from None
    for (i, _, _), (data, total) in zip(todo, replies):
        out[i] = data
        size = total if total is not None else size
    if len(todo) < len(ranges) or not ranges:
        if size is None:
            size = size_of()
        for s, e in ranges:
            if e > size:
                raise ValueError(f"{where}: range [{s}, {e}) past end of {size}-byte object")
    return out


def each_threaded(fn: Callable, items: Sequence, limit: int,
                  thread_name: str = "ckptstore-each") -> tuple[int, BaseException] | None:
    """Call ``fn(item)`` for every item, at most ``limit`` at once.

    Returns None when every call returned, else ``(index, exception)`` of the
    first failure in item order; once one call failed, calls not started yet
    are not started.
    """
    if not items:
        return None
    if len(items) == 1 or limit == 1:
        for i, item in enumerate(items):
            try:
                fn(item)
            except Exception as e:
                return i, e
        return None
    with cf.ThreadPoolExecutor(min(limit, len(items)), thread_name_prefix=thread_name) as ex:
        futs = [ex.submit(fn, item) for item in items]
        failure = None
        for i, f in enumerate(futs):
            try:
                f.result()
            except cf.CancelledError:
                continue
            except Exception as e:
                if failure is None:
                    failure = (i, e)
                    for later in futs[i + 1 :]:
                        later.cancel()
        return failure


def stream_into(raw, mv: memoryview, progress: Callable[[int], None] | None,
                read: Callable[[int], bytes] | None = None) -> tuple[int, bool]:
    """Read a response body into ``mv``, :data:`READ_PIECE` bytes at a time, reporting ``progress(n)``.

    ``raw`` is the urllib3 response under the client's (botocore's and
    ``requests``' alike). When its body is a plain length-delimited one, it
    is read straight into ``mv`` through the ``http.client`` response
    underneath (one copy, from the socket); otherwise through ``read(n)``
    (the client's own reader, with its checks; ``raw.read`` when None), a
    copy more. Returns ``(bytes read, at end)``: at end, the body held
    exactly ``len(mv)`` bytes and its connection went back to the pool;
    otherwise the caller closes the response.
    """
    fp = getattr(raw, "_fp", None)
    direct = (fp is not None and hasattr(fp, "readinto") and hasattr(fp, "isclosed")
              and hasattr(raw, "release_conn") and not getattr(fp, "chunked", False)
              and not (raw.headers or {}).get("content-encoding"))
    read = read or raw.read
    n, got = len(mv), 0
    while got < n:
        piece = mv[got : min(n, got + READ_PIECE)]
        if direct:
            k = fp.readinto(piece)
        else:
            data = read(len(piece))
            k = len(data)
            piece[:k] = data
        if not k:
            return got, False
        got += k
        if progress is not None:
            progress(got)
    if direct:
        if not fp.isclosed():  # more than Content-Length said, or no length
            return got, False
        raw.release_conn()
        return got, True
    return got, not read(1)


def stream_range(where: str, start: int, mv: memoryview, length: int | None, total: int | None, raw,
                 progress: Callable[[int], None] | None, read: Callable[[int], bytes] | None = None) -> bool:
    """The body of a ranged GET of ``[start, start + len(mv))`` into ``mv``, checked (:func:`stream_into`).

    ``length`` and ``total`` are what the answer's headers say (its
    ``Content-Length``, and the object size in its ``Content-Range``; None
    where absent); they are checked before any byte is read. A range past
    the end, or a body longer than asked, raises :class:`RangeReplyError`;
    a body cut short :class:`TransientStorageError`. Returns True when the
    body was read to its end and its connection went back to the pool
    (otherwise the caller closes the response).
    """
    n = len(mv)
    end = start + n
    check_range_reply(where, start, end, n if length is None else int(length), total)
    got, at_end = stream_into(raw, mv, progress, read)
    if at_end:
        return True
    if got == n:
        raise RangeReplyError(f"{where}: range [{start}, {end}) returned more than {n} bytes")
    # The headers, checked above, did not say the object ends sooner (with no Content-Range either, as
    # after a connection cut inside them): a body cut short is a cut transfer, retried like one.
    raise TransientStorageError(f"{where}: short read of range [{start}, {end}): {got} bytes")
