"""The run's call ledger (`rlrunner.agents.ledger`): a Ray actor on the driver's node, kept across attempts, where the
rollout workers of a multi-turn run record every tool result and environment answer, and look them up before calling.

    records = ToolRecords(journal_path, keep=resume_dir is not None, settle_timeout_s=tool_timeout_s + 5)
    records.start(step)            # an attempt starts after `step` (the actor made on first use, its journal read)
    records.handle                 # what `RolloutWorker.generate` gets
    records.settle(rollout_group)  # the group is going: no new calls from it; those under way finish and are recorded
    records.committed(step)        # a checkpoint of `step` is committed: earlier records never recur
    for event in records.events(): ...   # calls made again, records that no longer matched: for recovery.jsonl

Its journal is `tool_calls.jsonl` in the experiment's log folder: a relaunched driver with `runner.resume_dir` set reads
it back; a fresh start begins it anew.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlrunner.agents.ledger import CallLedger
from rlrunner.cluster.ray_setup import cluster_lost
from rlrunner.errors import describe

logger = logging.getLogger(__name__)

JOURNAL_FILE = "tool_calls.jsonl"
_ASK_TIMEOUT_S = 30.0


class ToolRecords:
    def __init__(self, journal: str, keep: bool, settle_timeout_s: float):
        self.journal, self.keep, self.settle_timeout_s = journal, keep, settle_timeout_s
        self.actor: Any = None

    def start(self, after_step: int) -> None:
        """An attempt starts after `after_step`: the ledger is made (its journal read) unless it is up, and the records
        of steps up to `after_step` go."""
        if self.actor is None:
            self.actor = (
                ray.remote(CallLedger)
                .options(
                    num_cpus=0,
                    max_restarts=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), False),
                )
                .remote(self.journal, self.keep, after_step)
            )
            self.keep = True  # a ledger made again in this run (the embedded Ray restarted) reads what this one wrote
        ray.get(self.actor.drop_through.remote(after_step), timeout=_ASK_TIMEOUT_S)

    @property
    def handle(self) -> Any:
        return self.actor

    def settle(self, group: Any) -> None:
        """`group`'s rollout workers may begin no more calls, and those under way on its live workers are waited for
        (each ends by `rollout.multi_turn.tool_timeout_s`, recorded): so that replacing the group makes no call twice.
        A dead worker's call under way is lost with it: the trajectory's next generation makes it again."""
        if self.actor is None or group is None or cluster_lost() is not None:
            return  # with the cluster gone, every call would block on it; the workers went with it
        try:
            owners = [worker._actor_id.hex() for worker in group.workers]
            dead = set(group.dead_ranks(timeout_s=1.0))
            alive = [owner for rank, owner in enumerate(owners) if rank not in dead]
            ray.get(self.actor.retire.remote(owners), timeout=_ASK_TIMEOUT_S)
            deadline = time.monotonic() + self.settle_timeout_s
            while ray.get(self.actor.in_progress.remote(alive), timeout=_ASK_TIMEOUT_S):
                if time.monotonic() > deadline:
                    logger.warning("tool calls still under way after %gs: they are made again", self.settle_timeout_s)
                    return
                time.sleep(0.02)
        except Exception as exc:  # the ledger or the cluster is gone: nothing left to wait for
            logger.warning("could not wait for the tool calls under way (%s)", describe(exc))

    def committed(self, step: int) -> None:
        if self.actor is not None:
            self.actor.drop_through.remote(step)

    def events(self) -> list[dict[str, Any]]:
        if self.actor is None:
            return []
        return ray.get(self.actor.take_events.remote(), timeout=_ASK_TIMEOUT_S)

    def forget(self) -> None:
        """The ledger went with the embedded Ray: the next attempt makes it again from the journal."""
        self.actor = None

    def close(self) -> None:
        actor, self.actor = self.actor, None
        if actor is not None:
            try:
                ray.get(actor.close.remote(), timeout=_ASK_TIMEOUT_S)
                ray.kill(actor, no_restart=True)
            except Exception:  # gone already
                pass
