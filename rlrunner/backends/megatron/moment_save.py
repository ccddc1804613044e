"""Saving a tensor-parallel rank's `distrib_optim.pt` (`moment_files`) from its data-parallel ranks' slices, with no
gather.

Each data-parallel (DP) rank owns a slice of its tensor-parallel rank's flat state, our order
(`DistributedAdamW.own_slice`: the fp32 weights and both moments). DP rank 0 writes the one file, laid out as
megatron-core lays its buffer out (`buffer_geometry`): its stand-in tensors for `param`, `exp_avg` and `exp_avg_sq`
get their bytes as the file is written (`file_writes.write_state_file`'s `deferred`), parameter after parameter in
the file's order, zeros in the alignment gaps; each part of a parameter another DP rank owns is received a chunk at a
time (at most `CHUNK_ELEMENTS`) into one buffer and written before the next is received. The other DP ranks send
theirs, in the same order, and write nothing. So no rank holds more than its own slice and a chunk, and at DP size 1
nothing is sent.

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
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from rlrunner.backends.megatron.flat_space import flat_offsets
from rlrunner.backends.megatron.moment_files import PARAM_STATE, Layout, coalesced_state, optimizer_file

CHUNK_ELEMENTS = 1 << 20  # 4 MiB of fp32: the most DP rank 0 receives at once

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
    `DistributedAdamW.own_slice`'s (the live state for a synchronous save, a copy for a background one); `offsets`
    and `numel` are the file's geometry (`moment_files.coalesced_offsets_of`) for `layout`."""

    def __init__(
        self,
        iteration: int,
        tp: int,
        tp_rank: int,
        layout: Layout,
        offsets: Sequence[int],
        numel: int,
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
        self.offsets, self.file_numel = list(offsets), int(numel)
        sizes = [math.prod(shape) for _, shape in layout]
        self.numel = sum(sizes)
        start, stop = _bounds(self.numel, self.dp, self.dp_rank)
        if (own["start"], own["stop"]) != (start, stop):
            raise ValueError(
                f"DP rank {self.dp_rank} of {self.dp} owns elements {own['start']}:{own['stop']}, "
                f"expected {start}:{stop} of {self.numel}"
            )
        self.chunk = int(chunk_elements or CHUNK_ELEMENTS)
        self.send = send or (lambda tensor, to: dist.send(tensor, group=group, group_dst=to))
        self.receive = receive or (lambda into, src: dist.recv(into, group=group, group_src=src))
        # (file offset, our flat [lo, hi)) of each parameter, in the file's order
        flat = flat_offsets(sizes)
        self.segments = sorted((offset, flat[i], flat[i + 1]) for i, offset in enumerate(self.offsets) if sizes[i])
        # the transfers, in the order DP rank 0 receives them (each key's pieces in the file's order, a chunk at a
        # time); a sender's are its own, in the same order
        self.plan = [(key, src, first, count) for key in PARAM_STATE for src, first, count in self._pieces() if src > 0]
        if self.dp_rank != 0:
            self.plan = [item for item in self.plan if item[1] == self.dp_rank]
        self.done = 0  # transfers of `plan` made
        self.broken = False  # a transfer failed: the peer or the group is gone, nothing more is tried
        self.buffer: torch.Tensor | None = None

    def _pieces(self) -> Iterator[tuple[int, int, int]]:
        """(owner DP rank, or -1 for an alignment gap of zeros; our flat index or file offset; count), in the file's
        order, each at most a chunk."""
        position = 0
        for offset, lo, hi in self.segments:
            if offset > position:
                yield -1, position, offset - position
            first = lo
            while first < hi:
                owner = first // -(-self.numel // self.dp)
                last = min(hi, _bounds(self.numel, self.dp, owner)[1])
                for piece in range(first, last, self.chunk):
                    yield owner, piece, min(self.chunk, last - piece)
                first = last
            position = offset + hi - lo
        if self.file_numel > position:
            yield -1, position, self.file_numel - position

    @property
    def name(self) -> str:
        return optimizer_file(self.iteration, self.tp_rank)

    def files(self) -> tuple[dict[str, dict[str, Any]], dict[int, Callable[[], Any]]]:
        """({name: state} of the file this rank writes, {id(stand-in): its values' parts}): DP rank 0's
        `distrib_optim.pt` whose tensors are stand-ins (untouched memory) filled as the file is written; nothing on the
        other DP ranks."""
        if self.dp_rank != 0:
            return {}, {}
        stand_ins = {key: torch.empty(self.file_numel, dtype=torch.float32) for key in PARAM_STATE}
        state = coalesced_state(
            self.iteration, self.tp, self.dp, self.own["step"], self.layout, self.offsets, stand_ins
        )
        return {self.name: state}, {id(stand_ins[key]): (lambda key=key: self._parts(key)) for key in PARAM_STATE}

    def _parts(self, key: str) -> Iterator[torch.Tensor]:
        """`key`'s flat tensor of the file, a part at a time: zeros in the gaps, this rank's own pieces, the other DP
        ranks' as received."""
        lo = self.own["start"]
        for owner, first, count in self._pieces():
            if owner < 0:
                yield torch.zeros(count, dtype=torch.float32)
            elif owner == 0:
                yield self.own[key][first - lo : first - lo + count]
            else:
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
