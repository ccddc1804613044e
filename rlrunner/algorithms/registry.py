"""The names the config picks algorithm variants by, each mapped to a lazy "module:attr" entry.

Importing this module imports no torch (config checks use it); an entry's module is imported when it is loaded.
"""

from __future__ import annotations

from typing import Callable

from rlrunner.utils.registry import check_name, load_entry

ADV_ESTIMATORS = {
    "grpo": "rlrunner.algorithms.advantages:grpo",
    "rloo": "rlrunner.algorithms.advantages:rloo",
    "reinforce_plus_plus_baseline": "rlrunner.algorithms.advantages:reinforce_plus_plus_baseline",
}

POLICY_LOSSES = {
    "ppo_clip": "rlrunner.algorithms.policy_losses:ppo_clip",
    "gspo": "rlrunner.algorithms.policy_losses:gspo",
}

# Defined here rather than in aggregation.py (which re-exports it) so that checking a config needs no torch.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def get_adv_estimator(name: str) -> Callable:
    """The advantage estimator registered as `name`; ConfigError naming `algorithm.adv_estimator` if unknown."""
    return load_entry(ADV_ESTIMATORS, name, "algorithm.adv_estimator")


def get_policy_loss(name: str) -> Callable:
    """The per-token policy loss registered as `name`; ConfigError naming `algorithm.policy_loss` if unknown."""
    return load_entry(POLICY_LOSSES, name, "algorithm.policy_loss")


def check_loss_agg_mode(name: str) -> None:
    """ConfigError naming `algorithm.loss_agg_mode` and the choices unless `name` is one of LOSS_AGG_MODES."""
    check_name(dict.fromkeys(LOSS_AGG_MODES), name, "algorithm.loss_agg_mode")
