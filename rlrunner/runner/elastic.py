"""Elastic runs (`runner.recovery.elastic`): the sizes the groups may take, which one the cluster fits now, and when
a run that shrank grows back.

    sizes = ElasticSizes.of(cfg)                      # pure: the configured layout and the smaller ones allowed
    layout = choose_layout(sizes, fits, ...)          # before an attempt: the configured one, or after
                                                      # shrink_after_s the largest that fits (None: wait as before)
    bigger = sizes.grow_target(current, fits_extra)   # at a step boundary: a larger layout the cluster fits again

A layout is the actor group's rank count and the rollout group's worker count. The actor group shrinks by whole
tensor-parallel groups to data-parallel sizes that split every mini-batch as the configured size does: with
`actor.layout_invariant` the powers of two up to the configured size (the update is then the same, bit for bit); else
every size that divides the rows (the same math: the same global batch, optimizer and schedule; other rounding).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from rlrunner.backends.tree_sum import is_power_of_two

GROW_CHECK_S = 2.0  # how often, at most, a run below its configured sizes asks whether the cluster fits more


class GrowBack(Exception):
    """Raised by the step loop at a step boundary: the cluster fits `layout`, larger than the groups'; the supervisor
    replaces the groups with groups of that size, from the snapshot (or checkpoint) of `step`, no step lost."""

    def __init__(self, layout: "Layout", step: int):
        super().__init__(f"the cluster fits {layout.describe()} again after step {step}")
        self.layout, self.step = layout, step


@dataclass(frozen=True, order=True)
class Layout:
    actor_ranks: int
    rollout_workers: int

    def describe(self) -> str:
        return f"{self.actor_ranks} actor ranks, {self.rollout_workers} rollout workers"


def layout_invariant(cfg: Any, supported: bool) -> bool:
    """`actor.layout_invariant` resolved: null is on where the run may change its data-parallel size (elastic, more
    ranks than cluster.min_actor_ranks) and the backend `supported` it at a power-of-two size."""
    setting = cfg.actor.layout_invariant
    if setting is not None:
        return bool(setting)
    tp = cfg.actor.tensor_model_parallel_size
    dp = cfg.actor.num_workers // tp
    elastic = cfg.runner.recovery.elastic and cfg.actor.num_workers > min_actor_ranks(cfg)
    return bool(supported and elastic and is_power_of_two(dp))


def min_actor_ranks(cfg: Any) -> int:
    """The fewest actor ranks an elastic run trains on: cluster.min_actor_ranks, null meaning one tensor-parallel
    group."""
    minimum = cfg.cluster.min_actor_ranks
    return minimum if minimum is not None else cfg.actor.tensor_model_parallel_size


@dataclass(frozen=True)
class ElasticSizes:
    configured: Layout
    actor_sizes: tuple[int, ...]  # actor rank counts allowed, largest first (the configured one included)
    rollout_sizes: tuple[int, ...]  # rollout worker counts allowed, largest first

    @classmethod
    def of(cls, cfg: Any, rows_per_minibatch: int, invariant: bool) -> "ElasticSizes":
        """The configured layout and, with `runner.recovery.elastic`, the smaller ones down to cluster.min_*."""
        tp = cfg.actor.tensor_model_parallel_size
        configured = Layout(cfg.actor.num_workers, cfg.rollout.num_workers)
        if not cfg.runner.recovery.elastic:
            return cls(configured, (configured.actor_ranks,), (configured.rollout_workers,))
        min_actor = min_actor_ranks(cfg)
        micro = cfg.actor.micro_batch_size
        actor = []
        for dp in range(configured.actor_ranks // tp, 0, -1):
            if dp * tp < min_actor or rows_per_minibatch % dp:
                continue
            if invariant and not is_power_of_two(dp):
                continue
            if not invariant and micro is not None and (rows_per_minibatch // dp) % micro:
                continue
            actor.append(dp * tp)
        rollout = range(configured.rollout_workers, cfg.cluster.min_rollout_workers - 1, -1)
        return cls(configured, tuple(actor), tuple(rollout))

    def candidates(self) -> list[Layout]:
        """Every layout allowed, the actor group's size first (it decides the step's speed), largest first."""
        return [Layout(a, r) for a in self.actor_sizes for r in self.rollout_sizes]

    def grow_target(self, current: Layout, fits_extra: Callable[[Layout], bool]) -> Layout | None:
        """The largest layout above `current` (no group smaller) whose extra workers the cluster fits now, or None."""
        for layout in self.candidates():
            if layout == current or layout.actor_ranks < current.actor_ranks:
                continue
            if layout.rollout_workers < current.rollout_workers:
                continue
            if fits_extra(layout):
                return layout
        return None


def choose_layout(
    sizes: ElasticSizes,
    fits: Callable[[Layout], bool],
    shrink_after_s: float,
    abandon: Callable[[], bool],
    poll_s: float = 0.25,
) -> Layout | None:
    """The layout of the next attempt: the configured one as soon as the cluster fits it; after `shrink_after_s`
    without, the largest smaller one that fits; None when none does (the attempt then waits for the configured one,
    as a run that is not elastic does)."""
    started = time.monotonic()
    while True:
        if fits(sizes.configured):
            return sizes.configured
        if time.monotonic() - started >= shrink_after_s or abandon():
            break
        time.sleep(poll_s)
    for layout in sizes.candidates():
        if layout != sizes.configured and fits(layout):
            return layout
    return None
