"""The gradients of a `DistributedAdamW`: reduced over data parallelism into the owned slice, and their norm.

Sharded (`shard`, ZeRO-2): as soon as backward has accumulated a parameter's gradient, a hook takes it and drops the
`.grad`: a parameter larger than a bucket (16 MiB) is reduced over DP onto the ranks owning its elements at once,
smaller ones wait in the bucket, which is all_reduced when full and at the end of the backward; the owned parts are
added into the gradient slice. So no rank ever holds the gradients of its whole TP shard, only one parameter's and
the bucket. Every parameter must get a gradient in every backward (the hooks are collectives over DP, run in
backward's order, the same on every replica); a `.grad` that no hook took is still reduced, by `reduce`.

Whole (ZeRO-1, Megatron-LM's distributed optimizer): the `.grad` are views of one buffer of the whole padded space,
all_reduced once per step. At DP size 1 the two are the same: the slice is everything and `.grad` are views of it.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from rlrunner.backends.megatron.flat_space import FlatSpace

BUCKET_ELEMENTS = 1 << 22  # 16 MiB of fp32: the gradients of small parameters reduced together
NORM_CHUNK_ELEMENTS = 1 << 20  # 8 MiB of fp64: the gradient norm's temporaries


class GradientReducer:
    def __init__(self, space: FlatSpace, shard: bool, bucket_elements: int, device: torch.device):
        self.space, self.shard = space, shard
        params = space.params
        # the owned slice (sharded), or the whole padded flat space whose `.grad` views backward accumulates into in
        # place, the gradients never copied (at DP size 1 the two are the same)
        self.buffer = torch.zeros(
            space.slice_size if shard else space.slice_size * space.dp_size, dtype=torch.float32, device=device
        )
        self.owned = self.buffer if shard else self.buffer[space.owned]
        if shard:
            # gradients of parameters smaller than a bucket wait in it, in the order backward gives them, and are
            # all_reduced together when it is full and at the end of every backward: one collective per bucket, not
            # one per parameter (each a point where every replica waits for the others)
            self._bucket = torch.empty(min(bucket_elements, space.numel), dtype=torch.float32, device=device)
            self._bucketed: list[tuple[int, int]] = []  # (parameter index, its offset in the bucket)
            self._bucket_filled = 0
            self._arrived = 0  # parameters whose gradient this backward has given: all of them ends it
            for index, param in enumerate(params):
                param.register_post_accumulate_grad_hook(self._reduce_hook(index))
        else:
            for param, view in zip(params, space.views(self.buffer)):
                param.grad = view  # autograd accumulates into it in place: the gradients are never copied

    def reduce(self) -> None:
        """Average the gradients over the DP group into the owned slice (a collective, every DP rank calls it). Sharded,
        backward has reduced each parameter's already (the hooks) and what remains is a `.grad` set from outside since;
        whole, one all_reduce of the gradient buffer, in place."""
        space = self.space
        if not self.shard:
            self._grads_in_buffer()
            if space.dp_size > 1:
                dist.all_reduce(self.buffer, group=space.dp_group)
                self.buffer.div_(space.dp_size)
            return
        self._flush_bucket()  # a backward that did not give every parameter its gradient (the same on every replica)
        self._arrived = 0
        set_here = torch.tensor([param.grad is not None for param in space.params], dtype=torch.uint8)
        dist.all_reduce(set_here, op=dist.ReduceOp.MAX, group=space.dp_group)
        for index in set_here.nonzero().flatten().tolist():  # the same list on every DP rank
            param = space.params[index]
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            param.grad = None
            self._reduce_into_slice(index, grad)
        self.owned.div_(space.dp_size)

    def zero(self) -> None:
        """Zero the gradients (whole, every `.grad` stays its view of the buffer; sharded, none is held, and nothing
        waits in the bucket). No collective."""
        self.buffer.zero_()
        if not self.shard:
            self._grads_in_buffer()
        else:
            for param in self.space.params:
                param.grad = None
            self._bucketed, self._bucket_filled, self._arrived = [], 0, 0

    def owned_grad(self, index: int) -> torch.Tensor:
        """The owned part of parameter `index`'s reduced gradient: a view of the gradient slice."""
        return self.space.owned_part(index, self.owned)

    def norm(self, tp_group: dist.ProcessGroup | None) -> float:
        """Whole-model L2 norm of the gradient, accumulated in fp64; gathered, never all_reduced: summed in rank order,
        the same bits on every rank run after run. The DP slices' squares are summed over DP, TP-sharded parameters'
        over the TP group, and replicated ones (layer norms, identical on every TP rank) are counted once."""
        space = self.space
        sums = torch.zeros(2, dtype=torch.float64, device=self.buffer.device)  # [TP-sharded, replicated] squares
        if not self.shard:  # every DP replica holds the whole reduced gradient
            for view, is_replicated in zip(space.views(self.buffer), space.replicated):
                sums[int(is_replicated)] += _square_sum(view)
        else:  # this rank's slice; the DP slices are disjoint, so their squares add up
            for index in space.owned_parts:
                sums[int(space.replicated[index])] += _square_sum(self.owned_grad(index))
            parts = [torch.empty_like(sums) for _ in range(space.dp_size)]
            dist.all_gather(parts, sums, group=space.dp_group)
            sums = torch.stack(parts).sum(0)
        tp_size = dist.get_world_size(tp_group)
        if tp_size > 1:
            parts = [torch.empty_like(sums) for _ in range(tp_size)]
            dist.all_gather(parts, sums, group=tp_group)
            gathered = torch.stack(parts)
            # replicated squares are the same on every TP rank; max (nan-propagating) makes an inf or nan in
            # one rank's copy skip the step on all of them rather than on that rank alone
            sums = torch.stack([gathered[:, 0].sum(), gathered[:, 1].max()])
        return math.sqrt(sums.sum().item())

    def _reduce_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        @torch.no_grad()
        def reduce(param: torch.Tensor) -> None:
            grad, param.grad = param.grad, None
            size = grad.numel()
            if size > self._bucket.numel():
                self._reduce_into_slice(index, grad)  # a large parameter on its own, straight to its owners
            else:
                if self._bucket_filled + size > self._bucket.numel():
                    self._flush_bucket()
                self._bucket[self._bucket_filled : self._bucket_filled + size].copy_(grad.reshape(-1))
                self._bucketed.append((index, self._bucket_filled))
                self._bucket_filled += size
            del grad
            self._arrived += 1
            if self._arrived == len(self.space.params):  # the end of this backward
                self._flush_bucket()
                self._arrived = 0

        return reduce

    @torch.no_grad()
    def _flush_bucket(self) -> None:
        """Sum the bucket over DP (every replica's holds the same parameters in the same order) and add the owned parts
        of its parameters into the gradient slice."""
        if not self._bucketed:
            return
        filled = self._bucket[: self._bucket_filled]
        dist.all_reduce(filled, group=self.space.dp_group)
        for index, offset in self._bucketed:
            if index in self.space.owned_parts:
                first, last = self.space.owned_parts[index]
                self.owned_grad(index).add_(filled[offset + first : offset + last])
        self._bucketed, self._bucket_filled = [], 0

    @torch.no_grad()
    def _reduce_into_slice(self, index: int, grad: torch.Tensor) -> None:
        """Sum parameter `index`'s gradient over DP onto the ranks owning its elements (one reduce per owner), and add
        this rank's owned part into the gradient slice."""
        space = self.space
        flat = grad.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        lo, hi = space.offsets[index], space.offsets[index + 1]
        for owner, first, last in space.owner_parts(lo, hi):
            part = flat[first - lo : last - lo]
            dist.reduce(part, dst=space.dp_ranks[owner], group=space.dp_group)
            if owner == space.dp_rank:
                self.owned_grad(index).add_(part)

    @torch.no_grad()
    def _grads_in_buffer(self) -> None:
        """Whole gradients: a `.grad` set from outside (replaced, or set to None) goes back to being its view of the
        gradient buffer, with the value it was given (None: zero)."""
        for param, view in zip(self.space.params, self.space.views(self.buffer)):
            if param.grad is None:
                view.zero_()
            elif param.grad.data_ptr() == view.data_ptr():
                continue
            else:
                view.copy_(param.grad)
            param.grad = view


def _square_sum(tensor: torch.Tensor, chunk: int = NORM_CHUNK_ELEMENTS) -> torch.Tensor:
    """The sum of `tensor`'s squares in fp64, `chunk` elements at a time: its fp64 temporaries are a chunk's, not the
    whole tensor's (two copies of the largest parameter, 100 MB at 600M over tp 2)."""
    total = torch.zeros((), dtype=torch.float64, device=tensor.device)
    for part in tensor.reshape(-1).split(chunk):
        total += part.double().square().sum()
    return total
