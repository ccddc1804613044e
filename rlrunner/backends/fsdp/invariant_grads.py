"""The FSDP backend's layout-invariant gradients (`actor.layout_invariant`): the same bits at any data-parallel size.

FSDP2 reduce-scatters each pass's gradients across the ranks and adds the result to the sharded gradient, so the sum
of a mini-batch's micro-batch gradients is taken in an order that depends on how many ranks ran them. Here, for every
FSDP unit, the reduce-scatter is replaced (FSDP2's `set_custom_reduce_scatter`) by an all-to-all that gives each
rank, for its shard of the parameters, every rank's gradient of the pass unreduced, and the reduction is done by the
unit's all-reduce hook (`set_all_reduce_hook`, called with the reduce-scatter's output, on one rank too): each source
rank's micro-batches are added as a subtree of the perfect binary tree over the mini-batch's logical micro-batches
(`rlrunner.backends.tree_sum`), and after the last pass the subtrees are added in the tree's order and written as the
output. Every earlier pass outputs zeros, so the sharded gradient FSDP accumulates is the tree's sum exactly.

The gradient norm is taken the same way whatever the sharding (`grad_norm`): each row's sum of squares in float64, all
rows gathered, then summed in one fixed order on every rank.

What it costs: the all-to-all moves as many bytes as the reduce-scatter; each rank holds, for its shard, one buffer per
source rank and tree level (at most the shard x log2 of the micro-batches per rank, x the ranks) until the last pass.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist

from rlrunner.backends.fsdp.weights import shard_rows
from rlrunner.backends.rank_parts import local_shard
from rlrunner.backends.tree_sum import TreeSum, tree_combine


class _UnitReduction:
    """One FSDP unit's reduction within an optimizer step: the pieces of the pass in progress and a tree per source
    rank."""

    def __init__(self) -> None:
        self.received: torch.Tensor | None = None  # [source ranks, shard elements] of the pass in progress
        self.trees: list[TreeSum] | None = None
        self.passes_left = 0

    def begin(self, passes: int) -> None:
        self.received, self.trees, self.passes_left = None, None, passes

    def __call__(self, reduce_output: torch.Tensor) -> None:
        """The all-reduce hook: add this pass's pieces to the trees; after the last, write their sum."""
        if self.passes_left <= 0:
            raise RuntimeError("a layout-invariant reduction ran more passes than its optimizer step has")
        pieces = self.received if self.received is not None else reduce_output.detach().clone().view(1, -1)
        self.received = None
        if self.trees is None:
            self.trees = [TreeSum() for _ in range(pieces.shape[0])]
        for tree, piece in zip(self.trees, pieces):
            tree.push(piece)
        self.passes_left -= 1
        if self.passes_left:
            reduce_output.zero_()
            return
        reduce_output.copy_(tree_combine([tree.total() for tree in self.trees]))
        self.trees = None


def _reduce_scatter_class() -> type:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class AllToAll(ReduceScatter):
        """In place of the reduce-scatter: every rank's piece for this rank's shard, kept unreduced."""

        def __init__(self, unit: _UnitReduction):
            self.unit = unit

        def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):  # noqa: ARG002
            received = torch.empty_like(input_tensor)
            dist.all_to_all_single(received, input_tensor, group=group)
            self.unit.received = received.view(group.size(), -1)
            return None

    return AllToAll


def supports_layout_invariance() -> bool:
    """Whether this torch's FSDP2 takes a custom reduce-scatter and an all-reduce hook (torch 2.8 and later)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return hasattr(FSDPModule, "set_custom_reduce_scatter") and hasattr(FSDPModule, "set_all_reduce_hook")


class LayoutInvariantGrads:
    """Installed on a sharded model: its units' reductions, begun before each optimizer step's passes."""

    def __init__(self, model: torch.nn.Module):
        from torch.distributed.fsdp import FSDPModule

        all_to_all = _reduce_scatter_class()
        self.units: list[_UnitReduction] = []
        for module in model.modules():
            if isinstance(module, FSDPModule):
                unit = _UnitReduction()
                module.set_custom_reduce_scatter(all_to_all(unit))
                module.set_all_reduce_hook(unit)
                self.units.append(unit)

    def begin(self, passes: int) -> None:
        """Before an optimizer step's `passes` forward/backward passes."""
        for unit in self.units:
            unit.begin(passes)


def grad_norm(params: Sequence[torch.nn.Parameter], group: Any = None) -> float:
    """The L2 norm of the parameters' gradients (DTensors sharded by rows, FSDP2's way), the same bits whatever the
    number of shards: every row's sum of squares in float64, gathered from every rank, summed in row order."""
    world = dist.get_world_size(group)
    shapes, segments = [], []
    for param in params:
        rows = param.shape[0] if param.dim() else 1
        chunk = -(-rows // world)
        sums = torch.zeros(chunk, dtype=torch.float64)
        if param.grad is not None:
            local = local_shard(param.grad)
            local = local.reshape(local.shape[0] if local.dim() else 1, -1)
            sums[: local.shape[0]] = local.to(torch.float64).square().sum(dim=1).cpu()
        shapes.append((rows, chunk))
        segments.append(sums)
    flat = torch.cat(segments) if segments else torch.zeros(0, dtype=torch.float64)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat, group=group)
    ordered, offset = [], 0
    for rows, chunk in shapes:
        for rank in range(world):
            start, stop = shard_rows(rows, world, rank)
            ordered.append(gathered[rank][offset : offset + stop - start])
        offset += chunk
    total = torch.cat(ordered).sum() if ordered else torch.zeros((), dtype=torch.float64)
    return math.sqrt(float(total))


@torch.no_grad()
def clip_grads(params: Sequence[torch.nn.Parameter], norm: float, max_norm: float) -> None:
    """Scale the gradients by max_norm / (norm + 1e-6) where that is below 1 (torch's clip_grad_norm_ rule)."""
    coefficient = max_norm / (norm + 1e-6)
    if coefficient >= 1.0:
        return
    for param in params:
        if param.grad is not None:
            local_shard(param.grad).mul_(coefficient)
