"""Driver side of the weight sync: connect the channels once per pair of groups, then push weights after each update.

    connect_weight_sync(actor_group, rollout_group, timeout_s)   # after both groups are ready and set up
    sync_weights(actor_group, rollout_group, bucket_bytes)       # after each update (and after a restore)

The weights never pass through the driver or the object store: each actor rank broadcasts its own shards,
in the rollout dtype, to every rollout worker (rlrunner.weight_sync.transport). Both calls are collectives of
the two groups together; a rank that fails or dies is reported at once, whichever group it is in, and
every wait is bounded. After a failure the channels are broken: connect again (the runner's recovery
rebuilds both groups, and `Trainer.start` connects them).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import ray

from rlrunner.cluster.actor_calls import CallTimeoutError, drain
from rlrunner.cluster.worker_group import WorkerGroup

DEFAULT_BUCKET_BYTES = 64 << 20
_POLL_S = 0.2


def connect_weight_sync(actor_group: WorkerGroup, rollout_group: WorkerGroup, timeout_s: float) -> dict[str, Any]:
    """Build the channels (one per actor rank, each with every rollout worker); every later wait in them is bounded by
    `timeout_s`. Returns the backend of each channel: {"actor": [...], "rollout": [[...] per worker]}."""
    host, port = actor_group.call_rank(0, "weight_sync_address", timeout_s=timeout_s)
    shape = (host, port, actor_group.num_workers, rollout_group.num_workers, timeout_s)
    actors = actor_group.call_all_async("join_weight_sync", *shape)
    rollouts = rollout_group.call_all_async("join_weight_sync", *shape)
    # The joins' own waits are bounded by timeout_s; the margin lets a stuck peer's own error arrive first.
    actor_backends, rollout_backends = wait_both(actor_group, actors, rollout_group, rollouts, timeout_s + 30.0)
    return {"actor": actor_backends, "rollout": rollout_backends}


def sync_weights(
    actor_group: WorkerGroup,
    rollout_group: WorkerGroup,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout_s: float | None = None,
    keep: bool = False,
    kept: bool = False,
    then: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Push the actor's current weights into every rollout worker (`keep`: the actor ranks keep a copy of what they
    sent), or (`kept`) the copy kept at an earlier sync. `then` is called once the sync is asked for, before it is
    waited for (to queue the workers' next calls behind it). Waits at most `timeout_s` (default: the groups' call
    limits). Returns {"bytes": bytes into each rollout worker, "seconds": the slowest rollout worker's receive}."""
    sends = actor_group.call_all_async("send_weights", bucket_bytes, keep, kept)
    receives = rollout_group.call_all_async("receive_weights", bucket_bytes)
    if then is not None:
        then()
    _, received = wait_both(actor_group, sends, rollout_group, receives, timeout_s)
    return {"bytes": received[0]["bytes"], "seconds": max(r["seconds"] for r in received)}


def wait_both(
    first: WorkerGroup,
    first_refs: Sequence[ray.ObjectRef],
    second: WorkerGroup,
    second_refs: Sequence[ray.ObjectRef],
    timeout_s: float | None,
) -> tuple[list[Any], list[Any]]:
    """The results of two groups' calls that belong together (a collective spanning both groups).

    A failure in either group is raised as soon as it is known (through that group's `get`, which names the rank),
    not after the other group's ranks, stuck in the collective with it, give up. CallTimeoutError after `timeout_s`
    (None: the larger of the groups' call limits; both None: no limit).
    """
    limits = [t for t in (first.call_timeout_s, second.call_timeout_s) if t is not None]
    limit = timeout_s if timeout_s is not None else (max(limits) if limits else None)
    deadline = None if limit is None else time.monotonic() + limit
    calls = [(first, list(first_refs)), (second, list(second_refs))]
    results: list[list[Any] | None] = [None, None]
    pending = set(first_refs) | set(second_refs)
    while any(r is None for r in results):
        for i, (group, refs) in enumerate(calls):
            if results[i] is not None:
                continue
            done = [ref for ref in refs if ref not in pending]
            if len(done) == len(refs) or any(_failed(ref) for ref in done):
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    results[i] = group.get(refs, remaining)  # returns at once, or raises the failed rank's error
                except BaseException:
                    drain(pending)
                    raise
        if all(r is not None for r in results):
            break
        if deadline is not None and time.monotonic() >= deadline:
            drain(pending)
            raise CallTimeoutError(
                f"the {first.name} and {second.name} groups did not finish their weight sync within {limit:g}s"
            )
        wait_s = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
        _, still = ray.wait(list(pending), num_returns=len(pending), timeout=wait_s) if pending else ([], [])
        pending = set(still)
    return results[0], results[1]


def _failed(ref: ray.ObjectRef) -> bool:
    """Whether a finished call raised (its worker's error, or its worker died)."""
    try:
        ray.get(ref, timeout=0)
    except Exception:
        return True
    return False
