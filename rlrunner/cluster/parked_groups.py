"""Worker groups kept after a run ends, for the next run of the same driver process (`cluster.reuse_workers`).

    parked_groups.park(key, group)   # a finished run's group, its workers released (`Worker.release`)
    group = parked_groups.take(key)  # the next run's group of the same shape, or None
    parked_groups.evict()            # a placement that does not fit at once: the parked groups give way

A worker process spends seconds of CPU importing torch, transformers and its backend before it does anything; a
driver that runs one run after another (a sweep, a notebook, the test suite) saves that by building the next run's
workers in the processes of the last one. A group is kept whole, with its placement groups, and taken only by a group
of the same shape (class, size, resources, placement); it belongs to the Ray cluster it was made in, and is dropped
when the driver is connected to another one.
"""

from __future__ import annotations

from typing import Any, Hashable

import ray

# At most this many worker processes are kept, in whole groups (the oldest goes first): a sweep over shapes does not
# fill the memory with idle processes, each holding torch and a backend's imports (about 0.6 GB of host memory).
MAX_PARKED_WORKERS = 8

_parked: dict[Hashable, Any] = {}  # shape -> a parked WorkerGroup, oldest first
_cluster: str | None = None  # the Ray cluster the parked groups live in


def _current_cluster() -> str | None:
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    return f"{context.gcs_address}/{context.get_node_id()}"


def _forget_other_clusters() -> None:
    """Parked groups of a cluster this driver is no longer connected to went with it."""
    global _cluster
    current = _current_cluster()
    if current != _cluster:
        _parked.clear()
        _cluster = current


def park(key: Hashable, group: Any) -> None:
    """Keep `group` (its workers released) for a later group of the same `key`; one already parked there goes, and
    so do the oldest while more than `MAX_PARKED_WORKERS` workers are kept."""
    _forget_other_clusters()
    previous = _parked.pop(key, None)
    if previous is not None:
        previous.shutdown()
    _parked[key] = group
    while sum(len(parked.workers) for parked in _parked.values()) > MAX_PARKED_WORKERS:
        oldest = next(key for key, parked in _parked.items() if parked.workers)  # what holds no worker stays
        _parked.pop(oldest).shutdown()


def take(key: Hashable) -> Any | None:
    """The group parked under `key`, no longer parked; None when there is none, or when one of its workers died
    while parked (its node went, or it was killed: the group is shut down)."""
    _forget_other_clusters()
    group = _parked.pop(key, None)
    if group is not None and group.dead_ranks(timeout_s=10.0):
        group.shutdown()
        return None
    return group


def evict() -> int:
    """Shut every parked group down (their resources are needed); returns how many there were."""
    _forget_other_clusters()
    groups = list(_parked.values())
    _parked.clear()
    for group in groups:
        group.shutdown()
    return len(groups)
