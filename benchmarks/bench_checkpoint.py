#!/usr/bin/env python
"""Checkpoint save/load throughput of rlrunner's actor checkpoints (FSDP2 + DCP, and the Megatron layout) against plain baselines.

What it measures, all in one run, on one disk folder, for the actor state a checkpoint holds (model +
AdamW optimizer + LR scheduler + per-rank RNG) of a Qwen2-architecture model of about `--params`
million parameters, sharded over `--workers` FSDP2 actor ranks on a local Ray:

  save  rlrunner CheckpointHandler.save      the real commit path: staging folder, per-rank DCP shards
                                             (fsync'd, CRC-32 computed as written), data.pt, manifest, rename
          of which FSDPCheckpointManager     its start_save + finish_save (background=False): the sync save
        torch.save + fsync                   the full (unsharded) state gathered into the driver, one file
        raw write + fsync                    os.write of as many bytes as the rlrunner checkpoint (disk ceiling)
  async FSDPCheckpointManager(background=True), i.e. runner.async_save=true:
        blocked                              start_save: what the training loop waits for (state copied off)
        background write                     the finish_save that follows at once (every rank's write done)
        copy floor                           each rank copies the tensors of the same fsdp_state into fresh
                                             host tensors (pinned on GPU); the slowest rank's time
        and what the blocked time is made of: the ranks' own part of start_save (a second async save, timed
        on the ranks), within it building fsdp_state and DCP's DefaultStager.stage of it; the same copy
        into host tensors that already exist; a Ray round trip (ping)
  load  rlrunner checksum verification       inspect_checkpoint(path, checksums=True) (CRC-32 of every file)
        rlrunner FSDPCheckpointManager.load  DCP load into the live actor group
        torch.load(weights_only=True)        the torch.save file
        raw read                             sequential read of the raw-write file

Then, unless `--megatron-tp 0`, the FSDP group is shut down and a Megatron-backend actor group of K =
`--megatron-tp` ranks (tp=K, dp=1; MegatronActorWorker) is built on the SAME model (the shape is chosen so
that heads, KV heads and MLP width divide by K), gets its own optimizer update, and is measured the same way
(same repeats, medians, page-cache drops), in Megatron-LM's layout (iter_0000001/mp_rank_XX/
{model_optim_rng,distrib_optim}.pt + latest_checkpointed_iteration.txt), rows labelled "megatron layout (tp=K)":

  save  CheckpointHandler.save with MegatronCheckpointManager, and the manager alone (start_save + finish_save,
        background=False); ratio against the raw write measured above
  async MegatronCheckpointManager(background=True): blocked in start_save, the background write (finish_save
        right after), the manager's write_s; "x copy floor" is against the FSDP copy floor (each rank holds
        about the same bytes in both layouts)
  load  checksum verification, and MegatronCheckpointManager.load into the live group; ratio against raw read
followed by one line comparing the Megatron layout's save and load seconds with DCP's for the same model.

The optimizer state is created by one real `update` on a small batch built like the runner builds it
(build_actor_batch + shard_actor_batch + per_rank_shards), so AdamW's exp_avg/exp_avg_sq exist before any save.
Each measurement is repeated `--repeat` times and the median is reported. When
/proc/sys/vm/drop_caches is writable the page cache is dropped before every load-side measurement;
otherwise loads read from the page cache (the output says which).

With `--output s3://bucket/prefix` (or any fsspec URL) it measures the store instead of the disk: the
same CheckpointHandler.save and FSDPCheckpointManager.load, with every rank uploading its own shard,
next to a plain s3fs put and get of the same objects (one thread per shard, as the ranks upload in
parallel) from this process, in one run; then the same save and load with MegatronCheckpointManager
(unless `--megatron-tp 0`). `--moto` first starts moto's S3 server on 127.0.0.1 (in its own process) and
creates the bucket: the way to try it without a real store.

Run from the repository root:

    .venv/bin/python benchmarks/bench_checkpoint.py                       # ~100M params, 2 ranks, 3 repeats, + megatron tp=2
    .venv/bin/python benchmarks/bench_checkpoint.py --params 5 --repeat 5  # small model: fixed costs dominate
    .venv/bin/python benchmarks/bench_checkpoint.py --params 20 --repeat 1 --dir /mnt/fast --megatron-tp 0  # FSDP only
    .venv/bin/python benchmarks/bench_checkpoint.py --output s3://bench/ckpt --moto   # a local S3 API
    .venv/bin/python benchmarks/bench_checkpoint.py --output s3://my-bucket/bench      # a real store (AWS_* credentials)
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
RAW_CHUNK_BYTES = 64 << 20
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


# -- model size ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int

    def overrides(self) -> list[str]:
        return [f"+model.override_config.{name}={value}" for name, value in vars(self).items()]


def shape_for_hidden(hidden: int, layers: int, tp: int = 1) -> ModelShape | None:
    """A Qwen2-like block: 64-wide heads, 4 query heads per KV head (at most), MLP 4x hidden; None when the
    heads cannot be split `tp` ways. With tp > 1 the KV heads are a multiple of tp (Megatron splits the query groups)."""
    heads = hidden // 64
    if heads % tp or (4 * hidden) % tp:
        return None
    limit = max(tp, heads // 4)
    kv_heads = max(d for d in range(tp, limit + 1, tp) if heads % d == 0)  # tp itself divides heads
    return ModelShape(hidden, 4 * hidden, layers, heads, kv_heads)


def approx_params(shape: ModelShape, vocab: int) -> float:
    hidden, layers = shape.hidden_size, shape.num_hidden_layers
    kv = shape.num_key_value_heads * 64
    attention = 2 * hidden * hidden + 2 * hidden * kv + hidden + 2 * kv  # q, o, k, v (+ qkv biases)
    mlp = 3 * hidden * shape.intermediate_size
    return layers * (attention + mlp + 2 * hidden) + 2 * vocab * hidden + hidden  # untied embeddings


def choose_shape(target_params: float, vocab: int, tp: int = 1) -> ModelShape:
    """Hidden size and depth landing near `target_params`, with depth close to hidden/64 (GPT-2-like aspect), and
    heads, KV heads and MLP width divisible by `tp`, so that the FSDP and the Megatron (tp) backends build one model."""
    best: tuple[float, ModelShape] | None = None
    for hidden in range(128, 8192 + 1, 64):
        base = shape_for_hidden(hidden, 0, tp)
        if base is None:
            continue
        per_layer = approx_params(shape_for_hidden(hidden, 1, tp), vocab) - approx_params(base, vocab)
        layers_exact = (target_params - approx_params(base, vocab)) / per_layer
        if layers_exact < 0.5:
            continue
        score = abs(math.log(layers_exact / (hidden / 64)))
        if best is None or score < best[0]:
            best = (score, shape_for_hidden(hidden, max(1, round(layers_exact)), tp))
    if best is None:  # a target below one layer of the smallest splittable width
        return next(shape for h in range(128, 8192 + 1, 64) if (shape := shape_for_hidden(h, 1, tp)) is not None)
    return best[1]


def exact_param_count(model_cfg: dict[str, Any]) -> int:
    """Parameters of the model the actors build, counted on the meta device (no memory, no init)."""
    from transformers import AutoModelForCausalLM

    from rlrunner.models.loading import build_hf_config, build_tokenizer

    config = build_hf_config(model_cfg, build_tokenizer(model_cfg))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def tokenizer_vocab_size() -> int:
    from rlrunner.models.tokenizer import build_char_tokenizer

    return len(build_char_tokenizer())


# -- the actor group -------------------------------------------------------------------------------


def build_config(
    shape: ModelShape, workers: int, cpus_per_worker: float, output_dir: Path, tp: int = 0, batch_size: int | None = None
):
    """A valid run config (tests/conftest.py style) whose model is `shape` and whose actor has `workers` ranks:
    FSDP ranks, or with `tp` > 0 the Megatron backend's (workers / tp data-parallel x tp tensor-parallel)."""
    from rlrunner.config import load_config

    backend = ["actor.training_backend=megatron", f"actor.tensor_model_parallel_size={tp}"] if tp else []
    return load_config(
        [
            f"runner.output_dir={output_dir}",
            "runner.experiment_name=bench",
            f"actor.num_workers={workers}",
            f"data.batch_size={batch_size or workers}",
            "algorithm.group_size=2",
            "actor.micro_batch_size=2",
            f"cluster.cpus_per_actor_worker={cpus_per_worker}",
            *backend,
            *shape.overrides(),
        ]
    )


def check_megatron_shape(cfg, tp: int) -> None:
    """The one-line ConfigError GRPORunner raises when the Megatron backend cannot split this model `tp` ways."""
    from rlrunner.models.loading import build_hf_config, build_tokenizer
    from rlrunner.runner.grpo_runner import check_megatron_model

    check_megatron_model(build_hf_config(cfg.model, build_tokenizer(cfg.model)), tp)


def start_ray(workers: int, cpus_per_worker: float) -> None:
    """A new local Ray (never an existing cluster) with enough logical CPUs for the group."""
    import ray

    ray.init(
        address="local",
        num_cpus=max(2, math.ceil(workers * cpus_per_worker) + 1),
        include_dashboard=False,
        logging_level="WARNING",
    )


def build_actor_group(cfg):
    """The actor WorkerGroup exactly as GRPORunner.build_groups makes it, set up (model sharded, AdamW built)."""
    from omegaconf import OmegaConf

    from rlrunner.cluster.worker_group import WorkerGroup
    from rlrunner.config import tensor_parallel_size
    from rlrunner.utils.seeding import derive_seed
    from rlrunner.backends.fsdp.worker import ActorWorker
    from rlrunner.backends.megatron.worker import MegatronActorWorker

    plain = lambda node: OmegaConf.to_container(node, resolve=True)  # noqa: E731
    megatron = cfg.actor.training_backend == "megatron"
    group = WorkerGroup(
        "actor",
        MegatronActorWorker if megatron else ActorWorker,
        cfg.actor.num_workers,
        worker_kwargs={
            "model_cfg": plain(cfg.model),
            "actor_cfg": plain(cfg.actor),
            "algorithm_cfg": plain(cfg.algorithm),
            "init_seed": derive_seed(cfg.runner.seed, "model_init"),
            "total_optimizer_steps": 100,
            "threads": cfg.cluster.threads_per_worker,
            "use_gpu": False,
        },
        cpus_per_worker=cfg.cluster.cpus_per_actor_worker,
        distributed=True,
        workers_per_bundle=tensor_parallel_size(cfg),  # a tensor-parallel group is one bundle, as in the runner
    )
    group.call_all("setup")
    return group


def update_shards(cfg) -> list[dict[str, torch.Tensor]]:
    """One step's actor batch, built and sharded like GRPORunner.train_step does (synthetic samples)."""
    from rlrunner.algorithms.grpo import group_advantages
    from rlrunner.config import data_parallel_size, tensor_parallel_size
    from rlrunner.models.loading import build_tokenizer, token_ids
    from rlrunner.runner.batching import build_actor_batch, per_rank_shards, shard_actor_batch

    tokenizer = build_tokenizer(cfg.model)
    ids = token_ids(cfg.model, tokenizer)
    group_size = cfg.algorithm.group_size
    samples, rewards = [], []
    for i in range(cfg.data.batch_size * group_size):
        a, b = i % 5, (3 * i) % 5
        answer = str(a + b) if i % 2 == 0 else str(a + b + 1)
        samples.append(
            {
                "prompt_ids": tokenizer.encode(f"What is {a}+{b}? Answer: "),
                "response_ids": tokenizer.encode(answer) + [ids.eos[0]],
            }
        )
        rewards.append(1.0 if i % 2 == 0 else 0.0)
    advantages = group_advantages(torch.tensor(rewards), group_size, cfg.algorithm.norm_adv_by_std)
    batch = build_actor_batch(samples, advantages, ids.pad)
    return per_rank_shards(shard_actor_batch(batch, data_parallel_size(cfg), 1), tensor_parallel_size(cfg))


def _optimizer_state_tensors(worker) -> int:
    """Runs in an actor: how many tensors AdamW holds in its state (0 before the first step)."""
    optimizer = getattr(worker.optimizer, "optimizer", worker.optimizer)  # DistributedAdamW wraps a torch AdamW
    return sum(torch.is_tensor(v) for state in optimizer.state.values() for v in state.values())


def create_optimizer_state(group, cfg) -> dict[str, float]:
    """One real GRPO update, so AdamW's exp_avg / exp_avg_sq exist; returns rank 0's stats."""
    shards = update_shards(cfg)
    stats = group.call_each("update", [(shard,) for shard in shards])
    tensors = group.get([w.__ray_call__.remote(_optimizer_state_tensors) for w in group.workers])
    if stats[0]["skipped_steps"] or min(tensors) == 0:
        raise RuntimeError(f"the update did not create optimizer state (stats {stats[0]}, state tensors {tensors})")
    return {**stats[0], "optimizer_state_tensors_per_rank": float(tensors[0])}


def _full_state_for_torch_save(worker) -> dict[str, Any]:
    """Runs in every actor (collective): the unsharded model + optimizer on rank 0, plus this rank's RNG."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from rlrunner.backends.fsdp.dcp_state import capture_rng

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(worker.model, options=options)
    optimizer = get_optimizer_state_dict(worker.model, worker.optimizer, options=options)
    out: dict[str, Any] = {"rank": worker.rank, "rng": capture_rng()}
    if worker.rank == 0:
        out.update(model=model, optimizer=optimizer, scheduler=worker.scheduler.state_dict())
    return out


def gather_full_state(group) -> dict[str, Any]:
    """The same content as the checkpoint, unsharded, in the driver: model, optimizer, scheduler, rng per rank."""
    parts = group.get([w.__ray_call__.remote(_full_state_for_torch_save) for w in group.workers])
    first = parts[0]
    return {
        "model": first["model"],
        "optimizer": first["optimizer"],
        "scheduler": first["scheduler"],
        "rng": {f"rank_{part['rank']}": part["rng"] for part in parts},
    }


# -- measurements ----------------------------------------------------------------------------------


def can_drop_page_cache() -> bool:
    return DROP_CACHES.exists() and os.access(DROP_CACHES, os.W_OK)


def drop_page_cache(enabled: bool) -> None:
    if enabled:
        os.sync()
        DROP_CACHES.write_text("3\n")


def timed(action: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def torch_save_durably(state: dict[str, Any], path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())


def raw_write(path: Path, nbytes: int, block: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        remaining = nbytes
        while remaining:
            remaining -= os.write(fd, block[: min(len(block), remaining)])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: Path, block: memoryview) -> int:
    total = 0
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(block):
            total += count
    return total


class TimedManager:
    """The FSDPCheckpointManager, passed to CheckpointHandler.save, recording how long its two halves took."""

    def __init__(self, manager):
        self.manager = manager
        self.backend = manager.backend
        self.save_seconds = 0.0

    @property
    def world_size(self) -> int:
        return self.manager.world_size

    @property
    def write_s(self) -> float | None:
        return self.manager.write_s

    def start_save(self, url: str, step: int) -> None:
        seconds, _ = timed(lambda: self.manager.start_save(url, step))
        self.save_seconds = seconds

    def finish_save(self, wait: bool) -> dict[str, dict[str, Any]] | None:
        seconds, files = timed(lambda: self.manager.finish_save(wait))
        self.save_seconds += seconds
        return files

    def load(self, url: str) -> None:
        self.manager.load(url)


@dataclass
class Samples:
    """Seconds per repeat for each operation, and the bytes it moved."""

    seconds: dict[str, list[float]]
    nbytes: dict[str, int]

    def add(self, name: str, seconds: float, nbytes: int) -> None:
        self.seconds.setdefault(name, []).append(seconds)
        self.nbytes[name] = nbytes

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])


def measure_saves(group, handler, work: Path, full_state: dict[str, Any], samples: Samples, block: memoryview) -> Path:
    """One repeat of every save-side measurement; returns the committed checkpoint (kept for the loads)."""
    from rlrunner.checkpoint.manager import FSDPCheckpointManager

    manager = TimedManager(FSDPCheckpointManager(group))
    seconds, url = timed(lambda: handler.save(1, manager, bench_data_state()))
    checkpoint = Path(url)
    checkpoint_bytes = folder_bytes(checkpoint)
    samples.add(FSDP_ROWS.save, seconds, checkpoint_bytes)
    samples.add(FSDP_ROWS.sync, manager.save_seconds, folder_bytes(checkpoint / "actor"))

    torch_file = work / "full_state.pt"
    seconds, _ = timed(lambda: torch_save_durably(full_state, torch_file))
    samples.add(TORCH_SAVE_ROW, seconds, torch_file.stat().st_size)

    raw_file = work / "raw.bin"
    seconds, _ = timed(lambda: raw_write(raw_file, checkpoint_bytes, block))
    samples.add(RAW_WRITE_ROW, seconds, checkpoint_bytes)
    return checkpoint


def measure_loads(group, storage, checkpoint: Path, work: Path, samples: Samples, block: memoryview, drop: bool) -> None:
    """One repeat of every load-side measurement, each from a cold page cache when `drop`."""
    from rlrunner.checkpoint.handler import COMPLETE, inspect_checkpoint
    from rlrunner.checkpoint.manager import FSDPCheckpointManager

    checkpoint_bytes = folder_bytes(checkpoint)
    drop_page_cache(drop)
    seconds, status = timed(lambda: inspect_checkpoint(storage, str(checkpoint), checksums=True))
    if status.status != COMPLETE:
        raise RuntimeError(f"{checkpoint} does not verify: {status.reasons}")
    samples.add(FSDP_ROWS.verify, seconds, checkpoint_bytes)

    drop_page_cache(drop)
    seconds, _ = timed(lambda: FSDPCheckpointManager(group).load(str(checkpoint / "actor")))
    samples.add(FSDP_ROWS.load, seconds, folder_bytes(checkpoint / "actor"))

    torch_file = work / "full_state.pt"
    drop_page_cache(drop)
    seconds, loaded = timed(lambda: torch.load(torch_file, weights_only=True))
    del loaded
    samples.add(TORCH_LOAD_ROW, seconds, torch_file.stat().st_size)

    raw_file = work / "raw.bin"
    drop_page_cache(drop)
    seconds, nbytes = timed(lambda: raw_read(raw_file, block))
    samples.add(RAW_READ_ROW, seconds, nbytes)


# -- the async save and its floor ------------------------------------------------------------------


def _local_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a (nested) state dict, DTensors as this rank's local shard: what DCP stages and writes."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return [state.to_local()]
    if torch.is_tensor(state):
        return [state]
    if isinstance(state, dict):
        state = list(state.values())
    if isinstance(state, (list, tuple)):
        return [tensor for item in state for tensor in _local_tensors(item)]
    return []


def _copy_floor(worker) -> dict[str, float]:
    """Runs in every actor: the pieces of an async save's blocked time on this rank, next to a plain copy.

    Each piece starts from the same `fsdp_state` the save builds; the copies are dropped before the next
    piece so that every one of them allocates fresh host memory, as a save does.
    """
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from rlrunner.backends.fsdp.dcp_state import fsdp_state

    pinned = torch.cuda.is_available()  # what ShardSaver's stager uses
    state_s, state = timed(lambda: fsdp_state(worker.model, worker.optimizer, worker.scheduler, worker.rank))
    tensors = _local_tensors(state)

    def fresh_copy() -> list[torch.Tensor]:
        return [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned).copy_(t) for t in tensors]

    copy_s, copies = timed(fresh_copy)
    recopy_s, _ = timed(lambda: [c.copy_(t) for c, t in zip(copies, tensors)])  # into memory already touched
    del copies
    stager = DefaultStager(StagingOptions(pinned, False, False, False))  # as ShardSaver.start builds it
    stage_s, staged = timed(lambda: stager.stage(state))
    del staged
    stager.close()
    return {
        "state_s": state_s,
        "copy_s": copy_s,
        "recopy_s": recopy_s,
        "stage_s": stage_s,
        "bytes": float(sum(t.numel() * t.element_size() for t in tensors)),
    }


def _timed_start_checkpoint(worker, url: str) -> float:
    """Runs in every actor: seconds of the rank's own part of start_save (fsdp_state + ShardSaver.start)."""
    seconds, _ = timed(lambda: worker.start_checkpoint(url, True))
    return seconds


def measure_async(group, work: Path, samples: Samples) -> None:
    """One repeat of the async save (blocked and background parts), its floor and the blocked time's pieces."""
    from rlrunner.checkpoint.manager import FSDPCheckpointManager

    folder = work / "async_shards"
    folder.mkdir()  # the handler makes it before start_save in a run
    manager = FSDPCheckpointManager(group, background=True)
    blocked, _ = timed(lambda: manager.start_save(str(folder), 1))
    waited, _ = timed(lambda: manager.finish_save(wait=True))
    written = folder_bytes(folder)
    shutil.rmtree(folder)
    samples.add(BLOCKED_ROW, blocked, written)
    samples.add(WAIT_ROW, waited, written)
    samples.add(WRITE_S_ROW, manager.write_s, written)

    ranks = group.get([w.__ray_call__.remote(_copy_floor) for w in group.workers])
    nbytes = int(sum(rank["bytes"] for rank in ranks))
    slowest = lambda key: max(rank[key] for rank in ranks)  # noqa: E731  the group waits for its slowest rank
    samples.add(COPY_FLOOR, slowest("copy_s"), nbytes)
    samples.add(STATE_ROW, slowest("state_s"), nbytes)
    samples.add(STAGE_ROW, slowest("stage_s"), nbytes)
    samples.add(RECOPY_ROW, slowest("recopy_s"), nbytes)
    seconds, _ = timed(lambda: group.call_all("ping"))
    samples.add(PING_ROW, seconds, 0)

    # The same async save again, its start timed on the ranks: the rest of the blocked time is the call's way
    # there and back (Ray, and the GIL the reply shares with the writer thread that has just started).
    folder.mkdir()
    driver_s, ranks_s = timed(
        lambda: group.get([w.__ray_call__.remote(_timed_start_checkpoint, str(folder)) for w in group.workers])
    )
    FSDPCheckpointManager(group, background=True).finish_save(wait=True)
    shutil.rmtree(folder)
    samples.add(RANK_START_ROW, max(ranks_s), written)
    samples.add(RANK_START_DRIVER_ROW, driver_s, written)


# -- the Megatron layout ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BackendRows:
    """The row names of one backend's checkpoint measurements (save, verify, load; async save when measured)."""

    save: str  # CheckpointHandler.save: the whole commit
    sync: str  # the manager alone: start_save + finish_save (background=False)
    verify: str  # inspect_checkpoint(checksums=True)
    load: str  # the manager's load into the live group
    blocked: str = ""  # async save: start_save (background=True)
    wait: str = ""  # async save: finish_save(wait=True) right after
    write_s: str = ""  # async save: the manager's write_s


def megatron_rows(tp: int) -> BackendRows:
    layout_name = f"megatron layout (tp={tp})"
    return BackendRows(
        save=f"{layout_name}: CheckpointHandler.save",
        sync="  of which MegatronCheckpointManager.save",
        verify=f"{layout_name}: inspect_checkpoint(checksums=True)",
        load=f"{layout_name}: MegatronCheckpointManager.load",
        blocked=f"{layout_name} async save: blocked in start_save (background=True)",
        wait=f"{layout_name} async save: background write, finish_save(wait=True) right after",
        write_s=f"{layout_name} async save: manager.write_s (slowest rank, start to written)",
    )


def bench_data_state() -> dict[str, Any]:
    """The driver's data state a checkpoint carries (data/data.pt), as the runner builds it after step 1."""
    return {"dataloader": {"epoch": 0, "position": 0}, "runner": {"global_step": 1, "epoch": 0, "total_steps": 1}}


def measure_megatron_saves(group, tp: int, handler, rows: BackendRows, samples: Samples) -> Path:
    """One repeat of the Megatron layout's synchronous save; returns the committed checkpoint (kept for the loads)."""
    from rlrunner.checkpoint.manager import MegatronCheckpointManager

    manager = TimedManager(MegatronCheckpointManager(group, tensor_parallel_size=tp))
    seconds, url = timed(lambda: handler.save(1, manager, bench_data_state()))
    checkpoint = Path(url)
    samples.add(rows.save, seconds, folder_bytes(checkpoint))
    samples.add(rows.sync, manager.save_seconds, folder_bytes(checkpoint / "actor"))
    return checkpoint


def measure_megatron_loads(group, tp: int, storage, checkpoint: Path, rows: BackendRows, samples: Samples, drop: bool) -> None:
    """One repeat of the Megatron layout's verification and load into the live group, from a cold page cache when `drop`."""
    from rlrunner.checkpoint.handler import COMPLETE, inspect_checkpoint
    from rlrunner.checkpoint.manager import MegatronCheckpointManager

    drop_page_cache(drop)
    seconds, status = timed(lambda: inspect_checkpoint(storage, str(checkpoint), checksums=True))
    if status.status != COMPLETE:
        raise RuntimeError(f"{checkpoint} does not verify: {status.reasons}")
    samples.add(rows.verify, seconds, folder_bytes(checkpoint))

    drop_page_cache(drop)
    seconds, _ = timed(lambda: MegatronCheckpointManager(group, tensor_parallel_size=tp).load(str(checkpoint / "actor")))
    samples.add(rows.load, seconds, folder_bytes(checkpoint / "actor"))


def measure_megatron_async(group, tp: int, work: Path, rows: BackendRows, samples: Samples) -> None:
    """One repeat of the Megatron layout's async save: the part training waits for, then the background write."""
    from rlrunner.checkpoint.manager import MegatronCheckpointManager

    folder = work / "async_megatron"
    folder.mkdir()  # the handler makes it before start_save in a run
    manager = MegatronCheckpointManager(group, background=True, tensor_parallel_size=tp)
    blocked, _ = timed(lambda: manager.start_save(str(folder), 1))
    waited, _ = timed(lambda: manager.finish_save(wait=True))
    written = folder_bytes(folder)
    shutil.rmtree(folder)
    samples.add(rows.blocked, blocked, written)
    samples.add(rows.wait, waited, written)
    samples.add(rows.write_s, manager.write_s, written)


def start_megatron_group(cfg, tp: int):
    """The Megatron actor group (tp ranks, dp 1) with optimizer state from one real update; prints what was built."""
    group = build_actor_group(cfg)
    stats = create_optimizer_state(group, cfg)
    print(
        f"megatron layout: {cfg.actor.num_workers} MegatronActorWorker ranks (tp={tp}, dp={cfg.actor.num_workers // tp}), "
        f"same model; optimizer state from one real update (grad_norm {stats['grad_norm']:.3f}, "
        f"{int(stats['optimizer_state_tensors_per_rank'])} AdamW state tensors on rank 0)",
        flush=True,
    )
    return group


def run_megatron_local(cfg, tp: int, storage, work: Path, repeat: int, drop: bool, samples: Samples, fingerprint, started: float) -> None:
    """Every Megatron-layout measurement, `repeat` times, on its own actor group (torn down at the end)."""
    from rlrunner.checkpoint.handler import CheckpointHandler

    rows = megatron_rows(tp)
    group = start_megatron_group(cfg, tp)
    handler = CheckpointHandler(storage, str(work / "experiment_megatron"), save_interval=1, max_keep=None, fingerprint=fingerprint)
    for index in range(repeat):
        checkpoint = measure_megatron_saves(group, tp, handler, rows, samples)
        measure_megatron_loads(group, tp, storage, checkpoint, rows, samples, drop)
        measure_megatron_async(group, tp, work, rows, samples)
        shutil.rmtree(checkpoint)
        print(f"megatron repeat {index + 1}/{repeat} done ({time.perf_counter() - started:.0f}s elapsed)", flush=True)
    group.shutdown()


# -- report ----------------------------------------------------------------------------------------

SYNC_ROW = "  of which FSDPCheckpointManager.save"  # start_save + finish_save, background=False
COPY_FLOOR = "copy floor: fsdp_state tensors -> fresh host tensors (slowest rank)"
BLOCKED_ROW = "async save: blocked in start_save (background=True)"
WAIT_ROW = "async save: background write, finish_save(wait=True) right after"
WRITE_S_ROW = "async save: manager.write_s (slowest rank, start to written)"
STATE_ROW = "rank: fsdp_state() (state dict of views, no copy)"
STAGE_ROW = "rank: DefaultStager.stage(fsdp_state) (the async save's copy)"
RECOPY_ROW = "rank: copy into host tensors already allocated (memcpy alone)"
PING_ROW = "driver: Ray round trip, call_all('ping')"
RANK_START_ROW = "rank: its part of start_save (fsdp_state + ShardSaver.start), timed on the rank"
RANK_START_DRIVER_ROW = "driver: the same call (same save), timed on the driver"
ASYNC_ROWS = [COPY_FLOOR, BLOCKED_ROW, WAIT_ROW, WRITE_S_ROW]
PIECE_ROWS = [RANK_START_ROW, RANK_START_DRIVER_ROW, STATE_ROW, STAGE_ROW, RECOPY_ROW, PING_ROW]
FSDP_ROWS = BackendRows(
    save="rlrunner CheckpointHandler.save",
    sync=SYNC_ROW,
    verify="rlrunner inspect_checkpoint(checksums=True)",
    load="rlrunner FSDPCheckpointManager.load",
    blocked=BLOCKED_ROW,
    wait=WAIT_ROW,
    write_s=WRITE_S_ROW,
)
TORCH_SAVE_ROW, RAW_WRITE_ROW = "torch.save + fsync (one file)", "raw write + fsync"
TORCH_LOAD_ROW, RAW_READ_ROW = "torch.load(weights_only=True)", "raw read"


def save_rows(megatron: BackendRows | None) -> list[str]:
    """The save section: rlrunner's FSDP rows, the Megatron layout's (when measured), then the plain baselines."""
    middle = [megatron.save, megatron.sync] if megatron else []
    return [FSDP_ROWS.save, FSDP_ROWS.sync, *middle, TORCH_SAVE_ROW, RAW_WRITE_ROW]


def load_rows(megatron: BackendRows | None) -> list[str]:
    middle = [megatron.verify, megatron.load] if megatron else []
    return [FSDP_ROWS.verify, FSDP_ROWS.load, *middle, TORCH_LOAD_ROW, RAW_READ_ROW]


# -- an object store (--output URL) ------------------------------------------------------------------

PLAIN_PUT_ROW = "s3fs put of the same objects (one thread per shard)"
PLAIN_GET_ROW = "s3fs get of the same objects (one thread per shard)"


def remote_save_rows(megatron: BackendRows | None) -> list[str]:
    middle = [megatron.save, megatron.sync] if megatron else []
    return [FSDP_ROWS.save, FSDP_ROWS.sync, *middle, PLAIN_PUT_ROW]


def remote_load_rows(megatron: BackendRows | None) -> list[str]:
    middle = [megatron.verify, megatron.load] if megatron else []
    return [FSDP_ROWS.verify, FSDP_ROWS.load, *middle, PLAIN_GET_ROW]


def start_moto(url: str) -> tuple[subprocess.Popen, dict[str, Any]]:
    """moto's S3 server on a free port of 127.0.0.1 in a process of its own, with the URL's bucket; its storage_options."""
    import boto3

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.1)
    credentials = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench", "region_name": "us-east-1"}
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    boto3.client("s3", endpoint_url=endpoint, **credentials).create_bucket(Bucket=bucket)
    return server, {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def _in_threads(action: Callable[[str], Any], names: list[str]) -> list[Any]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        return list(pool.map(action, names))


def measure_remote(
    group, storage, experiment: str, samples: Samples, fingerprint: dict[str, Any], make_manager: Callable[..., Any],
    rows: BackendRows, plain: bool,
) -> None:
    """One repeat on the store: rlrunner's save and load with the manager `make_manager(group, storage_options=...)`
    builds, and with `plain` a plain put and get of the same objects."""
    from rlrunner.checkpoint.handler import COMPLETE, CheckpointHandler, inspect_checkpoint

    handler = CheckpointHandler(storage, experiment, save_interval=1, max_keep=None, fingerprint=fingerprint)
    manager = TimedManager(make_manager(group, storage_options=storage.storage_options))
    seconds, url = timed(lambda: handler.save(1, manager, bench_data_state()))
    files = storage.walk(url)
    samples.add(rows.save, seconds, sum(files.values()))
    shards = {name: size for name, size in files.items() if name.startswith("actor/") and "/huggingface/" not in name}
    samples.add(rows.sync, manager.save_seconds, sum(shards.values()))

    fs, plain_url = storage.fs, storage.join(experiment, "plain")
    if plain:
        noise = os.urandom(1 << 20)  # incompressible, like the shards
        payloads = {name: (noise * (size // len(noise) + 1))[:size] for name, size in shards.items()}
        seconds, _ = timed(lambda: _in_threads(lambda n: fs.pipe_file(fs._strip_protocol(storage.join(plain_url, n)), payloads[n]), list(payloads)))
        samples.add(PLAIN_PUT_ROW, seconds, sum(len(p) for p in payloads.values()))
        payloads.clear()

    seconds, status = timed(lambda: inspect_checkpoint(storage, url, checksums=True))
    if status.status != COMPLETE:
        raise RuntimeError(f"{url} does not verify: {status.reasons}")
    samples.add(rows.verify, seconds, sum(files.values()))
    seconds, _ = timed(lambda: make_manager(group, storage_options=storage.storage_options).load(storage.join(url, "actor")))
    samples.add(rows.load, seconds, sum(shards.values()))
    if plain:
        seconds, got = timed(lambda: _in_threads(lambda n: fs.cat_file(fs._strip_protocol(storage.join(plain_url, n))), list(shards)))
        samples.add(PLAIN_GET_ROW, seconds, sum(len(g) for g in got))
        storage.delete_tree(plain_url)
    handler.delete(url)


def remote_table(samples: Samples, megatron: BackendRows | None) -> str:
    lines = ["| operation | bytes | seconds | MB/s | vs plain s3fs |", "|---|---:|---:|---:|---:|"]
    for section, rows in (("save", remote_save_rows(megatron)), ("load", remote_load_rows(megatron))):
        reference = samples.nbytes[rows[-1]] / samples.median(rows[-1])
        for name in rows:
            seconds = samples.median(name)
            rate = samples.nbytes[name] / seconds
            lines.append(f"| {section}: {name.strip()} | {samples.nbytes[name]:,} | {seconds:.3f} | {rate / 1e6:.0f} | {rate / reference:.2f} |")
    return "\n".join(lines)


def markdown_table(samples: Samples, megatron: BackendRows | None = None) -> str:
    lines = ["| operation | bytes | seconds | GB/s | vs raw write |", "|---|---:|---:|---:|---:|"]
    for section, rows, reference in (("save", save_rows(megatron), RAW_WRITE_ROW), ("load", load_rows(megatron), RAW_READ_ROW)):
        ref_rate = samples.nbytes[reference] / samples.median(reference)
        for name in rows:
            seconds = samples.median(name)
            rate = samples.nbytes[name] / seconds
            label = f"{section}: {name.strip()}" if not name.startswith(" ") else f"{section}:   ↳ {name.strip()}"
            lines.append(f"| {label} | {samples.nbytes[name]:,} | {seconds:.3f} | {rate / 1e9:.3f} | {rate / ref_rate:.2f} |")
    return "\n".join(lines)


def async_table(samples: Samples, megatron: BackendRows | None = None, tp: int = 0) -> str:
    """The async save next to its floor (a plain copy of the same state) and the synchronous save; the Megatron
    layout's async save below, against the same floor (each rank holds about the same bytes in both layouts)."""
    floor = samples.median(COPY_FLOOR)
    lines = ["| async save (runner.async_save=true) | bytes | seconds | x copy floor |", "|---|---:|---:|---:|"]
    names = ASYNC_ROWS + [SYNC_ROW]
    labels = {name: name for name in ASYNC_ROWS + PIECE_ROWS}
    labels[SYNC_ROW] = "sync save: FSDPCheckpointManager start_save + finish_save (background=False)"
    if megatron:
        names += [megatron.blocked, megatron.wait, megatron.write_s, megatron.sync]
        labels.update({name: name for name in (megatron.blocked, megatron.wait, megatron.write_s)})
        labels[megatron.sync] = f"megatron layout (tp={tp}) sync save: MegatronCheckpointManager start_save + finish_save (background=False)"
    for name in names + PIECE_ROWS:
        seconds = samples.median(name)
        nbytes = f"{samples.nbytes[name]:,}" if samples.nbytes[name] else ""
        lines.append(f"| {labels[name]} | {nbytes} | {seconds:.4f} | {seconds / floor:.2f} |")
    blocked, sync = samples.median(BLOCKED_ROW), samples.median(SYNC_ROW)
    verdict = "met" if blocked <= 1.5 * floor else "NOT met"
    lines += [
        "",
        f"blocked / copy floor = {blocked / floor:.2f}x (goal <= 1.5x: {verdict}); "
        f"sync save / blocked = {sync / blocked:.1f}x",
    ]
    if megatron:
        meg_blocked, meg_sync = samples.median(megatron.blocked), samples.median(megatron.sync)
        lines.append(
            f"megatron layout (tp={tp}): blocked / FSDP copy floor = {meg_blocked / floor:.2f}x; "
            f"sync save / blocked = {meg_sync / meg_blocked:.1f}x; blocked megatron / FSDP = {meg_blocked / blocked:.2f}x"
        )
    return "\n".join(lines)


def backend_comparison(samples: Samples, megatron: BackendRows, tp: int, params: int, fsdp_ranks: int) -> str:
    """One line: the Megatron layout's save and load seconds against DCP's, for the same model's state."""
    def pair(meg: str, fsdp: str) -> str:
        m, f = samples.median(meg), samples.median(fsdp)
        return f"{m:.3f} s vs {f:.3f} s ({m / f:.2f}x)"

    return (
        f"megatron layout (tp={tp}, {tp} ranks) vs FSDP/DCP ({fsdp_ranks} ranks), same model ({params:,} parameters; "
        f"actor files {samples.nbytes[megatron.sync]:,} vs {samples.nbytes[FSDP_ROWS.sync]:,} bytes): "
        f"manager save {pair(megatron.sync, FSDP_ROWS.sync)}; handler save {pair(megatron.save, FSDP_ROWS.save)}; "
        f"load {pair(megatron.load, FSDP_ROWS.load)}; checksum verification {pair(megatron.verify, FSDP_ROWS.verify)}"
    )


def per_repeat_seconds(samples: Samples) -> str:
    """Every repeat's seconds, in order, so a slow first repeat (cold allocations) stays visible."""
    return "\n".join(f"  {name.strip()}: " + ", ".join(f"{s:.4f}" for s in seconds) for name, seconds in samples.seconds.items())


def filesystem_of(path: Path) -> str:
    """'<device> (<fstype>)' of the mount holding `path`, from /proc/mounts."""
    best = ("?", "?", "")
    resolved = str(path.resolve())
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype = line.split()[:3]
            if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[2]):
                best = (device, fstype, mount)
    except OSError:
        pass
    return f"{best[0]} ({best[1]}, mounted on {best[2] or '?'})"


def memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def command_line() -> str:
    return shlex.join([sys.executable, *sys.argv])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from rlrunner.storage import add_storage_options_argument

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100.0, help="target model size in millions of parameters")
    parser.add_argument("--workers", type=int, default=2, help="actor (FSDP) ranks")
    parser.add_argument("--megatron-tp", type=int, default=2,
                        help="also measure the Megatron layout with this many ranks (tp=K, dp=1) on the same model; 0: off")
    parser.add_argument("--cpus-per-worker", type=float, default=0.5, help="Ray logical CPUs per actor rank")
    parser.add_argument("--repeat", type=int, default=3, help="repeats per measurement (the median is reported)")
    parser.add_argument("--dir", type=Path, default=None, help="disk folder to write in (a fresh subfolder is made)")
    parser.add_argument("--output", default=None, help="measure this fsspec URL (s3://bucket/prefix) instead of the disk")
    parser.add_argument("--moto", action="store_true", help="with --output s3://...: start a local moto S3 server first")
    add_storage_options_argument(parser, "--storage-options", "--storage_options")
    args = parser.parse_args(argv)
    if args.megatron_tp < 0:
        parser.error(f"--megatron-tp must be >= 0 (0 turns the megatron rows off), got {args.megatron_tp}")
    if args.workers < 1 or args.repeat < 1:
        parser.error(f"--workers and --repeat must be positive, got {args.workers} and {args.repeat}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray

    from rlrunner.storage import open_storage

    parent = args.dir or Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_checkpoint_", dir=parent))
    drop = can_drop_page_cache()
    started = time.perf_counter()
    tp = args.megatron_tp
    try:
        shape = choose_shape(args.params * 1e6, tokenizer_vocab_size(), max(tp, 1))
        cfg = build_config(shape, args.workers, args.cpus_per_worker, work)
        meg_cfg = build_config(shape, tp, args.cpus_per_worker, work, tp=tp, batch_size=args.workers) if tp else None
        if meg_cfg is not None:
            check_megatron_shape(meg_cfg, tp)
        params = exact_param_count(dict(cfg.model))
        also = f"; then the megatron layout on {tp} ranks (tp={tp}, dp=1)" if tp else ""
        print(f"model: Qwen2 {vars(shape)}, {params:,} parameters; {args.workers} FSDP actor ranks{also}", flush=True)

        start_ray(max(args.workers, tp), args.cpus_per_worker)
        group = build_actor_group(cfg)
        stats = create_optimizer_state(group, cfg)
        print(
            "optimizer state: created by one real ActorWorker.update on a runner-built batch "
            f"(grad_norm {stats['grad_norm']:.3f}, {int(stats['optimizer_state_tensors_per_rank'])} AdamW state tensors on rank 0)",
            flush=True,
        )
        fingerprint = {"benchmark": "bench_checkpoint", "params": params}
        if args.output:
            return run_remote(args, group, meg_cfg, params, fingerprint, started)
        storage = open_storage(str(work))
        samples = Samples({}, {})
        run_fsdp_local(group, storage, work, args.repeat, drop, samples, fingerprint, started)
        megatron = megatron_rows(tp) if meg_cfg is not None else None
        if meg_cfg is not None:
            run_megatron_local(meg_cfg, tp, storage, work, args.repeat, drop, samples, fingerprint, started)
        report_local(args, samples, megatron, params, drop, work, started)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def run_fsdp_local(group, storage, work: Path, repeat: int, drop: bool, samples: Samples, fingerprint, started: float) -> None:
    """Every FSDP/DCP and baseline measurement, `repeat` times; the FSDP actor group is torn down at the end."""
    from rlrunner.checkpoint.handler import CheckpointHandler

    full_state = gather_full_state(group)
    handler = CheckpointHandler(storage, str(work / "experiment"), save_interval=1, max_keep=None, fingerprint=fingerprint)
    block = memoryview(bytearray(os.urandom(1 << 20)) * (RAW_CHUNK_BYTES >> 20))
    for index in range(repeat):
        checkpoint = measure_saves(group, handler, work, full_state, samples, block)
        measure_loads(group, storage, checkpoint, work, samples, block, drop)
        measure_async(group, work, samples)
        shutil.rmtree(checkpoint)
        print(f"repeat {index + 1}/{repeat} done ({time.perf_counter() - started:.0f}s elapsed)", flush=True)
    del full_state
    group.shutdown()  # before the Megatron group starts: one backend's ranks at a time
    for leftover in ("full_state.pt", "raw.bin"):
        (work / leftover).unlink(missing_ok=True)


def report_local(args: argparse.Namespace, samples: Samples, megatron: BackendRows | None, params: int, drop: bool,
                 work: Path, started: float) -> None:
    import ray

    tp = args.megatron_tp
    print()
    print(markdown_table(samples, megatron))
    print()
    print(async_table(samples, megatron, tp))
    print()
    if megatron:
        print(backend_comparison(samples, megatron, tp, params, args.workers))
        print()
    print(
        f"Medians of {args.repeat} repeats. 'torch.save + fsync' includes the fsync; its state is gathered unsharded into "
        "the driver beforehand (not timed). 'vs raw write' is the ratio of throughputs; load rows are relative to "
        "'raw read' (= 1.00), both measured in this run. Page cache "
        + ("dropped (/proc/sys/vm/drop_caches was writable) before every load-side row." if drop
           else "NOT dropped (/proc/sys/vm/drop_caches not writable): loads are from the page cache.")
    )
    if megatron:
        print(
            f"The megatron layout rows come from a second actor group ({tp} MegatronActorWorker ranks, tp={tp}, dp=1) built "
            "after the FSDP group was shut down, on the same model and batch, with its own optimizer update."
        )
    print(
        f"machine: {os.cpu_count()} CPU cores ({platform.machine()}), {memory_gib():.0f} GiB RAM, "
        f"torch {torch.__version__}, ray {ray.__version__}; disk folder {work} on {filesystem_of(work)}"
    )
    print("seconds per repeat:")
    print(per_repeat_seconds(samples))
    print(f"command: {command_line()}")
    print(f"total time: {time.perf_counter() - started:.0f}s")


def run_remote(args: argparse.Namespace, group, meg_cfg, params: int, fingerprint: dict[str, Any], started: float) -> int:
    """The store's measurements: the FSDP group's (with the plain put/get), then the Megatron layout's on its own group."""
    import uuid

    from rlrunner.checkpoint.manager import FSDPCheckpointManager, MegatronCheckpointManager
    from rlrunner.storage import open_storage

    server = None
    options = args.storage_options
    if args.moto:
        server, options = start_moto(args.output)
    tp = args.megatron_tp
    megatron = megatron_rows(tp) if meg_cfg is not None else None
    try:
        storage = open_storage(args.output, options)
        experiment = storage.join(args.output, f"bench-{uuid.uuid4().hex[:8]}")
        samples = Samples({}, {})
        for repeat in range(args.repeat):
            measure_remote(group, storage, experiment, samples, fingerprint, FSDPCheckpointManager, FSDP_ROWS, plain=True)
            print(f"repeat {repeat + 1}/{args.repeat} done ({time.perf_counter() - started:.0f}s elapsed)", flush=True)
        group.shutdown()
        if megatron:
            group = start_megatron_group(meg_cfg, tp)
            make_megatron = functools.partial(MegatronCheckpointManager, tensor_parallel_size=tp)
            for repeat in range(args.repeat):
                measure_remote(group, storage, experiment, samples, fingerprint, make_megatron, megatron, plain=False)
                print(f"megatron repeat {repeat + 1}/{args.repeat} done ({time.perf_counter() - started:.0f}s elapsed)", flush=True)
            group.shutdown()
        print()
        print(remote_table(samples, megatron))
        print()
        if megatron:
            print(backend_comparison(samples, megatron, tp, params, args.workers))
            print()
        where = "moto's S3 server on 127.0.0.1 (its own process)" if args.moto else args.output.split("/", 3)[2]
        print(f"Medians of {args.repeat} repeats, store: {where}; the plain put/get run from this process, one thread per shard.")
        print(f"machine: {os.cpu_count()} CPU cores ({platform.machine()}), {memory_gib():.0f} GiB RAM, torch {torch.__version__}")
        print("seconds per repeat:")
        print(per_repeat_seconds(samples))
        print(f"command: {command_line()}")
        print(f"total time: {time.perf_counter() - started:.0f}s")
    finally:
        if server is not None:
            server.kill()
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
