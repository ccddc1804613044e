"""The calculator job's reward (verl's signature): the arithmetic verifier's credit for the final answer, or, when
higher, credit for a call to the tool with the question's operands (the trajectory is in `extra_info`).

The answer gets 1.0 when exact, partial credit for a well-formed integer with some digits in place (at most 0.9). A
call earns up to 0.5 for its arguments, 0.25 for each of the question's operands it holds: what lets a model find out
that calling the tool with the question's operands pays, before it has learned to copy the tool's answer (an exact
answer is worth twice as much).
"""

from __future__ import annotations

import re

from rlrunner.rewards.arithmetic import arithmetic_reward

OPERAND_CREDIT = 0.25  # each of the question's operands a call holds


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> dict:
    answer = arithmetic_reward(solution_str, str(ground_truth))
    call = 0.0
    operands = re.fullmatch(r"(\d+)\*(\d+)=", extra_info.get("prompt", ""))
    for made in extra_info.get("trajectory", {}).get("tool_calls", []):
        arguments = made.get("arguments") or {}
        if operands is None or set(arguments) != {"a", "b"} or made.get("error"):
            continue
        right = (arguments["a"] == int(operands.group(1))) + (arguments["b"] == int(operands.group(2)))
        call = max(call, OPERAND_CREDIT * right)
    return {"score": max(answer, call), "answer_credit": answer, "call_credit": call}
