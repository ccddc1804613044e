#!/usr/bin/env python
"""Peak resident memory of every actor and rollout process against the actor rank's share of the training state.

For each training backend (`--backends`), actor layout (`--layouts`: ranks, and the tensor-parallel size for the
megatron backend) and model size (`--sizes`), a GRPO run of `--steps` steps (a synchronous save at the last one;
in-memory snapshots on, as by default, unless `--no-snapshots`) on a local Ray private to this script. Once the run
has trained, with its workers still up, each worker's peak resident set (VmHWM in /proc/<pid>/status: the machine is
the only node) is read, and compared with:

  share     the training state one actor rank would hold if it were split evenly: parameters, gradients and the
            two AdamW moments in float32 (16 bytes per parameter) over the actor ranks
  overhead  what a rank holds besides its state: the peak of the same layout with the tiny embedded model
            (interpreter, torch, transformers, Ray, the framework), measured in the same invocation
  layout's  what a rank of the layout holds by design: the share for FSDP and for Megatron's default (weights,
            gradients and moments sharded over data parallelism, ZeRO-3); with `--megatron-whole-weights`
            (actor.megatron.shard_weights=false, Megatron-LM's distributed optimizer with sharded gradients) the
            whole fp32 weights of the tensor-parallel shard plus its slice of the gradients and moments (more than
            the share when dp > 1)

and printed as peak / share and (peak - overhead) / share (issue 18's goal: within 1.3x of the share plus the
overhead), and (peak - overhead) / layout's. The rollout worker holds the whole model in its engine's dtype, by
design; its peak is shown beside.
Start-up is the attempt's `rebuild_s + load_s` (workers started, model built and sharded, weights synced).

Sizes (Qwen2 shapes with the embedded character tokenizer, so nearly every parameter is in the layers):

  tiny   the embedded test model (configs/grpo.yaml's default), about 0.1M parameters
  120m   hidden 640, 16 layers, MLP 3456, 10 heads (2 KV)
  358m   hidden 896, 24 layers, MLP 4864, 14 heads (2 KV): the size of issue 18's table
  600m   hidden 1024, 28 layers, MLP 6144, 16 heads (2 KV): the largest that fits a 24 GiB machine beside a rollout
         worker
  1b     hidden 1536, 24 layers, MLP 8960, 12 heads (2 KV), about 1.1B

A configuration whose estimated need (each actor rank: 1.2 times the state its layout holds, the most measured from
358M up, plus 0.5 GiB of its own; the rollout worker: 6 bytes per parameter, plus 0.5 GiB) exceeds 90% of the memory
available is skipped with a line saying so, never started.

Run from the repository root (the defaults take a few minutes on 2 cores, 24 GiB):

    .venv/bin/python benchmarks/bench_memory.py
    .venv/bin/python benchmarks/bench_memory.py --sizes tiny,358m --layouts 2,4 --backends fsdp
    .venv/bin/python benchmarks/bench_memory.py --backends megatron --layouts 2:tp2,4:tp2
    .venv/bin/python benchmarks/bench_memory.py --backends fsdp --fsdp-unit linear --probe /tmp/probe
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, beside this script
from benchlib.common import (  # noqa: E402
    ONE_ROLLOUT_WORKER,
    command_line,
    make_workdir,
    memory_gib,
    ray_cpus,
    start_local_ray,
    stop_ray,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
SIZES = {
    "tiny": {},
    "120m": {
        "hidden_size": 640,
        "num_hidden_layers": 16,
        "intermediate_size": 3456,
        "num_attention_heads": 10,
        "num_key_value_heads": 2,
    },
    "358m": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    },
    "600m": {
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "intermediate_size": 6144,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
    },
    "1b": {
        "hidden_size": 1536,
        "num_hidden_layers": 24,
        "intermediate_size": 8960,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
    },
}
STATE_BYTES_PER_PARAM = 16  # float32 parameters, gradients, AdamW's two moments
CPUS_PER_WORKER = 0.5
ROLLOUT_BYTES_PER_PARAM = 6
OVERHEAD_BYTES = 0.5 * 2**30  # a process's own (interpreter, torch, Ray, the framework): the tiny model's peak


@dataclass(frozen=True)
class Layout:
    ranks: int
    tp: int = 1

    @property
    def label(self) -> str:
        return f"{self.ranks // self.tp} x {self.tp}"  # dp x tp


@dataclass
class Row:
    backend: str
    layout: Layout
    size: str
    params: int
    actor_peaks: list[float]  # bytes, one per rank
    rollout_peak: float
    startup_s: float
    skipped: str | None = None


def parse_layouts(text: str) -> list[Layout]:
    """'2,4' (data parallel) or '2:tp2,4:tp2' (ranks:tp<size>, megatron)."""
    layouts = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        ranks, _, tp = item.partition(":tp")
        layouts.append(Layout(int(ranks), int(tp) if tp else 1))
    return layouts


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="fsdp,megatron", help="comma-separated training backends")
    parser.add_argument("--layouts", default="2,4", help="actor layouts: ranks, or ranks:tp<size> (megatron only)")
    parser.add_argument(
        "--megatron-tp",
        type=int,
        default=2,
        help="tensor-parallel size of the megatron runs for layouts given as plain rank counts",
    )
    parser.add_argument("--sizes", default="tiny,120m,358m,600m", help=f"comma-separated sizes of {sorted(SIZES)}")
    parser.add_argument("--steps", type=int, default=2, help="training steps per run")
    parser.add_argument(
        "--no-snapshots",
        action="store_true",
        help="turn the in-memory snapshots off (on by default, as in a run: each rank streams its state to its "
        "holder every step, and the peaks include what that costs the rank)",
    )
    from rlrunner.config_checks import FSDP_UNITS

    parser.add_argument(
        "--fsdp-unit", default=FSDP_UNITS[0], choices=FSDP_UNITS, help="actor.fsdp.unit of the fsdp runs"
    )
    parser.add_argument(
        "--megatron-whole-weights",
        action="store_true",
        help="actor.megatron.shard_weights=false for the megatron runs (every data-parallel replica keeps its "
        "tensor-parallel shard's weights whole: ZeRO-2)",
    )
    parser.add_argument(
        "--no-recompute",
        action="store_true",
        help="actor.gradient_checkpointing=false (both backends; the default recomputes)",
    )
    parser.add_argument(
        "--probe",
        default=None,
        metavar="DIR",
        help="attribute the peaks: every worker runs benchlib/rss_probe and logs its stack at each new "
        "high of its resident set to DIR/<pid>.txt (summarise with benchmarks/rss_report.py)",
    )
    parser.add_argument(
        "--workdir", default=None, help="where run folders go (default: a temp folder, deleted at the end)"
    )
    args = parser.parse_args(argv)
    args.backend_list = [b for b in args.backends.split(",") if b]
    args.layout_list = parse_layouts(args.layouts)
    args.size_list = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in args.size_list if s not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; known: {sorted(SIZES)}")
    if "tiny" not in args.size_list:
        args.size_list.insert(0, "tiny")  # the overhead every other size is measured against
    return args


def overrides_for(size: str) -> list[str]:
    return [f"+model.override_config.{key}={value}" for key, value in SIZES[size].items()]


def count_params(size: str) -> int:
    """Parameters of the run's model at `size`, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlrunner.config import load_config
    from rlrunner.models.loading import build_hf_config, build_tokenizer

    cfg = load_config(overrides_for(size))
    config = build_hf_config(cfg.model, build_tokenizer(cfg.model))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def estimated_need_bytes(backend: str, layout: Layout, params: int, whole_weights: bool) -> float:
    """What a run needs at most, all processes together (see the module's docstring; the rollout worker's 6 bytes per
    parameter: its float32 model and the weight sync's buffers, 2.0 GiB measured at 358M)."""
    actors = layout.ranks * (1.2 * layout_bytes(backend, layout, params, whole_weights) + OVERHEAD_BYTES)
    return actors + ROLLOUT_BYTES_PER_PARAM * params + OVERHEAD_BYTES


def available_bytes() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return float(line.split()[1]) * 1024
    return memory_gib() * 2**30


def peak_rss_bytes(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return float(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


class PeakProbe:
    """A Supervisor callback: each worker's peak resident set once the run has trained (its workers still up)."""

    def __init__(self):
        self.actor: list[float] = []
        self.rollout: list[float] = []
        self.startup_s = 0.0

    def on_train_start(self, trainer) -> None:
        timings = trainer.start_timings
        self.startup_s = float(timings.get("rebuild_s", 0.0)) + float(timings.get("load_s", 0.0))

    def on_train_end(self, trainer) -> None:
        self.actor = [peak_rss_bytes(host["pid"]) for host in trainer.actor_group.hosts]
        self.rollout = [peak_rss_bytes(host["pid"]) for host in trainer.rollout_group.hosts]


def run_one(args: argparse.Namespace, workdir: Path, backend: str, layout: Layout, size: str, params: int) -> Row:
    from rlrunner.config import load_config
    from rlrunner.runner.supervisor import Supervisor

    need, have = estimated_need_bytes(backend, layout, params, args.megatron_whole_weights), available_bytes()
    if need > 0.9 * have:
        return Row(
            backend,
            layout,
            size,
            params,
            [],
            0.0,
            0.0,
            skipped=f"needs about {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available",
        )
    name = f"{backend}-{layout.ranks}x{layout.tp}-{size}"
    cfg = load_config(
        [
            f"runner.output_dir={workdir / name}",
            "runner.experiment_name=memory",
            f"runner.max_steps={args.steps}",
            f"runner.save_interval={args.steps}",
            "runner.async_save=false",
            "runner.logger.progress_bar=false",
            ONE_ROLLOUT_WORKER,
            "runner.logger.backends=[]",
            "data.synthetic.val_size=0",
            f"runner.snapshot.enabled={str(not args.no_snapshots).lower()}",
            f"actor.training_backend={backend}",
            f"actor.num_workers={layout.ranks}",
            f"actor.tensor_model_parallel_size={layout.tp}",
            f"actor.fsdp.unit={args.fsdp_unit}",
            f"actor.gradient_checkpointing={str(not args.no_recompute).lower()}",
            "data.batch_size=4",
            "algorithm.group_size=4",
            *(
                [f"actor.megatron.shard_weights={str(not args.megatron_whole_weights).lower()}"]
                if backend == "megatron"
                else []
            ),
            "actor.micro_batch_size=4",
            "rollout.max_new_tokens=4",
            "rollout.generation_batch_size=4",
            f"cluster.cpus_per_actor_worker={CPUS_PER_WORKER}",
            f"cluster.cpus_per_rollout_worker={CPUS_PER_WORKER}",
            *overrides_for(size),
        ]
    )
    probe = PeakProbe()
    Supervisor(cfg, callbacks=[probe]).run()
    shutil.rmtree(workdir / name, ignore_errors=True)
    return Row(backend, layout, size, params, probe.actor, max(probe.rollout), probe.startup_s)


def layout_bytes(backend: str, layout: Layout, params: int, whole_weights: bool) -> float:
    """What a rank of this layout holds of the training state by design: FSDP and Megatron's sharded weights (ZeRO-3)
    shard everything over the ranks; with whole weights Megatron's distributed optimizer shards the gradients and
    moments over every rank but keeps the fp32 weights of the tensor-parallel shard whole on each data-parallel
    replica (4 + 12/dp bytes per parameter of the shard), so with dp > 1 it holds more than the even share."""
    if backend == "megatron" and whole_weights:
        return params * 4 / layout.tp + params * 12 / layout.ranks
    return params * STATE_BYTES_PER_PARAM / layout.ranks


def table(rows: list[Row], whole_weights: bool) -> str:
    gib = 2**30
    overhead = {(r.backend, r.layout): max(r.actor_peaks) for r in rows if r.size == "tiny" and r.actor_peaks}
    lines = [
        "| backend | dp x tp | size | params | share per rank GiB | peak per actor rank GiB (max) | peak / share | "
        "(peak - overhead) / share | layout's state GiB | (peak - overhead) / layout's | rollout peak GiB | "
        "start-up s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        head = f"| {r.backend} | {r.layout.label} | {r.size} | {r.params / 1e6:.1f}M |"
        if r.skipped:
            lines.append(f"{head} - | skipped: {r.skipped} | - | - | - | - | - | - |")
            continue
        share = r.params * STATE_BYTES_PER_PARAM / r.layout.ranks
        held = layout_bytes(r.backend, r.layout, r.params, whole_weights)
        peak = max(r.actor_peaks)
        base = overhead.get((r.backend, r.layout))
        measured = base is not None and r.size != "tiny"
        above = f"{(peak - base) / share:.2f}" if measured else "-"
        above_held = f"{(peak - base) / held:.2f}" if measured else "-"
        lines.append(
            f"{head} {share / gib:.3f} | {peak / gib:.2f} | {peak / share:.1f} | {above} | {held / gib:.3f} | "
            f"{above_held} | {r.rollout_peak / gib:.2f} | {r.startup_s:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    began = time.monotonic()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.chdir(REPO_ROOT)
    print(
        f"# rlrunner memory benchmark\n\ncommand: {command_line()}\nmachine: {os.cpu_count()} cores, "
        f"{memory_gib():.1f} GiB\nin-memory snapshots: {'off' if args.no_snapshots else 'on (the default)'}",
        flush=True,
    )
    workdir = make_workdir(Path(args.workdir) if args.workdir else None, "bench_memory_")
    rows: list[Row] = []
    try:
        largest = max(layout.ranks for layout in args.layout_list)
        if args.probe:  # the workers inherit the environment of the Ray this script starts
            probe_path = str(Path(__file__).resolve().parent / "benchlib" / "rss_probe")
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [probe_path, os.environ.get("PYTHONPATH")]))
            os.environ["RLRUNNER_RSS_PROBE_DIR"] = str(Path(args.probe).resolve())
        start_local_ray(ray_cpus(largest + 1, CPUS_PER_WORKER), log_to_driver=False)
        params = {size: count_params(size) for size in args.size_list}
        for backend in args.backend_list:
            for layout in args.layout_list:
                if backend == "megatron" and layout.tp == 1 and args.megatron_tp > 1:
                    layout = Layout(layout.ranks, min(args.megatron_tp, layout.ranks))
                if backend != "megatron" and layout.tp > 1:
                    continue  # tensor parallelism is the megatron backend's
                for size in args.size_list:
                    row = run_one(args, workdir, backend, layout, size, params[size])
                    rows.append(row)
                    state = row.skipped or (
                        f"actor peaks {[round(p / 2**30, 2) for p in row.actor_peaks]} GiB, "
                        f"rollout {row.rollout_peak / 2**30:.2f} GiB, start-up {row.startup_s:.1f} s"
                    )
                    print(f"  {backend} {layout.label} {size}: {state}", flush=True)
    finally:
        stop_ray()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(table(rows, args.megatron_whole_weights))
    print(
        f"\nshare = {STATE_BYTES_PER_PARAM} bytes per parameter / actor ranks; layout's = the state a rank of the "
        f"layout holds by design; overhead = the same layout's peak with the tiny model; total benchmark time: "
        f"{time.monotonic() - began:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
