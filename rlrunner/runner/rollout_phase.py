"""The rollout side of an attempt: generations started and collected on the rollout workers, validation, the weight
sync into them, and the rollout group's repair. A lost or hung rollout worker costs no step: the rollout group alone is
replaced, the weights the lost generation was started with are pushed into it (the actor's current ones, or with a
policy lag the copy the actor ranks kept of the last sync's) and the generation is started again (the same seeds give
the same samples).

`Trainer` (`trainer.py`) is a `RolloutPhase`: these methods use its `ctx`, `cfg`, `actor_group`, `rollout_group`,
`rollout_repairs`, `spares_due`, `generations_ahead`, `generations_kept`, `tool_events_due` and `_stop_requested`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from rlrunner.cluster.actor_calls import CallAbandoned
from rlrunner.cluster.worker_group import WorkerGroup
from rlrunner.errors import RewardFunctionError, exception_chain
from rlrunner.runner.batching import chunk, first_samples, generation_chunking, split_evenly
from rlrunner.runner.metrics import validation_metrics
from rlrunner.runner.placement import group_specs, spare_pools
from rlrunner.runner.recovery import rollout_loss
from rlrunner.weight_sync.driver import DEFAULT_BUCKET_BYTES, connect_weight_sync, sync_weights

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """A generation started on the rollout workers (`Trainer.launch_generation`): enough to start it again."""

    step: int
    prompts: list[dict[str, Any]]
    validation: bool
    refs: list[Any]
    group: WorkerGroup  # the rollout group it runs on
    during: int | None = None  # a generation ahead: the step whose update it runs beside

    def same_as(self, step: int, prompts: list[dict[str, Any]], group: WorkerGroup, during: int) -> bool:
        """Whether it is the generation ahead that step `during` would start now: the same rollout group (so the same
        weights, those after step `during` - 1, pushed again unchanged after an actor rank's repair), step and
        prompts."""
        if self.validation or (self.step, self.during, self.group) != (step, during, group):
            return False
        return [p["index"] for p in self.prompts] == [p["index"] for p in prompts]


class RolloutPhase:
    def generation_ahead(self, step: int, prompts: list[dict[str, Any]], during: int) -> Generation:
        """Start generating step `step`'s batch beside step `during`'s update, or keep the one already running: an
        actor rank lost in that update is replaced alone and the step redone, while the rollout workers, unaffected,
        went on generating with the same weights."""
        for running in self.generations_ahead:
            if running.same_as(step, prompts, self.rollout_group, during):
                self.generations_kept += 1
                return running
        return self.launch_generation(step, prompts, during=during)

    def sync_weights(self, kept: bool = False, then: Callable[[], None] | None = None) -> None:
        """Every actor rank sends its own part of the weights, in the rollout's dtype, to every rollout worker, straight
        from worker to worker over collective channels: nothing passes through the driver or the object store. With a
        policy lag the ranks keep a copy of what they sent, which `kept` sends again: the weights a generation ahead
        was started with, for a rollout group replaced after the update changed the live ones."""
        keep = self.cfg.algorithm.policy_lag > 0 and not kept
        sync_weights(self.actor_group, self.rollout_group, DEFAULT_BUCKET_BYTES, keep=keep, kept=kept, then=then)

    def sync_weights_in_step(self, step: int, then: Callable[[], None] | None = None) -> None:
        """`sync_weights` after an update (`then` is called once it is asked for); lost rollout workers are replaced,
        and the repair pushes the weights: with a policy lag the copy this sync kept, as the next step's update may
        already be running behind it (`Trainer._may_update_ahead`)."""
        try:
            self.sync_weights(then=then)
        except Exception as exc:
            try:
                self.repair_rollout(exc, step, "weight sync", kept_weights=self.cfg.algorithm.policy_lag > 0)
            except CallAbandoned:
                # Stopped during the repair. The update is done, so the step is complete: the loop stops after it and
                # the emergency checkpoint holds it (a resumed run pushes the weights at its start).
                pass

    def generate(self, step: int, prompts: list[dict[str, Any]], validation: bool = False) -> list[dict[str, Any]]:
        """Scored samples in prompt order; chunks of prompts are fixed here, so the result is the same for any worker
        count, and after a lost rollout worker is replaced the generation is redone with the same result. A stop
        request abandons a training generation in flight (CallAbandoned): nothing has changed yet. A validation
        (`validation`: the `rollout.val.*` sampling) is never abandoned: it belongs to a step whose update is done."""
        return self.collect_generations([self.launch_generation(step, prompts, validation)])[0]

    def launch_generation(
        self, step: int, prompts: list[dict[str, Any]], validation: bool = False, during: int | None = None
    ) -> Generation:
        """Start generating step `step`'s samples of `prompts` on the rollout workers (collected by
        `collect_generations`); `during`: beside that step's update."""
        per_prompt, chunk_prompts = generation_chunking(self.cfg, validation)
        assignment = split_evenly(chunk(prompts, chunk_prompts), self.rollout_group.num_workers)
        starts = first_samples(assignment, per_prompt)
        records = self.ctx.tool_records
        ledger = () if records is None else (records.handle,)  # a multi-turn run's: where tool calls are recorded
        refs = self.rollout_group.call_each_async(
            "generate", [(step, part, first, validation, *ledger) for part, first in zip(assignment, starts)]
        )
        return Generation(step, prompts, validation, refs, self.rollout_group, during)

    def collect_generations(self, generations: list[Generation], ahead: bool = False) -> list[list[dict[str, Any]]]:
        """The scored samples of each generation, in order. A lost or hung rollout worker is repaired and the
        generations not yet collected are started again on the new group. `ahead`: they were started before the
        update that has since changed the actor's weights, so the repair pushes the copy the actor ranks kept of the
        weights they were started with, and a stop request does not abandon them (the step's update is done)."""
        results: list[list[dict[str, Any]]] = []
        pending = list(generations)
        while pending:
            generation = pending[0]
            abandon = None if generation.validation or ahead else self._stop_requested
            try:
                parts = self.rollout_group.get(generation.refs, abandon=abandon)
            except CallAbandoned:
                raise
            except Exception as exc:
                failed = [err for err in exception_chain(exc) if isinstance(err, RewardFunctionError)]
                if failed:  # the innermost: the worker's own error (the outer ones carry Ray's traceback)
                    raise RewardFunctionError(str(failed[-1])) from None
                phase = "validation" if generation.validation else "generation ahead" if ahead else "generation"
                # A generation ahead belongs to a step whose update is done: its repair goes on through a stop request
                # (abandoned, the step would be undone while the actor's weights keep its update)
                self.repair_rollout(exc, generation.step, phase, kept_weights=ahead, stoppable=not ahead)
                pending = [self.launch_generation(g.step, g.prompts, g.validation, g.during) for g in pending]
                continue
            results.append([sample for part in parts for sample in part])
            pending.pop(0)
        return results

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

    def repair_rollout(
        self, exc: Exception, step: int, phase: str, kept_weights: bool = False, stoppable: bool = True
    ) -> None:
        """Replace the rollout group after a loss or hang of rollout workers alone and push the actor's current weights
        into it (`kept_weights`: the copy of the last sync's, `sync_weights`): no checkpoint is loaded and the actor is
        not touched, so no step is lost. A repair that fails the same
        way is tried again. Raises the failure (the whole attempt is then repaired, or the run ends) for any other
        failure, or once `runner.recovery.max_restarts` rollout repairs came without a step completed in between;
        CallAbandoned after a stop request (`stoppable`: else the repair goes on to its end)."""
        recovery = self.cfg.runner.recovery
        failed_at = time.time()
        stop_requested = self._stop_requested if stoppable else lambda: False
        while True:
            cause = rollout_loss(exc, self.actor_group, self.rollout_group) if recovery.enabled else None
            if cause is None or self.rollout_repairs >= recovery.max_restarts:
                raise exc
            if stop_requested():
                raise CallAbandoned(f"stopped during a rollout repair ({phase} of step {step})")
            self.rollout_repairs += 1
            started = time.monotonic()
            logger.error("step %d, %s: %s; replacing the rollout group alone (no step is lost)", step, phase, cause)
            if self.ctx.tool_records is not None:  # its live workers' tool calls under way finish and are recorded
                self.ctx.tool_records.settle(self.rollout_group)
                self.tool_events_due = True
            self.rollout_group.shutdown()
            try:
                _, rollout = group_specs(self.ctx, recovery.wait_timeout_s, stop_requested)
                rollout["spares"] = spares = spare_pools(self.ctx)["rollout"].take(rollout["num_workers"])
                self.rollout_group = WorkerGroup(**rollout)
                self.spares_due = True
                self.rollout_group.wait_ready(stop_requested)
                replaced = time.monotonic()
                connect_weight_sync(self.actor_group, self.rollout_group, timeout_s=recovery.step_timeout_s)
                self.sync_weights(kept=kept_weights)
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
