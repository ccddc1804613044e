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

     detection   failure.failed_at_unix - kill time; split into "error reaches the driver" (time the
                 runner's repairable_cause() was entered; this script wraps that method on the runner
                 instance to timestamp it, nothing else changes) and "classify" (the rest: pinging
                 every worker for up to 1 s to name the unresponsive ones)
     teardown    failure.teardown_s (ray.kill of every worker, placement groups removed)
     find ckpt   the rest of the gap up to start(): remove leftovers + verify the newest checkpoint (CRC-32)
     wait        resumed.wait_s (placement groups waiting for free CPUs)
     rebuild     resumed.rebuild_s (new worker processes, model built, process group)
     load        resumed.load_s (storage probe + checkpoint load + weight sync to the rollout worker)
     1st step    first_step.time_unix - resumed.time_unix (the first training step after the restart)
     total       first_step.time_unix - kill time
   plus the steps lost per kill (failure.lost_steps: done since the last checkpoint, to be redone).

2. Goodput under failure injection (`--goodput-steps` steps). A timer thread SIGKILLs one worker every T
   seconds for each T in `--periods` (alternating actor rank 1 / rollout 0; a kill that falls while the
   groups are being rebuilt waits until the target exists again, then the next kill is T s after it),
   next to the same job without failures. Goodput = completed training steps / wall time of
   `GRPORunner.run()` (Ray start excluded), as a ratio to the no-failure run. A run still going after
   `--max-run-s` is stopped through the runner's own StopRequest (runner.max_wall_time_s: emergency
   checkpoint, StoppedEarly) and its steps so far count. After each run metrics.jsonl is checked to
   hold every step 1..N exactly once.

Run from the repository root (the defaults take about 13 minutes on 2 CPU cores):

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
from typing import Any, Callable, Iterator

REPO_ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.02
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
    parser.add_argument("--max-run-s", type=float, default=150.0, help="stop a goodput run still going after this long (its steps so far count)")
    parser.add_argument("--save-interval", type=int, default=50, help="runner.save_interval")
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count() or 1, help="CPUs of the local Ray")
    parser.add_argument("--max-restarts", type=int, default=10_000, help="runner.recovery.max_restarts")
    parser.add_argument("--workdir", default=None, help="where run folders go (default: a new folder under /tmp, deleted at the end)")
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run, e.g. rollout.max_new_tokens=6")
    args = parser.parse_args(argv)
    args.period_list = [float(p) for p in args.periods.split(",") if p.strip()] if args.periods else []
    return args


def build_config(output_dir: Path, steps: int, args: argparse.Namespace, *extra: str):
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


def check_metrics(log_path: Path, last_step: int) -> str:
    """'ok' when metrics.jsonl holds every step 1..last_step exactly once, in order; else what is wrong."""
    steps = metrics_steps(log_path)
    if steps == list(range(1, last_step + 1)):
        return "ok"
    duplicated = sorted({s for s in steps if steps.count(s) > 1})
    missing = sorted(set(range(1, last_step + 1)) - set(steps))
    return f"BAD: {len(steps)} lines, duplicated {duplicated[:10]}, missing {missing[:10]}"


def median_step_s(log_path: Path) -> float:
    times = [r["time/step_s"] for r in read_jsonl(log_path / "metrics.jsonl") if "time/step_s" in r]
    return statistics.median(times) if times else float("nan")


# -- killing workers -------------------------------------------------------------------------------


@dataclass
class Kill:
    target: str
    pid: int
    time_unix: float
    last_step: int  # the newest step in metrics.jsonl when the kill happened


def target_pid(runner, group_name: str, rank: int) -> int | None:
    """The pid of a live worker of the runner's current group, or None while that group does not exist."""
    group = runner.actor_group if group_name == "actor" else runner.rollout_group
    if group is None:
        return None
    try:
        return int(group.hosts[rank]["pid"])
    except (AttributeError, IndexError, KeyError):
        return None


def kill_worker(runner, group_name: str, rank: int, killed: set[int]) -> Kill | None:
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


def last_step_now(runner) -> int:
    steps = metrics_steps(runner.log_path)
    return steps[-1] if steps else 0


def wait_until(condition: Callable[[], bool], done: threading.Event) -> bool:
    """Poll `condition` until it holds (True) or the run is over (False)."""
    while not done.is_set():
        if condition():
            return True
        time.sleep(POLL_S)
    return False


def kill_until_done(runner, group_name: str, rank: int, killed: set[int], done: threading.Event) -> Kill | None:
    """Kill the target as soon as it exists (it may be mid-rebuild); None if the run ended first."""
    while not done.is_set():
        kill = kill_worker(runner, group_name, rank, killed)
        if kill is not None:
            return kill
        time.sleep(POLL_S)
    return None


def record_error_arrivals(runner) -> list[float]:
    """Wrap runner.repairable_cause (on this instance only) to timestamp when a failure reached the driver."""
    arrivals: list[float] = []
    original = runner.repairable_cause

    def timed_repairable_cause(exc: BaseException) -> str | None:
        arrivals.append(time.time())
        return original(exc)

    runner.repairable_cause = timed_repairable_cause
    return arrivals


@dataclass
class RunOutcome:
    wall_s: float
    last_step: int
    finished: bool
    error: str | None
    metrics_check: str
    step_s: float
    kills: list[Kill] = field(default_factory=list)


def run_with_killer(cfg, killer: Callable[[Any, threading.Event, list[Kill]], None], stop_after_s: float | None = None) -> tuple[Any, RunOutcome, list[float]]:
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
    last = runner.global_step
    outcome = RunOutcome(wall, last, finished, error, check_metrics(runner.log_path, last), median_step_s(runner.log_path), kills)
    return runner, outcome, arrivals


# -- 1. recovery time ------------------------------------------------------------------------------


PHASES = ["detection", "error reaches driver", "classify", "teardown", "find ckpt", "wait", "rebuild", "load", "1st step", "total"]


@dataclass
class Restart:
    kill: Kill
    failure: dict[str, Any]
    resumed: dict[str, Any] | None
    first_step: dict[str, Any] | None
    arrival_unix: float | None
    phases: dict[str, float] = field(default_factory=dict)


def recovery_killer(args: argparse.Namespace) -> Callable[[Any, threading.Event, list[Kill]], None]:
    """The kill schedule of part 1: after the first checkpoint, then after each recovery's first step."""

    def killer(runner, done: threading.Event, kills: list[Kill]) -> None:
        killed: set[int] = set()
        targets = cycle(RECOVERY_TARGETS)
        for index in range(args.kills):
            if index == 0:
                ready = lambda: last_step_now(runner) >= args.save_interval  # noqa: E731
            else:
                ready = lambda: any(e["restart"] == index for e in recovery_events(runner.log_path, "first_step"))  # noqa: E731
            if not wait_until(ready, done) or done.wait(args.kill_delay):
                return
            kill = kill_until_done(runner, *next(targets), killed, done)
            if kill is None:
                return
            kills.append(kill)
            print(f"  kill {index + 1}: {kill.target} (pid {kill.pid}) after step {kill.last_step}", flush=True)

    return killer


def restart_phases(kill: Kill, failure: dict, resumed: dict | None, first: dict | None, arrival: float | None) -> dict[str, float]:
    phases = {
        "detection": failure["failed_at_unix"] - kill.time_unix,
        "teardown": failure["teardown_s"],
    }
    if arrival is not None:
        phases["error reaches driver"] = arrival - kill.time_unix
        phases["classify"] = failure["failed_at_unix"] - arrival
    if resumed is not None:
        start_s = resumed["wait_s"] + resumed["rebuild_s"] + resumed["load_s"]
        phases["find ckpt"] = resumed["time_unix"] - start_s - failure["time_unix"]
        phases.update({"wait": resumed["wait_s"], "rebuild": resumed["rebuild_s"], "load": resumed["load_s"]})
        if first is not None:
            phases["1st step"] = first["time_unix"] - resumed["time_unix"]
            phases["total"] = first["time_unix"] - kill.time_unix
    return phases


def match_restarts(log_path: Path, kills: list[Kill], arrivals: list[float]) -> list[Restart]:
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
        restarts.append(Restart(kill, failure, resumed.get(number), first.get(number), arrival, phases))
    return restarts


def measure_recovery(args: argparse.Namespace, workdir: Path) -> None:
    print(f"\n## 1. Recovery time: {args.recovery_steps} steps, {args.kills} SIGKILLs, save_interval {args.save_interval}\n", flush=True)
    cfg = build_config(workdir / "recovery", args.recovery_steps, args)
    runner, outcome, arrivals = run_with_killer(cfg, recovery_killer(args))
    restarts = match_restarts(runner.log_path, outcome.kills, arrivals)
    failures = recovery_events(runner.log_path, "failure")
    print()
    print(phase_summary_table(restarts))
    print()
    print(per_kill_table(restarts, outcome.step_s))
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


def describe_outcome(outcome: RunOutcome) -> str:
    return f"finished at step {outcome.last_step}" if outcome.finished else f"ended at step {outcome.last_step} ({outcome.error})"


# -- 2. goodput ------------------------------------------------------------------------------------


@dataclass
class GoodputRow:
    period: float | None
    outcome: RunOutcome
    restarts: int
    lost_steps: int


def periodic_killer(period: float) -> Callable[[Any, threading.Event, list[Kill]], None]:
    """One SIGKILL every `period` seconds (counted from the previous kill), actor and rollout in turn."""

    def killer(runner, done: threading.Event, kills: list[Kill]) -> None:
        killed: set[int] = set()
        targets = cycle(GOODPUT_TARGETS)
        while not done.wait(period):
            if runner.stop.requested:
                return
            kill = kill_until_done(runner, *next(targets), killed, done)
            if kill is None:
                return
            kills.append(kill)

    return killer


def no_killer(runner, done: threading.Event, kills: list[Kill]) -> None:
    return None


def measure_goodput_run(args: argparse.Namespace, workdir: Path, period: float | None) -> GoodputRow:
    name = "no-failures" if period is None else f"kill-every-{period:g}s"
    cfg = build_config(workdir / name, args.goodput_steps, args)
    killer = no_killer if period is None else periodic_killer(period)
    runner, outcome, _ = run_with_killer(cfg, killer, stop_after_s=args.max_run_s)
    failures = recovery_events(runner.log_path, "failure")
    row = GoodputRow(period, outcome, len(failures), sum(f["lost_steps"] for f in failures))
    label = "no failures" if period is None else f"T={period:g}s"
    print(
        f"  {label}: {describe_outcome(outcome)}, {len(outcome.kills)} kills, {row.restarts} restarts, "
        f"wall {outcome.wall_s:.1f} s, metrics 1..{outcome.last_step} exactly once: {outcome.metrics_check}",
        flush=True,
    )
    return row


def measure_goodput(args: argparse.Namespace, workdir: Path) -> None:
    print(
        f"\n## 2. Goodput under failure injection: {args.goodput_steps} steps per run (default job: 800), "
        f"runner.save_interval={args.save_interval}, runs capped at {args.max_run_s:g} s\n",
        flush=True,
    )
    rows = [measure_goodput_run(args, workdir, None)]
    rows += [measure_goodput_run(args, workdir, period) for period in args.period_list]
    print()
    print(goodput_table(rows))
    print()
    print(f"- save interval: runner.save_interval={args.save_interval} steps (~{args.save_interval * rows[0].outcome.step_s:.1f} s of training at the median step time)")
    print("- steps/s = completed training steps / wall time of GRPORunner.run() (first start-up included, Ray start excluded)")
    for row in rows:
        if not row.outcome.finished:
            print(f"- {'no failures' if row.period is None else f'T={row.period:g}s'}: did not finish: {row.outcome.error}")


def goodput_table(rows: list[GoodputRow]) -> str:
    baseline = rows[0].outcome.last_step / rows[0].outcome.wall_s
    lines = [
        "| T (s) | kills | restarts | steps done | lost steps (redone) | wall s | steps/s | goodput | metrics 1..N once |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        rate = row.outcome.last_step / row.outcome.wall_s
        period = "no failures" if row.period is None else f"{row.period:g}"
        done = f"{row.outcome.last_step}" + ("" if row.outcome.finished else " (stopped)")
        lines.append(
            f"| {period} | {len(row.outcome.kills)} | {row.restarts} | {done} | {row.lost_steps} | {row.outcome.wall_s:.1f} | "
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
