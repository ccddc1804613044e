"""bench_recovery.py part 2: goodput under failure injection, against the same job without failures.

Each round runs the default job for `--goodput-steps` steps without failures (snapshots on, then off; and with idle
spares), then with one SIGKILL of an actor rank every T seconds for each T in `--periods`, without and with spares.
Goodput = completed training steps / wall time of `Supervisor.run()`, as a ratio to the round's no-failure run; runs
with failures still going after `--max-run-s` are stopped through the supervisor's StopRequest and their committed
steps count. `--rounds N` repeats the whole set and prints the medians.
"""

from __future__ import annotations

import argparse
import statistics
import threading
from itertools import cycle
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from benchlib.recovery_report import (
    GoodputRow,
    describe_outcome,
    goodput_rounds_table,
    goodput_table,
    median_restart_s,
)
from benchlib.recovery_runs import Kill, Killer, kill_until_done, recovery_events, run_with_killer

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from rlrunner.runner.supervisor import Supervisor

GOODPUT_TARGETS = [("actor", 1), ("actor", 0)]


def periodic_killer(period: float) -> Killer:
    """One SIGKILL every `period` seconds (counted from the previous kill), actor and rollout in turn."""

    def killer(supervisor: Supervisor, done: threading.Event, kills: list[Kill]) -> None:
        """Never kills once a stop was requested (the run is winding down to its emergency checkpoint)."""
        killed: set[int] = set()
        targets = cycle(GOODPUT_TARGETS)
        while not done.wait(period):
            kill = kill_until_done(supervisor, *next(targets), killed, done)
            if kill is None:
                return
            kills.append(kill)

    return killer


def no_killer(supervisor: Supervisor, done: threading.Event, kills: list[Kill]) -> None:
    return None


def measure_goodput_run(
    args: argparse.Namespace,
    workdir: Path,
    cfg_for: Callable[..., DictConfig],
    period: float | None,
    max_run_s: float | None,
    spares: str = "none",
    overrides: Sequence[str] = (),
) -> GoodputRow:
    name = ("no-failures" if period is None else f"kill-every-{period:g}s") + "".join(
        f"-{o.split('=')[0]}" for o in overrides
    )
    cfg = cfg_for(workdir / name, args.goodput_steps, *overrides)
    killer = no_killer if period is None else periodic_killer(period)
    supervisor, outcome, _ = run_with_killer(cfg, killer, stop_after_s=max_run_s)
    log_path = supervisor.ctx.log_path
    failures = recovery_events(log_path, "failure")
    row = GoodputRow(
        period, outcome, len(failures), sum(f["lost_steps"] for f in failures), median_restart_s(log_path), spares
    )
    label = ("no failures" if period is None else f"T={period:g}s") + f", spares: {spares}"
    delayed = [k for k in outcome.kills if k.waited_s > 0.5]
    print(
        f"  {label}: {describe_outcome(outcome)}; {len(outcome.kills)} kills "
        f"({len(delayed)} waited for a rebuild to finish), {row.restarts} restarts, wall {outcome.wall_s:.1f} s, "
        f"metrics 1..{outcome.last_step} exactly once: {outcome.metrics_check}",
        flush=True,
    )
    return row


def measure_goodput(args: argparse.Namespace, workdir: Path, cfg_for: Callable[..., DictConfig]) -> None:
    """Part 2, `args.rounds` times; `cfg_for(output_dir, steps, *overrides)` is the job's config."""
    print(
        f"\n## 2. Goodput under failure injection: {args.goodput_steps} steps per run (the default job has 800), "
        f"runner.save_interval={args.save_interval}, {args.rounds} round(s)\n",
        flush=True,
    )
    rounds = []
    for number in range(1, args.rounds + 1):
        if args.rounds > 1:
            print(f"### round {number} of {args.rounds}\n", flush=True)
        rounds.append(measure_goodput_round(args, workdir / f"round-{number}", cfg_for))
    if args.rounds > 1:
        print(f"\n### Goodput over the {args.rounds} rounds (each against its own round's no-failure run)\n")
        print(goodput_rounds_table(rounds))


def measure_goodput_round(
    args: argparse.Namespace, workdir: Path, cfg_for: Callable[..., DictConfig]
) -> list[GoodputRow]:
    """Every goodput run once: no failures (snapshots on, off; with idle spares), then each period without and with
    spares; prints the round's table and returns its rows (the first is the baseline)."""
    rows = [measure_goodput_run(args, workdir, cfg_for, None, None)]
    # what the in-memory snapshots (on by default, in every other run) cost a run without failures
    rows.append(
        measure_goodput_run(
            args, workdir, cfg_for, None, None, "none, snapshots off", ["runner.snapshot.enabled=false"]
        )
    )
    max_run_s = args.max_run_s if args.max_run_s is not None else 2.0 * rows[0].outcome.wall_s
    print(
        f"  runs with failures are stopped after {max_run_s:.0f} s (--max-run-s; their committed steps count)",
        flush=True,
    )
    for label, overrides in args.variants:
        spares = "none" if not overrides else f"{args.actor_spares} + {args.rollout_spares}"
        if overrides:  # what idle spares cost a run without failures
            rows.append(measure_goodput_run(args, workdir, cfg_for, None, None, spares, overrides))
        rows += [
            measure_goodput_run(args, workdir, cfg_for, period, max_run_s, spares, overrides)
            for period in args.period_list
        ]
    print()
    print(goodput_table(rows))
    print()
    step_s = rows[0].outcome.step_s
    restart_times = [r.restart_s for r in rows if r.restart_s is not None]
    print(
        f"- save interval: runner.save_interval={args.save_interval} steps "
        f"(~{args.save_interval * step_s:.1f} s of training at the median step time {step_s:.3f} s)"
    )
    if restart_times:
        restart_s = statistics.median(restart_times)
        print(
            f"- a restart (failure caught -> first step after it) took {restart_s:.1f} s (median over the runs); "
            "with the in-memory snapshot of the last step a restart redoes no step, so a kill costs about that much "
            "wall time"
        )
    print(
        "- steps/s = completed training steps / wall time of Supervisor.run() "
        "(first start-up included, Ray start excluded)"
    )
    for row in rows:
        if not row.outcome.finished:
            print(
                f"- {'no failures' if row.period is None else f'T={row.period:g}s'} (spares: {row.spares}): "
                f"did not finish: {row.outcome.error}"
            )
    return rows
