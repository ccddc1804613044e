"""`Trackers`: the driver's one handle on its trackers, which sends every step to each tracker exactly once.

    trackers = Trackers(cfg.runner.logger.backends, cfg.runner.logger, log_dir, experiment_name, config, resuming)
    trackers.begin(start_step, history)     # every attempt: open (first time), then send what a store is missing
    trackers.log(step, metrics)             # each step
    trackers.end_attempt()                  # an attempt ends (the runs stay open)
    trackers.close("finished")              # or "stopped" / "failed"

A resumed run redoes the steps after its checkpoint; each tracker's store may hold some of them already (sent
before the crash) or miss some it was sent (a killed process's unflushed records). So at `begin` each tracker says
the newest step its store holds, is sent the steps of `metrics.jsonl` after it up to the resume point, and then
only steps after its newest. TensorBoard instead rewrites the steps after the resume point (see tensorboard.py).
A tracker that fails never stops training: a warning, and it is skipped until the next attempt (or, when one
step fails to log, that step is missing in it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlrunner.errors import first_line
from rlrunner.trackers.base import Tracker, numeric_metrics, redact, redact_uri
from rlrunner.trackers.registry import KEY, TRACKERS, check_backends
from rlrunner.trackers.state import TRACKERS_FILE, read_state, write_state
from rlrunner.utils.registry import load_entry

logger = logging.getLogger(__name__)

STATUSES = ("finished", "stopped", "failed")


def plain(value: Any) -> Any:
    """A DictConfig/ListConfig as plain dicts and lists (resolved); anything else as it is."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


class Trackers:
    """The trackers of `backends` for the experiment whose logs are in `log_dir` (see the module docstring)."""

    def __init__(
        self,
        backends: list[str],
        logger_cfg: Mapping[str, Any],
        log_dir: str | os.PathLike,
        run_name: str,
        config: dict[str, Any],
        continue_runs: bool,
    ):
        self.backends = list(plain(backends))
        check_backends(self.backends)
        # each tracker's section (runner.logger.<name>) as a plain dict; tensorboard has none
        self.sections = {name: plain(logger_cfg.get(name)) or {} for name in TRACKERS}
        self.log_dir = Path(log_dir)
        # one display name for every tracker: runner.logger.wandb.name, else the experiment's name
        self.run_name = self.sections["wandb"].get("name") or run_name
        self.config = redact(plain(config))
        self.continue_runs = continue_runs
        self._trackers: dict[str, Tracker] = {}
        self._opened: set[str] = set()
        self._active: dict[str, int] = {}  # tracker -> newest step its store holds, for the trackers of this attempt
        self._failures: dict[str, int] = {}
        self._state: dict[str, dict[str, Any]] | None = None  # trackers.json, read at the first begin

    def begin(self, start_step: int, history: list[dict[str, Any]]) -> None:
        """An attempt starts after `start_step`; `history`: the records of metrics.jsonl (steps <= start_step)."""
        if self._state is None:
            self._state = read_state(self.log_dir) if self.continue_runs else {}
            self._trackers = {name: self._make(name) for name in self.backends}
            self._open_trackers(first=True)
        else:
            self._open_trackers(first=False)
        self._active = {}
        by_step = {r["step"]: r for r in history if isinstance(r.get("step"), int) and r["step"] <= start_step}
        backlog = [by_step[step] for step in sorted(by_step)]  # in step order, each step once (its last record)
        for name in self.backends:
            if name in self._opened:
                self._begin_one(name, start_step, backlog)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Send one step to each tracker whose store does not hold it yet."""
        values = numeric_metrics({k: v for k, v in metrics.items() if k != "step"})
        for name, newest in self._active.items():
            if step <= newest:
                continue  # a redone step the store already holds
            self._active[name] = step
            try:
                self._trackers[name].log(step, values)
            except Exception as exc:
                self._failed(name, f"logging step {step}", exc, "the step is missing in it")

    def end_attempt(self) -> None:
        """The attempt ended: TensorBoard's writer is closed; the other trackers' runs stay open."""
        self._active = {}
        for name in self._opened:
            try:
                self._trackers[name].end_attempt()
            except Exception as exc:
                self._failed(name, "ending the attempt", exc, "going on")

    def close(self, status: str) -> None:
        """End every tracker's run: "finished", "stopped" (on request, to be resumed) or "failed"."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        self._active = {}
        for name in self.backends:
            if name in self._opened:
                try:
                    self._trackers[name].close(status)
                except Exception as exc:
                    self._failed(name, "closing its run", exc, "going on")
        self._opened.clear()
        for name, count in self._failures.items():
            if count > 1:
                logger.warning("tracker %s: %d failures in all in this run (the first was logged)", name, count)

    # -- internals ------------------------------------------------------------------------------------

    def _make(self, name: str) -> Tracker:
        cls = load_entry(TRACKERS, name, KEY)
        return cls(self.sections[name], self.log_dir, self.run_name, self.config)

    def _open_trackers(self, first: bool) -> None:
        """Open the trackers not open yet (all at the first begin; later, those that failed to open)."""
        assert self._state is not None
        changed = first
        for name in self.backends:
            if name in self._opened:
                continue
            previous = self._state.get(name) if self.continue_runs else None
            try:
                entry = self._trackers[name].open(previous or None)
            except Exception as exc:
                self._failed(name, "opening its run", exc, "it is tried again at the next attempt")
                continue
            self._opened.add(name)
            if entry:
                changed |= self._state.get(name) != entry
                self._state[name] = entry
        if changed and (self._state or (self.log_dir / TRACKERS_FILE).exists()):
            try:
                write_state(self.log_dir, self._state)
            except OSError as exc:
                logger.warning("could not write the trackers' run ids in %s: %s", self.log_dir, first_line(exc))

    def _begin_one(self, name: str, start_step: int, backlog: list[dict[str, Any]]) -> None:
        """Start `name`'s attempt and send it the steps of `backlog` its store misses; skip it for this attempt if
        that fails (the next attempt sends them)."""
        tracker = self._trackers[name]
        try:
            tracker.begin_attempt(start_step)
            newest = tracker.last_step()
            missing = [r for r in backlog if r["step"] > newest]
            for record in missing:
                tracker.log(record["step"], numeric_metrics({k: v for k, v in record.items() if k != "step"}))
        except Exception as exc:
            self._failed(name, "starting the attempt", exc, "it is skipped until the next attempt")
            return
        if missing:
            logger.info(
                "tracker %s: sent steps %d..%d again from metrics.jsonl (its store held steps up to %d)",
                name,
                missing[0]["step"],
                missing[-1]["step"],
                newest,
            )
        self._active[name] = missing[-1]["step"] if missing else newest

    def _failed(self, name: str, doing: str, exc: Exception, then: str) -> None:
        count = self._failures[name] = self._failures.get(name, 0) + 1
        message = redact_uri(first_line(exc)) or type(exc).__name__
        if count == 1:
            logger.warning("tracker %s failed %s (%s: %s): %s", name, doing, type(exc).__name__, message, then)
        else:
            logger.debug("tracker %s failed %s (%s: %s)", name, doing, type(exc).__name__, message)
