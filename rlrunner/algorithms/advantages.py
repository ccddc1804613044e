"""Advantage estimators: one scalar advantage per sample from the samples' rewards.

All share one signature, so the config can pick one by name (rlrunner/algorithms/registry.py):

    estimator(rewards [N] float, group_size, response_lengths [N] long, norm_adv_by_std) -> advantages [N] float32

with the N = prompts x group_size samples in prompt-major order (the G samples of prompt 0, then of prompt 1, ...).
"""

from __future__ import annotations

import torch

from rlrunner.algorithms.grpo import group_advantages


def _check_rewards(rewards: torch.Tensor, group_size: int) -> None:
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {tuple(rewards.shape)}"
        )


def grpo(rewards: torch.Tensor, group_size: int, response_lengths: torch.Tensor, norm_adv_by_std: bool) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean(group)) / (std(group) + eps), the division only when `norm_adv_by_std`.

    `response_lengths` is unused.
    """
    return group_advantages(rewards, group_size, norm_adv_by_std)


def rloo(rewards: torch.Tensor, group_size: int, response_lengths: torch.Tensor, norm_adv_by_std: bool) -> torch.Tensor:
    """RLOO: A_i = r_i - mean_{j != i in i's group} r_j, the leave-one-out baseline (unbiased: it excludes r_i).

    Needs group_size >= 2. `norm_adv_by_std` and `response_lengths` are ignored: RLOO does not scale by the std.
    """
    _check_rewards(rewards, group_size)
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2 (a baseline from the other samples), got {group_size}")
    groups = rewards.float().view(-1, group_size)
    others_mean = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others_mean).reshape(-1)


def reinforce_plus_plus_baseline(
    rewards: torch.Tensor, group_size: int, response_lengths: torch.Tensor, norm_adv_by_std: bool
) -> torch.Tensor:
    """REINFORCE++ with a group baseline: a_i = r_i - mean(group of i), then whitened over the whole batch by token.

    Every response token carries its sample's a_i, so the whitening weights each sample by its length len_i:
    mean_w = sum(len_i a_i) / sum(len_i), var = sum(len_i (a_i - mean_w)^2) / (sum(len_i) - 1) (Bessel over
    tokens), A_i = (a_i - mean_w) / sqrt(var + 1e-8). Both denominators are floored at 1, so a batch of (almost) no
    response tokens gets finite advantages (they weigh nothing in the loss). `norm_adv_by_std` is ignored: the
    batch whitening always divides by the std.
    """
    _check_rewards(rewards, group_size)
    if response_lengths.shape != rewards.shape:
        raise ValueError(
            f"response_lengths must have the shape of rewards {tuple(rewards.shape)}, "
            f"got {tuple(response_lengths.shape)}"
        )
    groups = rewards.float().view(-1, group_size)
    centered = (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)
    weights = response_lengths.float()
    tokens = weights.sum()
    mean = (weights * centered).sum() / tokens.clamp(min=1.0)
    var = (weights * (centered - mean) ** 2).sum() / (tokens - 1.0).clamp(min=1.0)
    return (centered - mean) * torch.rsqrt(var + 1e-8)
