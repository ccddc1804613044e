"""The calculator job's reward (verl's signature): 1.0 for the exact product; otherwise partial credit, under 0.85.

The partial credit gives a model that starts from random weights a gradient before it ever gets an answer right: for a
call to the tool (0.05) and each of the question's factors it holds in its place (0.1 each), for the answer's digits in
their places in what the tool said (up to 0.3), for the answer's digits in their places in the product (up to 0.1), and
0.05 when it has as many digits. The call and the copy weigh most: they are what makes an exact answer with the tool.
The same function scores the job without the tool (no calls: the answer's credit alone); compare the two jobs'
`rollout/accuracy` as well as their rewards (docs/agents.md). The trajectory is in `extra_info`.
"""

from __future__ import annotations

import re

ANSWER_CREDIT = 0.1  # an answer's digits that match the product's, from the left
LENGTH_CREDIT = 0.05  # an answer of as many digits as the product
CALL_CREDIT = 0.05  # a call made, whatever its factors
FACTOR_CREDIT = 0.1  # each of the question's factors a call holds in its place
COPY_CREDIT = 0.3  # an answer's digits that match the tool's last answer, from the left


def digits_in_place(got: str, wanted: str) -> float:
    """The share of `wanted`'s digits that `got` (all digits, or nothing counts) has in the same place, from the left;
    a longer `got` counts its extra digits against it."""
    if not got.isdigit() or not wanted:
        return 0.0
    return sum(a == b for a, b in zip(got, wanted)) / max(len(got), len(wanted))


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> dict:
    answer, truth = solution_str.strip(), str(ground_truth)
    if answer == truth:
        return {"score": 1.0, "answer_credit": 1.0, "call_credit": 0.0, "copy_credit": 0.0}
    partial = ANSWER_CREDIT * digits_in_place(answer, truth) + LENGTH_CREDIT * (
        answer.isdigit() and len(answer) == len(truth)
    )
    factors = [int(n) for n in re.findall(r"\d+", extra_info.get("prompt", ""))]
    call = copy = 0.0
    for made in extra_info.get("trajectory", {}).get("tool_calls", []):
        numbers = (made.get("arguments") or {}).get("numbers")
        if not made.get("made", True) or made.get("error") or not isinstance(numbers, list):
            continue
        call = max(call, CALL_CREDIT + FACTOR_CREDIT * sum(got == wanted for got, wanted in zip(numbers, factors)))
        copy = COPY_CREDIT * digits_in_place(answer, made["output"])
    return {"score": partial + call + copy, "answer_credit": partial, "call_credit": call, "copy_credit": copy}
