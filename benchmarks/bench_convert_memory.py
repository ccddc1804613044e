#!/usr/bin/env python
"""Peak memory of the DCP -> state-dict converter against the size of the model's weights.

It first writes a real checkpoint: a Qwen2-architecture model of about `--params` million parameters
sharded over `--workers` FSDP2 actor ranks on a local Ray, one real GRPO update (so the AdamW state
exists), then `CheckpointHandler.save`. Then it runs, each in a fresh subprocess under a small
wrapper that reports the child's peak RSS (`resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`):

  (a) converter  toolkits/ckpt_convertor/convert_dcp_to_state_dict.py --dcp_path ... --output_path ...
  (b) baseline   a process that only imports torch, rlrunner.tools.convert and
                 torch.distributed.checkpoint.format_utils (interpreter + import overhead, subtracted)
  (c) naive      torch.distributed.checkpoint.format_utils.dcp_to_torch_save on the same DCP folder,
                 which loads the whole checkpoint (model AND optimizer) before writing it

and prints a markdown table: weights bytes, checkpoint bytes, peak RSS above the baseline for (a) and
(c), and their ratios to the weights.

Run from the repository root:

    .venv/bin/python benchmarks/bench_convert_memory.py                # ~100M params, 2 ranks
    .venv/bin/python benchmarks/bench_convert_memory.py --params 20 --dir /mnt/fast
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, beside this script
from benchlib.common import (  # noqa: E402
    command_line,
    filesystem_of,
    folder_bytes,
    make_workdir,
    memory_gib,
    ray_cpus,
    start_local_ray,
    stop_ray,
)
from benchlib.groups import create_optimizer_state, start_groups  # noqa: E402
from benchlib.model import build_config, choose_shape, exact_param_count, tokenizer_vocab_size  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
CONVERTER = REPO_ROOT / "toolkits" / "ckpt_convertor" / "convert_dcp_to_state_dict.py"

# argv: RESULT_JSON CMD...; runs CMD, then writes its exit code, wall seconds and peak RSS (KiB on Linux).
PEAK_RSS_WRAPPER = """
import json, resource, subprocess, sys, time
started = time.perf_counter()
code = subprocess.run(sys.argv[2:]).returncode
seconds = time.perf_counter() - started
peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
with open(sys.argv[1], "w") as handle:
    json.dump({"returncode": code, "seconds": seconds, "peak_kib": peak_kib}, handle)
"""

BASELINE_CODE = "import torch, rlrunner.tools.convert, torch.distributed.checkpoint.format_utils"
NAIVE_CODE = (
    "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
    "dcp_to_torch_save(sys.argv[1], sys.argv[2])"
)


@dataclass(frozen=True)
class ChildRun:
    name: str
    peak_bytes: int
    seconds: float
    output: str


def write_checkpoint(params_millions: float, workers: int, cpus_per_worker: float, work: Path) -> tuple[Path, int]:
    """A committed `global_step_1` of a real actor group after one update; returns it and the exact parameter count."""
    from rlrunner.checkpoint.handler import CheckpointHandler
    from rlrunner.storage import open_storage

    shape = choose_shape(params_millions * 1e6, tokenizer_vocab_size())
    cfg = build_config(shape, workers, cpus_per_worker, work)
    params = exact_param_count(dict(cfg.model))
    print(f"model: Qwen2 {vars(shape)}, {params:,} parameters; {workers} actor ranks", flush=True)
    start_local_ray(ray_cpus(workers, cpus_per_worker))
    try:
        groups = start_groups(cfg)  # as a run builds them (group_specs); the fsdp backend
        create_optimizer_state(groups)
        storage = open_storage(str(work / "experiment"))
        handler = CheckpointHandler(
            storage,
            storage.url,
            save_interval=1,
            max_keep=None,
            fingerprint={"benchmark": "bench_convert_memory", "params": params},
        )
        data_state = {"runner": {"global_step": 1, "epoch": 0, "total_steps": 1}}
        checkpoint = Path(handler.save(1, groups.manager(), data_state))  # the backend's manager, a synchronous save
        groups.shutdown()
    finally:
        stop_ray()
    return checkpoint, params


def model_weight_bytes(dcp_dir: Path) -> int:
    """Bytes of the `model.*` tensors recorded in the DCP metadata (the size of the full weights)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from rlrunner.backends.dcp_files import read_metadata
    from rlrunner.backends.fsdp.weights import MODEL_PREFIX

    total = 0
    for key, item in read_metadata(dcp_dir).state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata):
            total += item.size.numel() * item.properties.dtype.itemsize
    return total


def run_with_peak_rss(name: str, command: list[str], work: Path) -> ChildRun:
    """Run `command` in a fresh process under the wrapper; its peak RSS and wall time."""
    result_file = work / f"{name}.json"
    completed = subprocess.run(
        [sys.executable, "-c", PEAK_RSS_WRAPPER, str(result_file), *command],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    result = json.loads(result_file.read_text()) if result_file.is_file() else {"returncode": completed.returncode}
    if completed.returncode or result["returncode"]:
        raise RuntimeError(f"{name} failed (exit {result['returncode']}):\n{completed.stdout}\n{completed.stderr}")
    return ChildRun(name, result["peak_kib"] * 1024, result["seconds"], completed.stdout.strip())


def measure(dcp_dir: Path, work: Path) -> dict[str, ChildRun]:
    converted, naive_out = work / "converted.pt", work / "naive_full.pt"
    runs = {
        "baseline": run_with_peak_rss("baseline", [sys.executable, "-c", BASELINE_CODE], work),
        "converter": run_with_peak_rss(
            "converter",
            [sys.executable, str(CONVERTER), "--dcp_path", str(dcp_dir), "--output_path", str(converted)],
            work,
        ),
        "naive": run_with_peak_rss("naive", [sys.executable, "-c", NAIVE_CODE, str(dcp_dir), str(naive_out)], work),
    }
    print(f"converter said: {runs['converter'].output}")
    print(
        f"output files: converter {converted.stat().st_size:,} bytes, "
        f"dcp_to_torch_save {naive_out.stat().st_size:,} bytes"
    )
    return runs


def markdown_table(weights: int, checkpoint: int, runs: dict[str, ChildRun]) -> str:
    base = runs["baseline"].peak_bytes
    rows = [
        ("model weights (model.* tensors in .metadata)", weights, f"{1.0:.2f}"),
        ("checkpoint (DCP folder: model + optimizer + scheduler + RNG)", checkpoint, f"{checkpoint / weights:.2f}"),
        ("(b) baseline peak RSS (imports only)", base, "-"),
        ("(a) converter peak RSS", runs["converter"].peak_bytes, "-"),
        (
            "(a) converter peak RSS above baseline",
            runs["converter"].peak_bytes - base,
            f"{(runs['converter'].peak_bytes - base) / weights:.2f}",
        ),
        ("(c) dcp_to_torch_save peak RSS", runs["naive"].peak_bytes, "-"),
        (
            "(c) dcp_to_torch_save peak RSS above baseline",
            runs["naive"].peak_bytes - base,
            f"{(runs['naive'].peak_bytes - base) / weights:.2f}",
        ),
    ]
    lines = ["| quantity | bytes | MiB | / weights |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {value:,} | {value / 2**20:,.1f} | {ratio} |" for name, value, ratio in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100.0, help="target model size in millions of parameters")
    parser.add_argument("--workers", type=int, default=2, help="actor (FSDP) ranks that write the checkpoint")
    parser.add_argument("--cpus-per-worker", type=float, default=0.5, help="Ray logical CPUs per actor rank")
    parser.add_argument("--dir", type=Path, default=None, help="disk folder to write in (a fresh subfolder is made)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = make_workdir(args.dir, "bench_convert_memory_")
    started = time.perf_counter()
    try:
        checkpoint, _ = write_checkpoint(args.params, args.workers, args.cpus_per_worker, work)
        dcp_dir = checkpoint / "actor"
        runs = measure(dcp_dir, work)
        weights, checkpoint_bytes = model_weight_bytes(dcp_dir), folder_bytes(dcp_dir)
        print()
        print(markdown_table(weights, checkpoint_bytes, runs))
        print()
        print(
            "Peak RSS is each child's ru_maxrss (RUSAGE_CHILDREN, read by a wrapper process); "
            "'above baseline' subtracts the imports-only process. Wall seconds: "
            + ", ".join(f"{run.name} {run.seconds:.1f}s" for run in runs.values())
            + "."
        )
        print(
            f"machine: {os.cpu_count()} CPU cores, {memory_gib():.0f} GiB RAM; folder {work} on {filesystem_of(work)}"
        )
        print(f"command: {command_line()}")
        print(f"total time: {time.perf_counter() - started:.0f}s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
