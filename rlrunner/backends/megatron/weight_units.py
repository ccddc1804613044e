"""The weights of a `DistributedAdamW` with `shard_weights` (ZeRO-3), gathered a unit at a time.

A rank keeps only its slice of the weights (the optimizer's `owned_params`), and no whole buffer: the parameters are
grouped in units (the model's embedding, each layer, the head), each a view of a buffer of its own whose storage is
empty except while the unit is gathered: the owners of its elements broadcast them over DP. The model gathers a unit
before using it and releases it after, in forward and again in backward (`TPCausalLM.weight_units`), so a rank
holds its share of the training state and one or two units. `UnitCursor` walks every unit once, for a pass over the
whole weights (a save, a weight sync).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from rlrunner.backends.megatron.flat_space import FlatSpace, bind_to_buffer


class WeightUnits:
    def __init__(
        self, space: FlatSpace, units: Sequence[Sequence[str]] | None, owned_params: torch.Tensor, device: torch.device
    ):
        """`units`: the parameter names of each unit, consecutive runs of the space's parameters covering all of them;
        `owned_params`: this rank's slice of the weights, what a gather broadcasts from. The parameters become views
        of the units' buffers, released (their values must be in `owned_params` already)."""
        self.space, self.owned_params = space, owned_params
        self.ranges = _unit_ranges(space.names, space.offsets, units)
        self.unit_of = [
            index for index, (first, last) in enumerate(self.ranges) for _ in range(first, last)
        ]  # parameter index -> its unit
        self.sizes = [space.offsets[last] - space.offsets[first] for first, last in self.ranges]
        self.buffers = []
        for (first, last), size in zip(self.ranges, self.sizes):  # each unit's buffer, its storage empty until gathered
            buffer = bind_to_buffer(space.params[first:last], size, device)
            buffer.untyped_storage().resize_(0)
            self.buffers.append(buffer)
        self._gathered = [0] * len(self.ranges)  # how many holders each unit has now

    def __len__(self) -> int:
        return len(self.ranges)

    def unit_of_param(self, name: str) -> int:
        """The unit parameter `name` is gathered with."""
        return self.unit_of[self.space.index[name]]

    @torch.no_grad()
    def gather(self, unit: int) -> None:
        """Give unit `unit`'s parameters their whole values: each DP rank broadcasts the elements it owns (a collective
        over DP, called by every DP rank in the same order). Nested calls count: the unit stays until as many
        `release`s."""
        self._gathered[unit] += 1
        if self._gathered[unit] > 1:
            return
        space, buffer = self.space, self.buffers[unit]
        lo = space.offsets[self.ranges[unit][0]]
        # the parameters are views of the buffer, and autograd may hold them for backward: refilling must not count as
        # an in-place change of what it saved (the values are the same ones, put back)
        with torch.autograd._unsafe_preserve_version_counter(buffer):
            buffer.untyped_storage().resize_(self.sizes[unit] * buffer.element_size())
            for owner, first, last in space.owner_parts(lo, lo + self.sizes[unit]):
                part = buffer[first - lo : last - lo]
                if owner == space.dp_rank:
                    part.copy_(self.owned_params[first - space.owned.start : last - space.owned.start])
                dist.broadcast(part, src=space.dp_ranks[owner], group=space.dp_group)

    def release(self, unit: int) -> None:
        """Drop unit `unit`'s gathered values (its buffer's storage), once every `gather` of it has been released."""
        if self._gathered[unit] <= 0:
            raise RuntimeError(f"weight unit {unit} released more often than gathered")
        self._gathered[unit] -= 1
        if self._gathered[unit] == 0:
            self.buffers[unit].untyped_storage().resize_(0)


class UnitCursor:
    """Visits every weight unit of a `DistributedAdamW` (its `units`, None without `shard_weights`, and its `space`)
    once, in order, gathered one at a time: what a pass over the whole weights (a save, a weight sync) does with
    sharded weights. Every DP rank must make the same visits, so a rank that
    reads nothing still walks them (`finish`), and a rank that stops early (an error) walks the rest in `finish` too,
    instead of leaving its peers waiting in a gather. Without `shard_weights` it gathers nothing."""

    def __init__(self, units: WeightUnits | None, space: FlatSpace):
        self.units = units  # None: the weights are whole
        self.space = space
        self.current = -1  # the unit gathered now (-1: none yet)

    def tensor(self, name: str) -> torch.Tensor:
        """Parameter `name`, its unit gathered (the units before it visited, the one before released): valid until a
        later unit is asked for or `finish`. Units must be asked for in order."""
        param = self.space.params[self.space.index[name]]
        if self.units is None:
            return param
        unit = self.units.unit_of_param(name)
        if unit < self.current:
            raise RuntimeError(f"weight unit {unit} asked for after unit {self.current}: a pass visits them in order")
        self._advance_to(unit)
        return param

    def _advance_to(self, unit: int) -> None:
        while self.current < unit:
            if self.current >= 0:
                self.units.release(self.current)
            self.current += 1
            self.units.gather(self.current)

    def finish(self) -> None:
        """Visit the units left, and release the last."""
        if self.units is None or self.current > len(self.units) - 1:
            return
        last = len(self.units) - 1
        self._advance_to(last)
        self.units.release(last)
        self.current = last + 1  # done: nothing is gathered


def _unit_ranges(names: list[str], offsets: list[int], units: Sequence[Sequence[str]] | None) -> list[tuple[int, int]]:
    """[first, last) parameter indices of each unit; ValueError unless the units are consecutive runs of `names`
    covering every one once, in order."""
    if not units:
        raise ValueError("shard_weights needs the units the parameters are gathered in")
    ranges, position = [], 0
    for unit in units:
        unit = list(unit)
        if not unit or names[position : position + len(unit)] != unit:
            raise ValueError(
                f"weight unit {unit[:2]}... is not the next run of parameters "
                f"(expected {names[position : position + 1]})"
            )
        ranges.append((position, position + len(unit)))
        position += len(unit)
    if position != len(names):
        raise ValueError(f"the weight units leave out {len(names) - position} parameter(s), e.g. {names[position]!r}")
    return ranges
