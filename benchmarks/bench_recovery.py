#!/usr/bin/env python
"""In-job recovery of rlrunner's GRPO runner: how long a restart takes, and what failures cost in goodput.

Everything runs on a local Ray started by this script (`ray.init(address="local", num_cpus=--num-cpus)`),
with the default job (configs/grpo.yaml: 2 FSDP2 actor ranks + 1 rollout worker at 0.5 CPU each, the
embedded tiny Qwen2, checkpoints every `runner.save_interval` steps). Every run writes to a fresh temp
folder with the progress bar and TensorBoard off. Workers are killed with SIGKILL on their process id
(`supervisor.trainer.actor_group.hosts[r]["pid"]`: the current attempt's group) from a thread while `Supervisor.run()` trains in the main thread, as
tests/test_recovery.py does.

1. Recovery time (`--recovery-steps` steps, `--kills` kills). The first kill comes `--kill-delay` s after
   the first checkpoint is committed (so every restart loads one); each further kill comes `--kill-delay`
   s after the previous restart's first completed step. Targets cycle actor rank 1, actor rank 0 (a killed
   rollout worker no longer restarts the attempt: its group alone is replaced, with no step lost and none of
   these phases). The phases of each restart come from `<log_path>/recovery.jsonl`:

     detection   failure.failed_at_unix - kill time (the supervisor stamps failed_at when it catches the error)
   and, adding up exactly to "total":
     error reaches driver   kill -> the supervisor's failure handling is entered (Supervisor._repairable_failure,
                 which stamps failed_at, then calls repairable_cause; this script wraps that method on the
                 supervisor instance to timestamp it; nothing else changes)
     classify    repairable_cause (pings every worker for up to 1 s to name the dead ones) + the log line
     teardown    failure.teardown_s (Trainer.close: ray.kill of every worker of both groups, placement groups
                 removed; 0 when the lost rank is replaced alone, runner.recovery.replace_lost_ranks)
     find ckpt   the rest of the gap up to the start of the new attempt: which ranks to replace alone (a ping of
                 every worker) and the newest complete snapshot; for a restart of both groups also remove leftovers +
                 verify the newest checkpoint (CRC-32)
     wait        resumed.wait_s (the new placement groups waiting for free CPUs)
     rebuild     resumed.rebuild_s (new worker processes or adopted spares, process group, model built and sharded;
                 replacing a rank alone: the survivors leave their process group, the group forms it again with the
                 replacement and every rank sets its model up again)
     load        resumed.load_s (storage probe + weight-sync channels + snapshot or checkpoint load + weight sync to
                 the rollout worker)
     1st step    first_step.time_unix - resumed.time_unix (the first training step after the restart)
     total       first_step.time_unix - kill time
   plus the steps lost per kill (failure.lost_steps: completed steps redone; 0 when the restart loads the in-memory
   snapshot of the last completed step), and rebuild_s split by group (each WorkerGroup's start_s, read from the live
   attempt, `supervisor.trainer`) next to the run's initial start. "find ckpt" includes asking the snapshot holders
   for the newest complete snapshot, and "load" is the snapshot's (or checkpoint's) load plus the weight sync.

   The part runs twice: without spares, then with warm spares (`cluster.spare_workers.actor=--actor-spares`,
   `.rollout=--rollout-spares`; a lost rank replaced alone takes one actor spare, a restart of both groups takes
   2 + 1, the default job whole). With
   spares each kill waits until every spare is up again (they are refilled in the background after a restart).

2. Goodput under failure injection (`--goodput-steps` steps; 400 by default, half the default job, to keep
   the whole script near 12 minutes). A timer thread SIGKILLs one worker every T seconds for each T in
   `--periods` (actor ranks 1 and 0 in turn; a kill that falls while the groups are being
   rebuilt waits until its target exists, and the next kill is T s after it), next to the same job
   without failures. Goodput = completed training steps / wall time of `Supervisor.run()` (Ray start
   excluded), as a ratio to the no-failure run. A run with failures still going after `--max-run-s`
   (default: twice the no-failure run's wall time) is stopped through the supervisor's own StopRequest
   (max_wall_time_s: emergency checkpoint, StoppedEarly) and its committed steps count. After each run
   metrics.jsonl is checked to hold every step 1..N exactly once. The runs with failures are made without spares
   and again with spares (there a kill does not wait for the spares: one that falls before they are back up pays the
   process start), and the no-failure run is also made with spares idle beside it (what they cost a run without
   failures), and without spares with the in-memory snapshots off (what they cost). Every ratio is against the
   no-failure run without spares, snapshots on (the default). `--rounds N` runs that whole set N times (each round's
   ratios against its own no-failure run, since the machine's speed drifts between runs) and prints the medians.

3. Rollout repair (`--rollout-steps` steps, `--rollout-kills` SIGKILLs of the rollout worker, each `--kill-delay` s
   after the previous repair; benchlib/rollout_repair.py): per kill, detection, the repair's wait / rebuild / sync,
   kill -> repaired, kill -> the next finished step and the steps lost, and the run's wall time against the same job
   without failures.

The local Ray gets `--num-cpus` logical CPUs: by default the machine's cores plus what the spares reserve
(`cluster.cpus_per_*_worker` each), so that they can be placed beside the job. A spare is an idle process (imports
done, the rollout spare's engine built) until it is used, so on 2 cores this overcommits reservations, not work.

Run from the repository root (the defaults take about 20 minutes on 2 CPU cores):

    .venv/bin/python benchmarks/bench_recovery.py
    .venv/bin/python benchmarks/bench_recovery.py --kills 3 --periods 20 --goodput-steps 200
    .venv/bin/python benchmarks/bench_recovery.py --only goodput --save-interval 10
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import platform
import shutil
import statistics
import sys
import threading
import time
from itertools import cycle
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, beside this script
from benchlib.common import command_line, make_workdir, start_local_ray, stop_ray  # noqa: E402
from benchlib.recovery_report import (  # noqa: E402
    GoodputRow,
    Restart,
    describe_outcome,
    goodput_rounds_table,
    goodput_table,
    match_restarts,
    median_restart_s,
    per_kill_table,
    phase_summary_table,
    rebuild_table,
    recovery_comparison_table,
)
from benchlib.rollout_repair import measure_rollout_repair  # noqa: E402
from benchlib.recovery_runs import (  # noqa: E402
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

REPO_ROOT = Path(__file__).resolve().parents[1]
# Actor ranks only: a killed rollout worker is now repaired inside the attempt (Trainer.repair_rollout), with no
# restart, no checkpoint load and no lost step, so it has none of the restart phases measured here.
RECOVERY_TARGETS = [("actor", 1), ("actor", 0)]
GOODPUT_TARGETS = [("actor", 1), ("actor", 0)]


# -- configuration ---------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("recovery", "goodput", "rollout"), default=None, help="run one of the three parts")
    parser.add_argument("--recovery-steps", type=int, default=300, help="steps of the recovery-time job")
    parser.add_argument("--kills", type=int, default=5, help="workers killed in the recovery-time job")
    parser.add_argument("--kill-delay", type=float, default=3.0, help="seconds after a recovery's first step before the next kill")
    parser.add_argument("--rollout-kills", type=int, default=5, help="rollout workers killed in the rollout-repair job")
    parser.add_argument("--rollout-steps", type=int, default=200, help="steps of each rollout-repair job")
    parser.add_argument("--periods", default="10,20,40", help="comma-separated kill periods T (seconds) for the goodput part")
    parser.add_argument("--goodput-steps", type=int, default=400, help="steps of each goodput job (the default job has 800)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the goodput part's whole set of runs this many times; each round's ratios are against "
                             "its own no-failure run, and the medians over the rounds are printed at the end")
    parser.add_argument(
        "--max-run-s", type=float, default=None,
        help="stop a goodput run with failures still going after this long; its committed steps count (default: 2 x the no-failure run's wall time)",
    )
    parser.add_argument("--save-interval", type=int, default=50, help="runner.save_interval")
    parser.add_argument("--actor-spares", type=int, default=2, help="cluster.spare_workers.actor of the runs with spares")
    parser.add_argument("--rollout-spares", type=int, default=1, help="cluster.spare_workers.rollout of the runs with spares")
    parser.add_argument("--num-cpus", type=int, default=None,
                        help="logical CPUs of the local Ray (default: the cores, plus what the spares reserve)")
    parser.add_argument("--max-restarts", type=int, default=10_000, help="runner.recovery.max_restarts")
    parser.add_argument("--workdir", default=None, help="where run folders go (default: a new folder under /tmp, deleted at the end)")
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run, e.g. rollout.max_new_tokens=6")
    args = parser.parse_args(argv)
    args.period_list = [float(p) for p in args.periods.split(",") if p.strip()] if args.periods else []
    args.variants = spare_variants(args.actor_spares, args.rollout_spares)
    if args.num_cpus is None:
        args.num_cpus = (os.cpu_count() or 1) + math.ceil(SPARE_CPUS * (args.actor_spares + args.rollout_spares))
    return args


SPARE_CPUS = 0.5  # cluster.cpus_per_actor_worker and cpus_per_rollout_worker of configs/grpo.yaml


def spare_variants(actor: int, rollout: int) -> list[tuple[str, list[str]]]:
    """(label, overrides) of the runs: without spares, and with them unless none are asked for."""
    variants = [("without spares", [])]
    if actor or rollout:
        variants.append((f"with spares (actor {actor}, rollout {rollout})",
                         [f"cluster.spare_workers.actor={actor}", f"cluster.spare_workers.rollout={rollout}"]))
    return variants


def spares_up(supervisor: Supervisor) -> bool:
    """Whether every warm spare of the run is up (true when it has none)."""
    pools = supervisor.ctx.spare_pools
    return pools is not None and all(pool.all_up() for pool in pools.values())


def build_config(output_dir: Path, steps: int, args: argparse.Namespace, *extra: str) -> DictConfig:
    """The default job (configs/grpo.yaml) with this benchmark's overrides."""
    from rlrunner.config import load_config

    return load_config(
        [
            f"runner.output_dir={output_dir}",
            f"runner.max_steps={steps}",
            f"runner.save_interval={args.save_interval}",
            "runner.logger.progress_bar=false",
            "runner.logger.backends=[]",
            "data.synthetic.val_size=0",
            f"runner.recovery.max_restarts={args.max_restarts}",
            *args.overrides,
            *extra,
        ]
    )


def configure_logging() -> None:
    """rlrunner's warnings and errors (one line per restart) on stderr; Ray and torch quiet."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("ray", "torch.distributed", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)



# -- 1. recovery time ------------------------------------------------------------------------------


def recovery_killer(args: argparse.Namespace, attempts: list[dict[str, float]], with_spares: bool) -> Killer:
    """The kill schedule of part 1: after the first checkpoint, then after each recovery's first step (and, `with_spares`,
    once every spare is up). Before each kill (and after the last recovery) the live attempt's start-up timings go to
    `attempts`."""

    def killer(supervisor: Supervisor, done: threading.Event, kills: list[Kill]) -> None:
        killed: set[int] = set()
        targets = cycle(RECOVERY_TARGETS)
        for index in range(args.kills):
            if index == 0:  # after the first checkpoint, so that every restart loads one
                ready = lambda: supervisor.trainer is not None and (supervisor.trainer.last_saved_step or 0) >= args.save_interval  # noqa: E731
            else:
                ready = lambda: first_step_logged(supervisor, index)  # noqa: E731
            if not wait_until(ready, done) or (with_spares and not wait_until(lambda: spares_up(supervisor), done)):
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


def measure_recovery(args: argparse.Namespace, workdir: Path) -> None:
    totals = []
    for label, overrides in args.variants:
        restarts = measure_recovery_variant(args, workdir, label, overrides)
        totals.append((label, [r.phases["total"] for r in restarts if "total" in r.phases],
                       [r.failure["lost_steps"] for r in restarts]))
    print("\n### Kill -> next finished step, by variant\n")
    print(recovery_comparison_table(totals))


def measure_recovery_variant(args: argparse.Namespace, workdir: Path, label: str, overrides: list[str]) -> list[Restart]:
    print(f"\n## 1. Recovery time {label}: {args.recovery_steps} steps, {args.kills} SIGKILLs, save_interval "
          f"{args.save_interval}\n", flush=True)
    cfg = build_config(workdir / f"recovery-{len(overrides)}", args.recovery_steps, args, *overrides)
    attempts: list[dict[str, float]] = []
    supervisor, outcome, arrivals = run_with_killer(cfg, recovery_killer(args, attempts, bool(overrides)))
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
    print(f"- kills: {len(outcome.kills)}, failures logged: {len(failures)} (restarts beyond the kills: {max(0, len(failures) - len(outcome.kills))})")
    for failure in failures:
        print(f"  - restart {failure['restart']}: step {failure['step']}, cause: {failure['cause']}")
    print(f"- metrics.jsonl steps 1..{outcome.last_step} exactly once: {outcome.metrics_check}")
    return restarts


# -- 2. goodput ------------------------------------------------------------------------------------


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


def measure_goodput_run(args: argparse.Namespace, workdir: Path, period: float | None, max_run_s: float | None,
                        spares: str = "none", overrides: Sequence[str] = ()) -> GoodputRow:
    name = ("no-failures" if period is None else f"kill-every-{period:g}s") + "".join(f"-{o.split('=')[0]}" for o in overrides)
    cfg = build_config(workdir / name, args.goodput_steps, args, *overrides)
    killer = no_killer if period is None else periodic_killer(period)
    supervisor, outcome, _ = run_with_killer(cfg, killer, stop_after_s=max_run_s)
    log_path = supervisor.ctx.log_path
    failures = recovery_events(log_path, "failure")
    row = GoodputRow(period, outcome, len(failures), sum(f["lost_steps"] for f in failures), median_restart_s(log_path),
                     spares)
    label = ("no failures" if period is None else f"T={period:g}s") + f", spares: {spares}"
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
        f"runner.save_interval={args.save_interval}, {args.rounds} round(s)\n",
        flush=True,
    )
    rounds = []
    for number in range(1, args.rounds + 1):
        if args.rounds > 1:
            print(f"### round {number} of {args.rounds}\n", flush=True)
        rounds.append(measure_goodput_round(args, workdir / f"round-{number}"))
    if args.rounds > 1:
        print(f"\n### Goodput over the {args.rounds} rounds (each against its own round's no-failure run)\n")
        print(goodput_rounds_table(rounds))


def measure_goodput_round(args: argparse.Namespace, workdir: Path) -> list[GoodputRow]:
    """Every goodput run once: no failures (snapshots on, off; with idle spares), then each period without and with
    spares; prints the round's table and returns its rows (the first is the baseline)."""
    rows = [measure_goodput_run(args, workdir, None, None)]
    # what the in-memory snapshots (on by default, in every other run) cost a run without failures
    rows.append(measure_goodput_run(args, workdir, None, None, "none, snapshots off", ["runner.snapshot.enabled=false"]))
    max_run_s = args.max_run_s if args.max_run_s is not None else 2.0 * rows[0].outcome.wall_s
    print(f"  runs with failures are stopped after {max_run_s:.0f} s (--max-run-s; their committed steps count)", flush=True)
    for label, overrides in args.variants:
        spares = "none" if not overrides else f"{args.actor_spares} + {args.rollout_spares}"
        if overrides:  # what idle spares cost a run without failures
            rows.append(measure_goodput_run(args, workdir, None, None, spares, overrides))
        rows += [measure_goodput_run(args, workdir, period, max_run_s, spares, overrides) for period in args.period_list]
    print()
    print(goodput_table(rows))
    print()
    step_s = rows[0].outcome.step_s
    restart_times = [r.restart_s for r in rows if r.restart_s is not None]
    print(f"- save interval: runner.save_interval={args.save_interval} steps (~{args.save_interval * step_s:.1f} s of training at the median step time {step_s:.3f} s)")
    if restart_times:
        restart_s = statistics.median(restart_times)
        print(
            f"- a restart (failure caught -> first step after it) took {restart_s:.1f} s (median over the runs); with the "
            "in-memory snapshot of the last step a restart redoes no step, so a kill costs about that much wall time"
        )
    print("- steps/s = completed training steps / wall time of Supervisor.run() (first start-up included, Ray start excluded)")
    for row in rows:
        if not row.outcome.finished:
            print(f"- {'no failures' if row.period is None else f'T={row.period:g}s'} (spares: {row.spares}): did not finish: "
                  f"{row.outcome.error}")
    return rows


# -- main ------------------------------------------------------------------------------------------


def describe_machine(num_cpus: int) -> str:
    import ray
    import torch

    return (
        f"{platform.node()}: {os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, ray {ray.__version__}; local Ray with num_cpus={num_cpus}"
    )


def run_folders(args: argparse.Namespace) -> tuple[Path, bool]:
    """A new folder for the runs, and whether to keep it: under --workdir (kept), else under the temp folder (kept
    with --keep)."""
    return make_workdir(Path(args.workdir) if args.workdir else None, "bench_recovery_"), bool(args.workdir) or args.keep


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    began = time.monotonic()
    configure_logging()
    os.chdir(REPO_ROOT)
    print(f"# rlrunner recovery benchmark\n\ncommand: {command_line()}")
    workdir, keep = run_folders(args)
    try:
        ray_started = time.monotonic()
        start_local_ray(args.num_cpus, log_to_driver=False)
        print(f"machine: {describe_machine(args.num_cpus)}")
        if args.num_cpus > (os.cpu_count() or 1):
            print(f"(Ray's logical CPUs exceed the cores by what the idle spares reserve: {args.num_cpus} on "
                  f"{os.cpu_count()} cores)")
        print(f"Ray start: {time.monotonic() - ray_started:.1f} s (excluded from every measurement); run folders: {workdir}", flush=True)
        if args.only in (None, "recovery") and args.kills > 0:
            measure_recovery(args, workdir)
        if args.only in (None, "goodput"):
            measure_goodput(args, workdir)
        if args.only in (None, "rollout") and args.rollout_kills > 0:
            measure_rollout_repair(lambda name, *extra: build_config(workdir / name, args.rollout_steps, args, *extra),
                                   args.rollout_kills, args.kill_delay, args.variants, spares_up)
    finally:
        stop_ray()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"\ntotal benchmark time: {time.monotonic() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
