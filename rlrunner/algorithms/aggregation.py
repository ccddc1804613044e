"""Per-token loss [B, T] -> one micro-batch's scalar share of the mini-batch loss.

The backend calls `aggregate_loss` once per micro-batch on each data-parallel rank; the gradients are then averaged
over the dp_size ranks and summed over the micro-batches. So each call normalises by the WHOLE mini-batch's count
(`global_tokens` / `global_sequences`, over all ranks) and multiplies by dp_size to undo the average.
"""

from __future__ import annotations

import torch

from rlrunner.algorithms.grpo import masked_sum
from rlrunner.algorithms.registry import LOSS_AGG_MODES

__all__ = ["LOSS_AGG_MODES", "aggregate_loss"]


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_tokens: float,
    global_sequences: float,
    max_response_length: int,
    dp_size: int,
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss, times dp_size, under one of LOSS_AGG_MODES:

    - token-mean: sum of masked tokens / global_tokens (every token weighs the same)
    - seq-mean-token-sum: sum over rows of (sum of the row's masked tokens) / global_sequences
    - seq-mean-token-mean: sum over rows with >= 1 token of (the row's masked token mean) / global_sequences
      (every sequence weighs the same, whatever its length)
    - seq-mean-token-sum-norm: sum of masked tokens / (global_sequences * max_response_length), Dr. GRPO's
      constant normaliser (no length bias)

    `global_sequences` counts the mini-batch's sequences with at least one response token; the counts must be > 0.
    """
    if mode == "token-mean":
        return masked_sum(per_token, mask) * (dp_size / global_tokens)
    if mode == "seq-mean-token-sum":
        return masked_sum(per_token, mask) * (dp_size / global_sequences)
    if mode == "seq-mean-token-mean":
        row_sums = (per_token * mask).sum(dim=-1)
        # a row without response tokens has sum 0: flooring its count keeps it at 0 instead of 0/0
        row_means = row_sums / mask.sum(dim=-1).clamp(min=1.0)
        return row_means.sum() * (dp_size / global_sequences)
    if mode == "seq-mean-token-sum-norm":
        return masked_sum(per_token, mask) * (dp_size / (global_sequences * max_response_length))
    raise ValueError(f"unknown loss aggregation mode '{mode}', expected one of {', '.join(LOSS_AGG_MODES)}")
