"""The overlapped schedule (`algorithm.policy_lag`): which steps are generated ahead, and with which weights."""

from __future__ import annotations

import pytest

from rlrunner.runner.in_flight import GeneratedBatch, InFlightBatches, steps_ahead


def _run_schedule(lag: int, total_steps: int, queue: InFlightBatches, first_step: int = 1) -> dict[int, int]:
    """Replay the trainer's schedule: {step: the step whose weights generated its samples}."""
    weights_of = {}
    for step in range(first_step, total_steps + 1):
        batch = queue.pop(step) or GeneratedBatch(step, step - 1, [])
        for ahead in steps_ahead(step, queue.last_step(step), lag, total_steps):
            queue.push(GeneratedBatch(ahead, step - 1, []))
        weights_of[step] = batch.weights_step
    assert len(queue) == 0  # nothing is generated past the last step
    return weights_of


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_step_t_trains_on_the_weights_after_step_t_minus_1_minus_lag(lag: int) -> None:
    weights_of = _run_schedule(lag, 10, InFlightBatches())
    assert weights_of == {step: max(0, step - 1 - lag) for step in range(1, 11)}


def test_one_generation_per_step_once_the_pipeline_is_full() -> None:
    assert steps_ahead(1, 1, 2, 10) == [2, 3]  # the first step fills it
    assert steps_ahead(5, 6, 2, 10) == [7]
    assert steps_ahead(9, 10, 2, 10) == []  # the last steps generate nothing past the run
    assert steps_ahead(5, 5, 0, 10) == []


def test_a_switch_of_lag_at_a_resume_trains_on_what_is_in_flight_then_follows_the_new_lag() -> None:
    # a lag-1 checkpoint of step 4 holds step 5's batch (generated with the weights after step 3)
    queue = InFlightBatches()
    queue.push(GeneratedBatch(5, 3, []))
    assert _run_schedule(0, 8, queue, first_step=5) == {5: 3, 6: 5, 7: 6, 8: 7}
    # a lag-0 checkpoint of step 4 resumed with lag 1: step 5 is generated at its start, then lag 1
    assert _run_schedule(1, 8, InFlightBatches(), first_step=5) == {5: 4, 6: 4, 7: 5, 8: 6}
    assert GeneratedBatch(6, 4, []).lag == 1


def test_batches_out_of_order_are_refused() -> None:
    queue = InFlightBatches()
    queue.push(GeneratedBatch(3, 1, []))
    with pytest.raises(ValueError, match="a batch for step 5 queued where step 4's belongs"):
        queue.push(GeneratedBatch(5, 1, []))
    with pytest.raises(ValueError, match=r"step 2 found the batches of steps \[3\] in flight"):
        queue.pop(2)
