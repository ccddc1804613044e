"""A lost actor rank replaced alone, inside the attempt: the other ranks keep their processes and the rollout group is
kept (`runner.recovery.replace_lost_ranks`).

`Trainer` (`trainer.py`) is an `ActorRepair`: these methods use its `ctx`, `cfg`, `actor_group`, `rollout_group`,
`pending_save`, `last_saved_step`, `spares_used`, `spares_due`, `start_timings`, `started`, `update_ahead`,
`restore_snapshot`, `sync_weights`, `_raise_if_stopping` and `_stop_requested`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import ray

from rlrunner.cluster.shared_storage import check_shared_folder
from rlrunner.cluster.worker_group import WorkerGroup
from rlrunner.runner.placement import START_TIMEOUT_S, spare_pools
from rlrunner.weight_sync.driver import connect_weight_sync

if TYPE_CHECKING:
    from rlrunner.runner.snapshots import Snapshot

logger = logging.getLogger(__name__)

# how long a surviving actor rank may take to leave its process group before it is taken for blocked and replaced too:
# a rank that takes the call leaves at once, unless its save in flight is still writing (it waits for that to stop);
# replaced, such a rank costs a process start, and no step
LEAVE_TIMEOUT_S = 10.0


class ActorRepair:
    def replace_actor_ranks(self, ranks: list[int], snapshot: Snapshot, placement_timeout_s: float) -> None:
        """Replace the lost actor `ranks` alone and go on from `snapshot` (of the last completed step, or one before):
        the other ranks leave their process group, the group is formed again with the replacements (warm spares when
        the pool has them), every rank is set up again and loads its part of the snapshot, and the rollout group,
        kept, joins new weight-sync channels and gets the weights. The save in flight (it had the lost ranks) is
        dropped, never committed."""
        self.started = False
        self.update_ahead = None  # asked of the ranks that go: the step is redone from the snapshot
        started = time.monotonic()
        recovery, group = self.cfg.runner.recovery, self.actor_group
        survivors = [rank for rank in range(group.num_workers) if rank not in ranks]
        ranks = sorted([*ranks, *self._survivors_leave(group, survivors)])
        self.pending_save = None
        self.ctx.handler.remove_leftovers()  # what the dropped save wrote
        self._raise_if_stopping()
        left = time.monotonic()
        pool = spare_pools(self.ctx)["actor"]
        spares = pool.take(len(ranks), placing=False) if group.workers_per_bundle == 1 else []
        self.spares_used = len(spares)
        group.replace_ranks(ranks, spares, placement_timeout_s, self._stop_requested)
        self.spares_due = True
        joined = time.monotonic()
        group.get(group.call_all_async("setup"), max(recovery.step_timeout_s, START_TIMEOUT_S), self._stop_requested)
        built = time.monotonic()
        check_shared_folder(self.ctx.storage, self.ctx.handler.root, [group])  # a replacement may be on a new node
        connect_weight_sync(group, self.rollout_group, timeout_s=recovery.step_timeout_s)
        self._raise_if_stopping()
        self.restore_snapshot(snapshot, self.last_saved_step)
        self.sync_weights()
        waited = group.placement_wait_s
        self.start_timings = {
            "wait_s": waited,
            "rebuild_s": built - started - waited,
            "load_s": time.monotonic() - built,
            "spares_used": self.spares_used,
            "replaced_ranks": list(ranks),
            # the rebuild's parts: survivors leaving, replacements up and the group formed, set-up
            "leave_s": left - started,
            "join_s": joined - left - waited,
            "setup_s": built - joined,
        }
        self.started = True

    def _survivors_leave(self, group: WorkerGroup, survivors: list[int]) -> list[int]:
        """Ask the surviving actor ranks to leave their process group; returns those that did not answer within
        LEAVE_TIMEOUT_S, to be replaced too. Such a rank is blocked in a collective whose peer left it: at data-parallel
        x tensor-parallel sizes a rank's tensor-parallel partner leaves the update when its data-parallel collective
        with the lost rank fails, and gloo does not free the rank waiting on the partner, whose process lives on, so
        the call to leave waits behind the update until the collective's own timeout. Replacing it (killing its
        process) frees the repair from that timeout; it loads its part of the snapshot like the lost rank."""
        refs = {rank: group.workers[rank].leave_process_group.remote() for rank in survivors}
        limit = min(LEAVE_TIMEOUT_S, self.cfg.runner.recovery.step_timeout_s)
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=limit)
        stuck = [rank for rank, ref in refs.items() if ref not in ready]
        group.get(
            [refs[rank] for rank in survivors if rank not in stuck], limit
        )  # raises what one that answered raised
        if stuck:
            logger.warning(
                "actor rank(s) %s did not leave their process group within %gs (blocked in a collective with a rank "
                "that left it): replacing them too",
                ", ".join(map(str, stuck)),
                limit,
            )
        return stuck
