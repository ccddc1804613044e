"""The flat index space a `DistributedAdamW` shards over data parallelism: its parameters laid end to end.

The local parameters of a tensor-parallel rank, flattened in order, make N elements, padded to a multiple of the
data-parallel (DP) size D; DP rank d owns elements [d*N/D, (d+1)*N/D). What lives in this space (the weights, the
gradients, AdamW's moments) is a flat tensor of the whole padded space, or of the owned slice alone; `FlatSpace`
says where each parameter's elements are in either, which rank owns which, and moves slices between the DP ranks.
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch
import torch.distributed as dist


class FlatSpace:
    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        dp_group: dist.ProcessGroup | None,
        replicated: set[str],
    ):
        self.names = [name for name, _ in named_params]
        self.index = {name: index for index, name in enumerate(self.names)}
        self.params = [param for _, param in named_params]
        check_names(self.names, replicated)
        self.replicated = [name in replicated for name in self.names]
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        self.offsets = flat_offsets(param.numel() for param in self.params)
        self.numel = self.offsets[-1]
        self.slice_size = -(-self.numel // self.dp_size)  # ceil: the padding sits at the end of the last slice
        start = self.dp_rank * self.slice_size
        self.owned = slice(start, start + self.slice_size)
        # {parameter index: its elements [first, last) that fall in the owned slice}: where its gradient (and, sharded,
        # its weight) goes
        self.owned_parts = {
            index: (max(lo, start) - lo, min(hi, self.owned.stop) - lo)
            for index, (lo, hi) in enumerate(zip(self.offsets, self.offsets[1:]))
            if max(lo, start) < min(hi, self.owned.stop)
        }

    @functools.cached_property
    def dp_ranks(self) -> list[int]:
        """The global ranks of the DP group, by DP rank (what point-to-point collectives name)."""
        return dist.get_process_group_ranks(self.dp_group)

    def owner_parts(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(DP rank, first, last): the elements [first, last) of the flat range [lo, hi) each DP rank owns."""
        return (
            [
                (owner, max(lo, owner * self.slice_size), min(hi, (owner + 1) * self.slice_size))
                for owner in range(lo // self.slice_size, (hi - 1) // self.slice_size + 1)
            ]
            if hi > lo
            else []
        )

    def owned_part(self, index: int, owned: torch.Tensor) -> torch.Tensor:
        """The owned part of parameter `index` in `owned`, a tensor laid out like the owned slice (the gradients, the
        sharded weights): a view."""
        first, last = self.owned_parts[index]
        lo = self.offsets[index] - self.owned.start
        return owned[lo + first : lo + last]

    def padded(self, device: torch.device | str) -> torch.Tensor:
        """A zeroed fp32 tensor of the whole padded space."""
        return torch.zeros(self.slice_size * self.dp_size, dtype=torch.float32, device=device)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat (padded) fp32 tensor, shaped like the parameters."""
        return [flat[lo:hi].view(p.shape) for p, lo, hi in zip(self.params, self.offsets, self.offsets[1:])]

    def exchange_slices(self, owned: torch.Tensor, out: torch.Tensor, chunk: int) -> None:
        """Every DP rank's `owned` slice into its place in `out` (a padded flat tensor) on every rank (all_gather). One
        `chunk` of elements at a time: gloo gathers into a buffer of its own and copies out, so a whole-slice call
        would cost a temporary of the whole flat tensor."""
        for lo in range(0, self.slice_size, chunk):
            hi = min(lo + chunk, self.slice_size)
            parts = [out[r * self.slice_size + lo : r * self.slice_size + hi] for r in range(self.dp_size)]
            mine = owned[lo:hi].clone()  # `owned` may be a view of `out` itself (the weights)
            dist.all_gather(parts, mine, group=self.dp_group)


def check_names(names: list[str], replicated: set[str]) -> None:
    if not names:
        raise ValueError("DistributedAdamW needs at least one parameter")
    if len(set(names)) != len(names):
        twice = sorted(n for n in names if names.count(n) > 1)[0]
        raise ValueError(f"DistributedAdamW got the parameter name {twice!r} twice")
    unknown = sorted(set(replicated) - set(names))
    if unknown:
        raise ValueError(f"replicated parameter {unknown[0]!r} is not among the optimizer's parameters")


def flat_offsets(sizes: Iterable[int]) -> list[int]:
    """Start of each tensor of `sizes` elements in a flat concatenation of them, and the total at the end."""
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return offsets


@torch.no_grad()
def bind_to_buffer(params: list[torch.nn.Parameter], numel: int, device: torch.device | str) -> torch.Tensor:
    """Make each of `params` a view of one zeroed fp32 buffer of `numel` elements (in order, any rest padding), which
    is returned. A parameter with storage keeps its values; one on the meta device gets its storage here (zeros).
    The Parameter objects stay the same (their contents are swapped), so modules and optimizers still hold them."""
    flat = torch.zeros(numel, dtype=torch.float32, device=device)
    offset = 0
    for param in params:
        view = flat[offset : offset + param.numel()].view(param.shape)
        offset += param.numel()
        if param.device.type != "meta":
            view.copy_(param.detach())
        torch.utils.swap_tensors(param, torch.nn.Parameter(view, requires_grad=param.requires_grad))
    if offset > numel:
        raise ValueError(f"{offset} parameter elements do not fit a buffer of {numel}")
    return flat
