"""The driver's part of a checkpoint (its `data/data.pt`) and of an in-memory snapshot: the data position and the step.

    state = DriverState(loader, total_steps)
    state.step = step                        # when the step's batch is drawn: the two parts move together
    saved = state.state_dict()               # {"dataloader": the loader's position, "runner": {"global_step", ...}}
    state.load_state_dict(saved)             # both parts back (a resumed run, a snapshot, an abandoned step)

Both are `Stateful` parts of one `StateParts` (`rlrunner.utils.stateful`): a checkpoint and a snapshot carry the same
parts through the same calls, and a part added here is carried by both.
"""

from __future__ import annotations

from typing import Any

from rlrunner.data.loader import PromptLoader
from rlrunner.utils.stateful import StateParts


class StepCounter:
    """The "runner" part: the step whose batch the loader handed out last (so the data position is the one after it),
    with the epoch and the run's length for whoever reads a checkpoint's data.pt."""

    def __init__(self, loader: PromptLoader, total_steps: int):
        self.loader = loader
        self.total_steps = total_steps
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.step, "epoch": self.loader.epoch, "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["global_step"])


class DriverState(StateParts):
    def __init__(self, loader: PromptLoader, total_steps: int):
        self.counter = StepCounter(loader, total_steps)
        super().__init__({"dataloader": loader, "runner": self.counter})

    @property
    def step(self) -> int:
        return self.counter.step

    @step.setter
    def step(self, value: int) -> None:
        self.counter.step = value
