"""Rewards: the built-in verifiers, a user's own reward function, and the processes that score with either.

Every reward is called with verl's signature, `fn(data_source, solution_str, ground_truth, extra_info)`, returning a
float or a dict whose `score` is the reward (its other numeric keys become metrics). The built-in verifiers are such
functions too (`builtin.py`), registered by name in `BUILTIN_VERIFIERS` (`reward.verifier`); a user's own is named by
`reward.function` (`function.py`). Scoring runs in processes of its own (`scorer.py`, `scoring_process.py`), so that a
slow reward runs in parallel and a hung one can be stopped.
"""

from __future__ import annotations

from rlrunner.rewards.arithmetic import arithmetic_reward
from rlrunner.rewards.math_verifier import answers_match, extract_answer, math_reward

# reward.verifier -> "module:function" with verl's signature (imported by the scoring processes)
BUILTIN_VERIFIERS: dict[str, str] = {
    "math": "rlrunner.rewards.builtin:math_score",
    "arithmetic": "rlrunner.rewards.builtin:arithmetic_score",
}

__all__ = [
    "BUILTIN_VERIFIERS",
    "answers_match",
    "arithmetic_reward",
    "extract_answer",
    "math_reward",
]
