"""The tiny model's tool-call format: a turn of two digits `ab` calls multiply(a, b).

A real model writes hermes calls (`rollout.multi_turn.parser=hermes`, the default). The embedded character-level model
starts from random weights, and a call it can stumble on is one it can learn: a two-digit turn is what it writes
anyway (most answers have two digits), and copying the question's two operands into it is what pays
(examples/calculator_tool/reward.py). Any other turn is an answer, and so is the last turn, whatever it holds
(`rollout.multi_turn.max_turns`: no call is made after it).
"""

from __future__ import annotations

import re

_CALL = re.compile(r"\s*(\d)(\d)\s*")


def parse_call(text: str) -> list[dict]:
    """[{"name": "multiply", "arguments": {"a": ..., "b": ...}}] for a turn of two digits, else [] (an answer)."""
    match = _CALL.fullmatch(text)
    if match is None:
        return []
    return [{"name": "multiply", "arguments": {"a": int(match.group(1)), "b": int(match.group(2))}}]
