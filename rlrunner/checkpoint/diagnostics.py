"""Describing a failed save in one line: the innermost error, and the free space where checkpoints go."""

from __future__ import annotations

import os
import shutil

from rlrunner.errors import describe
from rlrunner.storage import Storage, parent

_NEARLY_FULL_BYTES = 64 << 20
FULL_NOTE = ": the disk is probably full"


def free_space(storage: Storage, url: str) -> str:
    """How much room is left where checkpoints go: libraries do not always pass ENOSPC on as such."""
    if not storage.is_local:
        return f"free space of {storage.protocol}:// storage not measured"
    path = url
    while not os.path.exists(path) and parent(path) != path:  # the folder may not exist yet
        path = parent(path)
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return f"free space of {url} unknown"
    note = f"{human_bytes(free)} free on the disk holding {url}"
    return f"{note}{FULL_NOTE}" if free < _NEARLY_FULL_BYTES else note


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def root_cause(exc: BaseException) -> str:
    """The innermost error's one-line description, through Ray's and DCP's wrapping (first failing rank)."""
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        return f"rank {rank}: {root_cause(inner)}"
    cause = getattr(exc, "cause", None) or exc.__cause__
    if cause is not None and cause is not exc:
        return root_cause(cause)
    return describe(exc)
