"""The policy objective of one micro-batch, as `algorithm.*` names it: what a training backend is given to minimise.

    objective = PolicyObjective(algorithm_cfg)
    loss = objective.micro_batch_loss(log_probs, batch_terms, counts, dp_size, sums)   # backward() it
    metrics = objective.metrics(summed)                                             # on the driver

A backend computes the token log-probs (and the entropy, and the reference's log-probs for the KL term) and calls
this; the policy loss (`algorithm.policy_loss`), the truncated importance-sampling correction
(`algorithm.rollout_correction.tis_cap`) and the aggregation (`algorithm.loss_agg_mode`) are chosen here by name
(`registry.py`), so a new variant touches no backend. `sums` gathers this rank's token sums of the metrics; the
driver adds the ranks' sums in rank order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from rlrunner.algorithms.aggregation import aggregate_loss
from rlrunner.algorithms.grpo import kl_penalty, masked_sum
from rlrunner.algorithms.registry import get_policy_loss
from rlrunner.algorithms.rollout_correction import tis_weights

# this rank's sums that `metrics` turns into token means (a metric only of the terms that are on)
SUM_KEYS = ("pg_loss", "kl", "entropy", "clipped", "ppo_kl", "tokens", "logprob_diff", "tis_weight", "tis_capped")


@dataclass
class MicroBatch:
    """One micro-batch's inputs besides the policy's own log-probs, all [rows, positions] but `advantages` [rows]."""

    old_log_probs: torch.Tensor  # the behaviour policy's, as the actor computes them
    advantages: torch.Tensor
    mask: torch.Tensor  # 1.0 on response tokens
    rollout_log_probs: torch.Tensor  # the rollout engine's, of the same tokens under the same policy
    entropy: torch.Tensor  # with a graph when algorithm.entropy_coef is on
    ref_log_probs: torch.Tensor | None = None  # the reference policy's, when algorithm.use_kl_loss is on


@dataclass(frozen=True)
class MiniBatchCounts:
    """The whole mini-batch's counts over all data-parallel ranks (the aggregation's denominators)."""

    tokens: float
    sequences: float


class PolicyObjective:
    def __init__(self, algorithm_cfg: Mapping[str, Any]):
        self.loss_fn = get_policy_loss(algorithm_cfg["policy_loss"])
        self.agg_mode = algorithm_cfg["loss_agg_mode"]
        self.clip_low = algorithm_cfg["clip_ratio"]
        high = algorithm_cfg["clip_ratio_high"]
        self.clip_high = high if high is not None else self.clip_low
        self.kl_coef = algorithm_cfg["kl_coef"] if algorithm_cfg["use_kl_loss"] else None
        self.entropy_coef = algorithm_cfg["entropy_coef"]
        self.tis_cap = algorithm_cfg["rollout_correction"]["tis_cap"]
        self.loss_scale_factor = algorithm_cfg["loss_scale_factor"]

    def micro_batch_loss(
        self, log_probs: torch.Tensor, batch: MicroBatch, counts: MiniBatchCounts, dp_size: int, sums: dict[str, float]
    ) -> torch.Tensor:
        """The micro-batch's share of the mini-batch loss times `dp_size` (the gradients are averaged over the
        data-parallel ranks); its metric sums are added to `sums`."""
        mask, old = batch.mask, batch.old_log_probs
        terms = self.loss_fn(log_probs, old, batch.advantages, mask, self.clip_low, self.clip_high)
        per_token = terms.loss
        if self.tis_cap is not None:
            weights, capped = tis_weights(old.detach(), batch.rollout_log_probs, self.tis_cap)
            per_token = per_token * weights
            sums["tis_weight"] += masked_sum(weights, mask).item()
            sums["tis_capped"] += masked_sum(capped, mask).item()
        if batch.ref_log_probs is not None:
            kl = kl_penalty(log_probs, batch.ref_log_probs)
            per_token = per_token + self.kl_coef * kl
            sums["kl"] += masked_sum(kl.detach(), mask).item()
        if self.entropy_coef:
            per_token = per_token - self.entropy_coef * batch.entropy
        loss = aggregate_loss(
            per_token,
            mask,
            self.agg_mode,
            global_tokens=counts.tokens,
            global_sequences=counts.sequences,
            max_response_length=self.loss_scale_factor,
            dp_size=dp_size,
        )
        sums["pg_loss"] += masked_sum(terms.loss.detach(), mask).item()
        sums["entropy"] += masked_sum(batch.entropy.detach(), mask).item()
        sums["clipped"] += masked_sum(terms.clipped, mask).item()
        sums["ppo_kl"] += masked_sum(terms.approx_kl, mask).item()
        sums["tokens"] += mask.sum().item()
        # the rollout engine's log-probabilities of its own tokens against the actor's of the same policy: the
        # rollout/training mismatch
        sums["logprob_diff"] += masked_sum((old.detach() - batch.rollout_log_probs).abs(), mask).item()
        return loss

    @staticmethod
    def new_sums() -> dict[str, float]:
        return dict.fromkeys(SUM_KEYS, 0.0)

    def metrics(self, total: Mapping[str, float]) -> dict[str, float]:
        """Token means of the ranks' summed metrics (`actor/*`), and the loss as the token-mean terms make it up."""
        tokens = max(total["tokens"], 1.0)
        pg_loss = total["pg_loss"] / tokens
        metrics = {
            "actor/pg_loss": pg_loss,
            "actor/entropy": total["entropy"] / tokens,
            "actor/pg_clipfrac": total["clipped"] / tokens,
            "actor/ppo_kl": total["ppo_kl"] / tokens,
            # mean |rollout engine's log-prob - actor's| over the response tokens, under the policy that generated them
            "rollout/logprob_abs_diff": total["logprob_diff"] / tokens,
        }
        loss = pg_loss
        if self.kl_coef is not None:
            metrics["actor/kl"] = total["kl"] / tokens
            loss += self.kl_coef * metrics["actor/kl"]
        if self.entropy_coef:
            loss -= self.entropy_coef * metrics["actor/entropy"]
        if self.tis_cap is not None:
            metrics["actor/tis_weight_mean"] = total["tis_weight"] / tokens
            metrics["actor/tis_capped_frac"] = total["tis_capped"] / tokens
        return {"actor/loss": loss, **metrics}
