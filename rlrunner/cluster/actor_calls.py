"""What a call on Ray actors can end in (the errors a worker group raises) and the quiet clean-ups of actors and
placement groups that may be gone already."""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import remove_placement_group


class CallTimeoutError(TimeoutError):
    """A call on a worker group did not finish within its time limit (a hung worker or collective)."""

    def __init__(self, message: str, group: str | None = None):
        super().__init__(message)
        self.group = group  # the one group that did not answer; None when a collective of two groups timed out


class CallAbandoned(Exception):
    """The caller gave up waiting (e.g. a stop was requested while a rollout was in flight)."""


class WorkerRaised(Exception):
    """A worker's own code raised (not a lost worker): names the group and rank; the worker's error is the cause."""


def kill_quietly(actor: Any) -> None:
    """`ray.kill` an actor that may be gone already."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already dead
        pass


def remove_placement_group_quietly(group) -> None:
    if group is None:
        return
    try:
        remove_placement_group(group)
    except Exception:  # already removed, or its cluster is gone
        pass


def drain(pending) -> None:
    """Read what other ranks already returned after one failed, so Ray does not log their errors as unhandled.
    Never waits: a failure must reach the caller at once."""
    pending = list(pending)
    if not pending:
        return
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except Exception:
            pass
