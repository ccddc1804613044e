"""bench_recovery.py's reports: the phases of each restart (matched to the kill that caused it), where the
(re)start time goes, and goodput under failure injection."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib.recovery_runs import Kill, RunOutcome, recovery_events

# -- 1. recovery time ------------------------------------------------------------------------------

# "detection" is the supervisor's own (failed_at_unix - kill); the others add up exactly to "total".
PHASES = [
    "detection",
    "error reaches driver",
    "classify",
    "teardown",
    "find ckpt",
    "wait",
    "rebuild",
    "load",
    "1st step",
    "total",
]


@dataclass
class Restart:
    kill: Kill
    failure: dict[str, Any]
    resumed: dict[str, Any] | None
    first_step: dict[str, Any] | None
    arrival_unix: float | None
    phases: dict[str, float] = field(default_factory=dict)
    attempt: dict[str, float] = field(default_factory=dict)  # group start times of the attempt this restart built


def restart_phases(
    kill: Kill, failure: dict, resumed: dict | None, first: dict | None, arrival: float | None
) -> dict[str, float]:
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


def match_restarts(
    log_path: Path, kills: list[Kill], arrivals: list[float], attempts: list[dict[str, float]]
) -> list[Restart]:
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


def phase_summary_table(restarts: list[Restart]) -> str:
    rows = ["| phase | median s | min s | max s | n |", "|---|---:|---:|---:|---:|"]
    for phase in PHASES:
        values = [r.phases[phase] for r in restarts if phase in r.phases]
        if values:
            rows.append(
                f"| {phase} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} | {len(values)} |"
            )
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
    ("actor_start_s", "actor group: 2 processes started (or spares adopted), ping, process group"),
    ("rollout_start_s", "rollout group: process started (or a spare adopted), ping (beside the actor group's)"),
    ("actor_setup_s", "then: actor setup (model built and sharded, optimizer; waits for the rollout group), channels"),
    ("leave_s", "a rank replaced alone: the survivors leave their process group"),
    ("join_s", "a rank replaced alone: the replacement (spare or new process) joins, process group formed again"),
    ("setup_s", "a rank replaced alone: every rank sets its model up again"),
    ("rebuild_s", "rebuild_s (actor group start + actor setup; or leave + join + setup)"),
    ("load_s", "load_s (storage probe, snapshot or checkpoint load, weight sync)"),
]


def recovery_comparison_table(totals: list[tuple[str, list[float], list[int]]]) -> str:
    """Kill -> next finished step and the steps lost, per variant (label, totals, lost steps), as a ratio to the
    first variant's median."""
    rows = [
        "| variant | kills | median s | min s | max s | ratio to the first | lost steps per kill (max) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = statistics.median(totals[0][1]) if totals and totals[0][1] else None
    for label, values, lost in totals:
        if not values:
            rows.append(f"| {label} | 0 | - | - | - | - | - |")
            continue
        median = statistics.median(values)
        ratio = f"{median / base:.2f}" if base else "-"
        rows.append(
            f"| {label} | {len(values)} | {median:.2f} | {min(values):.2f} | {max(values):.2f} | {ratio} | "
            f"{max(lost) if lost else '-'} |"
        )
    return "\n".join(rows)


def rebuild_table(initial: list[dict[str, float]], restarts: list[Restart]) -> str:
    """Where the (re)start time goes: the initial start of the run next to the median restart."""
    rows = [
        "| part of start() | initial start s | restart median s | restart min s | restart max s |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, label in REBUILD_PARTS:
        values = [r.attempt[key] for r in restarts if key in r.attempt]
        first = f"{initial[0][key]:.2f}" if initial and key in initial[0] else "-"
        if values or first != "-":
            stats = (
                [f"{statistics.median(values):.2f}", f"{min(values):.2f}", f"{max(values):.2f}"]
                if values
                else ["-"] * 3
            )
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
    spares: str = "none"  # the warm spares of the run ("none", or "actor + rollout" counts)


def median_restart_s(log_path: Path) -> float | None:
    """Median seconds from a failure being caught to the first completed step after the restart."""
    failures = {e["restart"]: e for e in recovery_events(log_path, "failure")}
    firsts = recovery_events(log_path, "first_step")
    spans = [f["time_unix"] - failures[f["restart"]]["failed_at_unix"] for f in firsts if f["restart"] in failures]
    return statistics.median(spans) if spans else None


def goodput_ratios(rows: list[GoodputRow]) -> list[float]:
    """Each run's steps/s over the first run's (the round's no-failure baseline)."""
    baseline = rows[0].outcome.last_step / rows[0].outcome.wall_s
    return [row.outcome.last_step / row.outcome.wall_s / baseline for row in rows]


def goodput_rounds_table(rounds: list[list[GoodputRow]]) -> str:
    """One line per run of a round (the rounds run the same runs in the same order): each round's goodput against its
    own baseline, their median, and the kills and wall times behind them."""
    ratios = [goodput_ratios(rows) for rows in rounds]
    lines = [
        "| T (s) | spares | goodput per round | median goodput | kills per round | wall s per round |",
        "|---|---|---|---:|---|---|",
    ]
    for index, row in enumerate(rounds[0]):
        runs = [rows[index] for rows in rounds]
        period = "no failures" if row.period is None else f"{row.period:g}"
        per_round = [r[index] for r in ratios]
        lines.append(
            f"| {period} | {row.spares} | {' / '.join(f'{g:.2f}' for g in per_round)} | "
            f"{statistics.median(per_round):.2f} | {' / '.join(str(len(r.outcome.kills)) for r in runs)} | "
            f"{' / '.join(f'{r.outcome.wall_s:.1f}' for r in runs)} |"
        )
    return "\n".join(lines)


def goodput_table(rows: list[GoodputRow]) -> str:
    ratios = goodput_ratios(rows)
    lines = [
        "| T (s) | spares | kills | restarts | steps done | lost steps (redone) | restart s (median) | wall s | "
        "steps/s | goodput | metrics 1..N once |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row, ratio in zip(rows, ratios):
        rate = row.outcome.last_step / row.outcome.wall_s
        period = "no failures" if row.period is None else f"{row.period:g}"
        done = f"{row.outcome.last_step}" + ("" if row.outcome.finished else " (stopped)")
        lines.append(
            f"| {period} | {row.spares} | {len(row.outcome.kills)} | {row.restarts} | {done} | {row.lost_steps} | "
            f"{'-' if row.restart_s is None else f'{row.restart_s:.1f}'} | {row.outcome.wall_s:.1f} | "
            f"{rate:.2f} | {ratio:.2f} | {row.outcome.metrics_check} |"
        )
    return "\n".join(lines)
