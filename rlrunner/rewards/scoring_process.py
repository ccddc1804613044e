"""A scoring process: loads the reward function itself, then scores what its parent sends, one result per call.

    python -m rlrunner.rewards.scoring_process FD_IN FD_OUT PARENT_PID

The protocol is the process pool's (`rlrunner.utils.process_pool.serve`): the load payload is (spec, kwargs), an item
(data_source, solution_str, ground_truth, extra_info), its value (score, extras). It imports neither torch nor the rest
of rlrunner, only what the reward function needs.
"""

from __future__ import annotations

from typing import Any, Callable

from rlrunner.rewards.function import read_result
from rlrunner.utils.process_pool import serve
from rlrunner.utils.user_code import load_object


def load(payload: Any) -> tuple[Callable[[Any], Any], None]:
    spec, kwargs = payload
    function = load_object(spec)

    def score(item: tuple) -> tuple[float, dict[str, float]]:
        data_source, solution_str, ground_truth, extra_info = item
        value = function(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
            **kwargs,
        )
        return read_result(value)

    return score, None


if __name__ == "__main__":
    serve(load)
