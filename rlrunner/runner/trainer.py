"""One attempt at the run: the worker groups, the GRPO step loop, saves and the restore.

    trainer = Trainer(ctx)
    trainer.start(checkpoint, placement_timeout_s)  # groups up, storage checked, checkpoint restored, weights pushed
    trainer.train()                                 # steps up to the end, or until a stop request
    trainer.close()                                 # the groups go

Each step reads top to bottom: rollout -> reward (scored by the rollout workers) -> advantages -> policy update ->
weight sync, then the metrics line and, when the handler says so, a save. A lost or hung rollout worker costs no step:
the attempt rebuilds its rollout group alone, pushes the actor's current weights and redoes the generation or the weight
sync it interrupted (the same seeds give the same samples). For lost actor ranks the supervisor
(`rlrunner.runner.supervisor`) has the Trainer replace them alone (`replace_actor_ranks`) and train on; for any other
failure it makes a new Trainer, a new attempt from the newest snapshot or checkpoint.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from rlrunner.checkpoint.handler import PendingSave
from rlrunner.checkpoint.resume import Checkpoint
from rlrunner.cluster.shared_storage import check_shared_folder
from rlrunner.cluster.worker_group import CallAbandoned, WorkerGroup
from rlrunner.errors import ExperimentLockedError, RewardFunctionError, StoppedEarly, exception_chain
from rlrunner.runner.attempt_state import AttemptState
from rlrunner.runner.batching import (
    build_actor_batch,
    chunk,
    first_samples,
    generation_chunking,
    shard_actor_batch,
    split_evenly,
)
from rlrunner.runner.context import RunContext
from rlrunner.runner.driver_state import DriverState
from rlrunner.runner.metrics import Progress, actor_metrics, rollout_metrics, validation_metrics
from rlrunner.runner.placement import START_TIMEOUT_S, group_specs, spare_pools
from rlrunner.runner.recovery import rollout_loss
from rlrunner.runner.snapshots import Snapshot
from rlrunner.weight_sync.driver import DEFAULT_BUCKET_BYTES, connect_weight_sync, sync_weights

logger = logging.getLogger(__name__)


class Trainer(AttemptState):
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

    def replace_actor_ranks(self, ranks: list[int], snapshot: Snapshot, placement_timeout_s: float) -> None:
        """Replace the lost actor `ranks` alone and go on from `snapshot` (of the last completed step, or one before):
        the other ranks leave their process group, the group is formed again with the replacements (warm spares when
        the pool has them), every rank is set up again and loads its part of the snapshot, and the rollout group,
        kept, joins new weight-sync channels and gets the weights. The save in flight (it had the lost ranks) is
        dropped, never committed."""
        self.started = False
        started = time.monotonic()
        recovery, group = self.cfg.runner.recovery, self.actor_group
        survivors = [rank for rank in range(group.num_workers) if rank not in ranks]
        group.get([group.workers[rank].leave_process_group.remote() for rank in survivors], recovery.step_timeout_s)
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
        and are kept for the driver's next run with `cluster.reuse_workers` (`WorkerGroup.finish`)."""
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

    def sync_weights(self) -> None:
        """Every actor rank sends its own part of the weights, in the rollout's dtype, to every rollout worker, straight
        from worker to worker over collective channels: nothing passes through the driver or the object store."""
        sync_weights(self.actor_group, self.rollout_group, DEFAULT_BUCKET_BYTES)

    def sync_weights_in_step(self, step: int) -> None:
        """`sync_weights` after an update; lost rollout workers are replaced, and the repair pushes the weights."""
        try:
            self.sync_weights()
        except Exception as exc:
            try:
                self.repair_rollout(exc, step, "weight sync")
            except CallAbandoned:
                # Stopped during the repair. The update is done, so the step is complete: the loop stops after it and
                # the emergency checkpoint holds it (a resumed run pushes the weights at its start).
                pass

    def generate(self, step: int, prompts: list[dict[str, Any]], validation: bool = False) -> list[dict[str, Any]]:
        """Scored samples in prompt order; chunks of prompts are fixed here, so the result is the same for any worker
        count, and after a lost rollout worker is replaced the generation is redone with the same result. A stop
        request abandons a training generation in flight (CallAbandoned): nothing has changed yet. A validation
        (`validation`: the `rollout.val.*` sampling) is never abandoned: it belongs to a step whose update is done."""
        per_prompt, chunk_prompts = generation_chunking(self.cfg, validation)
        chunks = chunk(prompts, chunk_prompts)
        while True:
            assignment = split_evenly(chunks, self.rollout_group.num_workers)
            starts = first_samples(assignment, per_prompt)
            refs = self.rollout_group.call_each_async(
                "generate", [(step, part, first, validation) for part, first in zip(assignment, starts)]
            )
            try:
                results = self.rollout_group.get(refs, abandon=None if validation else self._stop_requested)
            except CallAbandoned:
                raise
            except Exception as exc:
                failed = [err for err in exception_chain(exc) if isinstance(err, RewardFunctionError)]
                if failed:  # the innermost: the worker's own error (the outer ones carry Ray's traceback)
                    raise RewardFunctionError(str(failed[-1])) from None
                self.repair_rollout(exc, step, "validation" if validation else "generation")
                continue
            return [sample for part in results for sample in part]

    def validate(self, step: int) -> dict[str, Any]:
        """The validation set generated with the current weights (those after `step`) and scored: `val/*` metrics."""
        started = time.perf_counter()
        samples = self.generate(step, self.ctx.val_dataset.items, validation=True)
        return {**validation_metrics(samples), "time/val_s": time.perf_counter() - started}

    def validation_due(self, step: int) -> bool:
        """Whether the weights after `step` are validated: every `runner.val_interval` steps and at the last step
        (step 0: before training, `runner.val_before_train`)."""
        runner = self.cfg.runner
        if self.ctx.val_dataset is None:
            return False
        if step == 0:
            return runner.val_before_train is not False
        return runner.val_interval > 0 and (step % runner.val_interval == 0 or step == self.ctx.total_steps)

    def repair_rollout(self, exc: Exception, step: int, phase: str) -> None:
        """Replace the rollout group after a loss or hang of rollout workers alone and push the actor's current weights
        into it: no checkpoint is loaded and the actor is not touched, so no step is lost. A repair that fails the same
        way is tried again. Raises the failure (the whole attempt is then repaired, or the run ends) for any other
        failure, or once `runner.recovery.max_restarts` rollout repairs came without a step completed in between;
        CallAbandoned after a stop request."""
        recovery = self.cfg.runner.recovery
        failed_at = time.time()
        while True:
            cause = rollout_loss(exc, self.actor_group, self.rollout_group) if recovery.enabled else None
            if cause is None or self.rollout_repairs >= recovery.max_restarts:
                raise exc
            if self.ctx.stop.requested:
                raise CallAbandoned(f"stopped during a rollout repair ({phase} of step {step})")
            self.rollout_repairs += 1
            started = time.monotonic()
            logger.error("step %d, %s: %s; replacing the rollout group alone (no step is lost)", step, phase, cause)
            self.rollout_group.shutdown()
            try:
                _, rollout = group_specs(self.ctx, recovery.wait_timeout_s, self._stop_requested)
                rollout["spares"] = spares = spare_pools(self.ctx)["rollout"].take(rollout["num_workers"])
                self.rollout_group = WorkerGroup(**rollout)
                self.spares_due = True
                self.rollout_group.wait_ready(self._stop_requested)
                replaced = time.monotonic()
                connect_weight_sync(self.actor_group, self.rollout_group, timeout_s=recovery.step_timeout_s)
                self.sync_weights()
            except CallAbandoned:
                raise
            except Exception as again:
                exc = again
                continue
            waited = self.rollout_group.placement_wait_s
            self.ctx.recovery_log.write(
                "rollout_repaired",
                cause=cause,
                step=step,
                phase=phase,
                lost_steps=0,
                repairs=self.rollout_repairs,
                spares_used=len(spares),
                failed_at_unix=failed_at,
                wait_s=waited,
                rebuild_s=replaced - started - waited,
                sync_s=time.monotonic() - replaced,
            )
            return

    def train_step(self, step: int) -> dict[str, Any]:
        cfg, ctx = self.cfg, self.ctx
        started = time.perf_counter()
        prompts = self.loader.next_batch()
        self.driver_state.step = step  # the data position is now the one after `step`
        epoch = self.loader.epoch

        samples = self.generate(step, prompts)
        rollout_done = time.perf_counter()

        rewards = torch.tensor([s["reward"] for s in samples], dtype=torch.float32)
        lengths = torch.tensor([len(s["response_ids"]) for s in samples], dtype=torch.long)
        advantages = ctx.advantages(rewards, cfg.algorithm.group_size, lengths, cfg.algorithm.norm_adv_by_std)
        batch = build_actor_batch(samples, advantages, ctx.token_ids.pad)
        shards = shard_actor_batch(batch, ctx.rank_map.dp, ctx.num_minibatches)
        per_rank = self.actor_group.call_each("update", [(shard,) for shard in ctx.rank_map.scatter(shards)])
        actor_stats = ctx.rank_map.collect(per_rank)
        update_done = time.perf_counter()
        if ctx.snapshots.due(step):
            # Queued before the weight sync's calls, so the ranks' copies are made before the step completes: a rank
            # lost after that costs no completed step. Their hand-over to the holders overlaps the next generation.
            ctx.snapshots.take(step, self.actor_group, self.driver_state_of(step))
        sync_started = time.perf_counter()  # the snapshot's submission ends here: the loop never waits for more of it

        self.sync_weights_in_step(step)  # on the actor ranks it waits for their snapshot copies
        sync_done = time.perf_counter()

        metrics = {
            "data/epoch": epoch,
            **rollout_metrics(samples, count_errors=cfg.reward.on_error == "zero"),
            **actor_metrics(actor_stats, ctx.objective),
            "time/rollout_s": rollout_done - started,
            "time/update_s": update_done - rollout_done,
            "time/weight_sync_s": sync_done - sync_started,
            "time/step_s": sync_done - started,
        }
        if ctx.snapshots.enabled:
            metrics["time/snapshot_s"] = sync_started - update_done
        return metrics

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
            while failed is None and self.global_step < ctx.total_steps and not ctx.stop.requested:
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
                if self.restart_to_report is not None:
                    ctx.recovery_log.write("first_step", restart=self.restart_to_report, step=step)
                    self.restart_to_report = None
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

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """The actor's full weights (HF key names), gathered from the ranks."""
        return self.actor_group.call_all("full_state_dict")[0]
