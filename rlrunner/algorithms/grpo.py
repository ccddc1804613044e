"""GRPO as pure tensor functions: group-normalised advantages, token log-probs, KL, entropy, masked reductions.

The policy losses live in policy_losses.py, the other advantage estimators in advantages.py.

Shapes: `rewards` and `advantages` are [N] with the N = prompts x group_size samples in prompt-major
order (the G samples of prompt 0, then of prompt 1, ...); token tensors are [B, T] over target
positions, with `mask` 1.0 on response tokens.
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = r_i - mean(group), divided by (std(group) + eps) when `norm_by_std` (std is unbiased, as in GRPO).

    A group whose rewards are all equal gets zero advantages: it carries no learning signal.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {tuple(rewards.shape)}"
        )
    groups = rewards.float().view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if norm_by_std:
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target_t) for logits [B, T, V] and targets [B, T], computed in float32."""
    log_z = torch.logsumexp(logits.float(), dim=-1)
    picked = torch.gather(logits.float(), -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - log_z


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at every position, [B, T]."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    # a token with logit -inf has probability 0 and contributes 0 (not 0 * -inf = NaN)
    weighted = torch.where(probs > 0, probs * logits, torch.zeros_like(logits))
    return torch.logsumexp(logits, dim=-1) - weighted.sum(dim=-1)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) with the non-negative, low-variance k3 estimator: e^(ref-lp) - (ref-lp) - 1."""
    delta = torch.clamp(ref_log_probs - log_probs, min=-20.0, max=20.0)
    return torch.exp(delta) - delta - 1.0


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)
