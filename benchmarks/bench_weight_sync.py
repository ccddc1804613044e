#!/usr/bin/env python
"""Weight sync actor -> rollout workers: rlrunner's collective channels against the old object-store path and a
plain torch.distributed.broadcast, all measured in one run on a local Ray.

For a Qwen2-architecture model of about `--params` million parameters, an FSDP2 actor group of
`--actor-workers` ranks and a rollout group of `--rollout-workers` workers whose model is in `--dtype`, each
repeat (`--repeats`, medians reported) measures, from the driver, in turn:

  channels      rlrunner.weight_sync.driver.sync_weights: every actor rank broadcasts its own shards, cast to
                the rollout dtype, in buckets of at most `--bucket-mb` (a 32nd of what the rank sends, at least
                4 MiB: `channel_bucket_bytes`), to every rollout worker (gloo on CPU; NCCL between distinct GPUs;
                gloo over pinned host memory for a GPU shared by two members)
  object store  the old path: FSDPActorWorker.full_state_dict (FSDP gather of float32 on rank 0, to CPU) passed
                by reference through the Ray object store to every RolloutWorker.load_weights
  broadcast     torch.distributed.broadcast of as many bytes as the channels move into one rollout worker, from
                one process to one other (gloo on CPU tensors; NCCL when --gpus-per-worker > 0 and the cluster
                has two GPUs for it), in two more Ray actors of the same kind, timed the same way

"bytes" is what reaches each rollout worker (the object-store row moves float32); "vs broadcast" is the row's
time over the broadcast row's time. The channels are built once (connect_weight_sync, timed separately). Both
groups are built as a run builds them (rlrunner.runner.placement.group_specs on the run's RunContext; the config
sets the worker counts, `model.dtype` = `--dtype` for the rollout's model, and the per-worker resources).

Run from the repository root:

    .venv/bin/python benchmarks/bench_weight_sync.py                                  # ~100M params, CPU
    .venv/bin/python benchmarks/bench_weight_sync.py --params 20 --repeats 3 --dtype float32
    .venv/bin/python benchmarks/bench_weight_sync.py --gpus-per-worker 0.5 --actor-workers 1 --rollout-workers 1
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, beside this script
from rlrunner.cluster.worker import Worker  # noqa: E402

from benchlib.common import command_line, make_workdir, memory_gib, ray_cpus, start_local_ray, stop_ray, timed  # noqa: E402
from benchlib.groups import start_groups  # noqa: E402
from benchlib.model import build_config, choose_shape, exact_param_count, tokenizer_vocab_size  # noqa: E402


class BroadcastProbe(Worker):
    """Two of these, in a distributed WorkerGroup: rank 0 broadcasts `nbytes` to rank 1 over the default group."""

    def __init__(self, rank: int, world_size: int, threads: int = 1, use_gpu: bool = False):
        super().__init__(rank, world_size, threads, use_gpu)
        self.buffer = None

    def broadcast(self, nbytes: int) -> float:
        import torch.distributed as dist

        if self.buffer is None or self.buffer.numel() != nbytes:
            self.buffer = torch.full((nbytes,), self.rank, dtype=torch.uint8, device=self.device)
        started = time.perf_counter()
        dist.broadcast(self.buffer, src=0)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100.0, help="target model size in millions of parameters")
    parser.add_argument("--actor-workers", type=int, default=2, help="FSDP2 actor ranks")
    parser.add_argument("--rollout-workers", type=int, default=2, help="rollout workers")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="rollout model dtype"
    )
    parser.add_argument("--repeats", type=int, default=5, help="repeats per measurement (the median is reported)")
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=64.0,
        help="the channels' largest bucket (the cap sync_weights is given), MiB",
    )
    parser.add_argument("--cpus-per-worker", type=float, default=0.25, help="Ray logical CPUs per worker (fractional)")
    parser.add_argument(
        "--gpus-per-worker", type=float, default=0.0, help="GPUs per worker (0.5: actor and rollout share one)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="bound on every wait")
    return parser.parse_args(argv)


def sync_config(args: argparse.Namespace, shape, work: Path):
    """The run config of the two groups: the FSDP actor (float32 master weights) and the rollout in `--dtype`, with the
    benchmark's worker counts, resources and time bound (the actor's training settings do not matter to a sync)."""
    return build_config(
        shape,
        args.actor_workers,
        args.cpus_per_worker,
        work,
        extra=[
            f"model.dtype={args.dtype}",  # the rollout's model; the actor builds its master weights in float32
            f"rollout.num_workers={args.rollout_workers}",
            f"cluster.cpus_per_rollout_worker={args.cpus_per_worker}",
            f"cluster.gpus_per_worker={args.gpus_per_worker}",
            f"cluster.threads_per_worker={args.threads}",
            f"runner.recovery.step_timeout_s={args.timeout_s}",  # every call's bound
        ],
    )


def build_probes(args: argparse.Namespace):
    """The broadcast pair: NCCL on two GPUs of their own when asked for GPUs and the cluster has two, else gloo on
    CPU."""
    import ray

    from rlrunner.cluster.worker_group import WorkerGroup

    nccl = args.gpus_per_worker > 0 and ray.available_resources().get("GPU", 0) >= 2  # two whole, distinct GPUs
    probes = WorkerGroup(
        "broadcast",
        BroadcastProbe,
        2,
        distributed=True,
        cpus_per_worker=args.cpus_per_worker,
        gpus_per_worker=1.0 if nccl else 0.0,
        call_timeout_s=args.timeout_s,
        worker_kwargs={"threads": args.threads, "use_gpu": nccl},
    )
    return probes, "nccl (2 GPUs)" if nccl else "gloo (CPU tensors)"


def old_path(actors, rollouts, timeout_s: float) -> None:
    """What the runner's weight sync did before the channels: rank 0's full float32 state dict, by reference, into
    every RolloutWorker.load_weights."""
    refs = actors.call_all_async("full_state_dict")
    loads = rollouts.call_all_async("load_weights", refs[0])
    actors.get(refs[1:], timeout_s)
    rollouts.get(loads, timeout_s)


def check_bit_exact(actors, rollouts, dtype: torch.dtype) -> None:
    """Every rollout worker holds the actor's weights cast to its dtype, bit for bit (after the channel sync)."""

    def rollout_state(worker):
        return {n: t.detach().cpu() for n, t in worker.engine.model.state_dict().items()}  # the hf engine's model

    full = actors.call_all("full_state_dict")[0]
    for state in rollouts.get([w.__ray_call__.remote(rollout_state) for w in rollouts.workers]):
        for name, tensor in full.items():
            got, want = state[name], tensor.to(dtype)
            if got.dtype != want.dtype or not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)):
                raise AssertionError(f"rollout {name} differs from the actor's weights cast to {dtype}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray

    from rlrunner.weight_sync.driver import connect_weight_sync, sync_weights

    started = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    shape = choose_shape(args.params * 1e6, tokenizer_vocab_size())
    work = make_workdir(None, "bench_weight_sync_")  # the config's output_dir (nothing is written there)
    try:
        cfg = sync_config(args, shape, work)
        params = exact_param_count(dict(cfg.model))
        print(
            f"model: Qwen2 {vars(shape)}, {params:,} parameters; {args.actor_workers} actor ranks "
            f"(FSDP2, float32 master) -> {args.rollout_workers} rollout workers ({args.dtype}); "
            f"{args.cpus_per_worker:g} CPU, {args.gpus_per_worker:g} GPU and {args.threads} thread(s) per worker",
            flush=True,
        )
        start_local_ray(ray_cpus(args.actor_workers + args.rollout_workers + 2, args.cpus_per_worker))
        groups = start_groups(cfg, rollout=True)
        actors, rollouts = groups.actor, groups.rollout
        probes, probe_backend = build_probes(args)
        print(f"groups ready ({time.perf_counter() - started:.0f}s elapsed)", flush=True)

        connect_s, backends = timed(lambda: connect_weight_sync(actors, rollouts, args.timeout_s))
        stats = sync_weights(
            actors, rollouts, bucket_bytes, args.timeout_s
        )  # warm-up (buffers allocated), then checked
        check_bit_exact(actors, rollouts, dtype)
        wire_bytes = int(stats["bytes"])
        probes.call_all("broadcast", wire_bytes)  # warm-up (connections, buffers)
        old_path(actors, rollouts, args.timeout_s)  # warm-up
        old_bytes = params * 4

        seconds: dict[str, list[float]] = {"channels": [], "object store": [], "broadcast": []}
        for repeat in range(args.repeats):
            seconds["channels"].append(timed(lambda: sync_weights(actors, rollouts, bucket_bytes, args.timeout_s))[0])
            seconds["object store"].append(timed(lambda: old_path(actors, rollouts, args.timeout_s))[0])
            seconds["broadcast"].append(timed(lambda: probes.call_all("broadcast", wire_bytes))[0])
            print(f"repeat {repeat + 1}/{args.repeats} done ({time.perf_counter() - started:.0f}s elapsed)", flush=True)
        sync_weights(actors, rollouts, bucket_bytes, args.timeout_s)
        check_bit_exact(actors, rollouts, dtype)  # the old path's load left the same bits: the channels' last sync too

        rows = [
            ("channels (rlrunner sync_weights)", wire_bytes, seconds["channels"]),
            ("object store (full_state_dict + load_weights)", old_bytes, seconds["object store"]),
            (f"plain broadcast 1 -> 1, {probe_backend}", wire_bytes, seconds["broadcast"]),
        ]
        base = statistics.median(seconds["broadcast"])
        print()
        print("| path | bytes per rollout worker | seconds (median) | GB/s | time vs broadcast |")
        print("|---|---:|---:|---:|---:|")
        for name, nbytes, values in rows:
            median = statistics.median(values)
            print(f"| {name} | {nbytes:,} | {median:.3f} | {nbytes / median / 1e9:.2f} | {median / base:.2f} |")
        print()
        channels = statistics.median(seconds["channels"])
        print(
            f"channels: {args.actor_workers} x {args.rollout_workers} ({backends['actor']} at the actor ranks), "
            f"buckets of at most {args.bucket_mb:g} MiB, connect_weight_sync {connect_s:.2f}s once; "
            f"{statistics.median(seconds['object store']) / channels:.1f}x faster than the object-store path; "
            "rollout weights checked bit-equal to full_state_dict cast to the dtype."
        )
        print("seconds per repeat:")
        for name, values in seconds.items():
            print(f"  {name}: " + ", ".join(f"{s:.3f}" for s in values))
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
        print(
            f"machine: {os.cpu_count()} CPU cores ({platform.machine()}), {memory_gib():.0f} GiB RAM, {gpu}, "
            f"torch {torch.__version__}, ray {ray.__version__}"
        )
        print(f"command: {command_line()}")
        print(f"total time: {time.perf_counter() - started:.0f}s")
        for group in (probes, rollouts, actors):
            group.shutdown()
    finally:
        stop_ray()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
