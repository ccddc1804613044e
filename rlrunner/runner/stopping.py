"""Stopping early on request: SIGTERM / SIGINT (a preemption notice, a scheduler's limit) or `runner.max_wall_time_s`.

The first request lets the step loop wind down and write an emergency checkpoint; a second signal
(more than `DUPLICATE_WINDOW_S` after the first) ends the process at once with exit code 128+N,
leaving the last committed checkpoint as it is (Ray kills the workers of a dead driver, the kernel
releases the experiment lock, the next run removes a half-written save). A signal delivered twice
within the window (to the driver and again by the launch script that forwards it) counts once.

The handlers never raise: Ray turns an exception raised by a signal handler during one of its
calls into SystemExit(1).
"""

from __future__ import annotations

import logging
import os
import signal
import time

logger = logging.getLogger(__name__)

DUPLICATE_WINDOW_S = 1.0


class StopRequest:
    """Why the run should stop early, if it should. Read by the step loop between (and during) steps."""

    def __init__(self, max_wall_time_s: float | None = None):
        self.max_wall_time_s = max_wall_time_s
        self.started = time.monotonic()
        self.reason: str | None = None
        self._requested_at: float | None = None

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self._requested_at = time.monotonic()
            logger.warning(
                "%s: stopping after the step in flight (a rollout in flight is abandoned) with an emergency checkpoint",
                reason,
            )

    @property
    def requested(self) -> bool:
        if self.reason is None and self.max_wall_time_s is not None:
            if time.monotonic() - self.started >= self.max_wall_time_s:
                self.request(f"runner.max_wall_time_s={self.max_wall_time_s:g} reached")
        return self.reason is not None

    def on_signal(self, signum: int, frame=None) -> None:
        name = signal.Signals(signum).name
        if self.reason is None:
            self.request(f"{name} received")
            return
        if self.is_duplicate():
            return
        os.write(2, f"rlrunner: stopped at once by a second {name}; the last committed checkpoint is intact\n".encode())
        os._exit(128 + signum)

    def is_duplicate(self) -> bool:
        """Whether a signal arriving now belongs to the stop already requested (delivered twice)."""
        return self._requested_at is not None and time.monotonic() - self._requested_at < DUPLICATE_WINDOW_S

    def install(self) -> None:
        """Handle SIGTERM and SIGINT in this (the main) thread."""
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
