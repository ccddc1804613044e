"""bench_recovery.py part 3: what a killed rollout worker costs now that its group alone is replaced.

The default job runs without failures (the baseline), then with `kills` SIGKILLs of rollout worker 0 for each variant
(without spares, with warm spares), each kill `kill_delay` s after the previous repair (and, with spares, once they are
all up again). Per kill, from the killer's clock and `recovery.jsonl`
(`rollout_repaired`): detection (kill -> the trainer has the error), wait / rebuild / sync (the repair's phases),
kill -> repaired, kill -> the next finished step, and the steps lost; for the run, its wall time against the
baseline's.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from benchlib.recovery_runs import Kill, RunOutcome, kill_until_done, recovery_events, run_with_killer, wait_until

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from rlrunner.runner.supervisor import Supervisor

POLL_S = 0.005


@dataclass
class RepairRow:
    kill: Kill
    event: dict[str, Any]
    next_step_s: float  # kill -> the step in flight at the kill finished


def rollout_killer(
    kills_wanted: int, kill_delay: float, next_steps: list[float], ready_to_kill: Callable[[Supervisor], bool]
) -> Callable:
    def killer(supervisor: Supervisor, done: threading.Event, kills: list[Kill]) -> None:
        killed: set[int] = set()
        for index in range(kills_wanted):

            def ready() -> bool:
                return (
                    supervisor.trainer is not None
                    and supervisor.trainer.global_step >= 1
                    and len(recovery_events(supervisor.ctx.log_path, "rollout_repaired")) >= index
                )

            if (
                not wait_until(ready, done)
                or not wait_until(lambda: ready_to_kill(supervisor), done)
                or done.wait(kill_delay)
            ):
                return
            kill = kill_until_done(supervisor, "rollout", 0, killed, done)
            if kill is None:
                return
            kills.append(kill)
            while not done.is_set() and supervisor.trainer.global_step <= kill.last_step:
                time.sleep(POLL_S)
            next_steps.append(time.time() - kill.time_unix)

    return killer


def no_killer(supervisor: Supervisor, done: threading.Event, kills: list[Kill]) -> None:
    return None


def measure_rollout_repair(
    cfg_for: Callable[..., DictConfig],
    kills: int,
    kill_delay: float,
    variants: list[tuple[str, list[str]]],
    spares_up: Callable[[Supervisor], bool],
) -> None:
    print(
        f"\n## 3. Rollout repair: {kills} SIGKILLs of rollout worker 0, against the same job without failures\n",
        flush=True,
    )
    _, baseline, _ = run_with_killer(cfg_for("rollout-baseline"), no_killer)
    for label, overrides in variants:
        print(f"\n### {label}\n", flush=True)
        ready_to_kill = spares_up if overrides else (lambda supervisor: True)
        measure_rollout_kills(
            cfg_for(f"rollout-kills-{len(overrides)}", *overrides), kills, kill_delay, baseline, ready_to_kill
        )


def measure_rollout_kills(
    cfg: DictConfig, kills: int, kill_delay: float, baseline: RunOutcome, ready_to_kill: Callable[[Supervisor], bool]
) -> None:
    next_steps: list[float] = []
    supervisor, outcome, _ = run_with_killer(cfg, rollout_killer(kills, kill_delay, next_steps, ready_to_kill))
    log_path = supervisor.ctx.log_path
    events = recovery_events(log_path, "rollout_repaired")
    restarts = recovery_events(log_path, "failure")
    rows = [RepairRow(kill, event, step_s) for kill, event, step_s in zip(outcome.kills, events, next_steps)]
    print(repair_table(rows))
    print()
    print(f"- baseline: {describe(baseline)}")
    print(
        f"- with {len(outcome.kills)} rollout kills: {describe(outcome)}; rollout repairs logged {len(events)}, "
        f"restarts {len(restarts)}, "
        f"steps lost {sum(e['lost_steps'] for e in events) + sum(f['lost_steps'] for f in restarts)}"
    )
    if baseline.finished and outcome.finished:
        print(
            f"- wall time with kills / without: {outcome.wall_s / baseline.wall_s:.2f} "
            f"(+{outcome.wall_s - baseline.wall_s:.1f} s for {len(outcome.kills)} kills)"
        )


def describe(outcome: RunOutcome) -> str:
    state = "finished" if outcome.finished else f"did not finish ({outcome.error})"
    return (
        f"{state}, {outcome.last_step} steps in {outcome.wall_s:.1f} s, median step {outcome.step_s:.3f} s, "
        f"metrics 1..{outcome.last_step} exactly once: {outcome.metrics_check}"
    )


def repair_table(rows: list[RepairRow]) -> str:
    columns = ["detection", "wait", "rebuild", "sync", "kill -> repaired", "kill -> next step", "lost steps"]
    values = [
        [
            row.event["failed_at_unix"] - row.kill.time_unix,
            row.event["wait_s"],
            row.event["rebuild_s"],
            row.event["sync_s"],
            row.event["time_unix"] - row.kill.time_unix,
            row.next_step_s,
            row.event["lost_steps"],
        ]
        for row in rows
    ]
    lines = [
        "| kill | step | phase | " + " | ".join(f"{c} s" if c != "lost steps" else c for c in columns) + " |",
        "|---|---|---|" + "---|" * len(columns),
    ]
    for i, (row, vals) in enumerate(zip(rows, values), 1):
        cells = [f"{v:.2f}" if isinstance(v, float) else str(v) for v in vals]
        lines.append(f"| {i} | {row.event['step']} | {row.event['phase']} | " + " | ".join(cells) + " |")
    if values:
        medians = [statistics.median(v[i] for v in values) for i in range(len(columns))]
        lines.append(
            "| median | | | "
            + " | ".join(f"{m:.2f}" if i < len(columns) - 1 else f"{m:g}" for i, m in enumerate(medians))
            + " |"
        )
    return "\n".join(lines)
