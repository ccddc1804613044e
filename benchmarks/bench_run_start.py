#!/usr/bin/env python
"""Runs one after another in one driver process: their wall clock with `cluster.reuse_workers` off and on.

A sweep, a notebook or the test suite runs run after run in one driver. Each run here is a real run
(`Supervisor(cfg).run()`, the default job's config with `runner.max_steps` steps and no checkpoints but the last) on
a local Ray this script starts (so parked groups are allowed, `WorkerGroup.finish`). The first run of each setting
starts new worker processes; with reuse on, every later one is built in the processes the run before it left. The
settings alternate (off, on, off, on...), each in a Ray of its own, `--rounds` times; the table gives medians over the
later runs (2..N) and the ratio against reuse off measured in the same invocation. The runs' metrics are checked to
be the same, bit for bit (timings aside), whatever the setting.

    python benchmarks/bench_run_start.py [--runs 4] [--rounds 2] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib.common import ONE_ROLLOUT_WORKER, TWO_ACTOR_RANKS, make_workdir, start_local_ray, stop_ray, timed  # noqa: E402


def metrics_without_time(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


def one_setting(reuse: bool, runs: int, steps: int, workdir: Path, num_cpus: int) -> tuple[list[float], list]:
    """The wall clock of `runs` runs in a fresh local Ray, and their metrics."""
    from rlrunner.config import load_config
    from rlrunner.runner.supervisor import Supervisor

    start_local_ray(num_cpus, log_to_driver=False)
    walls, metrics = [], []
    try:
        for index in range(runs):
            output = workdir / f"{'reuse' if reuse else 'fresh'}-{index}"
            cfg = load_config(
                [
                    f"runner.output_dir={output}",
                    "runner.experiment_name=bench",
                    f"runner.max_steps={steps}",
                    f"runner.save_interval={steps}",
                    "runner.val_interval=0",
                    "runner.logger.progress_bar=false",
                    ONE_ROLLOUT_WORKER,
                    TWO_ACTOR_RANKS,
                    "runner.logger.backends=[]",
                    f"cluster.reuse_workers={str(reuse).lower()}",
                ]
            )
            wall, _ = timed(lambda: Supervisor(cfg).run())
            walls.append(wall)
            metrics.append(metrics_without_time(output / "bench" / "metrics.jsonl"))
    finally:
        stop_ray()
    return walls, metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4, help="runs per setting, one after another in one Ray")
    parser.add_argument("--rounds", type=int, default=2, help="times each setting is measured (alternating)")
    parser.add_argument("--steps", type=int, default=2, help="training steps per run")
    parser.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the local Ray")
    args = parser.parse_args(argv)
    workdir = make_workdir(None, "bench_run_start-")
    walls: dict[bool, list[list[float]]] = {False: [], True: []}
    reference = None
    for round_index in range(args.rounds):
        for reuse in (False, True):
            times, metrics = one_setting(reuse, args.runs, args.steps, workdir / f"round{round_index}", args.num_cpus)
            walls[reuse].append(times)
            for run_metrics in metrics:
                reference = reference or run_metrics
                if run_metrics != reference:
                    print(f"metrics differ (reuse={reuse}, round {round_index})", file=sys.stderr)
                    return 1
    first = {reuse: statistics.median(t[0] for t in walls[reuse]) for reuse in walls}
    later = {reuse: statistics.median(x for t in walls[reuse] for x in t[1:]) for reuse in walls}
    print(f"{args.runs} runs of {args.steps} steps per setting, {args.rounds} rounds; medians in seconds")
    print("| cluster.reuse_workers | first run | later runs | later runs vs reuse off |")
    print("|---|---:|---:|---:|")
    for reuse in (False, True):
        ratio = later[False] / later[reuse]
        print(f"| {str(reuse).lower()} | {first[reuse]:.2f} | {later[reuse]:.2f} | {ratio:.2f}x as fast |")
    print("metrics of every run: the same, bit for bit (timings aside)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
