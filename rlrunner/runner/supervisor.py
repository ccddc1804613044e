"""The supervisor: holds the experiment lock and makes attempts at the run until it ends.

    Supervisor(cfg).run(connect)

Each attempt is a fresh `Trainer`: its groups start, the checkpoint (if any) is restored, and it trains. When a
worker, a node, a collective or the embedded Ray fails, the failure is classified (`rlrunner.runner.recovery`).
Lost actor rank processes (their nodes up, the rest alive, a complete in-memory snapshot at hand) are replaced alone
and the same Trainer goes on from the snapshot (`Trainer.replace_actor_ranks`); any other lost or hung worker is
repaired by a new attempt from the newest complete snapshot, else checkpoint. Both count as restarts, up to
`runner.recovery.max_restarts` in a row without progress in between; an exception in worker code, a bad input or a
lost joined cluster ends the run with its exit code. A stop request (SIGTERM,
SIGINT, `runner.max_wall_time_s`) ends the loop with an emergency checkpoint.

Callbacks see each attempt once it is ready to train (`on_train_start`) and once it has trained to the end,
before its groups go (`on_train_end`): e.g. to evaluate or export the policy, or to look inside in a test.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from omegaconf import DictConfig

from rlrunner.cluster.actor_calls import CallAbandoned
from rlrunner.cluster.ray_setup import alive_nodes, cluster_lost, is_embedded, restart_embedded
from rlrunner.errors import ClusterLostError, RecoveryExhaustedError, RewardFunctionError, StoppedEarly, describe
from rlrunner.runner.context import RunContext
from rlrunner.runner.elastic import GrowBack, Layout, choose_layout
from rlrunner.runner.placement import cluster_fits
from rlrunner.runner.recovery import RestartBudget, ranks_to_replace, repairable_cause, same_failure, unrepairable
from rlrunner.runner.snapshots import Snapshot
from rlrunner.runner.stopping import StopRequest
from rlrunner.runner.trainer import Trainer
from rlrunner.storage import basename

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30.0  # how long workers may take to close (engines, channels) at the end of a run


class Callback(Protocol):
    def on_train_start(self, trainer: Trainer) -> None:
        """The attempt's groups are up, its checkpoint restored and the weights pushed; no step of it has run."""

    def on_train_end(self, trainer: Trainer) -> None:
        """The attempt trained to the end (the last save committed); its groups are still up."""


class Supervisor:
    def __init__(self, cfg: DictConfig, stop: StopRequest | None = None, callbacks: Sequence[Callback] = ()):
        self.ctx = RunContext(cfg, stop)
        self.cfg = cfg
        self.stop = self.ctx.stop
        self.callbacks = list(callbacks)
        self.trainer: Trainer | None = None  # the current attempt (the last one once `run` returns)
        self.furthest_step = 0  # the furthest step any attempt completed
        self._resumed_logged = 0  # the restart whose attempt was last logged as resumed (a grow-back is none)
        self._layout_wait_s = 0.0  # how long the next attempt waited for the cluster before its groups were placed

    def run(self, connect: Callable[[], None] | None = None) -> dict[str, Any]:
        """Train to the end, repairing the worker groups in-job after worker, node or collective failures; returns
        the last step's metrics.

        `connect` (start or join Ray) is called once the lock is held and the checkpoint is chosen, so that a
        bad `runner.resume_dir` or a locked experiment is reported before Ray's start-up, not after it.
        """
        with self.ctx.lock:
            self.ctx.logs.restore()  # once per driver: an in-job restart must not drop log lines not yet uploaded
            status = "failed"
            try:
                last = self._attempts(connect)
                status = "finished"
                return last
            except StoppedEarly:
                status = "stopped"
                raise
            finally:
                if self.ctx.metrics is not None:
                    self.ctx.metrics.close(status)
                self.ctx.snapshots.close()
                if self.ctx.tool_records is not None:
                    self.ctx.tool_records.close()
                self.ctx.close_spares()
                self.ctx.logs.upload()

    def _attempts(self, connect: Callable[[], None] | None) -> dict[str, Any]:
        ctx, recovery = self.ctx, self.cfg.runner.recovery
        handler = ctx.handler
        handler.remove_leftovers()
        resume_dir = self.cfg.runner.resume_dir
        initial = handler.find_resume(resume_dir)
        branched = initial is not None and resume_dir != "auto" and bool(handler.start_branch(initial))
        # the trackers' runs go on when the run does (resumed, or relaunched with auto); a fresh start or a new
        # branch starts new ones
        ctx.open_metrics(continue_runs=resume_dir is not None and not branched)
        if connect is not None:
            connect()
        checkpoint, placement_timeout_s = initial, self.cfg.cluster.placement_timeout_s
        budget = RestartBudget(recovery.max_restarts)
        snapshot = None
        trainer: Trainer | None = None
        replace: list[int] = []  # the lost actor ranks the next attempt replaces alone, keeping the rest of `trainer`
        layout_event: dict[str, Any] | None = None  # the groups' sizes changed: logged at the next first step
        while True:
            if not replace:
                trainer = self.trainer = Trainer(ctx)
                trainer.layout_event, layout_event = layout_event, None
            error: Exception | None = None
            grown: GrowBack | None = None
            graceful = False  # the attempt ended as it should (finished or stopped): its workers may close first
            try:
                if replace:
                    last = self._attempt(
                        trainer,
                        budget,
                        snapshot,
                        lambda: trainer.replace_actor_ranks(replace, snapshot, recovery.wait_timeout_s),
                    )
                else:
                    last = self._attempt(
                        trainer, budget, snapshot, lambda: trainer.start(checkpoint, placement_timeout_s, snapshot)
                    )
                graceful = True
                return last
            except (StoppedEarly, RewardFunctionError):  # ended on purpose: the user's function failed, no worker did
                graceful = True
                raise
            except GrowBack as exc:  # the cluster fits larger groups again: replaced after a step, none lost
                grown = error = exc
            except CallAbandoned:  # stopped while the workers were starting: nothing new to save
                raise StoppedEarly(
                    f"{self.stop.reason} while starting the workers; {self._newest_checkpoint_note()}; "
                    "resume with runner.resume_dir=auto"
                ) from None
            except Exception as exc:
                failure = self._repairable_failure(exc, trainer, budget)  # or raises the error that ends the run
                error = exc
            finally:
                if error is None:
                    trainer.close(CLOSE_TIMEOUT_S if graceful else 0.0)
            if grown is not None:
                trainer.close()
                checkpoint = handler.find_resume("auto") or initial
                snapshot = self._snapshot_for(grown.layout, checkpoint, trainer.global_step)
                layout_event = self._layout_event("grow", "the cluster fits larger groups again", grown.layout)
                layout_event.update(
                    lost_steps=trainer.global_step - (snapshot or checkpoint).step,
                    restore_from="snapshot" if snapshot else "checkpoint",
                )
                logger.info("growing back to %s after step %d", grown.layout.describe(), trainer.global_step)
                ctx.use_layout(grown.layout)
                placement_timeout_s, replace = recovery.wait_timeout_s, []
                continue
            replace, snapshot = self._lost_ranks_to_replace(trainer)
            teardown_s = 0.0
            if not replace:
                teardown_started = time.monotonic()
                trainer.close()
                teardown_s = time.monotonic() - teardown_started
                lost_cluster = cluster_lost(force=True)
                if lost_cluster is not None:  # the embedded Ray lost its node: nobody else will bring it back
                    logger.error("%s: restarting the embedded Ray", lost_cluster)
                    restart_embedded()
                    ctx.snapshots.forget()  # the holders and spares went with it
                    if ctx.tool_records is not None:
                        ctx.tool_records.forget()
                    ctx.close_spares(lost=True)
                    if connect is not None:
                        connect()  # signal handlers again (ray.init installs its own)
                handler.remove_leftovers()
                checkpoint = handler.find_resume("auto") or initial
                # the newest in-memory snapshot of a completed step, unless the newest checkpoint is newer
                snapshot = self._snapshot_for(ctx.layout, checkpoint, trainer.global_step)
            restart_step = snapshot.step if snapshot else checkpoint.step if checkpoint else 0
            failure.update(
                lost_steps=failure["step"] - restart_step,
                restore_from="snapshot" if snapshot else "checkpoint" if checkpoint else "none",
                replaced="actor ranks " + ",".join(map(str, replace)) if replace else "both groups",
            )
            logger.error(
                "restart %d (%d of %d without progress): %s, from the %s of step %d, %d completed steps to redo",
                budget.total,
                budget.count,
                recovery.max_restarts,
                f"replacing actor rank(s) {', '.join(map(str, replace))} alone" if replace else "replacing both groups",
                "in-memory snapshot" if snapshot else "checkpoint",
                restart_step,
                failure["lost_steps"],
            )
            detected = failure.pop("detected_monotonic")
            ctx.recovery_log.write("failure", restart=budget.total, **failure, teardown_s=teardown_s)
            if not replace:  # the groups' sizes: the configured ones, or (elastic) those the cluster fits
                waited_from = time.monotonic()
                layout = self._next_layout()
                self._layout_wait_s = time.monotonic() - waited_from
                if layout != ctx.layout:
                    snapshot = self._snapshot_for(layout, checkpoint, trainer.global_step)
                    layout_event = self._layout_event(
                        "grow" if layout > ctx.layout else "shrink", failure["cause"], layout
                    )
                    restart_step = snapshot.step if snapshot else checkpoint.step if checkpoint else 0
                    layout_event.update(
                        lost_steps=failure["step"] - restart_step,
                        restore_from="snapshot" if snapshot else "checkpoint" if checkpoint else "none",
                        since_monotonic=detected,  # its time to the next step counts from the failure's detection
                    )
                    ctx.use_layout(layout)
            placement_timeout_s = recovery.wait_timeout_s

    def _lost_ranks_to_replace(self, trainer: Trainer) -> tuple[list[int], Snapshot | None]:
        """After a repairable failure: the lost actor ranks to replace alone (`runner.recovery.replace_lost_ranks`) and
        the snapshot to go on from, when the attempt had started, its other workers are alive, the dead ranks' nodes
        are up and a complete snapshot at least as new as the newest checkpoint holds the last completed step or one
        before; ([], None) when both groups are to be replaced."""
        ctx = self.ctx
        if not (self.cfg.runner.recovery.replace_lost_ranks and trainer.started and ctx.snapshots.enabled):
            return [], None
        if cluster_lost(force=True) is not None:
            return [], None
        actor, rollout = trainer.actor_group, trainer.rollout_group
        try:
            ranks = ranks_to_replace(
                actor.dead_ranks(timeout_s=1.0),
                [host["node_id"] for host in actor.hosts],
                alive_nodes(),
                rollout.dead_ranks(timeout_s=1.0),
            )
        except Exception as exc:  # the cluster answered no more: replace everything
            logger.warning("could not tell which workers are lost (%s): replacing both groups", describe(exc))
            return [], None
        if not ranks:
            return [], None
        snapshot = ctx.snapshots.newest(min_step=trainer.last_saved_step or 0, max_step=trainer.global_step)
        if snapshot is None or snapshot.world_size != ctx.layout.actor_ranks:
            return [], None
        return ranks, snapshot

    def _snapshot_for(self, layout: Layout, checkpoint: Any, last_step: int) -> Snapshot | None:
        """The newest complete in-memory snapshot up to `last_step` and newer than `checkpoint`, if groups of `layout`
        can load it (a backend that does not reshard snapshots loads the checkpoint at another size)."""
        ctx = self.ctx
        snapshot = ctx.snapshots.newest(min_step=checkpoint.step if checkpoint else 0, max_step=last_step)
        if snapshot is not None and snapshot.world_size != layout.actor_ranks and not ctx.backend.reshards_snapshots:
            return None
        return snapshot

    def _next_layout(self) -> Layout:
        """The sizes of the next attempt's groups: the configured ones once the cluster fits them; an elastic run not
        fitting them within runner.recovery.shrink_after_s trains on with the largest that fit; with none (below the
        minimums) it waits for the configured ones, as one that is not elastic does."""
        ctx = self.ctx
        if len(ctx.sizes.candidates()) == 1:
            return ctx.sizes.configured
        chosen = choose_layout(
            ctx.sizes,
            lambda layout: cluster_fits(ctx, layout),
            self.cfg.runner.recovery.shrink_after_s,
            lambda: self.stop.requested,
        )
        if chosen is None:
            logger.warning(
                "the cluster fits no groups down to cluster.min_actor_ranks / min_rollout_workers: waiting for %s",
                ctx.sizes.configured.describe(),
            )
        return chosen or ctx.sizes.configured

    def _layout_event(self, kind: str, cause: str, layout: Layout) -> dict[str, Any]:
        """recovery.jsonl's record of a shrink or grow (its step and time to it added at the next completed step)."""
        old = self.ctx.layout
        return {
            "event": kind,
            "cause": cause,
            "old_actor_ranks": old.actor_ranks,
            "new_actor_ranks": layout.actor_ranks,
            "old_rollout_workers": old.rollout_workers,
            "new_rollout_workers": layout.rollout_workers,
            "since_monotonic": time.monotonic(),
        }

    def _attempt(
        self, trainer: Trainer, budget: RestartBudget, snapshot: Snapshot | None, start: Callable[[], None]
    ) -> dict[str, Any]:
        """One attempt: `start` (the groups up and the state restored: the in-memory `snapshot` if any, else a
        checkpoint), then train to the end; the last step's metrics."""
        start()
        if budget.total > self._resumed_logged:
            self._resumed_logged = budget.total
            timings = dict(trainer.start_timings)
            timings["wait_s"] = timings.get("wait_s", 0.0) + self._layout_wait_s  # before the groups, and theirs
            self.ctx.recovery_log.write(
                "resumed",
                restart=budget.total,
                step=trainer.global_step,
                source="snapshot" if snapshot else "checkpoint" if trainer.global_step else "none",
                **timings,
            )
            trainer.restart_to_report = budget.total
        self._layout_wait_s = 0.0
        for callback in self.callbacks:
            callback.on_train_start(trainer)
        last = trainer.train()
        for callback in self.callbacks:
            callback.on_train_end(trainer)
        return last

    def _repairable_failure(self, exc: Exception, trainer: Trainer, budget: RestartBudget) -> dict[str, Any]:
        """The record of a failure the next attempt repairs, or the error that ends the run, raised."""
        failed_at = time.time()
        recovery = self.cfg.runner.recovery
        cause = repairable_cause(exc, trainer.groups())
        if cause is None:
            error = unrepairable(exc)
            if error is exc:
                raise exc
            raise error from exc
        lost_cluster = cluster_lost(force=True)
        if lost_cluster is not None and not is_embedded():
            raise ClusterLostError(f"{lost_cluster}; the driver exits so that it can be relaunched") from exc
        if not recovery.enabled:
            raise exc
        if self.stop.requested:  # no restart once a stop was asked for: the newest checkpoint stands
            raise StoppedEarly(
                f"{self.stop.reason}, then a failure ({cause}); {self._newest_checkpoint_note()}; "
                "resume with runner.resume_dir=auto"
            ) from exc
        newest = self.ctx.handler.newest_complete()
        self.furthest_step = max(self.furthest_step, trainer.global_step)
        # progress: a new checkpoint committed, or (restored from memory) a step completed beyond any before
        if not budget.spend(f"{newest}@{self.furthest_step}", cause):
            same = same_failure(budget.causes)
            raise RecoveryExhaustedError(
                f"giving up after {recovery.max_restarts} in-job restarts without progress in between "
                f"(runner.recovery.max_restarts); last failure{' (the same each time)' if same else ''}: {cause}",
                same_error=same,
            ) from exc
        logger.error("step %d: %s", trainer.global_step + 1, cause)
        return {
            "cause": cause,
            "step": trainer.global_step,
            "failed_at_unix": failed_at,
            "detected_monotonic": time.monotonic(),
        }

    def _newest_checkpoint_note(self) -> str:
        newest = self.ctx.handler.newest_complete()
        return f"the newest checkpoint is {basename(newest)}" if newest else "there is no checkpoint yet"
