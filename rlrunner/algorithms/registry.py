"""The names the config picks algorithm variants by, each mapped to a lazy "module:attr" entry.

Importing this module imports no torch (config checks use it); an entry's module is imported when it is loaded.
"""

from __future__ import annotations

from typing import Any, Callable

from rlrunner.errors import ConfigError
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


def check_algorithm(algorithm: Any) -> None:
    """ConfigError naming the first `algorithm.*` key of the seam whose value cannot work (names, the correction's
    cap, the normaliser)."""
    check_name(ADV_ESTIMATORS, algorithm.adv_estimator, "algorithm.adv_estimator")
    check_name(POLICY_LOSSES, algorithm.policy_loss, "algorithm.policy_loss")
    check_loss_agg_mode(algorithm.loss_agg_mode)
    if algorithm.loss_scale_factor <= 0:
        raise ConfigError(f"algorithm.loss_scale_factor must be positive, got {algorithm.loss_scale_factor}")
    cap = algorithm.rollout_correction.tis_cap
    if cap is not None and cap <= 0:
        raise ConfigError(f"algorithm.rollout_correction.tis_cap must be positive or null, got {cap}")
    lag = algorithm.policy_lag
    if lag < 0:
        raise ConfigError(f"algorithm.policy_lag must be 0 (synchronous) or more, got {lag}")
    if lag > 0 and cap is None:
        raise ConfigError(
            f"algorithm.policy_lag={lag} trains on samples {lag} update(s) old: set "
            "algorithm.rollout_correction.tis_cap (e.g. 2.0) so the importance weights correct for it"
        )
