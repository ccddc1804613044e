#!/usr/bin/env python
"""The default job against the same work done by TRL's `GRPOTrainer`, one after the other on this machine.

rlrunner's run is the default job (`Supervisor(cfg).run()` on an embedded local Ray: one FSDP actor rank, one `hf`
rollout worker, 2 cores), `--steps` steps, no validation or periodic save, snapshots on. TRL's run
(`benchlib/trl_grpo.py`, run by `--trl-python`, the interpreter of a venv with TRL) is one process training the same
tiny Qwen2 from the same initial weights (rlrunner's seeded init, written as an HF folder with its tokenizer) on the
same prompts in the same order (rlrunner's loader's, written out), with the same reward, loss and optimizer settings
(see that script). Each run recomputes activations in the backward as its own defaults say: TRL does
(`GRPOConfig.gradient_checkpointing`, true), rlrunner does not for a model this small (`actor.gradient_checkpointing`
null, on above 16M parameters), the same numbers either way; `--trl-gradient-checkpointing off` runs TRL without, and
an `actor.gradient_checkpointing` override is followed by TRL's run unless that flag is given. Reported: the median step
time inside each loop and steps per second (rlrunner / TRL), the wall time end to end including start-up, the time
outside the steps (start-up and close), rlrunner's step broken down (generation and reward, update, weight sync,
snapshot), and both runs' mean reward over their last 50 steps (the same work should learn alike, not bit for bit: the
samplers differ).

Run from the repository root (TRL in a venv of its own: it pins its own transformers):

    python3.11 -m venv /tmp/trl && /tmp/trl/bin/pip install torch==2.13.0 trl
    .venv/bin/python benchmarks/bench_vs_trl.py --trl-python /tmp/trl/bin/python          # 200 steps each
    .venv/bin/python benchmarks/bench_vs_trl.py --trl-python /tmp/trl/bin/python --override algorithm.policy_lag=1 \
        --override algorithm.rollout_correction.tis_cap=2.0
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, beside this script
from benchlib.common import command_line, machine, make_workdir, read_jsonl, stop_ray  # noqa: E402

TRL_SCRIPT = Path(__file__).resolve().parent / "benchlib" / "trl_grpo.py"
LAST = 50  # the reward is compared over the last this many steps


def job_overrides(args: argparse.Namespace, output_dir: Path) -> list[str]:
    return [
        f"runner.output_dir={output_dir}",
        "runner.experiment_name=vs-trl",
        f"runner.max_steps={args.steps}",
        f"runner.save_interval={args.steps + 1000}",
        "runner.logger.progress_bar=false",
        "runner.logger.backends=[]",
        "data.synthetic.val_size=0",
        f"runner.seed={args.seed}",
        *args.override,
    ]


def export_job(cfg: Any, folder: Path, steps: int) -> None:
    """The default job's initial weights, config and tokenizer as an HF folder, and its prompts in its order."""
    from rlrunner.models.loading import random_model, torch_dtype
    from rlrunner.runner.context import RunContext
    from rlrunner.utils.seeding import derive_seed

    ctx = RunContext(cfg)
    model = random_model(
        ctx.hf_config, derive_seed(cfg.runner.seed, "model_init"), cfg.model.attn_implementation, torch_dtype("float32")
    )
    model.save_pretrained(folder / "model", safe_serialization=True)
    ctx.tokenizer.save_pretrained(folder / "model")
    loader = ctx.new_loader()
    with open(folder / "prompts.jsonl", "w") as out:
        for _ in range(steps):
            for record in loader.next_batch():
                out.write(json.dumps({"prompt": record["extra_info"]["prompt"], "answer": record["answer"]}) + "\n")


def run_rlrunner(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from rlrunner.cluster.ray_setup import start_embedded
    from rlrunner.config import load_config
    from rlrunner.runner.metrics import METRICS_FILE
    from rlrunner.runner.supervisor import Supervisor

    began = time.perf_counter()
    try:
        start_embedded(2)
        supervisor = Supervisor(load_config(job_overrides(args, work)))
        supervisor.run()
    finally:
        stop_ray()
    wall = time.perf_counter() - began
    steps = read_jsonl(Path(supervisor.ctx.log_path) / METRICS_FILE)
    step_s = [s["time/step_s"] for s in steps]
    return {
        "steps": steps,
        "step_s": step_s,
        "reward": [s["rollout/reward_mean"] for s in steps],
        "wall_s": wall,
        "first_step_after_s": wall - sum(step_s),  # what is not a step: start-up (and the end's close)
    }


def trl_micro_batch_size(args: argparse.Namespace, cfg: Any) -> int:
    """TRL's samples per forward/backward: `--trl-micro-batch-size`, else rlrunner's `actor.micro_batch_size` when set,
    else a rank's whole share of a mini-batch (what the default job's token budget holds in one micro-batch: its
    `actor/micro_batches` metric, printed with the results, says whether the run did)."""
    if args.trl_micro_batch_size:
        return args.trl_micro_batch_size
    if cfg.actor.micro_batch_size:
        return cfg.actor.micro_batch_size
    prompts = cfg.actor.mini_batch_size or cfg.data.batch_size
    return prompts * cfg.algorithm.group_size // cfg.actor.num_workers


def trl_recomputes(args: argparse.Namespace, cfg: Any) -> bool:
    """Whether TRL's run recomputes activations: `--trl-gradient-checkpointing`, else an explicit
    `actor.gradient_checkpointing`, else TRL's own default (on)."""
    if args.trl_gradient_checkpointing != "default":
        return args.trl_gradient_checkpointing == "on"
    setting = cfg.actor.gradient_checkpointing
    return True if setting is None else bool(setting)


def run_trl(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from rlrunner.config import load_config

    cfg = load_config(job_overrides(args, work / "export"))
    out = work / "trl.json"
    command = [
        args.trl_python,
        str(TRL_SCRIPT),
        f"--model={work / 'model'}",
        f"--prompts={work / 'prompts.jsonl'}",
        f"--steps={args.steps}",
        f"--out={out}",
        f"--seed={args.seed}",
        f"--max-new-tokens={cfg.rollout.max_new_tokens}",
        f"--micro-batch-size={trl_micro_batch_size(args, cfg)}",
        *(["--gradient-checkpointing"] if trl_recomputes(args, cfg) else []),
    ]
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"TRL's run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - began  # the process's start included
    result["micro_batch_size"] = trl_micro_batch_size(args, cfg)
    result["recomputes"] = trl_recomputes(args, cfg)
    result["micro_batches"] = cfg.data.batch_size * cfg.algorithm.group_size // result["micro_batch_size"]
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-python", required=True, help="the interpreter of a venv with TRL installed")
    parser.add_argument("--steps", type=int, default=200, help="steps of each run")
    parser.add_argument("--seed", type=int, default=1, help="runner.seed (and TRL's seed)")
    parser.add_argument("--first", choices=["rlrunner", "trl"], default="rlrunner", help="which run goes first")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="for rlrunner's run")
    parser.add_argument(
        "--trl-micro-batch-size", type=int, default=None, help="TRL's samples per pass (default: rlrunner's)"
    )
    parser.add_argument(
        "--trl-gradient-checkpointing",
        choices=["default", "on", "off"],
        default="default",
        help="TRL's activation recomputation (default: rlrunner's explicit setting, else TRL's default, on)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="folder for the runs' output (a fresh subfolder)")
    args = parser.parse_args(argv)
    if args.steps <= LAST:
        parser.error(f"--steps must be more than {LAST}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rlrunner.config import load_config

    print(f"command: {command_line()}")
    print(f"machine: {machine()}")
    work = make_workdir(args.dir, "bench_vs_trl_")
    started = time.perf_counter()
    try:
        export_job(load_config(job_overrides(args, work / "export")), work, args.steps)
        order = [args.first, *(name for name in ("rlrunner", "trl") if name != args.first)]
        runs = {name: (run_rlrunner if name == "rlrunner" else run_trl)(args, work) for name in order}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ours, trl = runs["rlrunner"], runs["trl"]
    med = {name: statistics.median(run["step_s"][3:]) for name, run in runs.items()}
    print(f"\nTRL {trl['versions']['trl']} (torch {trl['versions']['torch']}, {trl['threads']} threads)\n")
    print(f"| {args.steps} steps | rlrunner | TRL | rlrunner / TRL |")
    print("|---|---:|---:|---:|")
    print(
        f"| median step s (after 3) | {med['rlrunner']:.4f} | {med['trl']:.4f} | {med['rlrunner'] / med['trl']:.2f} |"
    )
    print(
        f"| steps per second in the loop | {1 / med['rlrunner']:.2f} | {1 / med['trl']:.2f} | "
        f"**{med['trl'] / med['rlrunner']:.2f}x** |"
    )
    print(
        f"| wall s, start-up included | {ours['wall_s']:.1f} | {trl['wall_s']:.1f} | "
        f"{trl['wall_s'] / ours['wall_s']:.2f}x the speed |"
    )
    print(
        f"| not in a step (start-up, close) s | {ours['first_step_after_s']:.1f} | "
        f"{trl['wall_s'] - sum(trl['step_s']):.1f} | |"
    )
    print(
        f"| reward, mean of the last {LAST} steps | {statistics.mean(ours['reward'][-LAST:]):.3f} | "
        f"{statistics.mean(trl['reward'][-LAST:]):.3f} | |"
    )
    parts = ("time/rollout_s", "time/update_s", "time/weight_sync_s", "time/snapshot_s")
    breakdown = {key: statistics.median(s[key] for s in ours["steps"][3:] if key in s) for key in parts}
    print("\nrlrunner's step, medians: " + ", ".join(f"{key} {value:.4f}" for key, value in breakdown.items()))
    passes = sorted({s["actor/micro_batches"] for s in ours["steps"]})
    print(
        f"forward/backward passes per step: rlrunner {passes} on each of its ranks (actor.micro_batch_tokens "
        f"and actor.micro_batch_size), TRL {trl['micro_batches']} of {trl['micro_batch_size']} samples"
    )
    print(f"TRL recomputes activations in the backward: {'yes' if trl['recomputes'] else 'no'}")
    print(f"total time: {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
