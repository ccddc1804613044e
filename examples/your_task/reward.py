"""The example task's reward function, written as for verl: one function, a scorer per data source.

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info)`; so does rlrunner, with the same
arguments, so a file like this one runs in either unchanged.
"""


def add_score(solution: str, ground_truth: str) -> dict:
    """1.0 for the exact sum; 0.1 for a well-formed wrong number (a format reward, as verl's gsm8k scorer gives)."""
    answer = solution.strip()
    correct = answer == ground_truth
    return {"score": 1.0 if correct else 0.1 if answer.isdigit() else 0.0, "acc": float(correct)}


def copy_score(solution: str, ground_truth: str) -> float:
    """The share of the digits copied in the right place."""
    answer = solution.strip()
    return sum(a == b for a, b in zip(answer, ground_truth)) / max(len(answer), len(ground_truth))


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "add":
        return add_score(solution_str, ground_truth)
    if data_source == "copy":
        return copy_score(solution_str, ground_truth)
    raise NotImplementedError(f"no reward for data source {data_source!r}")
