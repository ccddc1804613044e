#!/usr/bin/env python
"""In-job recovery of rlrunner's GRPO runner: how long a restart takes, and what failures cost in goodput.

Everything runs on a local Ray started by this script (`ray.init(address="local", num_cpus=--num-cpus)`),
with the default job (configs/grpo.yaml: 2 FSDP2 actor ranks + 1 rollout worker at 0.5 CPU each, the
embedded tiny Qwen2, checkpoints every `runner.save_interval` steps). Every run writes to a fresh temp
folder with the progress bar and TensorBoard off. Workers are killed with SIGKILL on their process id
(`runner.actor_group.hosts[r]["pid"]`, `runner.rollout_group.hosts[0]["pid"]`) from a thread while
`GRPORunner.run()` trains in the main thread, as tests/test_recovery.py does.

1. Recovery time (`--recovery-steps` steps, `--kills` kills). The first kill comes `--kill-delay` s after
   the first checkpoint is committed (so every restart loads one); each further kill comes `--kill-delay`
   s after the previous restart's first completed step. Targets cycle actor rank 1, rollout 0, actor
   rank 0, rollout 0. The phases of each restart come from `<log_path>/recovery.jsonl`:

     detection   failure.failed_at_unix - kill time (the runner stamps failed_at when it catches the error)
   and, adding up exactly to "total":
     error reaches driver   kill -> the runner's repairable_cause() is entered (this script wraps that
                 method on the runner instance to timestamp it; nothing else changes)
     classify    repairable_cause (pings every worker for up to 1 s to name the dead ones) + the log line
     teardown    failure.teardown_s (ray.kill of every worker of both groups, placement groups removed)
     find ckpt   the rest of the gap up to start(): remove leftovers + verify the newest checkpoint (CRC-32)
     wait        resumed.wait_s (the new placement groups waiting for free CPUs)
     rebuild     resumed.rebuild_s (new worker processes, process group, model built and sharded)
     load        resumed.load_s (storage probe + checkpoint load + weight sync to the rollout worker)
     1st step    first_step.time_unix - resumed.time_unix (the first training step after the restart)
     total       first_step.time_unix - kill time
   plus the steps lost per kill (failure.lost_steps: done since the last checkpoint, to be redone), and
   rebuild_s split by group (each WorkerGroup's start_s, read from the live runner) next to the run's
   initial start.

2. Goodput under failure injection (`--goodput-steps` steps; 400 by default, half the default job, to keep
   the whole script near 12 minutes). A timer thread SIGKILLs one worker every T seconds for each T in
   `--periods` (actor rank 1 and rollout worker 0 in turn; a kill that falls while the groups are being
   rebuilt waits until its target exists, and the next kill is T s after it), next to the same job
   without failures. Goodput = completed training steps / wall time of `GRPORunner.run()` (Ray start
   excluded), as a ratio to the no-failure run. A run with failures still going after `--max-run-s`
   (default: twice the no-failure run's wall time) is stopped through the runner's own StopRequest
   (max_wall_time_s: emergency checkpoint, StoppedEarly) and its committed steps count. After each run
   metrics.jsonl is checked to hold every step 1..N exactly once.

Run from the repository root (the defaults take about 12 minutes on 2 CPU cores):

    .venv/bin/python benchmarks/bench_recovery.py
    .venv/bin/python benchmarks/bench_recovery.py --kills 3 --periods 20 --goodput-steps 200
    .venv/bin/python benchmarks/bench_recovery.py --only goodput --save-interval 10
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from itertools import cycle
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from rlrunner.runner.grpo_runner import GRPORunner

REPO_ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.05
RECOVERY_TARGETS = [("actor", 1), ("rollout", 0), ("actor", 0), ("rollout", 0)]
GOODPUT_TARGETS = [("actor", 1), ("rollout", 0)]


# -- configuration and Ray -------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("recovery", "goodput"), default=None, help="run one of the two parts")
    parser.add_argument("--recovery-steps", type=int, default=300, help="steps of the recovery-time job")
    parser.add_argument("--kills", type=int, default=5, help="workers killed in the recovery-time job")
    parser.add_argument("--kill-delay", type=float, default=3.0, help="seconds after a recovery's first step before the next kill")
    parser.add_argument("--periods", default="10,20,40", help="comma-separated kill periods T (seconds) for the goodput part")
    parser.add_argument("--goodput-steps", type=int, default=400, help="steps of each goodput job (the default job has 800)")
    parser.add_argument(
        "--max-run-s", type=float, default=None,
        help="stop a goodput run with failures still going after this long; its committed steps count (default: 2 x the no-failure run's wall time)",
    )
    parser.add_argument("--save-interval", type=int, default=50, help="runner.save_interval")
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count() or 1, help="CPUs of the local Ray")
    parser.add_argument("--max-restarts", type=int, default=10_000, help="runner.recovery.max_restarts")
    parser.add_argument("--workdir", default=None, help="where run folders go (default: a new folder under /tmp, deleted at the end)")
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run, e.g. rollout.max_new_tokens=6")
    args = parser.parse_args(argv)
    args.period_list = [float(p) for p in args.periods.split(",") if p.strip()] if args.periods else []
    return args


def build_config(output_dir: Path, steps: int, args: argparse.Namespace, *extra: str) -> DictConfig:
    """The default job (configs/grpo.yaml) with this benchmark's overrides."""
    from rlrunner.config import load_config

    return load_config(
        [
            f"runner.output_dir={output_dir}",
            f"runner.max_steps={steps}",
            f"runner.save_interval={args.save_interval}",
            "runner.logger.progress_bar=false",
            "runner.logger.tensorboard=false",
            f"runner.recovery.max_restarts={args.max_restarts}",
            *args.overrides,
            *extra,
        ]
    )


def start_ray(num_cpus: int) -> None:
    import ray

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)


def configure_logging() -> None:
    """rlrunner's warnings and errors (one line per restart) on stderr; Ray and torch quiet."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("ray", "torch.distributed", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


# -- reading a run's logs --------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return records


def recovery_events(log_path: Path, event: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(log_path / "recovery.jsonl") if e["event"] == event]


def metrics_steps(log_path: Path) -> list[int]:
    return [int(r["step"]) for r in read_jsonl(log_path / "metrics.jsonl")]


def check_metrics(log_path: Path, last_step: int, finished: bool) -> str:
    """'ok' when metrics.jsonl holds every step 1..last_step exactly once, in order (a stopped run may also
    hold the steps it did after its last checkpoint, still 1..M once each); else what is wrong."""
    steps = metrics_steps(log_path)
    if steps == list(range(1, len(steps) + 1)) and (len(steps) == last_step or (not finished and len(steps) >= last_step)):
        return "ok" if len(steps) == last_step else f"ok (1..{len(steps)}; steps after {last_step} not saved)"
    duplicated = sorted({s for s in steps if steps.count(s) > 1})
    missing = sorted(set(range(1, last_step + 1)) - set(steps))
    return f"BAD: {len(steps)} lines, duplicated {duplicated[:10]}, missing {missing[:10]}"


def committed_step(runner: GRPORunner) -> int:
    """The step of the newest complete checkpoint: the progress a stopped run keeps."""
    from rlrunner.checkpoint import layout

    newest = runner.handler.newest_complete()
    return (layout.step_from_name(newest.name) or 0) if newest is not None else 0


def median_step_s(log_path: Path) -> float:
    times = [r["time/step_s"] for r in read_jsonl(log_path / "metrics.jsonl") if "time/step_s" in r]
    return statistics.median(times) if times else float("nan")


# -- killing workers -------------------------------------------------------------------------------


@dataclass
class Kill:
    target: str
    pid: int
    time_unix: float
    last_step: int  # the runner's newest completed step when the kill happened
    waited_s: float = 0.0  # how long the kill waited for its target to exist (it fell during a rebuild)


def target_pid(runner: GRPORunner, group_name: str, rank: int) -> int | None:
    """The pid of a live worker of the runner's current group, or None while that group does not exist."""
    group = runner.actor_group if group_name == "actor" else runner.rollout_group
    if group is None:
        return None
    try:
        return int(group.hosts[rank]["pid"])
    except (AttributeError, IndexError, KeyError):
        return None


def kill_worker(runner: GRPORunner, group_name: str, rank: int, killed: set[int]) -> Kill | None:
    """SIGKILL the target if it is up (and not already killed); None when there is nothing to kill now."""
    pid = target_pid(runner, group_name, rank)
    if pid is None or pid in killed:
        return None
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    killed.add(pid)
    return Kill(f"{group_name} rank {rank}" if group_name == "actor" else f"{group_name} worker {rank}", pid, time.time(), last_step_now(runner))


def last_step_now(runner: GRPORunner) -> int:
    """The runner's newest completed step (read from its attribute: cheap enough to poll)."""
    return int(runner.global_step)


def wait_until(condition: Callable[[], bool], done: threading.Event) -> bool:
    """Poll `condition` until it holds (True) or the run is over (False)."""
    while not done.is_set():
        if condition():
            return True
        time.sleep(POLL_S)
    return False


def stop_due(runner: GRPORunner) -> bool:
    """Whether the run's stop was requested or its wall-time limit passed (the runner notices that lazily)."""
    stop = runner.stop
    overdue = stop.max_wall_time_s is not None and time.monotonic() - stop.started >= stop.max_wall_time_s
    return stop.reason is not None or overdue


def kill_until_done(runner: GRPORunner, group_name: str, rank: int, killed: set[int], done: threading.Event) -> Kill | None:
    """Kill the target as soon as it exists (it may be mid-rebuild); None if the run ended or is stopping first."""
    began = time.time()
    while not done.is_set() and not stop_due(runner):
        kill = kill_worker(runner, group_name, rank, killed)
        if kill is not None:
            kill.waited_s = kill.time_unix - began
            return kill
        time.sleep(POLL_S)
    return None


def record_error_arrivals(runner: GRPORunner) -> list[float]:
    """Wrap runner.repairable_cause (on this instance only) to timestamp when a failure reached the driver."""
    arrivals: list[float] = []
    original = runner.repairable_cause

    def timed_repairable_cause(exc: BaseException) -> str | None:
        arrivals.append(time.time())
        return original(exc)

    runner.repairable_cause = timed_repairable_cause
    return arrivals


Killer = Callable[["GRPORunner", threading.Event, "list[Kill]"], None]  # runs beside GRPORunner.run()


@dataclass
class RunOutcome:
    wall_s: float
    last_step: int
    finished: bool
    error: str | None
    metrics_check: str
    step_s: float
    kills: list[Kill] = field(default_factory=list)


def run_with_killer(cfg: DictConfig, killer: Killer, stop_after_s: float | None = None) -> tuple[GRPORunner, RunOutcome, list[float]]:
    """Train `cfg` to the end in this thread while `killer(runner, done, kills)` runs in another."""
    from rlrunner.errors import StoppedEarly
    from rlrunner.runner.grpo_runner import GRPORunner
    from rlrunner.runner.stopping import StopRequest

    runner = GRPORunner(cfg, StopRequest(stop_after_s))
    arrivals = record_error_arrivals(runner)
    done = threading.Event()
    kills: list[Kill] = []
    thread = threading.Thread(target=killer, args=(runner, done, kills), daemon=True)
    error: str | None = None
    finished = False
    started = time.monotonic()
    runner.stop.started = started
    thread.start()
    try:
        runner.run()
        finished = True
    except StoppedEarly as exc:
        error = f"stopped: {exc}"
    except Exception as exc:  # reported in the tables; the benchmark goes on
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    wall = time.monotonic() - started
    done.set()
    thread.join(timeout=30)
    last = runner.global_step if finished else committed_step(runner)
    outcome = RunOutcome(wall, last, finished, error, check_metrics(runner.log_path, last, finished), median_step_s(runner.log_path), kills)
    return runner, outcome, arrivals


# -- 1. recovery time ------------------------------------------------------------------------------


# "detection" is the runner's own (failed_at_unix - kill); the others add up exactly to "total".
PHASES = ["detection", "error reaches driver", "classify", "teardown", "find ckpt", "wait", "rebuild", "load", "1st step", "total"]


@dataclass
class Restart:
    kill: Kill
    failure: dict[str, Any]
    resumed: dict[str, Any] | None
    first_step: dict[str, Any] | None
    arrival_unix: float | None
    phases: dict[str, float] = field(default_factory=dict)
    attempt: dict[str, float] = field(default_factory=dict)  # group start times of the attempt this restart built


def attempt_timings(runner: GRPORunner) -> dict[str, float]:
    """The live attempt's start-up: the runner's start_timings and each WorkerGroup's start_s (workers
    created + ping + process group; the actor group's `setup` call, which builds and shards the model, is
    the rest of rebuild_s)."""
    timings = {key: float(value) for key, value in getattr(runner, "start_timings", {}).items()}
    for name, group in (("actor", runner.actor_group), ("rollout", runner.rollout_group)):
        start_s = getattr(group, "start_s", None)
        if start_s is not None:
            timings[f"{name}_start_s"] = float(start_s)
    if {"rebuild_s", "actor_start_s", "rollout_start_s"} <= timings.keys():
        timings["actor_setup_s"] = timings["rebuild_s"] - timings["actor_start_s"] - timings["rollout_start_s"]
    return timings


def first_step_logged(runner: GRPORunner, restart: int) -> bool:
    return any(e["restart"] == restart for e in recovery_events(runner.log_path, "first_step"))


def recovery_killer(args: argparse.Namespace, attempts: list[dict[str, float]]) -> Killer:
    """The kill schedule of part 1: after the first checkpoint, then after each recovery's first step.
    Before each kill (and after the last recovery) the live attempt's start-up timings go to `attempts`."""

    def killer(runner: GRPORunner, done: threading.Event, kills: list[Kill]) -> None:
        killed: set[int] = set()
        targets = cycle(RECOVERY_TARGETS)
        for index in range(args.kills):
            if index == 0:  # after the first checkpoint, so that every restart loads one
                ready = lambda: (runner.last_saved_step or 0) >= args.save_interval  # noqa: E731
            else:
                ready = lambda: first_step_logged(runner, index)  # noqa: E731
            if not wait_until(ready, done):
                return
            attempts.append(attempt_timings(runner))
            if done.wait(args.kill_delay):
                return
            kill = kill_until_done(runner, *next(targets), killed, done)
            if kill is None:
                return
            kills.append(kill)
            print(f"  kill {index + 1}: {kill.target} (pid {kill.pid}) after step {kill.last_step}", flush=True)
        if wait_until(lambda: first_step_logged(runner, args.kills), done):
            attempts.append(attempt_timings(runner))

    return killer


def restart_phases(kill: Kill, failure: dict, resumed: dict | None, first: dict | None, arrival: float | None) -> dict[str, float]:
    torn_down_at = failure["time_unix"]  # the failure event is written right after the teardown
    phases = {
        "detection": failure["failed_at_unix"] - kill.time_unix,
        "teardown": failure["teardown_s"],
    }
    if arrival is not None:
        phases["error reaches driver"] = arrival - kill.time_unix
        phases["classify"] = torn_down_at - failure["teardown_s"] - arrival
    if resumed is not None:
        start_s = resumed["wait_s"] + resumed["rebuild_s"] + resumed["load_s"]
        phases["find ckpt"] = resumed["time_unix"] - start_s - torn_down_at
        phases.update({"wait": resumed["wait_s"], "rebuild": resumed["rebuild_s"], "load": resumed["load_s"]})
        if first is not None:
            phases["1st step"] = first["time_unix"] - resumed["time_unix"]
            phases["total"] = first["time_unix"] - kill.time_unix
    return phases


def match_restarts(log_path: Path, kills: list[Kill], arrivals: list[float], attempts: list[dict[str, float]]) -> list[Restart]:
    """Kill i caused restart i+1 (kills are serialized on the previous recovery's first step)."""
    failures = recovery_events(log_path, "failure")
    resumed = {e["restart"]: e for e in recovery_events(log_path, "resumed")}
    first = {e["restart"]: e for e in recovery_events(log_path, "first_step")}
    restarts = []
    for index, kill in enumerate(kills):
        number = index + 1
        failure = next((f for f in failures if f["restart"] == number), None)
        if failure is None:
            continue
        arrival = arrivals[index] if index < len(arrivals) else None
        phases = restart_phases(kill, failure, resumed.get(number), first.get(number), arrival)
        attempt = attempts[number] if number < len(attempts) else {}
        restarts.append(Restart(kill, failure, resumed.get(number), first.get(number), arrival, phases, attempt))
    return restarts


def measure_recovery(args: argparse.Namespace, workdir: Path) -> None:
    print(f"\n## 1. Recovery time: {args.recovery_steps} steps, {args.kills} SIGKILLs, save_interval {args.save_interval}\n", flush=True)
    cfg = build_config(workdir / "recovery", args.recovery_steps, args)
    attempts: list[dict[str, float]] = []
    runner, outcome, arrivals = run_with_killer(cfg, recovery_killer(args, attempts))
    restarts = match_restarts(runner.log_path, outcome.kills, arrivals, attempts)
    failures = recovery_events(runner.log_path, "failure")
    print()
    print(phase_summary_table(restarts))
    print()
    print(per_kill_table(restarts, outcome.step_s))
    print()
    print(rebuild_table(attempts[:1], restarts))
    print()
    print(f"- run: {describe_outcome(outcome)}; wall {outcome.wall_s:.1f} s; median step {outcome.step_s:.3f} s")
    print(f"- kills: {len(outcome.kills)}, failures logged: {len(failures)} (restarts beyond the kills: {max(0, len(failures) - len(outcome.kills))})")
    for failure in failures:
        print(f"  - restart {failure['restart']}: step {failure['step']}, cause: {failure['cause']}")
    print(f"- metrics.jsonl steps 1..{outcome.last_step} exactly once: {outcome.metrics_check}")


def phase_summary_table(restarts: list[Restart]) -> str:
    rows = ["| phase | median s | min s | max s | n |", "|---|---:|---:|---:|---:|"]
    for phase in PHASES:
        values = [r.phases[phase] for r in restarts if phase in r.phases]
        if values:
            rows.append(f"| {phase} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} | {len(values)} |")
    lost = [r.failure["lost_steps"] for r in restarts]
    if lost:
        rows.append(f"| lost steps | {statistics.median(lost):g} | {min(lost)} | {max(lost)} | {len(lost)} |")
    return "\n".join(rows)


def per_kill_table(restarts: list[Restart], step_s: float) -> str:
    head = ["kill", "target", "after step", "resumed at"] + PHASES + ["lost steps", "redo s"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * 4 + "---:|" * (len(head) - 4)]
    for index, restart in enumerate(restarts, 1):
        resumed_at = restart.resumed["step"] if restart.resumed else "-"
        cells = [str(index), restart.kill.target, str(restart.kill.last_step), str(resumed_at)]
        cells += [f"{restart.phases[p]:.2f}" if p in restart.phases else "-" for p in PHASES]
        lost = restart.failure["lost_steps"]
        cells += [str(lost), f"{lost * step_s:.1f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


REBUILD_PARTS = [
    ("wait_s", "wait for placement"),
    ("actor_start_s", "actor group: 2 processes started, ping, process group"),
    ("rollout_start_s", "rollout group: process started, ping"),
    ("actor_setup_s", "actor setup (model built and sharded, optimizer)"),
    ("rebuild_s", "rebuild_s (sum of the three above)"),
    ("load_s", "load_s (storage probe, checkpoint load, weight sync)"),
]


def rebuild_table(initial: list[dict[str, float]], restarts: list[Restart]) -> str:
    """Where the (re)start time goes: the initial start of the run next to the median restart."""
    rows = ["| part of start() | initial start s | restart median s | restart min s | restart max s |", "|---|---:|---:|---:|---:|"]
    for key, label in REBUILD_PARTS:
        values = [r.attempt[key] for r in restarts if key in r.attempt]
        first = f"{initial[0][key]:.2f}" if initial and key in initial[0] else "-"
        if values or first != "-":
            stats = [f"{statistics.median(values):.2f}", f"{min(values):.2f}", f"{max(values):.2f}"] if values else ["-"] * 3
            rows.append(f"| {label} | {first} | " + " | ".join(stats) + " |")
    return "\n".join(rows)


def describe_outcome(outcome: RunOutcome) -> str:
    if outcome.finished:
        return f"finished at step {outcome.last_step}"
    return f"ended with step {outcome.last_step} committed ({outcome.error})"


# -- 2. goodput ------------------------------------------------------------------------------------


@dataclass
class GoodputRow:
    period: float | None
    outcome: RunOutcome
    restarts: int
    lost_steps: int
    restart_s: float | None  # median failed_at -> first completed step after it


def median_restart_s(log_path: Path) -> float | None:
    """Median seconds from a failure being caught to the first completed step after the restart."""
    failures = {e["restart"]: e for e in recovery_events(log_path, "failure")}
    firsts = recovery_events(log_path, "first_step")
    spans = [f["time_unix"] - failures[f["restart"]]["failed_at_unix"] for f in firsts if f["restart"] in failures]
    return statistics.median(spans) if spans else None


def periodic_killer(period: float) -> Killer:
    """One SIGKILL every `period` seconds (counted from the previous kill), actor and rollout in turn."""

    def killer(runner: GRPORunner, done: threading.Event, kills: list[Kill]) -> None:
        """Never kills once a stop was requested (the run is winding down to its emergency checkpoint)."""
        killed: set[int] = set()
        targets = cycle(GOODPUT_TARGETS)
        while not done.wait(period):
            kill = kill_until_done(runner, *next(targets), killed, done)
            if kill is None:
                return
            kills.append(kill)

    return killer


def no_killer(runner: GRPORunner, done: threading.Event, kills: list[Kill]) -> None:
    return None


def measure_goodput_run(args: argparse.Namespace, workdir: Path, period: float | None, max_run_s: float | None) -> GoodputRow:
    name = "no-failures" if period is None else f"kill-every-{period:g}s"
    cfg = build_config(workdir / name, args.goodput_steps, args)
    killer = no_killer if period is None else periodic_killer(period)
    runner, outcome, _ = run_with_killer(cfg, killer, stop_after_s=max_run_s)
    failures = recovery_events(runner.log_path, "failure")
    row = GoodputRow(period, outcome, len(failures), sum(f["lost_steps"] for f in failures), median_restart_s(runner.log_path))
    label = "no failures" if period is None else f"T={period:g}s"
    delayed = [k for k in outcome.kills if k.waited_s > 0.5]
    print(
        f"  {label}: {describe_outcome(outcome)}; {len(outcome.kills)} kills ({len(delayed)} waited for a rebuild to finish), "
        f"{row.restarts} restarts, wall {outcome.wall_s:.1f} s, metrics 1..{outcome.last_step} exactly once: {outcome.metrics_check}",
        flush=True,
    )
    return row


def measure_goodput(args: argparse.Namespace, workdir: Path) -> None:
    print(
        f"\n## 2. Goodput under failure injection: {args.goodput_steps} steps per run (the default job has 800), "
        f"runner.save_interval={args.save_interval}\n",
        flush=True,
    )
    rows = [measure_goodput_run(args, workdir, None, None)]
    max_run_s = args.max_run_s if args.max_run_s is not None else 2.0 * rows[0].outcome.wall_s
    print(f"  runs with failures are stopped after {max_run_s:.0f} s (--max-run-s; their committed steps count)", flush=True)
    rows += [measure_goodput_run(args, workdir, period, max_run_s) for period in args.period_list]
    print()
    print(goodput_table(rows))
    print()
    step_s = rows[0].outcome.step_s
    restart_times = [r.restart_s for r in rows if r.restart_s is not None]
    print(f"- save interval: runner.save_interval={args.save_interval} steps (~{args.save_interval * step_s:.1f} s of training at the median step time {step_s:.3f} s)")
    if restart_times:
        restart_s = statistics.median(restart_times)
        print(
            f"- a restart (failure caught -> first step after it) took {restart_s:.1f} s (median); a run makes progress only when "
            f"T > restart + save_interval x step time ~ {restart_s + args.save_interval * step_s:.0f} s, since every restart goes back to a multiple of {args.save_interval}"
        )
    print("- steps/s = completed training steps / wall time of GRPORunner.run() (first start-up included, Ray start excluded)")
    for row in rows:
        if not row.outcome.finished:
            print(f"- {'no failures' if row.period is None else f'T={row.period:g}s'}: did not finish: {row.outcome.error}")


def goodput_table(rows: list[GoodputRow]) -> str:
    baseline = rows[0].outcome.last_step / rows[0].outcome.wall_s
    lines = [
        "| T (s) | kills | restarts | steps done | lost steps (redone) | restart s (median) | wall s | steps/s | goodput | metrics 1..N once |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        rate = row.outcome.last_step / row.outcome.wall_s
        period = "no failures" if row.period is None else f"{row.period:g}"
        done = f"{row.outcome.last_step}" + ("" if row.outcome.finished else " (stopped)")
        lines.append(
            f"| {period} | {len(row.outcome.kills)} | {row.restarts} | {done} | {row.lost_steps} | "
            f"{'-' if row.restart_s is None else f'{row.restart_s:.1f}'} | {row.outcome.wall_s:.1f} | "
            f"{rate:.2f} | {rate / baseline:.2f} | {row.outcome.metrics_check} |"
        )
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------


def describe_machine(num_cpus: int) -> str:
    import ray
    import torch

    return (
        f"{platform.node()}: {os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, ray {ray.__version__}; local Ray with num_cpus={num_cpus}"
    )


@dataclass
class WorkDir:
    path: Path
    keep: bool

    def cleanup(self) -> None:
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)


def make_workdir(args: argparse.Namespace) -> WorkDir:
    if args.workdir:
        path = Path(args.workdir)
        path.mkdir(parents=True, exist_ok=True)
        return WorkDir(Path(tempfile.mkdtemp(prefix="bench_recovery_", dir=path)), True)
    return WorkDir(Path(tempfile.mkdtemp(prefix="bench_recovery_", dir="/tmp")), args.keep)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    began = time.monotonic()
    configure_logging()
    os.chdir(REPO_ROOT)
    print(f"# rlrunner recovery benchmark\n\ncommand: {shlex.join([sys.executable, *sys.argv])}")
    workdir = make_workdir(args)
    ray_started = time.monotonic()
    start_ray(args.num_cpus)
    print(f"machine: {describe_machine(args.num_cpus)}")
    print(f"Ray start: {time.monotonic() - ray_started:.1f} s (excluded from every measurement); run folders: {workdir.path}", flush=True)
    try:
        if args.only in (None, "recovery") and args.kills > 0:
            measure_recovery(args, workdir.path)
        if args.only in (None, "goodput"):
            measure_goodput(args, workdir.path)
    finally:
        import ray

        ray.shutdown()
        workdir.cleanup()
    print(f"\ntotal benchmark time: {time.monotonic() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
