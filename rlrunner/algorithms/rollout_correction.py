"""Rollout correction: the rollout engine samples from (numerically) not quite the policy the actor computes.

Truncated importance sampling (TIS) reweights each token by p_actor / p_rollout of the behaviour policy, capped so
that a token the engine found very unlikely cannot blow up the gradient.
"""

from __future__ import annotations

import torch


def tis_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, capped), both [B, T] float32 and detached: weights = min(exp(old - rollout), cap), capped = 1.0
    where exp(old - rollout) > cap.

    A huge positive difference overflows exp to inf, which the cap turns into `cap`; a huge negative one gives 0.
    """
    if not cap > 0:
        raise ValueError(f"the importance weight cap must be > 0, got {cap}")
    ratio = torch.exp((old_log_probs.detach() - rollout_log_probs.detach()).float())
    return torch.clamp(ratio, max=cap), (ratio > cap).float()
