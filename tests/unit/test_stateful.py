"""The one state protocol: named Stateful parts saved and loaded as one (`utils/stateful.py`), the driver's set of them
(`runner/driver_state.py`) and a snapshot's DTensor-free copy (`backends/rank_parts.py`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlrunner.backends.rank_parts import RankRNG, local_tensors, placed_like
from rlrunner.data.loader import PromptLoader
from rlrunner.runner.driver_state import DriverState
from rlrunner.runner.in_flight import GeneratedBatch
from rlrunner.utils.stateful import StateParts

from conftest import assert_bit_equal


class Counter:
    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def test_parts_round_trip_by_name() -> None:
    a, b = Counter(1), Counter(2)
    parts = StateParts({"a": a, "b": b})
    saved = parts.state_dict()
    assert saved == {"a": {"value": 1}, "b": {"value": 2}}
    a.value, b.value = 10, 20
    parts.load_state_dict(saved)
    assert (a.value, b.value) == (1, 2)
    assert parts.without(["a"]).state_dict() == {"b": {"value": 2}}


@pytest.mark.parametrize(
    ("saved", "message"),
    [
        ({"a": {"value": 5}}, "the saved state has no 'b' part (parts here: a, b)"),
        ({"a": {"value": 5}, "b": {"value": 6}, "c": {}}, "the saved state has an unknown 'c' part (parts here: a, b)"),
    ],
)
def test_a_state_from_another_set_of_parts_is_refused_before_any_part_loads(saved: dict, message: str) -> None:
    a, b = Counter(1), Counter(2)
    with pytest.raises(ValueError) as error:
        StateParts({"a": a, "b": b}).load_state_dict(saved)
    assert str(error.value) == message
    assert (a.value, b.value) == (1, 2)


def test_a_part_without_the_protocol_is_refused() -> None:
    with pytest.raises(TypeError, match="state part 'x' \\(int\\) has no state_dict/load_state_dict"):
        StateParts({"x": 3})


def _loader() -> PromptLoader:
    return PromptLoader([{"id": i} for i in range(10)], batch_size=3, seed=7)


def test_the_driver_state_is_the_data_position_and_the_step_as_data_pt_holds_them() -> None:
    loader = _loader()
    state = DriverState(loader, total_steps=5)
    loader.next_batch()
    state.step = 1
    saved = state.state_dict()
    assert sorted(saved) == ["dataloader", "in_flight", "runner"]
    assert saved["runner"] == {"global_step": 1, "epoch": 0, "total_steps": 5}
    assert saved["in_flight"] == {}  # nothing generated ahead: a checkpoint gets no in_flight file
    expected = [loader.next_batch() for _ in range(4)]  # across the epoch's end

    again = DriverState(_loader(), total_steps=5)
    again.load_state_dict(saved)
    assert again.step == 1
    assert [again.counter.loader.next_batch() for _ in range(4)] == expected


def test_the_driver_state_carries_the_batches_generated_ahead_of_its_step() -> None:
    loader = _loader()
    state = DriverState(loader, total_steps=5)
    loader.next_batch()
    state.step = 1
    state.in_flight.push(GeneratedBatch(2, 0, [{"prompt_ids": [3], "reward": 1.0}]))
    saved = state.state_dict()
    again = DriverState(_loader(), total_steps=5)
    again.load_state_dict(saved)
    assert again.in_flight.state_dict() == saved["in_flight"]
    assert again.in_flight.pop(2).samples == [{"prompt_ids": [3], "reward": 1.0}]
    # batches that do not follow the state's step belong to another position: refused
    saved["runner"]["global_step"] = 0
    with pytest.raises(ValueError, match=r"the state of step 0 holds batches generated for steps \[2\]"):
        DriverState(_loader(), total_steps=5).load_state_dict(saved)


def test_the_rng_part_puts_this_process_rng_back() -> None:
    part = RankRNG(3)
    saved = part.state_dict()
    assert list(saved) == ["rank_3"]
    expected = torch.rand(4)
    torch.rand(7)
    part.load_state_dict(saved)
    assert_bit_equal({"draw": torch.rand(4)}, {"draw": expected})


def test_a_state_without_dtensors_is_kept_as_it_is_through_a_snapshot_copy() -> None:
    state = {"w": torch.arange(4.0), "groups": [{"lr": 0.1, "params": ["w"]}], "pair": (torch.ones(2), 3)}
    local = local_tensors(state)
    restored = placed_like(local, state)
    assert restored["groups"] == state["groups"] and isinstance(restored["pair"], tuple) and restored["pair"][1] == 3
    assert_bit_equal({"w": restored["w"], "pair": restored["pair"][0]}, {"w": state["w"], "pair": state["pair"][0]})
