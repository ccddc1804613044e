"""Reward verifiers: each takes ``(response_text, answer_field)`` and returns a float in [0, 1]."""

from __future__ import annotations

from typing import Callable

from rlrunner.rewards.arithmetic import arithmetic_reward
from rlrunner.rewards.math_verifier import answers_match, extract_answer, math_reward

RewardFn = Callable[[str, str], float]

REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "math": math_reward,
    "arithmetic": arithmetic_reward,
}


def get_reward_fn(name: str) -> RewardFn:
    """The registered reward function called ``name``; ValueError for an unknown name."""
    try:
        return REWARD_FUNCTIONS[name]
    except KeyError:
        choices = ", ".join(sorted(REWARD_FUNCTIONS))
        raise ValueError(f"unknown reward verifier '{name}'; choose one of: {choices}") from None


__all__ = [
    "REWARD_FUNCTIONS",
    "answers_match",
    "arithmetic_reward",
    "extract_answer",
    "get_reward_fn",
    "math_reward",
]
