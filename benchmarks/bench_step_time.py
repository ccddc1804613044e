#!/usr/bin/env python
"""GRPO step time of the Megatron backend (tensor parallel) against FSDP on this machine, in one run.

Both runs are real runs (`rlrunner.runner.supervisor.Supervisor(cfg).run()`), built from `load_config` with the same
overrides apart from the backend: the same model (the embedded tiny Qwen2, or `--hidden`/`--layers`), the same
data, batch and seeds, the same number of actor ranks (`--tp` x `--dp`; FSDP shards over all of them, Megatron
splits every layer over `--tp` of them) and one rollout worker, one after the other (`--first` picks the
order) on one embedded local Ray that this script starts (`ray.init(address="local", num_cpus=...)`). Each run
takes `--warmup` + `--steps` steps with `runner.save_interval` beyond the run, so no step saves (the last step's
save comes after its timing and is not counted). From each run's metrics.jsonl it reports the median over the last
`--steps` steps of

  time/step_s         the whole step: rollout + update + weight sync
  time/rollout_s      generation on the rollout worker and rewards
  time/update_s       the actor's GRPO update (forward, backward, gradient reduction, optimizer step)
  time/weight_sync_s  pushing the new weights to the rollout worker

and the ratio megatron / fsdp. Step 1's reward and response length are printed for both: with the same initial
weights and seeds the first rollout is the same, a check that the two runs really did the same work.

Run from the repository root:

    .venv/bin/python benchmarks/bench_step_time.py                                # tiny model, 30 steps after 3 warm-up
    .venv/bin/python benchmarks/bench_step_time.py --hidden 512 --layers 4        # a bigger model
    .venv/bin/python benchmarks/bench_step_time.py --steps 10 --warmup 2 --tp 2 --dp 2
    .venv/bin/python benchmarks/bench_step_time.py --first megatron                # the other order
    .venv/bin/python benchmarks/bench_step_time.py --tp 2 --dp 2 --megatron-override actor.megatron.shard_weights=false
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, beside this script
from benchlib.common import ONE_ROLLOUT_WORKER, command_line, machine, make_workdir, read_jsonl, runs_in_embedded_ray  # noqa: E402

TIMES = ["time/step_s", "time/update_s", "time/weight_sync_s", "time/rollout_s"]
BACKENDS = ("fsdp", "megatron")
TINY_KV_HEADS = 2  # the embedded tiny model's query groups (num_key_value_heads), kept for bigger widths
TINY_MLP_RATIO = 2  # the embedded tiny model's intermediate_size / hidden_size


@dataclass
class BackendRun:
    """One backend's run: its metrics per step (from metrics.jsonl) and how long the whole run took."""

    backend: str
    label: str
    steps: list[dict[str, Any]]
    wall_s: float

    def median(self, key: str, first_measured: int) -> float:
        return statistics.median(s[key] for s in self.steps if s["step"] >= first_measured)


def model_overrides(hidden: int | None, layers: int | None) -> list[str]:
    """`+model.override_config.*` for the chosen size: 64-wide heads, the tiny model's 2 KV heads and MLP ratio."""
    out = []
    if hidden is not None:
        heads = max(TINY_KV_HEADS, hidden // 64)
        out += [
            f"+model.override_config.hidden_size={hidden}",
            f"+model.override_config.intermediate_size={TINY_MLP_RATIO * hidden}",
            f"+model.override_config.num_attention_heads={heads}",
            f"+model.override_config.num_key_value_heads={TINY_KV_HEADS}",
        ]
    if layers is not None:
        out.append(f"+model.override_config.num_hidden_layers={layers}")
    return out


def backend_overrides(backend: str, tp: int) -> list[str]:
    if backend == "megatron":
        return ["actor.training_backend=megatron", f"actor.tensor_model_parallel_size={tp}"]
    return ["actor.training_backend=fsdp"]


def run_overrides(args: argparse.Namespace, backend: str, output_dir: Path) -> list[str]:
    """Every override of one run; the two runs differ only in the backend lines (and the experiment name)."""
    total = args.warmup + args.steps
    return [
        f"runner.output_dir={output_dir}",
        f"runner.experiment_name=step-time-{backend}",
        f"runner.max_steps={total}",
        f"runner.save_interval={total + 1000}",  # no periodic save: only the last step's, after its timing
        "runner.logger.progress_bar=false",
        "runner.logger.backends=[]",
        "data.synthetic.val_size=0",  # no validation: the figures time training alone
        f"runner.seed={args.seed}",
        f"actor.num_workers={args.tp * args.dp}",
        f"cluster.cpus_per_actor_worker={args.cpus_per_actor_worker}",
        f"cluster.cpus_per_rollout_worker={args.cpus_per_rollout_worker}",
        ONE_ROLLOUT_WORKER,
        *backend_overrides(backend, args.tp),
        *model_overrides(args.hidden, args.layers),
        *args.override,
        *(args.megatron_override if backend == "megatron" else []),
    ]


def read_metrics(log_path: Path) -> list[dict[str, Any]]:
    from rlrunner.runner.metrics import METRICS_FILE

    return read_jsonl(log_path / METRICS_FILE)


def run_backend(args: argparse.Namespace, backend: str, output_dir: Path) -> BackendRun:
    """One full run of `backend` (a Supervisor, as `python -m rlrunner.main_grpo` makes one) on the Ray this process
    started; its per-step metrics."""
    from rlrunner.config import load_config
    from rlrunner.runner.supervisor import Supervisor

    cfg = load_config(run_overrides(args, backend, output_dir))
    supervisor = Supervisor(cfg)
    started = time.perf_counter()
    supervisor.run()
    wall = time.perf_counter() - started
    steps = read_metrics(Path(supervisor.ctx.log_path))
    if len(steps) != args.warmup + args.steps:
        raise RuntimeError(f"{backend}: metrics.jsonl has {len(steps)} steps, expected {args.warmup + args.steps}")
    workers = cfg.actor.num_workers
    label = f"megatron (tp={args.tp} x dp={args.dp})" if backend == "megatron" else f"fsdp ({workers} ranks)"
    print(f"{label}: {len(steps)} steps in {wall:.1f}s (start-up included)", flush=True)
    return BackendRun(backend, label, steps, wall)


def model_description(args: argparse.Namespace) -> str:
    """The model both runs train, from the config the megatron run uses (checked splittable `--tp` ways)."""
    from rlrunner.backends.registry import get_backend
    from rlrunner.config import load_config
    from rlrunner.models.loading import build_hf_config, build_tokenizer

    cfg = load_config(run_overrides(args, "megatron", Path(tempfile.gettempdir())))
    config = build_hf_config(cfg.model, build_tokenizer(cfg.model))
    get_backend("megatron").check_model(config, cfg.actor)  # the ConfigError a run raises, before Ray starts
    keys = [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    ]
    shape = ", ".join(f"{key}={getattr(config, key)}" for key in keys)
    batch = f"data.batch_size={cfg.data.batch_size} x algorithm.group_size={cfg.algorithm.group_size}"
    return (
        f"Qwen2 {shape}; {batch}, actor.micro_batch_size={cfg.actor.micro_batch_size}, "
        f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}, {cfg.rollout.num_workers} rollout worker, "
        f"cluster.threads_per_worker={cfg.cluster.threads_per_worker}"
    )


def ray_cpus(args: argparse.Namespace) -> int:
    """Logical CPUs for one run's groups (the runs take turns): the actor ranks and the rollout worker."""
    from rlrunner.config import load_config

    cfg = load_config(run_overrides(args, "fsdp", Path(tempfile.gettempdir())))
    need = cfg.actor.num_workers * args.cpus_per_actor_worker + cfg.rollout.num_workers * args.cpus_per_rollout_worker
    return max(2, math.ceil(need))


def markdown_table(runs: dict[str, BackendRun], first_measured: int) -> str:
    fsdp, megatron = runs["fsdp"], runs["megatron"]
    lines = [
        f"| median over steps {first_measured}..{len(fsdp.steps)} | {fsdp.label} | {megatron.label} | "
        "megatron / fsdp |",
        "|---|---:|---:|---:|",
    ]
    for key in TIMES:
        f, m = fsdp.median(key, first_measured), megatron.median(key, first_measured)
        lines.append(f"| {key} | {f:.3f} | {m:.3f} | {m / f:.2f} |")
    return "\n".join(lines)


def first_rollout(runs: dict[str, BackendRun]) -> str:
    """Step 1's rollout of both runs: the same initial weights and seeds give the same samples, so these agree."""
    keys = ("rollout/reward_mean", "rollout/response_length_mean")
    values = {b: tuple(runs[b].steps[0][k] for k in keys) for b in BACKENDS}
    same = "the same" if values["fsdp"] == values["megatron"] else "NOT the same"
    shown = "; ".join(
        f"{b} " + ", ".join(f"{k.split('/')[1]} {v:.4f}" for k, v in zip(keys, values[b])) for b in BACKENDS
    )
    return f"step 1 rollout ({same} in both runs, as the same initial weights and seeds should give): {shown}."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="measured steps per backend (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per backend, excluded from the medians")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default: the embedded tiny model's)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the embedded tiny model's)")
    parser.add_argument("--tp", type=int, default=2, help="Megatron tensor-parallel size")
    parser.add_argument("--dp", type=int, default=1, help="Megatron data-parallel size (FSDP gets tp x dp ranks)")
    parser.add_argument("--seed", type=int, default=1, help="runner.seed of both runs")
    parser.add_argument("--cpus-per-actor-worker", type=float, default=0.5, help="cluster.cpus_per_actor_worker")
    parser.add_argument("--cpus-per-rollout-worker", type=float, default=0.5, help="cluster.cpus_per_rollout_worker")
    parser.add_argument("--first", choices=BACKENDS, default="fsdp", help="which backend runs first")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra config override for both runs (repeatable), e.g. --override data.batch_size=8",
    )
    parser.add_argument(
        "--megatron-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra override of the megatron run only, e.g. --megatron-override actor.megatron.shard_weights=false",
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="folder for the runs' output (a fresh subfolder is made)"
    )
    args = parser.parse_args(argv)
    for name in ("steps", "tp", "dp"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    for name in ("hidden", "layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be positive, got {value}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rlrunner.errors import ConfigError

    print(f"command: {command_line()}")
    print(f"machine: {machine()}")
    try:
        print(f"model: {model_description(args)}", flush=True)
        num_cpus = ray_cpus(args)
    except (ConfigError, ValueError) as exc:
        print(f"bench_step_time: {exc}", file=sys.stderr)
        return 2
    work = make_workdir(args.dir, "bench_step_time_")
    order = [args.first, *(b for b in BACKENDS if b != args.first)]
    print(
        f"embedded Ray with {num_cpus} logical CPUs; runs in order {', '.join(order)}; output under {work}", flush=True
    )
    started = time.perf_counter()
    runs = runs_in_embedded_ray(num_cpus, work, order, lambda backend: run_backend(args, backend, work))

    first_measured = args.warmup + 1
    print()
    print(markdown_table(runs, first_measured))
    print()
    print(
        f"Medians of {args.steps} steps after {args.warmup} warm-up steps, same overrides and seeds for both runs "
        f"(runner.seed={args.seed}); {first_rollout(runs)}"
    )
    print(
        "whole runs (start-up, steps and the last step's save): "
        + ", ".join(f"{r.label} {r.wall_s:.1f}s" for r in runs.values())
    )
    print(f"total time: {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
