"""Worker groups built the way a run builds them, for benchmarks that drive the workers themselves.

The group arguments come from `rlrunner.runner.placement.group_specs` on the run's `RunContext`, and the groups are
started as `Trainer._start_groups` starts them (both side by side, the actor's `setup` overlapping the rollout
workers' start), without the weight-sync connection (a benchmark times that itself). Checkpoint managers come from
the run's training backend, as `RunContext.checkpoint_manager` makes them, with the background flag and storage
options a measurement asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Groups:
    """The run context of a config, its actor group (set up: model built and sharded, optimizer made) and, when asked
    for, its rollout group."""

    ctx: Any  # rlrunner.runner.context.RunContext
    actor: Any  # WorkerGroup of the backend's actor workers
    rollout: Any = None  # WorkerGroup of RolloutWorker, or None

    @property
    def cfg(self):
        return self.ctx.cfg

    def manager(self, background: bool = False, storage_options: dict[str, Any] | None = None):
        """The training backend's checkpoint manager for the actor group (an ActorCheckpointManager): the run's
        I/O time bound (runner.recovery.checkpoint_timeout_s), `background` as runner.async_save."""
        ctx = self.ctx
        return ctx.backend.checkpoint_manager(
            self.actor, ctx.rank_map, ctx.cfg.runner.recovery.checkpoint_timeout_s, background, storage_options
        )

    def shutdown(self) -> None:
        for group in (self.rollout, self.actor):
            if group is not None:
                group.shutdown()
        self.actor = self.rollout = None


def start_groups(cfg, rollout: bool = False) -> Groups:
    """The groups of `cfg` on the Ray this process started: the actor group set up, and with `rollout` the rollout
    group too."""
    from rlrunner.cluster.worker_group import WorkerGroup
    from rlrunner.runner.context import RunContext
    from rlrunner.runner.placement import START_TIMEOUT_S, group_specs

    ctx = RunContext(cfg)
    actor_spec, rollout_spec = group_specs(ctx, cfg.cluster.placement_timeout_s, abandon=lambda: False)
    groups = Groups(ctx, WorkerGroup(**actor_spec))
    try:
        if rollout:
            groups.rollout = WorkerGroup(**rollout_spec)
        groups.actor.wait_ready()
        setup = groups.actor.call_all_async("setup")
        if groups.rollout is not None:
            groups.rollout.wait_ready()
        groups.actor.get(setup, max(cfg.runner.recovery.step_timeout_s, START_TIMEOUT_S))
    except BaseException:
        groups.shutdown()
        raise
    return groups


def update_shards(ctx) -> list[dict[str, torch.Tensor]]:
    """One step's actor batch, built and sharded like Trainer.train_step does (synthetic samples): one shard per
    actor rank (`RankMap.scatter`: the tensor-parallel ranks of a data-parallel rank get the same rows)."""
    from rlrunner.algorithms.grpo import group_advantages
    from rlrunner.runner.batching import build_actor_batch, shard_actor_batch

    cfg, tokenizer = ctx.cfg, ctx.tokenizer
    group_size = cfg.algorithm.group_size
    samples, rewards = [], []
    for i in range(cfg.data.batch_size * group_size):
        a, b = i % 5, (3 * i) % 5
        answer = str(a + b) if i % 2 == 0 else str(a + b + 1)
        response = tokenizer.encode(answer) + [ctx.token_ids.eos[0]]
        samples.append(
            {
                "prompt_ids": tokenizer.encode(f"What is {a}+{b}? Answer: "),
                "response_ids": response,
                "logprobs": [-1.0] * len(response),  # the rollout's log-probs: only a metric reads them
            }
        )
        rewards.append(1.0 if i % 2 == 0 else 0.0)
    advantages = group_advantages(torch.tensor(rewards), group_size, cfg.algorithm.norm_adv_by_std)
    batch = build_actor_batch(samples, advantages, ctx.token_ids.pad)
    return ctx.rank_map.scatter(shard_actor_batch(batch, ctx.rank_map.dp, 1))


def _optimizer_state_tensors(worker) -> int:
    """Runs in an actor: how many tensors AdamW holds in its state (0 before the first step)."""
    optimizer = getattr(worker.optimizer, "optimizer", worker.optimizer)  # DistributedAdamW wraps a torch AdamW
    return sum(torch.is_tensor(v) for state in optimizer.state.values() for v in state.values())


def create_optimizer_state(groups: Groups) -> dict[str, float]:
    """One real GRPO update, so AdamW's exp_avg / exp_avg_sq exist; returns rank 0's stats."""
    actor = groups.actor
    stats = actor.call_each("update", [(shard,) for shard in update_shards(groups.ctx)])
    tensors = actor.get([w.__ray_call__.remote(_optimizer_state_tensors) for w in actor.workers])
    if stats[0]["skipped_steps"] or min(tensors) == 0:
        raise RuntimeError(f"the update did not create optimizer state (stats {stats[0]}, state tensors {tensors})")
    return {**stats[0], "optimizer_state_tensors_per_rank": float(tensors[0])}
