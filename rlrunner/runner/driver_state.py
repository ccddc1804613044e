"""The driver's part of a checkpoint (its `data/data.pt`, and `data/in_flight.pt` when batches were generated ahead) and
of an in-memory snapshot: the data position, the step and the batches generated for later steps.

    state = DriverState(loader, total_steps)
    state.step = step                        # when the step's batch is drawn: the two parts move together
    saved = state.state_dict()               # {"dataloader": the loader's position, "runner": {"global_step", ...},
                                             #  "in_flight": the batches generated ahead (`in_flight.py`)}
    state.load_state_dict(saved)             # both parts back (a resumed run, a snapshot, an abandoned step)

Both are `Stateful` parts of one `StateParts` (`rlrunner.utils.stateful`): a checkpoint and a snapshot carry the same
parts through the same calls, and a part added here is carried by both.
"""

from __future__ import annotations

from typing import Any

from rlrunner.data.loader import PromptLoader
from rlrunner.runner.in_flight import InFlightBatches
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
        self.in_flight = InFlightBatches()  # the loader's position is after the last of these
        super().__init__({"dataloader": loader, "runner": self.counter, "in_flight": self.in_flight})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        queued = [batch.step for batch in self.in_flight.batches]
        if queued and queued[0] != self.step + 1:
            raise ValueError(f"the state of step {self.step} holds batches generated for steps {queued}")

    @property
    def step(self) -> int:
        return self.counter.step

    @step.setter
    def step(self, value: int) -> None:
        self.counter.step = value
