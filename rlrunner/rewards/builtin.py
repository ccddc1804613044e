"""The built-in verifiers in verl's reward-function signature (what `reward.verifier` names)."""

from __future__ import annotations

from typing import Any

from rlrunner.rewards.arithmetic import arithmetic_reward
from rlrunner.rewards.math_verifier import math_reward


def arithmetic_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """The synthetic arithmetic task's verifier (partial credit for a well-formed integer)."""
    return arithmetic_reward(solution_str, str(ground_truth))


def math_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """GSM8K / MATH answers: the last \\boxed{} (or `#### x`) against the ground truth, as numbers when both parse."""
    return math_reward(solution_str, str(ground_truth))
