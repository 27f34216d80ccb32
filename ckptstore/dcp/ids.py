"""DCP checkpoint ids: a repository URL, or the URL of one of its steps (``.../step-N``)."""

from __future__ import annotations

import os
import re

from ..format.layout import check_step as _check_step


def _is_url(checkpoint_id) -> bool:
    return isinstance(checkpoint_id, (str, os.PathLike))


_STEP_SEGMENT = re.compile(r"step-([0-9]{1,19})")


def split_checkpoint_id(checkpoint_id: str | os.PathLike) -> tuple[str, int | None]:
    """The repository URL and step a DCP ``checkpoint_id`` names.

    A URL or path whose last segment is ``step-N`` (``s3://bucket/run/step-1000``,
    ``/ckpt/run/step-1000``, as torchtitan and most trainers name their
    checkpoints) names step N of the repository at its parent
    (``s3://bucket/run``). Anything else names a repository, and the step
    comes from the writer's or reader's ``step`` argument.

    >>> split_checkpoint_id("s3://bucket/run/step-1000")
    ('s3://bucket/run', 1000)
    >>> split_checkpoint_id("s3://bucket/run")
    ('s3://bucket/run', None)
    """
    text = os.fspath(checkpoint_id)
    head, sep, last = text.rstrip("/").rpartition("/")
    m = _STEP_SEGMENT.fullmatch(last)
    if not sep or m is None or not head or head.endswith(":/"):
        return text, None
    return head, _check_step(int(m.group(1)))


def _pick_step(url: str, id_step: int | None, step: int | None, what: str) -> int | None:
    if id_step is not None and step is not None and id_step != step:
        raise ValueError(f"{what}: {url!r} names step {id_step} but step={step} was given")
    return id_step if id_step is not None else step
