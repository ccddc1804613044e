#!/usr/bin/env python
"""Checkpoint save/load throughput of rlrunner's actor checkpoints (FSDP2 + DCP, and the Megatron layout) against
plain baselines.

What it measures, all in one run, on one disk folder, for the actor state a checkpoint holds (model +
AdamW optimizer + LR scheduler + per-rank RNG) of a Qwen2-architecture model of about `--params`
million parameters, sharded over `--workers` FSDP2 actor ranks on a local Ray:

  save  rlrunner CheckpointHandler.save      the real commit path: staging folder, per-rank DCP shards
                                             (fsync'd, CRC-32 computed as written), data.pt, manifest, rename
          of which the checkpoint manager    its start_save + finish_save (background=False): the sync save
                                             (the fsdp backend's ActorCheckpointManager)
        torch.save + fsync                   the full (unsharded) state gathered into the driver, one file
        raw write + fsync                    os.write of as many bytes as the rlrunner checkpoint (disk ceiling)
  async the manager with background=True, i.e. runner.async_save=true:
        blocked                              start_save: what the training loop waits for (state copied off)
        background write                     the finish_save that follows at once (every rank's write done)
        copy floor                           each rank copies the tensors of the same state dict into fresh
                                             host tensors (pinned on GPU); the slowest rank's time
        and what the blocked time is made of: the ranks' own part of start_save (a second async save, timed
        on the ranks: rank_state().state_dict() + start_dcp_save), within it building that and DCP's DefaultStager.stage
        of it; the same copy into host tensors that already exist; a Ray round trip (ping)
  load  rlrunner checksum verification       inspect_checkpoint(path, checksums=True) (CRC-32 of every file)
        rlrunner ActorCheckpointManager.load DCP load into the live actor group
        torch.load(weights_only=True)        the torch.save file
        raw read                             sequential read of the raw-write file

Then, unless `--megatron-tp 0`, the FSDP group is shut down and a Megatron-backend actor group of K x D ranks
(tp=K `--megatron-tp`, dp=D `--megatron-dp`, default 2 x 2; MegatronActorWorker) is built on the SAME model (the
shape is chosen so that heads, KV heads and MLP width divide by K), gets its own optimizer update, and is measured
the same way (same repeats, medians, page-cache drops) in each format of `--megatron-formats`, alternating within a
repeat on the same group: `torch`, Megatron-LM's layout (iter_0000001/mp_rank_XX/model_optim_rng.pt and
distrib_optim.pt, written by data-parallel rank 0 of each tensor-parallel rank), and `torch_dist`, megatron-core's
distributed format (every rank writing its own part), rows labelled "megatron FORMAT (tp=K, dp=D)":

  save  CheckpointHandler.save with MegatronCheckpointManager, and the manager alone (start_save + finish_save,
        background=False); ratio against the raw write measured above
  async MegatronCheckpointManager(background=True): blocked in start_save, the background write (finish_save
        right after), the manager's write_s; "x copy floor" is against the FSDP copy floor (each rank holds
        about the same bytes in both layouts)
  load  checksum verification, and MegatronCheckpointManager.load into the live group; ratio against raw read
followed by a line per format comparing its save, load and blocked seconds with DCP's for the same model, and one
comparing torch_dist with torch (the fully parallel save against the one writer per tensor-parallel rank).

Both actor groups are built as a run builds them (rlrunner.runner.placement.group_specs on the run's RunContext),
and their checkpoint managers by the training backend (get_backend(...).checkpoint_manager, as RunContext does).
The optimizer state is created by one real `update` on a small batch built like the trainer builds it
(build_actor_batch + shard_actor_batch + RankMap.scatter), so AdamW's exp_avg/exp_avg_sq exist before any save.
Each measurement is repeated `--repeat` times and the median is reported. When
/proc/sys/vm/drop_caches is writable the page cache is dropped before every load-side measurement;
otherwise loads read from the page cache (the output says which).

With `--output s3://bucket/prefix` (or any fsspec URL) it measures the store instead of the disk: the
same CheckpointHandler.save and manager load, with every rank uploading its own shard,
next to a plain s3fs put and get of the same objects (one thread per shard, as the ranks upload in
parallel) from this process, in one run; then the same save and load with MegatronCheckpointManager
(unless `--megatron-tp 0`). `--moto` first starts moto's S3 server on 127.0.0.1 (in its own process) and
creates the bucket: the way to try it without a real store.

Run from the repository root:

    .venv/bin/python benchmarks/bench_checkpoint.py  # ~100M params, 2 ranks, 3 repeats, + megatron tp=2 x dp=2
    .venv/bin/python benchmarks/bench_checkpoint.py --params 5 --repeat 5  # small model: fixed costs dominate
    .venv/bin/python benchmarks/bench_checkpoint.py --params 20 --repeat 1 --dir /mnt/fast --megatron-tp 0  # FSDP only
    .venv/bin/python benchmarks/bench_checkpoint.py --output s3://bench/ckpt --moto   # a local S3 API
    .venv/bin/python benchmarks/bench_checkpoint.py --output s3://my-bucket/bench  # a real store (AWS_* credentials)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, beside this script
from benchlib.ckpt_local import (  # noqa: E402
    can_drop_page_cache,
    gather_full_state,
    measure_async,
    measure_handler_save,
    measure_loads,
    measure_manager_async,
    measure_saves,
    measure_verify_and_load,
    raw_block,
    set_ckpt_format,
    start_megatron_group,
)
from benchlib.ckpt_remote import run_remote  # noqa: E402
from benchlib.ckpt_report import report_local  # noqa: E402
from benchlib.ckpt_rows import FSDP_ROWS, Samples, megatron_rows  # noqa: E402
from benchlib.common import make_workdir, ray_cpus, start_local_ray, stop_ray  # noqa: E402
from benchlib.groups import Groups, create_optimizer_state, start_groups  # noqa: E402
from benchlib.model import build_config, check_megatron_shape, choose_shape, exact_param_count, tokenizer_vocab_size  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from rlrunner.storage import add_storage_options_argument

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=100.0, help="target model size in millions of parameters")
    parser.add_argument("--workers", type=int, default=2, help="actor (FSDP) ranks")
    parser.add_argument(
        "--megatron-tp",
        type=int,
        default=2,
        help="also measure the Megatron layout with this many ranks (tp=K, dp=1) on the same model; 0: off",
    )
    parser.add_argument(
        "--megatron-dp", type=int, default=2, help="data-parallel size of the Megatron group (tp x dp ranks)"
    )
    parser.add_argument(
        "--megatron-formats",
        default="torch,torch_dist",
        type=lambda text: text.split(","),
        help="actor.megatron.ckpt_format values to measure on the Megatron group, comma-separated",
    )
    parser.add_argument("--cpus-per-worker", type=float, default=0.5, help="Ray logical CPUs per actor rank")
    parser.add_argument("--repeat", type=int, default=3, help="repeats per measurement (the median is reported)")
    parser.add_argument("--dir", type=Path, default=None, help="disk folder to write in (a fresh subfolder is made)")
    parser.add_argument(
        "--output", default=None, help="measure this fsspec URL (s3://bucket/prefix) instead of the disk"
    )
    parser.add_argument(
        "--moto", action="store_true", help="with --output s3://...: start a local moto S3 server first"
    )
    add_storage_options_argument(parser, "--storage-options", "--storage_options")
    args = parser.parse_args(argv)
    if args.megatron_tp < 0:
        parser.error(f"--megatron-tp must be >= 0 (0 turns the megatron rows off), got {args.megatron_tp}")
    if args.megatron_dp < 1 or not set(args.megatron_formats) <= {"torch", "torch_dist"}:
        parser.error(f"--megatron-dp must be >= 1 and --megatron-formats of torch, torch_dist: {args}")
    if args.workers < 1 or args.repeat < 1:
        parser.error(f"--workers and --repeat must be positive, got {args.workers} and {args.repeat}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rlrunner.storage import open_storage

    work = make_workdir(args.dir, "bench_checkpoint_")
    drop = can_drop_page_cache()
    started = time.perf_counter()
    tp, dp = args.megatron_tp, args.megatron_dp
    try:
        shape = choose_shape(args.params * 1e6, tokenizer_vocab_size(), max(tp, 1))
        cfg = build_config(shape, args.workers, args.cpus_per_worker, work)
        meg_cfg = None
        if tp:
            batch = max(args.workers, dp)
            meg_cfg = build_config(shape, tp * dp, args.cpus_per_worker, work, tp=tp, batch_size=batch)
            check_megatron_shape(meg_cfg)
        params = exact_param_count(dict(cfg.model))
        formats = ", ".join(args.megatron_formats)
        also = f"; then the megatron backend on {tp * dp} ranks (tp={tp}, dp={dp}), formats {formats}" if tp else ""
        print(f"model: Qwen2 {vars(shape)}, {params:,} parameters; {args.workers} FSDP actor ranks{also}", flush=True)

        start_local_ray(ray_cpus(max(args.workers, tp * dp), args.cpus_per_worker))
        groups = start_groups(cfg)
        stats = create_optimizer_state(groups)
        print(
            "optimizer state: created by one real FSDPActorWorker.update on a trainer-built batch "
            f"(grad_norm {stats['grad_norm']:.3f}, "
            f"{int(stats['optimizer_state_tensors_per_rank'])} AdamW state tensors on rank 0)",
            flush=True,
        )
        fingerprint = {"benchmark": "bench_checkpoint", "params": params}
        if args.output:
            return run_remote(args, groups, meg_cfg, params, fingerprint, started)
        storage = open_storage(str(work))
        samples = Samples({}, {})
        run_fsdp_local(groups, storage, work, args.repeat, drop, samples, fingerprint, started)
        megatron = [megatron_rows(tp, dp, f) for f in args.megatron_formats] if meg_cfg is not None else []
        if meg_cfg is not None:
            run_megatron_local(meg_cfg, args, storage, work, drop, samples, fingerprint, started)
        report_local(args, samples, megatron, params, drop, work, started)
    finally:
        stop_ray()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def run_fsdp_local(
    groups: Groups,
    storage,
    work: Path,
    repeat: int,
    drop: bool,
    samples: Samples,
    fingerprint: dict[str, Any],
    started: float,
) -> None:
    """Every FSDP/DCP and baseline measurement, `repeat` times; the FSDP actor group is torn down at the end."""
    from rlrunner.checkpoint.handler import CheckpointHandler

    full_state = gather_full_state(groups.actor)
    handler = CheckpointHandler(
        storage, str(work / "experiment"), save_interval=1, max_keep=None, fingerprint=fingerprint
    )
    block = raw_block()
    for index in range(repeat):
        checkpoint = measure_saves(groups, handler, work, full_state, FSDP_ROWS, samples, block)
        measure_loads(groups, storage, checkpoint, work, FSDP_ROWS, samples, block, drop)
        measure_async(groups, work, FSDP_ROWS, samples)
        shutil.rmtree(checkpoint)
        print(f"repeat {index + 1}/{repeat} done ({time.perf_counter() - started:.0f}s elapsed)", flush=True)
    del full_state
    groups.shutdown()  # before the Megatron group starts: one backend's ranks at a time
    for leftover in ("full_state.pt", "raw.bin"):
        (work / leftover).unlink(missing_ok=True)


def run_megatron_local(
    cfg,
    args: argparse.Namespace,
    storage,
    work: Path,
    drop: bool,
    samples: Samples,
    fingerprint: dict[str, Any],
    started: float,
) -> None:
    """Every Megatron measurement in each format, `args.repeat` times, on its own actor group (torn down at the
    end); the formats alternate within a repeat, on the same group."""
    from rlrunner.checkpoint.handler import CheckpointHandler

    tp, dp = args.megatron_tp, args.megatron_dp
    groups = start_megatron_group(cfg, tp)
    handler = CheckpointHandler(
        storage, str(work / "experiment_megatron"), save_interval=1, max_keep=None, fingerprint=fingerprint
    )
    for index in range(args.repeat):
        for ckpt_format in args.megatron_formats:
            rows = megatron_rows(tp, dp, ckpt_format)
            set_ckpt_format(groups, ckpt_format)
            checkpoint = measure_handler_save(groups, handler, rows, samples)
            measure_verify_and_load(groups, storage, checkpoint, rows, samples, drop)
            measure_manager_async(groups, work / f"async_megatron_{ckpt_format}", rows, samples)
            shutil.rmtree(checkpoint)
        print(
            f"megatron repeat {index + 1}/{args.repeat} done ({time.perf_counter() - started:.0f}s elapsed)",
            flush=True,
        )
    groups.shutdown()


if __name__ == "__main__":
    sys.exit(main())
