"""The batches an overlapped run has generated ahead of their step (`algorithm.policy_lag` k >= 1), and its schedule.

With lag k the samples trained at step t were generated with the weights after step t-1-k (step 0's, the initial
weights, at the run's first steps): during step t's update the rollout workers, which still hold the weights after
step t-1, generate the batch of step t+k. What was generated and not yet trained on is the driver's "in_flight" state
part, carried by checkpoints (`data/in_flight.pt`) and snapshots beside the data position, so a resumed run trains
on the same samples. The schedule is a function of the step alone, never of timing:

    queue = InFlightBatches()
    batch = queue.pop(step)                            # generated ahead, or None: generate it now (lag 0 for it)
    for ahead in steps_ahead(step, queue.last_step(step), lag, total_steps): ...   # generate during the update
    queue.push(GeneratedBatch(ahead, weights_step=step - 1, samples=...))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GeneratedBatch:
    step: int  # the step that trains on it
    weights_step: int  # the weights it was generated with: those after this step (0: the initial ones)
    samples: list[dict[str, Any]]  # scored, in prompt order

    @property
    def lag(self) -> int:
        """How many updates its weights are behind the policy it is trained against (0: on-policy)."""
        return self.step - 1 - self.weights_step


@dataclass
class SubmittedUpdate:
    """An update asked of the actor ranks (`Trainer.submit_update`), not yet collected."""

    step: int
    refs: list[Any]  # one call per rank
    micro_batches: int  # each rank's forward/backward passes (the same on every rank)


def steps_ahead(step: int, last_queued: int, lag: int, total_steps: int) -> list[int]:
    """The steps whose batches are generated during step `step`'s update: those after `last_queued` (the last step
    with a batch already generated, `step` included) up to `step + lag`, none past the run's last step."""
    return list(range(max(last_queued, step) + 1, min(step + lag, total_steps) + 1))


class InFlightBatches:
    """Generated batches waiting for their step, oldest first (a `Stateful` part of the driver's state)."""

    def __init__(self) -> None:
        self.batches: list[GeneratedBatch] = []

    def __len__(self) -> int:
        return len(self.batches)

    def last_step(self, default: int) -> int:
        """The last step that has a batch here, or `default`."""
        return self.batches[-1].step if self.batches else default

    def push(self, batch: GeneratedBatch) -> None:
        expected = self.last_step(batch.step - 1) + 1
        if batch.step != expected:
            raise ValueError(f"a batch for step {batch.step} queued where step {expected}'s belongs")
        self.batches.append(batch)

    def peek(self, step: int) -> GeneratedBatch | None:
        """Step `step`'s batch if it is the next one, left in place (the state still holds it)."""
        return self.batches[0] if self.batches and self.batches[0].step == step else None

    def pop(self, step: int) -> GeneratedBatch | None:
        """Step `step`'s batch, or None when none was generated ahead. A queue that starts at another step does not
        belong to this run's position (a driver bug or a mismatched state): an error, never a silent skip."""
        if not self.batches:
            return None
        if self.batches[0].step != step:
            raise ValueError(f"step {step} found the batches of steps {[b.step for b in self.batches]} in flight")
        return self.batches.pop(0)

    def state_dict(self) -> dict[str, Any]:
        """{} with nothing in flight (a lag-0 run's checkpoint has no in_flight file)."""
        if not self.batches:
            return {}
        return {
            "batches": [{"step": b.step, "weights_step": b.weights_step, "samples": b.samples} for b in self.batches]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches = []
        for saved in state.get("batches", []):
            self.push(GeneratedBatch(int(saved["step"]), int(saved["weights_step"]), list(saved["samples"])))
