"""Per-token policy losses, chosen by name (rlrunner/algorithms/registry.py); all share one signature:

    loss(log_probs [B, T], old_log_probs [B, T], advantages [B], mask [B, T], clip_low, clip_high) -> PolicyLossTerms

`advantages` is one per sequence, broadcast over its tokens ([B, T] works too). The per-token loss is reduced to a
scalar by rlrunner/algorithms/aggregation.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# GSPO's log sequence ratio is capped before exp, so that a diverged sequence gives a large but finite ratio.
_GSPO_MAX_LOG_RATIO = 10.0


@dataclass
class PolicyLossTerms:
    loss: torch.Tensor  # per-token loss, [B, T]
    clipped: torch.Tensor  # 1.0 where the clipped branch was taken, [B, T]
    approx_kl: torch.Tensor  # old_log_probs - log_probs, detached, [B, T]


def _per_token(advantages: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def ppo_clip(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> PolicyLossTerms:
    """PPO's clipped surrogate per token: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), r = p / p_old.

    `mask` is unused: every token's ratio is its own.
    """
    advantages = _per_token(advantages)
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return PolicyLossTerms(
        loss=torch.maximum(unclipped, clipped),
        clipped=(clipped > unclipped).float(),
        approx_kl=-log_ratio.detach(),
    )


def gspo(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> PolicyLossTerms:
    """GSPO (Zheng et al. 2025), token-level form: PPO's clipped surrogate on the sequence's importance ratio.

    s_i = masked mean over row i's response tokens of (log_probs - old_log_probs), the length-normalised log ratio
    of the sequence. Each token's ratio is exp(log_probs - sg(log_probs) + sg(s_i)): its value is the sequence ratio
    exp(s_i), its gradient that of the token's own log-prob, so all tokens of a sequence are clipped together.
    """
    advantages = _per_token(advantages)
    log_ratio = log_probs - old_log_probs
    seq_log_ratio = (log_ratio * mask).sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    token_log_ratio = log_probs - log_probs.detach() + seq_log_ratio.detach()
    ratio = torch.exp(torch.clamp(token_log_ratio, max=_GSPO_MAX_LOG_RATIO))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return PolicyLossTerms(
        loss=torch.maximum(unclipped, clipped),
        clipped=(clipped > unclipped).float(),
        approx_kl=-log_ratio.detach(),
    )
