"""Verifier for the synthetic arithmetic task (prompts like "12+7=", answers like "19")."""

from __future__ import annotations

import re

_INTEGER = re.compile(r"-?[0-9]+")

_FORMAT_CREDIT = 0.2
_DIGIT_CREDIT = 0.7


def _right_aligned_matches(left: str, right: str) -> int:
    """Positions where the strings agree when aligned at their last character."""
    return sum(a == b for a, b in zip(reversed(left), reversed(right)))


def arithmetic_reward(response: str, answer: str) -> float:
    """1.0 for the exact integer; a well-formed wrong integer gets partial credit in [0.2, 0.9).

    The partial credit (a base for the format plus a share for each right-aligned
    matching character) gives a model trained from random init a gradient before
    it ever gets an answer fully right.
    """
    predicted = response.strip()
    expected = answer.strip()
    if predicted == expected:
        return 1.0
    if not _INTEGER.fullmatch(predicted):
        return 0.0
    matches = _right_aligned_matches(predicted, expected)
    return _FORMAT_CREDIT + _DIGIT_CREDIT * matches / max(len(predicted), len(expected))
