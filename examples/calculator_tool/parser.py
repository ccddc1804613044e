"""The tiny model's tool-call format: a turn holding three digits or more calls multiply with its first three.

A real model writes hermes calls (`rollout.multi_turn.parser=hermes`, the default). The embedded character-level model
starts from random weights, and a call it can stumble on is one it can learn: its first random turns hold three digits
now and then, and copying the question's three factors into them is what pays (examples/calculator_tool/reward.py).
A turn with fewer digits is an answer; so is the last turn, whatever it holds (`rollout.multi_turn.max_turns`: no
call is made after it).
"""

from __future__ import annotations

import re

_DIGIT = re.compile(r"\d")


def parse_call(text: str) -> list[dict]:
    """[{"name": "multiply", "arguments": {"numbers": [...]}}] with the turn's first three digits, or [] (an answer)."""
    digits = _DIGIT.findall(text)
    if len(digits) < 3:
        return []
    return [{"name": "multiply", "arguments": {"numbers": [int(digit) for digit in digits[:3]]}}]
