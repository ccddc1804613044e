#!/usr/bin/env python
"""What the in-memory snapshots cost a step: the default job with them on (the default) and off, in one invocation.

Both runs are real runs (`Supervisor(cfg).run()`) of the same job apart from `runner.snapshot.enabled`, one after
the other (`--first` picks the order) on one embedded local Ray this script starts: the default job's layout (two
FSDP actor ranks, one rollout worker), its model or a bigger one of the same family (`--hidden`, `--layers`: 64-wide
heads, 2 KV heads, the MLP twice the width, as `bench_step_time.py` builds them; `--hidden 512 --layers 8` is about
17M parameters). Each run takes `--warmup` + `--steps` steps, no validation, no periodic save. Reported, as medians
over the measured steps: the whole step (`time/step_s`), the weight sync (`time/weight_sync_s`, which the ranks'
streams run beside) and, with snapshots on, how long the streams outlasted it (`time/snapshot_s`), each also as a
share of the step; the ratio of the steps per second on / off.

Run from the repository root:

    .venv/bin/python benchmarks/bench_snapshot_cost.py                          # the default job, 40 steps after 3
    .venv/bin/python benchmarks/bench_snapshot_cost.py --hidden 512 --layers 8 --steps 10   # about 17M parameters
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib and bench_step_time, beside this script
from bench_step_time import model_overrides  # noqa: E402

from benchlib.common import (  # noqa: E402
    ONE_ROLLOUT_WORKER,
    TWO_ACTOR_RANKS,
    command_line,
    machine,
    make_workdir,
    read_jsonl,
    runs_in_embedded_ray,
)

RUNS = {"on": True, "off": False}
TIMES = ("time/step_s", "time/weight_sync_s", "time/snapshot_s")


def run_overrides(args: argparse.Namespace, name: str, output_dir: Path) -> list[str]:
    total = args.warmup + args.steps
    return [
        f"runner.output_dir={output_dir}",
        f"runner.experiment_name=snapshots-{name}",
        f"runner.max_steps={total}",
        f"runner.save_interval={total + 1000}",
        "runner.logger.progress_bar=false",
        "runner.logger.backends=[]",
        "data.synthetic.val_size=0",
        f"runner.seed={args.seed}",
        f"runner.snapshot.enabled={str(RUNS[name]).lower()}",
        ONE_ROLLOUT_WORKER,
        TWO_ACTOR_RANKS,
        *model_overrides(args.hidden, args.layers),
        *args.override,
    ]


def run_one(args: argparse.Namespace, name: str, output_dir: Path) -> list[dict[str, Any]]:
    from rlrunner.config import load_config
    from rlrunner.runner.metrics import METRICS_FILE
    from rlrunner.runner.supervisor import Supervisor

    supervisor = Supervisor(load_config(run_overrides(args, name, output_dir)))
    started = time.perf_counter()
    supervisor.run()
    steps = read_jsonl(Path(supervisor.ctx.log_path) / METRICS_FILE)
    if len(steps) != args.warmup + args.steps:
        raise RuntimeError(f"{name}: metrics.jsonl has {len(steps)} steps, expected {args.warmup + args.steps}")
    print(f"snapshots {name}: {len(steps)} steps in {time.perf_counter() - started:.1f}s (start-up included)")
    return [s for s in steps if s["step"] > args.warmup]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="measured steps per run (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per run, excluded from the medians")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default: the embedded tiny model's)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the embedded tiny model's)")
    parser.add_argument("--seed", type=int, default=1, help="runner.seed of both runs")
    parser.add_argument("--first", choices=list(RUNS), default="on", help="which run goes first")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="for both runs")
    parser.add_argument("--dir", type=Path, default=None, help="folder for the runs' output (a fresh subfolder)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be positive, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"command: {command_line()}")
    print(f"machine: {machine()}")
    work = make_workdir(args.dir, "bench_snapshot_cost_")
    order = [args.first, *(name for name in RUNS if name != args.first)]
    started = time.perf_counter()
    runs = runs_in_embedded_ray(2, work, order, lambda name: run_one(args, name, work))

    medians = {
        name: {key: statistics.median(s[key] for s in steps) for key in TIMES if key in steps[0]}
        for name, steps in runs.items()
    }
    print()
    print(f"| median over steps {args.warmup + 1}..{args.warmup + args.steps} | snapshots on | off | on / off |")
    print("|---|---:|---:|---:|")
    for key in TIMES:
        cells = []
        for name in ("on", "off"):
            value = medians[name].get(key)
            if value is None:
                cells.append("-")
                continue
            share = "" if key == "time/step_s" else f" ({100 * value / medians[name]['time/step_s']:.1f}%)"
            cells.append(f"{value:.4f} s{share}")
        on, off = medians["on"].get(key), medians["off"].get(key)
        print(f"| {key} | {cells[0]} | {cells[1]} | {f'{on / off:.2f}' if on is not None and off else '-'} |")
    on_step, off_step = medians["on"]["time/step_s"], medians["off"]["time/step_s"]
    print(f"| steps per second | {1 / on_step:.2f} | {1 / off_step:.2f} | **{off_step / on_step:.2f}x** |")
    print(f"\ntotal time: {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
