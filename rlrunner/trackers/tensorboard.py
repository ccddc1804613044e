"""TensorBoard event files in the log folder, rewritten from the resume point at every attempt.

Unlike the other trackers it continues nothing: each attempt opens a writer whose `purge_step` hides the events
an earlier writer left for steps after the resume point, and then gets every step the attempt logs.
"""

from __future__ import annotations

from typing import Any

from rlrunner.trackers.base import Tracker


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._writer = None
        self._newest = -1

    def open(self, continue_state: dict[str, Any] | None) -> dict[str, Any]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return {}

    def begin_attempt(self, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.end_attempt()
        # a reader drops the events of steps >= purge_step written before this writer's start marker
        purge_step = start_step + 1 if start_step > 0 else 0
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)
        self._newest = purge_step - 1

    def last_step(self) -> int:
        return self._newest

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is None:
            raise RuntimeError("TensorBoard: log() outside an attempt")
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()
        self._newest = max(self._newest, step)

    def end_attempt(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()

    def close(self, status: str) -> None:
        self.end_attempt()
