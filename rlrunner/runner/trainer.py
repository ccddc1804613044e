"""One attempt at the run: the worker groups, the GRPO step loop, saves and the restore.

    trainer = Trainer(ctx)
    trainer.start(checkpoint, placement_timeout_s)  # groups up, storage checked, checkpoint restored, weights pushed
    trainer.train()                                 # steps up to the end, or until a stop request
    trainer.close()                                 # the groups go

Each step reads top to bottom: rollout -> reward (scored by the rollout workers) -> advantages -> policy update ->
weight sync, then the metrics line and, when the handler says so, a save. With `algorithm.policy_lag` k >= 1 the step's
batch was generated during an earlier step, and the generation of step + k runs beside the update (`in_flight.py`). A
lost or hung rollout worker costs no step (`rollout_phase.py`: the rollout side of the attempt). For lost actor ranks
the supervisor (`rlrunner.runner.supervisor`) has the Trainer replace them alone (`replace_actor_ranks`) and train on;
for any other failure it makes a new Trainer, a new attempt from the newest snapshot or checkpoint.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from rlrunner.agents.metrics import model_tokens
from rlrunner.checkpoint.handler import PendingSave
from rlrunner.checkpoint.resume import Checkpoint
from rlrunner.cluster.actor_calls import CallAbandoned
from rlrunner.cluster.shared_storage import check_shared_folder
from rlrunner.cluster.worker_group import WorkerGroup
from rlrunner.errors import ExperimentLockedError, RewardFunctionError, StoppedEarly
from rlrunner.runner.actor_repair import ActorRepair
from rlrunner.runner.attempt_state import AttemptState
from rlrunner.runner.batching import build_actor_batch, shard_actor_batch
from rlrunner.runner.context import RunContext
from rlrunner.runner.driver_state import DriverState
from rlrunner.runner.elastic import GrowBack
from rlrunner.runner.grow_watch import GrowWatch
from rlrunner.runner.in_flight import GeneratedBatch, SubmittedUpdate, steps_ahead
from rlrunner.runner.metrics import Progress, actor_metrics, rollout_metrics
from rlrunner.runner.placement import START_TIMEOUT_S, group_specs, spare_pools
from rlrunner.runner.rollout_phase import Generation, RolloutPhase
from rlrunner.runner.snapshots import Snapshot
from rlrunner.weight_sync.driver import connect_weight_sync

logger = logging.getLogger(__name__)


class Trainer(AttemptState, RolloutPhase, ActorRepair):
    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.loader = ctx.new_loader()
        self.driver_state = DriverState(self.loader, ctx.total_steps)  # the driver's part of a checkpoint or snapshot
        self.global_step = 0
        self.last_saved_step: int | None = None  # the newest committed checkpoint's step
        self.pending_save: PendingSave | None = None  # a save whose files are still being written
        self.actor_group: WorkerGroup | None = None
        self.rollout_group: WorkerGroup | None = None
        self.start_timings: dict[str, float] = {}
        self.restart_to_report: int | None = None  # a restart whose first completed step is still to be logged
        self.rollout_repairs = 0  # rollout groups rebuilt since the last completed step
        self.spares_used = 0  # warm spares the attempt's groups took
        self.spares_due = False  # spares to start once the next step has completed
        self.started = False  # both groups up, the state restored and the weights pushed (`start` returned)
        self.reward_failure: RewardFunctionError | None = None  # the reward function failed on a batch generated ahead
        self.generations_ahead: list[Generation] = []  # started beside the update in flight, not yet collected
        self.generations_kept = 0  # generations ahead kept running through an actor rank's repair
        self.update_ahead: SubmittedUpdate | None = None  # the next step's update, asked for behind this step's sync
        self.tool_events_due = False  # generations may have been redone: the call ledger's events to log
        self.layout_event: dict[str, Any] | None = None  # a shrink or grow to log with the attempt's first step
        self.grow_watch = GrowWatch(ctx)  # below the configured sizes: when the groups grow back

    # -- the attempt's groups --------------------------------------------------------------------

    def start(
        self, checkpoint: Checkpoint | None, placement_timeout_s: float, snapshot: Snapshot | None = None
    ) -> None:
        """Groups up, storage checked, `snapshot` restored (an in-memory snapshot newer than `checkpoint`), else
        `checkpoint` (if any), the actor's weights pushed to the rollout group."""
        started = time.monotonic()
        self._start_groups(placement_timeout_s)
        built = time.monotonic()
        check_shared_folder(self.ctx.storage, self.ctx.handler.root, self.groups())
        if snapshot is not None:
            self._raise_if_stopping()
            self.restore_snapshot(snapshot, checkpoint.step if checkpoint is not None else None)
        elif checkpoint is not None:
            self._raise_if_stopping()
            self.restore(checkpoint)
        if self.ctx.tool_records is not None:
            self.ctx.tool_records.start(self.global_step)
            self.tool_events_due = True
        self._raise_if_stopping()
        self.sync_weights()
        waited = sum(g.placement_wait_s for g in self.groups())
        self.start_timings = {
            "wait_s": waited,
            "rebuild_s": built - started - waited,
            "load_s": time.monotonic() - built,
            "spares_used": self.spares_used,
        }
        self.started = True

    def _start_groups(self, placement_timeout_s: float) -> None:
        self.ctx.snapshots.prepare()  # the snapshot holders start beside the groups
        actor, rollout = group_specs(self.ctx, placement_timeout_s, self._stop_requested)
        pools = spare_pools(self.ctx)
        actor["spares"] = pools["actor"].take(actor["num_workers"], multiple_of=actor["workers_per_bundle"])
        rollout["spares"] = pools["rollout"].take(rollout["num_workers"])
        self.spares_used = len(actor["spares"]) + len(rollout["spares"])
        self.actor_group = WorkerGroup(**actor)
        self.rollout_group = WorkerGroup(**rollout)
        # Placed: the spares start off the groups' nodes, after the attempt's first step (their process starts would
        # otherwise compete with it for the CPUs)
        self.spares_due = True
        self.actor_group.wait_ready(self._stop_requested)
        # Building and sharding the model is start-up work (bounded like it), overlapping the rollout workers' start.
        setup = self.actor_group.call_all_async("setup")
        self.rollout_group.wait_ready(self._stop_requested)
        step_timeout_s = self.cfg.runner.recovery.step_timeout_s
        self.actor_group.get(setup, max(step_timeout_s, START_TIMEOUT_S), self._stop_requested)
        # The direct channels from the actor ranks to every rollout worker (rebuilt with the groups on every attempt).
        connect_weight_sync(self.actor_group, self.rollout_group, timeout_s=step_timeout_s)

    def refill_spares(self) -> None:
        """Start the spares used (or not yet started) in the background, off the nodes of the groups they cover."""
        self.spares_due = False
        pools = spare_pools(self.ctx)
        for group in self.groups():
            pools[group.name].refill(group.placement_nodes())

    def groups(self) -> list[WorkerGroup]:
        return [g for g in (self.actor_group, self.rollout_group) if g is not None]

    def close(self, close_timeout_s: float = 0.0) -> None:
        """The groups go: on a graceful end (`close_timeout_s` > 0) their workers close first, waiting at most that,
        and are kept for the driver's next run with `cluster.reuse_workers` (`WorkerGroup.finish`). A multi-turn run's
        tool calls under way finish first, recorded (a stop in the middle of a generation repeats none of them)."""
        if self.ctx.tool_records is not None:
            self.ctx.tool_records.settle(self.rollout_group)
        for group in self.groups():
            if close_timeout_s > 0:
                group.finish(close_timeout_s)
            else:
                group.shutdown()
        self.actor_group = self.rollout_group = None

    def _stop_requested(self) -> bool:
        return self.ctx.stop.requested

    def _raise_if_stopping(self) -> None:
        if self.ctx.stop.requested:
            raise CallAbandoned("stopped while starting the workers")

    def _raise_if_lock_lost(self, before: str) -> None:
        """A run whose experiment lease lapsed or was taken over must not write on: another run owns the folder."""
        lost = self.ctx.lock.lost()
        if lost is not None:
            raise ExperimentLockedError(f"stopping before {before}: the experiment lock was lost ({lost})")

    # -- one step ------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, Any]:
        """One step. With `algorithm.policy_lag` k >= 1 its batch was generated during an earlier step (`in_flight.py`)
        and the batches up to step + k are generated while this step's update runs, with the weights before it."""
        cfg, ctx = self.cfg, self.ctx
        started = time.perf_counter()
        in_flight = self.driver_state.in_flight
        batch = in_flight.pop(step)
        if batch is None:  # nothing generated ahead (lag 0, the run's first step, a switch from lag 0)
            batch = GeneratedBatch(step, step - 1, self.generate(step, self.loader.next_batch()))
        epoch = self.loader.epoch
        ahead_steps = steps_ahead(step, in_flight.last_step(step), cfg.algorithm.policy_lag, ctx.total_steps)
        position = self.loader.state_dict() if ahead_steps else None  # before the prompts drawn for the steps ahead
        ahead = [self.generation_ahead(s, self.loader.next_batch(), during=step) for s in ahead_steps]
        self.generations_ahead = ahead  # still running if the update fails: a redo of this step may keep them
        self.driver_state.step = step  # the data position is now the one after the last batch drawn
        samples = batch.samples
        rollout_done = time.perf_counter()

        update, self.update_ahead = self.update_ahead, None
        if update is None:
            update = self.submit_update(step, samples)
        elif update.step != step:  # the actor ranks' state is past this step: nothing may go on from it
            raise RuntimeError(f"step {step} found step {update.step}'s update asked for ahead of it")
        snapshot_due = ctx.snapshots.due(step)
        if snapshot_due:  # queued behind the update: the ranks stream their parts while the sync runs
            ctx.snapshots.take(step, self.actor_group)
        try:
            per_rank = self.actor_group.get(update.refs)
        except BaseException:
            ctx.snapshots.abandon()
            raise
        actor_stats = ctx.rank_map.collect(per_rank)
        update_done = time.perf_counter()
        try:
            generated = self.collect_generations(ahead, ahead=True)
        except RewardFunctionError as exc:
            # This step's update is done: it completes, and the run ends after it, its prompts ahead not drawn.
            self.loader.load_state_dict(position)
            generated, self.reward_failure = [], exc
        self.generations_ahead = []
        for generation, samples_ahead in zip(ahead, generated):
            in_flight.push(GeneratedBatch(generation.step, step - 1, samples_ahead))
        sync_started = time.perf_counter()

        self.sync_weights_in_step(step, then=lambda: self._after_sync_asked(step, snapshot_due))
        sync_done = time.perf_counter()
        if snapshot_due:  # the step completes once every rank's part is held
            ctx.snapshots.finish(self.actor_group, self.driver_state_of(step), cfg.runner.recovery.step_timeout_s)
        snapshot_done = time.perf_counter()

        metrics = {
            "data/epoch": epoch,
            **rollout_metrics(samples, count_errors=cfg.reward.on_error == "zero"),
            **actor_metrics(actor_stats, ctx.objective),
            "actor/micro_batches": update.micro_batches,
            "actor/dp_size": ctx.rank_map.dp,  # the step's layout (an elastic run's changes)
            "rollout/num_workers": self.rollout_group.num_workers,
            "time/rollout_s": rollout_done - started,
            "time/update_s": update_done - rollout_done,
            "time/weight_sync_s": sync_done - sync_started,
            "time/step_s": snapshot_done - started,
        }
        if cfg.algorithm.policy_lag > 0 or batch.lag > 0:
            metrics["rollout/policy_lag"] = batch.lag  # the samples' weights: those after step - 1 - lag
            metrics["time/generation_wait_s"] = sync_started - update_done  # the generation ahead outlasting the update
        if ctx.snapshots.enabled:
            metrics["time/snapshot_s"] = snapshot_done - sync_done  # the streams outlasting the sync
        return metrics

    def submit_update(self, step: int, samples: list[dict[str, Any]]) -> SubmittedUpdate:
        """Ask the actor ranks for step `step`'s update on `samples` (advantages, the batch, each rank's shard)."""
        cfg, ctx = self.cfg, self.ctx
        rewards = torch.tensor([s["reward"] for s in samples], dtype=torch.float32)
        lengths = torch.tensor([model_tokens(s) for s in samples], dtype=torch.long)  # the tokens the model sampled
        advantages = ctx.advantages(rewards, cfg.algorithm.group_size, lengths, cfg.algorithm.norm_adv_by_std)
        actor_batch = build_actor_batch(samples, advantages, ctx.token_ids.pad)
        shards = shard_actor_batch(
            actor_batch,
            ctx.rank_map.dp,
            ctx.num_minibatches,
            cfg.actor.micro_batch_size,
            cfg.actor.micro_batch_tokens,
            ctx.invariant_min_count,
        )
        refs = self.actor_group.call_each_async("update", [(shard,) for shard in ctx.rank_map.scatter(shards)])
        return SubmittedUpdate(step, refs, len(shards[0]["micro_batches"]))

    def _after_sync_asked(self, step: int, snapshot_due: bool) -> None:
        """What `sync_weights_in_step` calls once the sync is asked for, queued behind it: the snapshot's finish, then
        (`_may_update_ahead`) the next step's update."""
        if snapshot_due:
            timeout_s = self.cfg.runner.recovery.step_timeout_s
            self.ctx.snapshots.ask_finish(self.actor_group, self.driver_state_of(step), timeout_s)
        following = self.driver_state.in_flight.peek(step + 1)
        if following is not None and self._may_update_ahead(step):
            self.update_ahead = self.submit_update(step + 1, following.samples)

    def _may_update_ahead(self, step: int) -> bool:
        """Whether step + 1's update (its batch generated ahead) may start behind step `step`'s sync, before `step`
        completes: the actor ranks then go from one update to the next without waiting for the driver. Only where
        nothing after `step` reads or saves the actor's state of `step` (a save, a save still being committed) or may
        end the run at `step` (its last step, a stop request, a reward function that failed, a validation that may).
        Once asked for, step + 1 is run even if a stop request comes: like an update in progress today."""
        ctx = self.ctx
        return not (
            step >= ctx.total_steps
            or self.grow_watch.layout_after(step) is not None  # the groups are replaced after this step
            or ctx.stop.requested
            or self.reward_failure is not None
            or self.pending_save is not None
            or ctx.handler.should_save(step, ctx.total_steps)
            or self.validation_due(step)
        )

    # -- the loop ------------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Run the steps up to the end; returns the last step's metrics. StoppedEarly after a stop request;
        RewardFunctionError, after the emergency checkpoint, when the reward function failed."""
        cfg, ctx = self.cfg.runner, self.ctx
        logger.info(
            "run %s: steps %d..%d, logs in %s", cfg.experiment_name, self.global_step + 1, ctx.total_steps, ctx.log_path
        )
        logger.info(ctx.handler.describe_schedule())
        if self.global_step >= ctx.total_steps:
            logger.info("nothing to do: the resumed checkpoint is at step %d of %d", self.global_step, ctx.total_steps)
        metrics_log = ctx.metrics
        metrics_log.begin(self.global_step)
        progress = Progress(ctx.total_steps, self.global_step, cfg.logger.progress_bar)
        last: dict[str, Any] = {}
        failed: RewardFunctionError | None = None  # the reward function failed: the run ends after its emergency save
        try:
            if self.global_step == 0 and self.validation_due(0) and not ctx.stop.requested:
                try:
                    metrics_log.log(0, self.validate(0))  # the initial policy's score, logged at step 0
                except RewardFunctionError as exc:
                    failed = exc
            while (
                failed is None
                and self.global_step < ctx.total_steps
                and (not ctx.stop.requested or self.update_ahead is not None)  # an update asked for is run
            ):
                step = self.global_step + 1
                committed_before = self.last_saved_step
                self._raise_if_lock_lost(f"step {step}")
                before = self.driver_state.state_dict()
                try:
                    last = self.train_step(step)
                except (CallAbandoned, RewardFunctionError) as exc:
                    self.driver_state.load_state_dict(before)  # the abandoned step never happened
                    failed = exc if isinstance(exc, RewardFunctionError) else None
                    break
                failed, self.reward_failure = self.reward_failure, None  # scoring a batch ahead failed
                if self.validation_due(step):
                    try:  # inside the step: a failure before it is logged redoes the step, validation included
                        last.update(self.validate(step))
                    except RewardFunctionError as exc:
                        failed = exc  # the step itself is complete (updated and synced): it is logged and saved
                self.global_step = step
                self.rollout_repairs = 0
                if self.spares_due:
                    self.refill_spares()
                try:
                    save_started = time.perf_counter()
                    committed = self.commit_pending_save(wait=False)  # a background save that finished writing
                    saving = ctx.handler.should_save(step, ctx.total_steps)
                    if saving:
                        self.save_checkpoint(step)
                    if saving or committed:
                        last["time/save_s"] = time.perf_counter() - save_started  # what the loop was blocked for
                finally:  # the step happened even if its save failed: log it
                    metrics_log.log(step, last)
                    progress.update(step, last)
                if self.last_saved_step != committed_before:
                    ctx.logs.upload()  # the logs on the store reach at least the newest checkpoint
                    if ctx.tool_records is not None:  # no attempt redoes a step up to it: its tool records go
                        ctx.tool_records.committed(self.last_saved_step)
                if self.tool_events_due:
                    self._log_tool_events(step)
                if self.restart_to_report is not None:
                    ctx.recovery_log.write("first_step", restart=self.restart_to_report, step=step)
                    self.restart_to_report = None
                self._after_step_layout(step)
        finally:
            progress.close()
            metrics_log.end_attempt()
            ctx.logs.upload()
        self.commit_pending_save(wait=True)  # the last step's save, or the one in flight when a stop came
        if failed is not None:
            raise RewardFunctionError(
                f"{failed}; {self.emergency_save()}; fix the reward function (or set "
                "reward.on_error=zero) and resume with runner.resume_dir=auto"
            )
        if self.global_step < ctx.total_steps:  # the loop ended on a stop request
            raise StoppedEarly(
                f"{self.ctx.stop.reason} at step {self.global_step}; {self.emergency_save()}; "
                "resume with runner.resume_dir=auto"
            )
        return last

    def _after_step_layout(self, step: int) -> None:
        """The shrink or grow that made this attempt's groups, logged at its first step; then, below the configured
        sizes, GrowBack when the cluster fits larger groups after this step (its state kept, nothing in flight)."""
        ctx = self.ctx
        if self.layout_event is not None:
            event, self.layout_event = self.layout_event, None
            since = event.pop("since_monotonic")
            ctx.recovery_log.write(event.pop("event"), step=step, time_to_step_s=time.monotonic() - since, **event)
        grow = self.grow_watch.layout_after(step)
        if grow is None or step >= ctx.total_steps or ctx.stop.requested:
            return
        if self.pending_save is not None and self.pending_save.step == step:
            self.commit_pending_save(wait=True)
        if ctx.snapshots.complete_step == step or self.last_saved_step == step:
            self.commit_pending_save(wait=True)  # nothing in flight when the groups go
            raise GrowBack(grow, step)

    def _log_tool_events(self, step: int) -> None:
        """The call ledger's events since the generations were redone (calls made again, records that no longer
        matched) into recovery.jsonl."""
        self.tool_events_due = False
        for event in self.ctx.tool_records.events():
            mode, key_step, position, turn, call = event["key"]
            kind = event.pop("event")
            self.ctx.recovery_log.write(
                kind,
                step=step,
                mode=mode,
                key_step=key_step,
                position=position,
                turn=turn,
                call=call,
                **{k: v for k, v in event.items() if k != "key"},
            )

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """The actor's full weights (HF key names), gathered from the ranks."""
        return self.actor_group.call_all("full_state_dict")[0]
