"""When an elastic run below its configured sizes grows back: after a step whose state is kept, the cluster asked (at
most every GROW_CHECK_S) whether it places a larger layout's extra workers beside the groups.

    watch = GrowWatch(ctx)
    layout = watch.layout_after(step)   # a larger layout, or None; the same answer for the same step
"""

from __future__ import annotations

import time

from rlrunner.runner.context import RunContext
from rlrunner.runner.elastic import GROW_CHECK_S, Layout
from rlrunner.runner.placement import cluster_fits


class GrowWatch:
    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self._checked = (0, time.monotonic())  # (step, when) the cluster was last asked
        self._answer: tuple[int, Layout | None] = (0, None)  # (step, the larger layout it fits after that step)

    def layout_after(self, step: int) -> Layout | None:
        """A layout larger than the groups' that the cluster places now, or None. Asked only below the configured
        sizes, at most every GROW_CHECK_S, and only at a step whose snapshot or checkpoint is due, so that replacing the
        groups after it redoes no step. The step loop asks before it starts the next update ahead and after the step."""
        ctx = self.ctx
        if self._answer[0] == step:
            return self._answer[1]
        found = None
        checked_step, checked_at = self._checked
        kept = ctx.snapshots.due(step) or ctx.handler.should_save(step, ctx.total_steps)
        due = checked_step != step and time.monotonic() - checked_at >= GROW_CHECK_S
        if ctx.layout != ctx.sizes.configured and kept and due:
            self._checked = (step, time.monotonic())
            found = ctx.sizes.grow_target(ctx.layout, lambda layout: cluster_fits(ctx, layout, beside=ctx.layout))
        self._answer = (step, found)
        return found
