"""bench_recovery.py part 1: how long a restart takes, phase by phase, when an actor rank is killed.

The default job runs with `--kills` SIGKILLs for each variant (without spares, with warm spares): the first kill
`--kill-delay` s after the first checkpoint is committed, each further one `--kill-delay` s after the previous
restart's first completed step (and, with spares, once they are all up again). The phases of each restart (matched to
the kill that caused it; defined in bench_recovery.py's docstring), the steps lost, where the (re)start time goes, and
kill -> next finished step by variant.
"""

from __future__ import annotations

import argparse
import threading
from itertools import cycle
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from benchlib.recovery_report import (
    Restart,
    describe_outcome,
    match_restarts,
    per_kill_table,
    phase_summary_table,
    rebuild_table,
    recovery_comparison_table,
)
from benchlib.recovery_runs import (
    Kill,
    Killer,
    attempt_timings,
    first_step_logged,
    kill_until_done,
    recovery_events,
    run_with_killer,
    wait_until,
)

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from rlrunner.runner.supervisor import Supervisor

# Actor ranks only: a killed rollout worker is now repaired inside the attempt (Trainer.repair_rollout), with no
# restart, no checkpoint load and no lost step, so it has none of the restart phases measured here.
RECOVERY_TARGETS = [("actor", 1), ("actor", 0)]


def recovery_killer(
    args: argparse.Namespace, attempts: list[dict[str, float]], spares_up: Callable[[Supervisor], bool] | None
) -> Killer:
    """The kill schedule of part 1: after the first checkpoint, then after each recovery's first step (and, with
    `spares_up`, once every spare is up). Before each kill (and after the last recovery) the live attempt's start-up
    timings go to `attempts`."""

    def killer(supervisor: Supervisor, done: threading.Event, kills: list[Kill]) -> None:
        killed: set[int] = set()
        targets = cycle(RECOVERY_TARGETS)
        for index in range(args.kills):
            if index == 0:  # after the first checkpoint, so that every restart loads one

                def ready() -> bool:
                    return (
                        supervisor.trainer is not None
                        and (supervisor.trainer.last_saved_step or 0) >= args.save_interval
                    )

            else:

                def ready() -> bool:
                    return first_step_logged(supervisor, index)

            if not wait_until(ready, done) or (
                spares_up is not None and not wait_until(lambda: spares_up(supervisor), done)
            ):
                return
            attempts.append(attempt_timings(supervisor))
            if done.wait(args.kill_delay):
                return
            kill = kill_until_done(supervisor, *next(targets), killed, done)
            if kill is None:
                return
            kills.append(kill)
            print(f"  kill {index + 1}: {kill.target} (pid {kill.pid}) after step {kill.last_step}", flush=True)
        if wait_until(lambda: first_step_logged(supervisor, args.kills), done):
            attempts.append(attempt_timings(supervisor))

    return killer


def measure_recovery(
    args: argparse.Namespace, workdir: Path, cfg_for: Callable[..., DictConfig], spares_up: Callable[[Supervisor], bool]
) -> None:
    """Part 1 for each variant of `args.variants`; `cfg_for(output_dir, steps, *overrides)` is the job's config."""
    totals = []
    for label, overrides in args.variants:
        restarts = measure_recovery_variant(args, workdir, label, overrides, cfg_for, spares_up if overrides else None)
        totals.append(
            (
                label,
                [r.phases["total"] for r in restarts if "total" in r.phases],
                [r.failure["lost_steps"] for r in restarts],
            )
        )
    print("\n### Kill -> next finished step, by variant\n")
    print(recovery_comparison_table(totals))


def measure_recovery_variant(
    args: argparse.Namespace,
    workdir: Path,
    label: str,
    overrides: list[str],
    cfg_for: Callable[..., DictConfig],
    spares_up: Callable[[Supervisor], bool] | None,
) -> list[Restart]:
    print(
        f"\n## 1. Recovery time {label}: {args.recovery_steps} steps, {args.kills} SIGKILLs, save_interval "
        f"{args.save_interval}\n",
        flush=True,
    )
    cfg = cfg_for(workdir / f"recovery-{len(overrides)}", args.recovery_steps, *overrides)
    attempts: list[dict[str, float]] = []
    supervisor, outcome, arrivals = run_with_killer(cfg, recovery_killer(args, attempts, spares_up))
    log_path = supervisor.ctx.log_path
    restarts = match_restarts(log_path, outcome.kills, arrivals, attempts)
    failures = recovery_events(log_path, "failure")
    print()
    print(phase_summary_table(restarts))
    print()
    print(per_kill_table(restarts, outcome.step_s))
    print()
    print(rebuild_table(attempts[:1], restarts))
    print()
    print(f"- run: {describe_outcome(outcome)}; wall {outcome.wall_s:.1f} s; median step {outcome.step_s:.3f} s")
    print(
        f"- kills: {len(outcome.kills)}, failures logged: {len(failures)} "
        f"(restarts beyond the kills: {max(0, len(failures) - len(outcome.kills))})"
    )
    for failure in failures:
        print(f"  - restart {failure['restart']}: step {failure['step']}, cause: {failure['cause']}")
    print(f"- metrics.jsonl steps 1..{outcome.last_step} exactly once: {outcome.metrics_check}")
    return restarts
