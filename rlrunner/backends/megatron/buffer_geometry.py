"""Where megatron-core's distributed optimizer keeps each parameter: the geometry of its gradient buffer, and so of
the coalesced `distrib_optim.pt` that `load_parameter_state_from_dp_zero` reads.

megatron-core (`distributed/param_and_grad_buffer.py`, `_ParamAndGradBuffer`) lays a model chunk's parameters of one
dtype end to end in one buffer, in reverse order of `named_parameters()` (roughly backward's order). With the
distributed optimizer each parameter starts at a multiple of 64 elements (the gaps are zeros), and each bucket ends
padded to a multiple of lcm(DP size, 128) so that it splits evenly over the data-parallel ranks. A bucket closes once
it holds at least `bucket_size` elements (`bucket_size` gives megatron-core's for a run's flags); without
`overlap_grad_reduce` (megatron-core's default) it is None and the buffer is one bucket. The file's flat tensors are
the buffer with each bucket's end padding cut off (`numel_unpadded` elements), so a parameter's offset in them
depends on the buckets only through that padding.

The order of the parameters is megatron-core's `GPTModel` (local layer spec), the order its state dict lists them in
(`layout.expected_megatron_keys` without the `_extra_state` entries); tests hold it against megatron-core's own
buffer built for the same model.
"""

from __future__ import annotations

import math
from typing import Sequence

from rlrunner.backends.megatron.layout import EXTRA_STATE, DecoderDims, expected_megatron_keys

PARAM_ALIGNMENT = 64  # elements: megatron-core starts every parameter 128-byte aligned (at >= 16-bit precision)
BUCKET_ALIGNMENT = 128  # a bucket ends at a multiple of lcm(DP size, 128) elements


def bucket_size(dp: int, overlap_grad_reduce: bool, ddp_bucket_size: int | None = None) -> int | None:
    """The `bucket_size` megatron-core's DDP uses for a run with these Megatron-LM flags (`--overlap-grad-reduce`,
    `--ddp-bucket-size`) at data-parallel size `dp` (`DistributedDataParallel.__init__`): None, one bucket, without
    overlap."""
    if not overlap_grad_reduce:
        return None
    return ddp_bucket_size if ddp_bucket_size is not None else max(40_000_000, 1_000_000 * dp)


def megatron_param_names(dims: DecoderDims) -> list[str]:
    """The trainable parameters of megatron-core's GPTModel for these dimensions, in its `named_parameters()` order."""
    return [key for key in expected_megatron_keys(dims) if not key.endswith(EXTRA_STATE)]


def _padded(number: int, divisor: int) -> int:
    return -(-number // divisor) * divisor


def coalesced_offsets(numels: Sequence[int], dp: int, bucket_size: int | None = None) -> tuple[list[int], int]:
    """(each parameter's offset in the coalesced file's flat tensors, their length `numel_unpadded`), for parameters
    of `numels` elements given in `named_parameters()` order, at data-parallel size `dp`."""
    if dp < 1:
        raise ValueError(f"a data-parallel size is a positive integer, got {dp}")
    bucket_multiple = math.lcm(dp, BUCKET_ALIGNMENT)
    offsets = [0] * len(numels)
    bucket_start = start = 0
    coalesced_before = 0  # unpadded elements of the buckets closed so far
    open_params: list[tuple[int, int]] = []  # (index, start in the buffer) of the open bucket's parameters

    def close(end: int) -> int:
        nonlocal bucket_start, coalesced_before, open_params
        for index, param_start in open_params:
            offsets[index] = coalesced_before + param_start - bucket_start
        coalesced_before += end - bucket_start
        bucket_start, open_params = _padded(end, bucket_multiple), []
        return bucket_start

    end = 0
    for index in reversed(range(len(numels))):
        start = _padded(start, PARAM_ALIGNMENT)
        end = start + int(numels[index])
        open_params.append((index, start))
        start = close(end) if bucket_size is not None and end - bucket_start >= bucket_size else end
    if open_params:
        close(end)
    return offsets, coalesced_before
