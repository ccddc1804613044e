"""bench_recovery.py's runs: a Supervisor training in this thread while a killer thread SIGKILLs its workers, and
what the run's logs (metrics.jsonl, recovery.jsonl) say afterwards.

The supervisor makes a new `Trainer` for every attempt (`supervisor.trainer`, None before the first); its worker
groups' processes are `trainer.actor_group.hosts[r]["pid"]` and `trainer.rollout_group.hosts[0]["pid"]`.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from benchlib.common import read_jsonl

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from rlrunner.runner.supervisor import Supervisor

POLL_S = 0.05


# -- reading a run's logs --------------------------------------------------------------------------


def recovery_events(log_path: Path | str, event: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(Path(log_path) / "recovery.jsonl") if e["event"] == event]


def metrics_steps(log_path: Path | str) -> list[int]:
    return [int(r["step"]) for r in read_jsonl(Path(log_path) / "metrics.jsonl")]


def check_metrics(log_path: Path | str, last_step: int, finished: bool) -> str:
    """'ok' when metrics.jsonl holds every step 1..last_step exactly once, in order (a stopped run may also
    hold the steps it did after its last checkpoint, still 1..M once each); else what is wrong."""
    steps = metrics_steps(log_path)
    if steps == list(range(1, len(steps) + 1)) and (
        len(steps) == last_step or (not finished and len(steps) >= last_step)
    ):
        return "ok" if len(steps) == last_step else f"ok (1..{len(steps)}; steps after {last_step} not saved)"
    duplicated = sorted({s for s in steps if steps.count(s) > 1})
    missing = sorted(set(range(1, last_step + 1)) - set(steps))
    return f"BAD: {len(steps)} lines, duplicated {duplicated[:10]}, missing {missing[:10]}"


def committed_step(supervisor: Supervisor) -> int:
    """The step of the newest complete checkpoint: the progress a stopped run keeps."""
    from rlrunner.checkpoint import layout
    from rlrunner.storage import basename

    newest = supervisor.ctx.handler.newest_complete()  # its URL
    return (layout.step_from_name(basename(newest)) or 0) if newest is not None else 0


def median_step_s(log_path: Path | str) -> float:
    times = [r["time/step_s"] for r in read_jsonl(Path(log_path) / "metrics.jsonl") if "time/step_s" in r]
    return statistics.median(times) if times else float("nan")


def first_step_logged(supervisor: Supervisor, restart: int) -> bool:
    return any(e["restart"] == restart for e in recovery_events(supervisor.ctx.log_path, "first_step"))


def attempt_timings(supervisor: Supervisor) -> dict[str, float]:
    """The live attempt's start-up: the trainer's start_timings and each WorkerGroup's start_s (workers
    created or adopted + ping + process group). Both groups start side by side; once the actor group is up, its
    `setup` call (model built and sharded) runs while the rollout group may still be starting: rebuild_s minus the
    actor group's start_s is that, plus the weight-sync channels. A lost rank replaced alone has its own phases instead
    (leave_s, join_s, setup_s)."""
    trainer = supervisor.trainer
    if trainer is None:
        return {}
    # the numbers only (a lost rank replaced alone also records which ranks: `replaced_ranks`)
    timings = {key: float(value) for key, value in trainer.start_timings.items() if isinstance(value, (int, float))}
    if "leave_s" in timings:  # a lost rank replaced alone: the groups were not started again (their start_s is old)
        return timings
    for name, group in (("actor", trainer.actor_group), ("rollout", trainer.rollout_group)):
        start_s = getattr(group, "start_s", None)
        if start_s is not None:
            timings[f"{name}_start_s"] = float(start_s)
    if {"rebuild_s", "actor_start_s"} <= timings.keys():
        timings["actor_setup_s"] = timings["rebuild_s"] - timings["actor_start_s"]
    return timings


# -- killing workers -------------------------------------------------------------------------------


@dataclass
class Kill:
    target: str
    pid: int
    time_unix: float
    last_step: int  # the run's newest completed step when the kill happened
    waited_s: float = 0.0  # how long the kill waited for its target to exist (it fell during a rebuild)


def target_pid(supervisor: Supervisor, group_name: str, rank: int) -> int | None:
    """The pid of a live worker of the current attempt's group, or None while that group does not exist."""
    trainer = supervisor.trainer
    group = None if trainer is None else trainer.actor_group if group_name == "actor" else trainer.rollout_group
    if group is None:
        return None
    try:
        return int(group.hosts[rank]["pid"])
    except (AttributeError, IndexError, KeyError):
        return None


def last_step_now(supervisor: Supervisor) -> int:
    """The current attempt's newest completed step, read from its attribute (cheap enough to poll); 0 while a new
    attempt has not restored its checkpoint yet, as the old runner's counter was during a rebuild."""
    trainer = supervisor.trainer
    return int(trainer.global_step) if trainer is not None else 0


def kill_worker(supervisor: Supervisor, group_name: str, rank: int, killed: set[int]) -> Kill | None:
    """SIGKILL the target if it is up (and not already killed); None when there is nothing to kill now."""
    pid = target_pid(supervisor, group_name, rank)
    if pid is None or pid in killed:
        return None
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    killed.add(pid)
    target = f"{group_name} rank {rank}" if group_name == "actor" else f"{group_name} worker {rank}"
    return Kill(target, pid, time.time(), last_step_now(supervisor))


def wait_until(condition: Callable[[], bool], done: threading.Event) -> bool:
    """Poll `condition` until it holds (True) or the run is over (False)."""
    while not done.is_set():
        if condition():
            return True
        time.sleep(POLL_S)
    return False


def stop_due(supervisor: Supervisor) -> bool:
    """Whether the run's stop was requested or its wall-time limit passed (the run notices that lazily)."""
    stop = supervisor.stop
    overdue = stop.max_wall_time_s is not None and time.monotonic() - stop.started >= stop.max_wall_time_s
    return stop.reason is not None or overdue


def kill_until_done(
    supervisor: Supervisor, group_name: str, rank: int, killed: set[int], done: threading.Event
) -> Kill | None:
    """Kill the target as soon as it exists (it may be mid-rebuild); None if the run ended or is stopping first."""
    began = time.time()
    while not done.is_set() and not stop_due(supervisor):
        kill = kill_worker(supervisor, group_name, rank, killed)
        if kill is not None:
            kill.waited_s = kill.time_unix - began
            return kill
        time.sleep(POLL_S)
    return None


def record_error_arrivals(supervisor: Supervisor) -> list[float]:
    """Wrap the supervisor's failure handling (on this instance only) to timestamp when a failure reached the driver.

    `Supervisor._repairable_failure` is where an attempt's error lands: it stamps failed_at, then classifies the
    error (`repairable_cause`); nothing else changes."""
    arrivals: list[float] = []
    original = supervisor._repairable_failure

    def timed_repairable_failure(exc, trainer, budget):
        arrivals.append(time.time())
        return original(exc, trainer, budget)

    supervisor._repairable_failure = timed_repairable_failure
    return arrivals


# -- one run -----------------------------------------------------------------------------------------

Killer = Callable[["Supervisor", threading.Event, "list[Kill]"], None]  # runs beside Supervisor.run()


@dataclass
class RunOutcome:
    wall_s: float
    last_step: int
    finished: bool
    error: str | None
    metrics_check: str
    step_s: float
    kills: list[Kill] = field(default_factory=list)


def run_with_killer(
    cfg: DictConfig, killer: Killer, stop_after_s: float | None = None
) -> tuple[Supervisor, RunOutcome, list[float]]:
    """Train `cfg` to the end in this thread while `killer(supervisor, done, kills)` runs in another."""
    from rlrunner.errors import StoppedEarly
    from rlrunner.runner.stopping import StopRequest
    from rlrunner.runner.supervisor import Supervisor

    supervisor = Supervisor(cfg, StopRequest(stop_after_s))
    arrivals = record_error_arrivals(supervisor)
    done = threading.Event()
    kills: list[Kill] = []
    thread = threading.Thread(target=killer, args=(supervisor, done, kills), daemon=True)
    error: str | None = None
    finished = False
    started = time.monotonic()
    supervisor.stop.started = started
    thread.start()
    try:
        supervisor.run()
        finished = True
    except StoppedEarly as exc:
        error = f"stopped: {exc}"
    except Exception as exc:  # reported in the tables; the benchmark goes on
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    wall = time.monotonic() - started
    done.set()
    thread.join(timeout=30)
    last = supervisor.trainer.global_step if finished else committed_step(supervisor)
    log_path = supervisor.ctx.log_path
    outcome = RunOutcome(
        wall, last, finished, error, check_metrics(log_path, last, finished), median_step_s(log_path), kills
    )
    return supervisor, outcome, arrivals
