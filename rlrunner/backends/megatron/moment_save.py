"""Saving a tensor-parallel rank's `distrib_optim.pt` (`moment_files`) from its data-parallel ranks' slices, with no
gather.

Each data-parallel (DP) rank owns a slice of its tensor-parallel rank's flat moments (`DistributedAdamW.own_slice`).
DP rank 0 writes the one file: its stand-in tensors for `exp_avg` and `exp_avg_sq` (the whole flat vectors) get their
bytes as the file is written (`file_writes.write_state_file`'s `deferred`), first its own slice, then each other DP
rank's, in rank order, received a chunk at a time (`CHUNK_ELEMENTS`) into one buffer and written before the next is
received. The other DP ranks send theirs, in the same order (`exp_avg`, then `exp_avg_sq`), and write nothing. So no
rank holds more than its own slice and a chunk, and at DP size 1 nothing is sent.

The chunks travel over a process group of their own (`save_group`: the DP group's ranks, over gloo), created at
set-up by every rank in the same order. A background save sends and receives in the saver's thread while the training
thread runs its collectives on the training groups: two threads must never issue operations on one group, whose
operations are matched by their order. A synchronous save uses the same group, from the training thread.

Every DP rank's save runs, in this order: the walk over the weight units (sharded weights, synchronous: DP rank 0
writes `model_optim_rng.pt` while the others help gather), then the moments' transfers; each rank's `finish` completes
its part whatever happened before it (DP rank 0 receives and drops what a failed write did not take, the others send
the rest), so no peer is left waiting in a send or a receive.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from rlrunner.backends.megatron.distrib_optim import MOMENTS
from rlrunner.backends.megatron.moment_files import Layout, flat_moments_state, optimizer_file

CHUNK_ELEMENTS = 1 << 20  # 4 MiB of fp32: what DP rank 0 receives at once

Send = Callable[[torch.Tensor, int], None]  # (tensor, to DP rank)
Receive = Callable[[torch.Tensor, int], None]  # (into tensor, from DP rank)


def save_group(world_size: int, tp: int, rank: int, timeout: timedelta | None) -> dist.ProcessGroup | None:
    """This rank's group for a save's transfers: the ranks of its data-parallel group (rank = dp_rank * tp + tp_rank),
    over gloo, apart from the groups training uses; None at data-parallel size 1. Every rank creates every group, in
    the same order, as torch.distributed requires."""
    if world_size // tp <= 1:
        return None
    mine = None
    for tp_rank in range(tp):
        ranks = list(range(tp_rank, world_size, tp))
        group = dist.new_group(ranks, timeout=timeout, backend="gloo")
        if rank in ranks:
            mine = group
    return mine


def _bounds(numel: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """The elements [start, stop) DP rank `dp_rank` owns, clipped to the parameters (`DistributedAdamW._own_range`)."""
    size = -(-numel // dp)
    return min(dp_rank * size, numel), min((dp_rank + 1) * size, numel)


class MomentSave:
    """One DP rank's part in saving its tensor-parallel rank's `distrib_optim.pt` (see the module docstring). `own` is
    `DistributedAdamW.own_slice`'s (the live moments for a synchronous save, a copy for a background one)."""

    def __init__(
        self,
        iteration: int,
        tp: int,
        tp_rank: int,
        layout: Layout,
        own: dict[str, Any],
        group: Any = None,
        chunk_elements: int | None = None,
        send: Send | None = None,
        receive: Receive | None = None,
        dp: int | None = None,
        dp_rank: int | None = None,
    ):
        """`group`: the save group (None at DP size 1); `send`, `receive`, `dp` and `dp_rank` replace it in tests."""
        self.dp = dp if dp is not None else (1 if group is None else dist.get_world_size(group))
        self.dp_rank = dp_rank if dp_rank is not None else (0 if group is None else dist.get_rank(group))
        self.iteration, self.tp, self.tp_rank, self.layout, self.own = iteration, tp, tp_rank, layout, own
        self.numel = sum(math.prod(shape) for _, shape in layout)
        start, stop = _bounds(self.numel, self.dp, self.dp_rank)
        if (own["start"], own["stop"]) != (start, stop):
            raise ValueError(
                f"DP rank {self.dp_rank} of {self.dp} owns elements {own['start']}:{own['stop']}, "
                f"expected {start}:{stop} of {self.numel}"
            )
        self.chunk = int(chunk_elements or CHUNK_ELEMENTS)
        self.send = send or (lambda tensor, to: dist.send(tensor, group=group, group_dst=to))
        self.receive = receive or (lambda into, src: dist.recv(into, group=group, group_src=src))
        # the transfers, in the order DP rank 0 receives them (each moment's slices in rank order, a chunk at a time);
        # a sender's are its own, in the same order
        self.plan = [
            (key, src, first, min(self.chunk, hi - first))
            for key in MOMENTS
            for src in range(1, self.dp)
            for lo, hi in [_bounds(self.numel, self.dp, src)]
            for first in range(lo, hi, self.chunk)
        ]
        if self.dp_rank != 0:
            self.plan = [item for item in self.plan if item[1] == self.dp_rank]
        self.done = 0  # transfers of `plan` made
        self.broken = False  # a transfer failed: the peer or the group is gone, nothing more is tried
        self.buffer: torch.Tensor | None = None

    @property
    def name(self) -> str:
        return optimizer_file(self.iteration, self.tp_rank)

    def files(self) -> tuple[dict[str, dict[str, Any]], dict[int, Callable[[], Any]]]:
        """({name: state} of the file this rank writes, {id(stand-in): its values' parts}): DP rank 0's
        `distrib_optim.pt` whose moments are stand-ins (untouched memory) filled as the file is written; nothing on the
        other DP ranks."""
        if self.dp_rank != 0:
            return {}, {}
        stand_ins = {key: torch.empty(self.numel, dtype=torch.float32) for key in MOMENTS}
        state = flat_moments_state(self.iteration, self.tp, self.own["step"], self.layout, **stand_ins)
        return {self.name: state}, {id(stand_ins[key]): (lambda key=key: self._parts(key)) for key in MOMENTS}

    def _parts(self, key: str) -> Iterator[torch.Tensor]:
        """Moment `key`'s flat vector, a part at a time: this rank's slice, then every other DP rank's, as received."""
        yield from self.own[key].split(self.chunk)
        while self.done < len(self.plan) and self.plan[self.done][0] == key:
            yield self._receive()

    def _receive(self) -> torch.Tensor:
        _, src, _, count = self.plan[self.done]
        if self.buffer is None:
            self.buffer = torch.empty(min(self.chunk, max(n for *_, n in self.plan)), dtype=torch.float32)
        into = self.buffer[:count]
        self._transfer(lambda: self.receive(into, src))
        return into

    def _send_next(self) -> None:
        key, _, first, count = self.plan[self.done]
        lo = self.own["start"]
        part = self.own[key][first - lo : first - lo + count].detach().to("cpu").contiguous()
        self._transfer(lambda: self.send(part, 0))

    def _transfer(self, run: Callable[[], Any]) -> None:
        try:
            run()
        except BaseException:
            self.broken = True
            raise
        self.done += 1

    def finish(self) -> None:
        """Complete this rank's transfers: the other DP ranks send their slice (all of it: this is their save), DP
        rank 0 receives and drops whatever its write did not take (it failed before or while writing the file)."""
        while not self.broken and self.done < len(self.plan):
            if self.dp_rank == 0:
                self._receive()
            else:
                self._send_next()
