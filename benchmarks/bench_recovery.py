#!/usr/bin/env python
"""In-job recovery of rlrunner's GRPO runner: how long a restart takes, and what failures cost in goodput.

Everything runs on a local Ray started by this script (`ray.init(address="local", num_cpus=--num-cpus)`),
with the default job (configs/grpo.yaml, with 2 FSDP2 actor ranks and 1 rollout worker, at 0.5 CPU each, the
embedded tiny Qwen2, checkpoints every `runner.save_interval` steps). Every run writes to a fresh temp
folder with the progress bar and TensorBoard off. Workers are killed with SIGKILL on their process id
(`supervisor.trainer.actor_group.hosts[r]["pid"]`: the current attempt's group) from a thread while
`Supervisor.run()` trains in the main thread, as tests/integration/test_recovery_*.py do.

1. Recovery time (`--recovery-steps` steps, `--kills` kills; benchlib/recovery_time.py). The first kill comes
   `--kill-delay` s after the first checkpoint is committed (so every restart loads one); each further kill comes
   `--kill-delay` s after the previous restart's first completed step. Targets cycle actor rank 1, actor rank 0 (a
   killed rollout worker no longer restarts the attempt: its group alone is replaced, with no step lost and none of
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

2. Goodput under failure injection (`--goodput-steps` steps; 400 by default, half the default job, to keep the whole
   script near 12 minutes; benchlib/recovery_goodput.py). A timer thread SIGKILLs one worker every T seconds for each
   T in `--periods` (actor ranks 1 and 0 in turn; a kill that falls while the groups are being rebuilt waits until
   its target exists, and the next kill is T s after it), next to the same job
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
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, beside this script
from benchlib.common import ONE_ROLLOUT_WORKER, TWO_ACTOR_RANKS, command_line, make_workdir, start_local_ray, stop_ray  # noqa: E402
from benchlib.recovery_goodput import measure_goodput  # noqa: E402
from benchlib.recovery_time import measure_recovery  # noqa: E402
from benchlib.rollout_repair import measure_rollout_repair  # noqa: E402

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from rlrunner.runner.supervisor import Supervisor

REPO_ROOT = Path(__file__).resolve().parents[1]


# -- configuration ---------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", choices=("recovery", "goodput", "rollout"), default=None, help="run one of the three parts"
    )
    parser.add_argument("--recovery-steps", type=int, default=300, help="steps of the recovery-time job")
    parser.add_argument("--kills", type=int, default=5, help="workers killed in the recovery-time job")
    parser.add_argument(
        "--kill-delay", type=float, default=3.0, help="seconds after a recovery's first step before the next kill"
    )
    parser.add_argument("--rollout-kills", type=int, default=5, help="rollout workers killed in the rollout-repair job")
    parser.add_argument("--rollout-steps", type=int, default=200, help="steps of each rollout-repair job")
    parser.add_argument(
        "--periods", default="10,20,40", help="comma-separated kill periods T (seconds) for the goodput part"
    )
    parser.add_argument(
        "--goodput-steps", type=int, default=400, help="steps of each goodput job (the default job has 800)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the goodput part's whole set of runs this many times; each round's ratios are against "
        "its own no-failure run, and the medians over the rounds are printed at the end",
    )
    parser.add_argument(
        "--max-run-s",
        type=float,
        default=None,
        help="stop a goodput run with failures still going after this long; its committed steps count "
        "(default: 2 x the no-failure run's wall time)",
    )
    parser.add_argument("--save-interval", type=int, default=50, help="runner.save_interval")
    parser.add_argument(
        "--actor-spares", type=int, default=2, help="cluster.spare_workers.actor of the runs with spares"
    )
    parser.add_argument(
        "--rollout-spares", type=int, default=1, help="cluster.spare_workers.rollout of the runs with spares"
    )
    parser.add_argument(
        "--num-cpus",
        type=int,
        default=None,
        help="logical CPUs of the local Ray (default: the cores, plus what the spares reserve)",
    )
    parser.add_argument("--max-restarts", type=int, default=10_000, help="runner.recovery.max_restarts")
    parser.add_argument(
        "--workdir", default=None, help="where run folders go (default: a new folder under /tmp, deleted at the end)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    parser.add_argument(
        "overrides", nargs="*", help="extra Hydra overrides for every run, e.g. rollout.max_new_tokens=6"
    )
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
        variants.append(
            (
                f"with spares (actor {actor}, rollout {rollout})",
                [f"cluster.spare_workers.actor={actor}", f"cluster.spare_workers.rollout={rollout}"],
            )
        )
    return variants


def spares_up(supervisor: Supervisor) -> bool:
    """Whether every warm spare of the run is up (true when it has none)."""
    pools = supervisor.ctx.spare_pools
    return pools is not None and all(pool.all_up() for pool in pools.values())


def build_config(args: argparse.Namespace, output_dir: Path, steps: int, *extra: str) -> DictConfig:
    """The default job (configs/grpo.yaml) with this benchmark's overrides."""
    from rlrunner.config import load_config

    return load_config(
        [
            f"runner.output_dir={output_dir}",
            f"runner.max_steps={steps}",
            f"runner.save_interval={args.save_interval}",
            "runner.logger.progress_bar=false",
            ONE_ROLLOUT_WORKER,
            TWO_ACTOR_RANKS,
            "runner.logger.backends=[]",
            "data.synthetic.val_size=0",
            f"runner.recovery.max_restarts={args.max_restarts}",
            *args.overrides,
            *extra,
        ]
    )


def configure_logging() -> None:
    """rlrunner's warnings and errors (one line per restart) on stderr; Ray and torch quiet."""
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    for noisy in ("ray", "torch.distributed", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


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
    return make_workdir(Path(args.workdir) if args.workdir else None, "bench_recovery_"), bool(
        args.workdir
    ) or args.keep


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    began = time.monotonic()
    configure_logging()
    os.chdir(REPO_ROOT)
    print(f"# rlrunner recovery benchmark\n\ncommand: {command_line()}")
    workdir, keep = run_folders(args)
    cfg_for = partial(build_config, args)  # (output_dir, steps, *overrides) -> the job's config
    try:
        ray_started = time.monotonic()
        start_local_ray(args.num_cpus, log_to_driver=False)
        print(f"machine: {describe_machine(args.num_cpus)}")
        if args.num_cpus > (os.cpu_count() or 1):
            print(
                f"(Ray's logical CPUs exceed the cores by what the idle spares reserve: {args.num_cpus} on "
                f"{os.cpu_count()} cores)"
            )
        print(
            f"Ray start: {time.monotonic() - ray_started:.1f} s (excluded from every measurement); "
            f"run folders: {workdir}",
            flush=True,
        )
        if args.only in (None, "recovery") and args.kills > 0:
            measure_recovery(args, workdir, cfg_for, spares_up)
        if args.only in (None, "goodput"):
            measure_goodput(args, workdir, cfg_for)
        if args.only in (None, "rollout") and args.rollout_kills > 0:
            measure_rollout_repair(
                lambda name, *extra: cfg_for(workdir / name, args.rollout_steps, *extra),
                args.rollout_kills,
                args.kill_delay,
                args.variants,
                spares_up,
            )
    finally:
        stop_ray()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"\ntotal benchmark time: {time.monotonic() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
