#!/usr/bin/env python
"""Step time with a slow reward function: `reward.num_workers` scoring processes against one, in one run.

The default job (the embedded tiny Qwen2, the synthetic task, 16 prompts x 16 samples = 256 samples per step, one
rollout worker) with a user reward function that sleeps `--sleep-ms` (50 ms) per call and then scores as the
built-in arithmetic verifier does, as a verifier that runs code or checks equivalence takes tens of milliseconds. The
same config runs once per `--workers` value (1 and 4), one after the other on one embedded local Ray that this script
starts, each a real run (`Supervisor(cfg).run()`), `--warmup` + `--steps` steps, no periodic save. From each run's
metrics.jsonl it reports the median over the measured steps of `time/step_s` and `time/rollout_s` (generation and
scoring), and the ratio to the first `--workers` value. It also checks that every run logged the same metrics apart
from timings (the scores do not depend on how many processes computed them).

Run from the repository root:

    .venv/bin/python benchmarks/bench_reward_workers.py                    # 1 and 4 processes, 50 ms per call
    .venv/bin/python benchmarks/bench_reward_workers.py --workers 1 2 4 8 --steps 5
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, beside this script
from benchlib.common import command_line, cpu_model, make_workdir, read_jsonl, runs_in_embedded_ray  # noqa: E402

SLOW_REWARD = '''
"""A slow verifier: sleeps, then scores as the built-in arithmetic verifier."""
import time

from rlrunner.rewards.arithmetic import arithmetic_reward


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep({seconds})
    return arithmetic_reward(solution_str, str(ground_truth))
'''
TIMES = ("time/step_s", "time/rollout_s", "time/update_s")


def run(
    args: argparse.Namespace, workers: int, reward_file: Path, output_dir: Path
) -> tuple[int, list[dict[str, Any]]]:
    """One run with `workers` scoring processes: (samples per step, its steps' metrics)."""
    from rlrunner.config import load_config
    from rlrunner.runner.metrics import METRICS_FILE
    from rlrunner.runner.supervisor import Supervisor

    total = args.warmup + args.steps
    cfg = load_config(
        [
            f"runner.output_dir={output_dir}",
            f"runner.experiment_name=reward-workers-{workers}",
            f"runner.max_steps={total}",
            f"runner.save_interval={total + 1000}",
            "runner.logger.progress_bar=false",
            "runner.logger.backends=[]",
            "data.synthetic.val_size=0",
            f"reward.function={reward_file}",
            f"reward.num_workers={workers}",
            *args.override,
        ]
    )
    started = time.perf_counter()
    supervisor = Supervisor(cfg)
    supervisor.run()
    steps = read_jsonl(Path(supervisor.ctx.log_path) / METRICS_FILE)
    print(
        f"reward.num_workers={workers}: {len(steps)} steps in {time.perf_counter() - started:.1f}s (start-up included)",
        flush=True,
    )
    return cfg.data.batch_size * cfg.algorithm.group_size, [s for s in steps if s["step"] >= 1]


def median(steps: list[dict[str, Any]], key: str, first: int) -> float:
    return statistics.median(s[key] for s in steps if s["step"] >= first)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4], help="reward.num_workers of each run")
    parser.add_argument("--sleep-ms", type=float, default=50.0, help="what one reward call sleeps")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per run, excluded from the medians")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra config override for every run (repeatable)",
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="folder for the runs' output (a fresh subfolder is made)"
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or any(w < 1 for w in args.workers):
        parser.error("--steps and every --workers value must be positive, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import os

    print(f"command: {command_line()}")
    print(f"machine: {os.cpu_count()} CPU cores ({cpu_model()})")
    work = make_workdir(args.dir, "bench_reward_workers_")
    reward_file = work / "slow_reward.py"
    reward_file.write_text(textwrap.dedent(SLOW_REWARD.format(seconds=args.sleep_ms / 1000)))
    started = time.perf_counter()
    results = runs_in_embedded_ray(4, work, args.workers, lambda workers: run(args, workers, reward_file, work))
    first = args.warmup + 1
    base = args.workers[0]
    runs = {workers: steps for workers, (_, steps) in results.items()}
    samples = results[base][0]
    print()
    print(f"| reward.num_workers | {' | '.join(f'{k} (s)' for k in TIMES)} | step time / {base} process(es) |")
    print("|---:|" + "---:|" * (len(TIMES) + 1))
    for workers, steps in runs.items():
        values = [median(steps, key, first) for key in TIMES]
        ratio = values[0] / median(runs[base], TIMES[0], first)
        print(f"| {workers} | {' | '.join(f'{v:.3f}' for v in values)} | {ratio:.2f} |")
    print()
    print(
        f"Medians of steps {first}..{args.warmup + args.steps}; {samples} reward calls per step of "
        f"{args.sleep_ms:g} ms each ({samples * args.sleep_ms / 1000:.1f} s of sleep per step in one process)."
    )
    untimed = {
        w: [{k: v for k, v in s.items() if not k.startswith("time/")} for s in steps] for w, steps in runs.items()
    }
    same = all(metrics == untimed[base] for metrics in untimed.values())
    print(f"metrics apart from timings: {'the same' if same else 'NOT the same'} in every run")
    print(f"total time: {time.perf_counter() - started:.0f}s")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
