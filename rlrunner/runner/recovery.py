"""Which failures the driver repairs in-job, and the record of each restart (`recovery.jsonl`)."""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any, Sequence

import ray

from rlrunner.cluster.actor_calls import CallTimeoutError, WorkerRaised
from rlrunner.cluster.ray_setup import cluster_lost
from rlrunner.errors import ClusterLostError, RewardFunctionError, WorkerError, describe, exception_chain, user_error
from rlrunner.runner.metrics import local_folder

RECOVERY_FILE = "recovery.jsonl"

# Messages of torch.distributed / gloo / NCCL when a peer of a collective is gone or stuck.
_COLLECTIVE_FAILURE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket timeout",
    "timed out",
    "nccl communicator was aborted",
    "connection refused",
)
_DIST_ERROR_NAMES = {"DistBackendError", "DistNetworkError", "DistStoreError", "DistError"}


def failure_cause(exc: BaseException) -> str | None:
    """A one-line cause when `exc` comes from a lost or hung worker (repairable), None otherwise (a bug, bad input,
    the reward function's own failure: a hung reward call is not a hung worker)."""
    if any(isinstance(err, RewardFunctionError) for err in exception_chain(exc)):
        return None
    for err in exception_chain(exc):
        if isinstance(err, ClusterLostError):
            return f"cluster lost: {err}"
        if isinstance(err, CallTimeoutError):
            return f"hang: {err}"
        if isinstance(err, ray.exceptions.GetTimeoutError):
            return "hang: a call did not finish within runner.recovery.step_timeout_s"
        if isinstance(err, ray.exceptions.RayActorError):
            return f"worker lost: {describe(err)}"
        if isinstance(err, (ray.exceptions.ObjectLostError, ray.exceptions.NodeDiedError)):
            return f"node lost: {describe(err)}"
    for err in exception_chain(exc):
        text = str(err).lower()
        if type(err).__name__ in _DIST_ERROR_NAMES or any(marker in text for marker in _COLLECTIVE_FAILURE_MARKERS):
            return f"collective failed (a peer is gone or stuck): {describe(err)}"
    return None


def repairable_cause(exc: BaseException, groups: Sequence[Any]) -> str | None:
    """Why `exc` is a lost or hung worker, node or cluster the run can repair, or None (a bug or bad input).

    A worker is lost only when Ray reports it dead, or a call passed its time bound; ranks of `groups` that are
    busy or stuck in a collective behind a peer that raised are alive. The dead workers are named: the error
    that arrives first often comes from a surviving peer whose collective broke.
    """
    cause = failure_cause(exc)
    lost = cluster_lost(force=True)
    if lost is not None:  # the root cause: every worker error that follows comes from it
        return f"cluster lost: {lost} (then {cause or describe(exc)})"
    dead = [f"{g.name} rank {r}" for g in groups for r in g.dead_ranks(timeout_s=1.0)]
    if cause is None and not dead:
        return None
    if cause is None:
        cause = f"worker lost after {describe(exc)}"
    return f"{cause} [dead: {', '.join(dead)}]" if dead else cause


def rollout_loss(exc: BaseException, actor_group: Any, rollout_group: Any) -> str | None:
    """Why `exc` is the loss or hang of rollout workers alone, which costs no step: the actor ranks are alive (their
    state intact) and the cluster is there, and either a rollout worker is dead or the rollout group alone did not
    answer in time. None for anything else (the whole run is then repaired, or ends)."""
    cause = failure_cause(exc)
    if cause is None or cause.startswith("cluster lost") or cluster_lost(force=True) is not None:
        return None
    if actor_group.dead_ranks(timeout_s=1.0):
        return None
    dead = [f"rollout rank {rank}" for rank in rollout_group.dead_ranks(timeout_s=1.0)]
    hung = any(isinstance(err, CallTimeoutError) and err.group == rollout_group.name for err in exception_chain(exc))
    if not dead and not hung:
        return None
    return f"{cause} [dead: {', '.join(dead)}]" if dead else cause


def ranks_to_replace(
    dead_actor_ranks: Sequence[int],
    rank_nodes: Sequence[str],
    alive_nodes: Sequence[str],
    dead_rollout_ranks: Sequence[int],
) -> list[int]:
    """The actor ranks a repair replaces alone (the other ranks and the rollout group kept): the dead ones, when no
    rollout worker is dead and every dead rank's node (`rank_nodes[rank]`) is alive, i.e. processes were lost, not
    nodes. [] when the whole attempt is to be replaced."""
    if not dead_actor_ranks or dead_rollout_ranks:
        return []
    if any(rank_nodes[rank] not in set(alive_nodes) for rank in dead_actor_ranks):
        return []
    return sorted(dead_actor_ranks)


def unrepairable(exc: BaseException) -> BaseException:
    """The error to end the run with: worker code that raised becomes a one-line WorkerError (not retried)."""
    raised = next((err for err in exception_chain(exc) if isinstance(err, WorkerRaised)), None)
    if raised is not None and user_error(exc) is None:
        return WorkerError(f"{raised} (an error in worker code: not retried)")
    return exc


class RecoveryLog:
    """Appends one JSON object per restart event to `<log_path>/recovery.jsonl` (kept across resumes)."""

    def __init__(self, log_path: str | os.PathLike):
        self.path = local_folder(log_path) / RECOVERY_FILE

    def write(self, event: str, **fields: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(json.dumps({"event": event, "time_unix": time.time(), **fields}) + "\n")


_VARYING = re.compile(r"0x[0-9a-f]+|[0-9a-f]{12,}|\d+", re.IGNORECASE)
_DEAD_LIST = re.compile(r"\s*\[dead: [^\]]*\]")  # which peers went down with the failing one varies


def same_failure(causes: list[str]) -> bool:
    """Whether the causes are one error repeated (at least twice): equal once the dead-worker list, pids, ids,
    ranks and other numbers are blanked."""
    return len(causes) >= 2 and len({_VARYING.sub("#", _DEAD_LIST.sub("", cause)) for cause in causes}) == 1


class RestartBudget:
    """`max_restarts` in-job restarts per stretch without progress.

    A restart after progress (the run moved on since the previous restart: a new checkpoint committed, or a step
    completed beyond any before) starts the count again, so a long run on preemptible nodes survives any number of
    spread-out failures, while a run that keeps failing before it gets any further gives up.
    """

    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts
        self.count = 0
        self.total = 0
        self.causes: list[str] = []  # the failures of the current stretch
        self._progress_at_last_restart: str | None = None

    def spend(self, progress: str | None, cause: str = "") -> bool:
        """Record a restart, given how far the run got (anything that changes when it moves on: the newest committed
        checkpoint, the furthest step); False when the budget is used up."""
        if self.count and progress is not None and progress != self._progress_at_last_restart:
            self.count = 0
            self.causes = []
        self._progress_at_last_restart = progress
        self.count += 1
        self.total += 1
        self.causes.append(cause)
        return self.count <= self.max_restarts
