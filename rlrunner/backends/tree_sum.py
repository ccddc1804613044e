"""Sums of tensors in a fixed binary tree, so that how the terms were split among ranks does not change the bits.

Floating-point addition is commutative but not associative: (a + b) + c and a + (b + c) may differ in the last bit.
A layout-invariant update (`actor.layout_invariant`) adds the gradients of K logical micro-batches as the perfect
binary tree over them, whatever the data-parallel size D: each rank adds its contiguous block of K / D micro-batches
as a subtree (`TreeSum`, leaf after leaf), and the D subtrees are then added in the same tree's order
(`tree_combine`). With K and D powers of two, every size gives the tree over all K leaves, bit for bit.

    tree = TreeSum()
    for leaf in leaves:          # in order
        tree.push(leaf)
    total = tree.total()         # == tree_combine([TreeSum over each block].total() ...)
"""

from __future__ import annotations

from typing import Sequence

import torch


class TreeSum:
    """The sum of the tensors pushed, in the perfect binary tree over them (a binary counter: two subtrees of the same
    height are added as soon as both are complete, the left one first). With a count that is not a power of two the
    incomplete subtrees are added right to left at `total`: still a fixed order for that count."""

    def __init__(self) -> None:
        self._stack: list[tuple[int, torch.Tensor]] = []  # (height, subtree sum), heights decreasing
        self.count = 0

    def push(self, leaf: torch.Tensor) -> None:
        """Add the next leaf. The tree keeps `leaf` as a buffer and may add into it in place: pass one the caller no
        longer uses."""
        height, value = 0, leaf
        while self._stack and self._stack[-1][0] == height:
            _, left = self._stack.pop()
            value = left.add_(value)  # left + value, in the left subtree's buffer
            height += 1
        self._stack.append((height, value))
        self.count += 1

    def total(self) -> torch.Tensor:
        """The sum of every leaf pushed; the tree is empty afterwards."""
        if not self._stack:
            raise ValueError("the sum of no leaves")
        value = self._stack.pop()[1]
        while self._stack:
            value = self._stack.pop()[1].add_(value)
        self.count = 0
        return value


def tree_combine(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of `values` (subtree sums, in order) as the binary tree over them: pairs first, then pairs of pairs.
    For a power-of-two count, that is the perfect tree whose leaves are the values."""
    level = list(values)
    if not level:
        raise ValueError("the sum of no values")
    while len(level) > 1:
        paired = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0]


def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0
