#!/usr/bin/env python
"""Steps per second with `algorithm.policy_lag=1` (generation overlapped with the update) against lag 0, in one run.

Both runs are real runs (`Supervisor(cfg).run()`) of the same job apart from the lag, one after the other (`--first`
picks the order) on one embedded local Ray this script starts: one FSDP actor rank and one rollout worker (`hf`
engine), one torch thread each (`cluster.threads_per_worker=1`), each pinned to a core of its own once the run has
started (every thread of the worker process and of its child processes, the reward scoring ones, with
`sched_setaffinity`: Ray does not pin CPUs). The job is chosen so that generation and update take about the same
time (`--generation-batch-size`, prompts per generation chunk, and `--max-new-tokens` set the generation's share; the
default job's 16 prompts one at a time balance its update, in passes of 32 sequences, on this machine; the lag-0
run's medians say how even the two are): at lag 0 each
side waits for the other, at lag 1 they run side by side, so the physical limit is 2x when the two are equal.
Both runs use the lag-1 run's correction (`algorithm.rollout_correction.tis_cap`), so the update does the same work.

Each run takes `--warmup` + `--steps` steps, no validation, no periodic save (snapshots on, the default). Reported:
the median `time/step_s` over the measured steps, steps per second, and the ratio lag 1 / lag 0; the lag-0 run's
median generation (`time/rollout_s`) and update (`time/update_s`); the lag-1 run's median wait for the generation
ahead after its update (`time/generation_wait_s`).

Run from the repository root:

    .venv/bin/python benchmarks/bench_overlap.py                        # 30 steps after 3 warm-up, each run
    .venv/bin/python benchmarks/bench_overlap.py --generation-batch-size 4 --first lag1   # generation < update
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, beside this script
from benchlib.common import command_line, machine, make_workdir, read_jsonl, runs_in_embedded_ray  # noqa: E402

LAGS = {"lag0": 0, "lag1": 1}


def pin_process_tree(cpu: int) -> int:
    """Pin every thread of this process, and of its child processes, to `cpu` (run inside a worker); the threads
    pinned."""
    pids, pinned = [os.getpid()], 0
    while pids:
        pid = pids.pop()
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(task), {cpu})
                pinned += 1
            except (ProcessLookupError, PermissionError):
                pass
            try:
                with open(f"/proc/{pid}/task/{task}/children") as handle:
                    pids.extend(int(child) for child in handle.read().split())
            except OSError:
                pass
    return pinned


class PinWorkers:
    """A Supervisor callback: the actor rank on one core, the rollout worker on the other, once the run starts."""

    def __init__(self, actor_cpu: int, rollout_cpu: int):
        self.cpus = {"actor": actor_cpu, "rollout": rollout_cpu}
        self.pinned: dict[str, int] = {}

    def on_train_start(self, trainer) -> None:
        import ray

        for group in trainer.groups():
            cpu = self.cpus[group.name]
            refs = [w.__ray_call__.remote(lambda self, cpu=cpu: pin_process_tree(cpu)) for w in group.workers]
            self.pinned[group.name] = sum(ray.get(refs))

    def on_train_end(self, trainer) -> None:
        pass


def run_overrides(args: argparse.Namespace, name: str, output_dir: Path) -> list[str]:
    total = args.warmup + args.steps
    return [
        f"runner.output_dir={output_dir}",
        f"runner.experiment_name=overlap-{name}",
        f"runner.max_steps={total}",
        f"runner.save_interval={total + 1000}",
        "runner.logger.progress_bar=false",
        "runner.logger.backends=[]",
        "data.synthetic.val_size=0",
        f"runner.seed={args.seed}",
        "actor.num_workers=1",
        # passes of 32 sequences: on one thread they take 0.65x the time of the share's 256 in one pass (the token
        # budget's default), whose activations outgrow the caches
        "actor.micro_batch_size=32",
        # the balance above was found with activations recomputed (the default for every model until the tiny one
        # stopped recomputing): kept, so the job and its figures stay the same
        "actor.gradient_checkpointing=true",
        # and with every row a pass of its own prompt's (the estimate packs none of this job's passes: its responses
        # are long); pinned, so that a trained policy's shorter responses never change the job
        "actor.pack_shared_prompts=false",
        "rollout.num_workers=1",
        "cluster.threads_per_worker=1",
        "cluster.cpus_per_actor_worker=0.5",
        "cluster.cpus_per_rollout_worker=0.5",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.generation_batch_size={args.generation_batch_size}",
        f"algorithm.policy_lag={LAGS[name]}",
        "algorithm.rollout_correction.tis_cap=2.0",
        *args.override,
    ]


def run_one(args: argparse.Namespace, name: str, output_dir: Path) -> list[dict[str, Any]]:
    from rlrunner.config import load_config
    from rlrunner.runner.metrics import METRICS_FILE
    from rlrunner.runner.supervisor import Supervisor

    cfg = load_config(run_overrides(args, name, output_dir))
    pins = PinWorkers(actor_cpu=0, rollout_cpu=1 % (os.cpu_count() or 1))
    supervisor = Supervisor(cfg, callbacks=[pins])
    started = time.perf_counter()
    supervisor.run()
    steps = read_jsonl(Path(supervisor.ctx.log_path) / METRICS_FILE)
    if len(steps) != args.warmup + args.steps:
        raise RuntimeError(f"{name}: metrics.jsonl has {len(steps)} steps, expected {args.warmup + args.steps}")
    print(
        f"{name}: {len(steps)} steps in {time.perf_counter() - started:.1f}s (start-up included); threads pinned: "
        f"{pins.pinned}",
        flush=True,
    )
    return steps


def median(steps: list[dict[str, Any]], key: str, first: int) -> float:
    return statistics.median(s[key] for s in steps if s["step"] >= first)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per run, excluded from the medians")
    parser.add_argument(
        "--max-new-tokens", type=int, default=16, help="rollout.max_new_tokens: the generation's share of a step"
    )
    parser.add_argument(
        "--generation-batch-size", type=int, default=1, help="rollout.generation_batch_size: prompts per chunk"
    )
    parser.add_argument("--seed", type=int, default=1, help="runner.seed of both runs")
    parser.add_argument("--first", choices=list(LAGS), default="lag0", help="which run goes first")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="for both runs")
    parser.add_argument("--dir", type=Path, default=None, help="folder for the runs' output (a fresh subfolder)")
    args = parser.parse_args(argv)
    if min(args.steps, args.max_new_tokens, args.generation_batch_size) < 1 or args.warmup < 0:
        parser.error("--steps, --max-new-tokens and --generation-batch-size must be positive, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"command: {command_line()}")
    print(f"machine: {machine()}")
    work = make_workdir(args.dir, "bench_overlap_")
    order = [args.first, *(name for name in LAGS if name != args.first)]
    started = time.perf_counter()
    runs = runs_in_embedded_ray(2, work, order, lambda name: run_one(args, name, work))

    first = args.warmup + 1
    step = {name: median(steps, "time/step_s", first) for name, steps in runs.items()}
    print()
    print(f"| median over steps {first}..{args.warmup + args.steps} | lag 0 | lag 1 | lag 1 / lag 0 |")
    print("|---|---:|---:|---:|")
    print(f"| time/step_s | {step['lag0']:.3f} | {step['lag1']:.3f} | {step['lag1'] / step['lag0']:.2f} |")
    print(
        f"| steps per second | {1 / step['lag0']:.2f} | {1 / step['lag1']:.2f} | "
        f"**{step['lag0'] / step['lag1']:.2f}x** |"
    )
    keys = ("rollout_s", "update_s", "weight_sync_s", "generation_wait_s")
    lag0 = {key: median(runs["lag0"], f"time/{key}", first) for key in keys[:3]}
    lag1 = {key: median(runs["lag1"], f"time/{key}", first) for key in keys[1:]}
    print()
    print(
        f"lag 0: generation (time/rollout_s) {lag0['rollout_s']:.3f}s, update (time/update_s) {lag0['update_s']:.3f}s, "
        f"weight sync {lag0['weight_sync_s']:.3f}s; lag 1: update {lag1['update_s']:.3f}s, then waiting for the "
        f"generation ahead {lag1['generation_wait_s']:.3f}s, weight sync {lag1['weight_sync_s']:.3f}s"
    )
    print(f"total time: {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
