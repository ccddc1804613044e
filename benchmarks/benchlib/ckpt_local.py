"""bench_checkpoint.py's measurements on a disk folder: one repeat of each, for a backend's actor group.

Every measurement takes `Groups` (benchlib.groups): the actor group and the run context whose training backend
makes the checkpoint manager, so the FSDP and the Megatron layouts go through the same calls.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from benchlib.ckpt_rows import (
    COPY_FLOOR,
    PING_ROW,
    RANK_START_DRIVER_ROW,
    RANK_START_ROW,
    RAW_READ_ROW,
    RAW_WRITE_ROW,
    RECOPY_ROW,
    STAGE_ROW,
    STATE_ROW,
    TORCH_LOAD_ROW,
    TORCH_SAVE_ROW,
    BackendRows,
    Samples,
)
from benchlib.common import folder_bytes, timed
from benchlib.groups import Groups, create_optimizer_state, start_groups

RAW_CHUNK_BYTES = 64 << 20
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


# -- plain baselines ---------------------------------------------------------------------------------


def can_drop_page_cache() -> bool:
    return DROP_CACHES.exists() and os.access(DROP_CACHES, os.W_OK)


def drop_page_cache(enabled: bool) -> None:
    if enabled:
        os.sync()
        DROP_CACHES.write_text("3\n")


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


def raw_block() -> memoryview:
    """RAW_CHUNK_BYTES of incompressible bytes, the raw write's and read's buffer."""
    return memoryview(bytearray(os.urandom(1 << 20)) * (RAW_CHUNK_BYTES >> 20))


def _full_state_for_torch_save(worker) -> dict[str, Any]:
    """Runs in every FSDP actor (collective): the unsharded model + optimizer on rank 0, plus this rank's RNG."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from rlrunner.utils.rng import capture_rng

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


# -- rlrunner's save and load ------------------------------------------------------------------------


class TimedManager:
    """A checkpoint manager, passed to CheckpointHandler.save, recording how long its two halves took."""

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


def bench_data_state() -> dict[str, Any]:
    """The driver's data state a checkpoint carries (data/data.pt), as the trainer builds it after step 1."""
    return {"dataloader": {"epoch": 0, "position": 0}, "runner": {"global_step": 1, "epoch": 0, "total_steps": 1}}


def measure_handler_save(groups: Groups, handler, rows: BackendRows, samples: Samples) -> Path:
    """One CheckpointHandler.save of the group's state, and its manager's share (start_save + finish_save,
    background=False); returns the committed checkpoint."""
    manager = TimedManager(groups.manager())
    seconds, url = timed(lambda: handler.save(1, manager, bench_data_state()))
    checkpoint = Path(url)
    samples.add(rows.save, seconds, folder_bytes(checkpoint))
    samples.add(rows.sync, manager.save_seconds, folder_bytes(checkpoint / "actor"))
    return checkpoint


def measure_verify_and_load(
    groups: Groups, storage, checkpoint: Path, rows: BackendRows, samples: Samples, drop: bool
) -> None:
    """The checkpoint's checksum verification, then the manager's load into the live group, each from a cold page
    cache when `drop`."""
    from rlrunner.checkpoint.status import COMPLETE, inspect_checkpoint

    drop_page_cache(drop)
    seconds, status = timed(lambda: inspect_checkpoint(storage, str(checkpoint), checksums=True))
    if status.status != COMPLETE:
        raise RuntimeError(f"{checkpoint} does not verify: {status.reasons}")
    samples.add(rows.verify, seconds, folder_bytes(checkpoint))

    drop_page_cache(drop)
    seconds, _ = timed(lambda: groups.manager().load(str(checkpoint / "actor")))
    samples.add(rows.load, seconds, folder_bytes(checkpoint / "actor"))


def measure_manager_async(groups: Groups, folder: Path, rows: BackendRows, samples: Samples) -> int:
    """One async save (runner.async_save=true) into `folder`: the part training waits for (start_save), then the
    background write (finish_save right after) and the manager's write_s; returns the bytes written."""
    folder.mkdir()  # the handler makes it before start_save in a run
    manager = groups.manager(background=True)
    blocked, _ = timed(lambda: manager.start_save(str(folder), 1))
    waited, _ = timed(lambda: manager.finish_save(wait=True))
    written = folder_bytes(folder)
    shutil.rmtree(folder)
    samples.add(rows.blocked, blocked, written)
    samples.add(rows.wait, waited, written)
    samples.add(rows.write_s, manager.write_s, written)
    return written


# -- FSDP: the baselines beside it, the async save's floor and pieces ----------------------------------------


def measure_saves(
    groups: Groups,
    handler,
    work: Path,
    full_state: dict[str, Any],
    rows: BackendRows,
    samples: Samples,
    block: memoryview,
) -> Path:
    """One repeat of every save-side measurement; returns the committed checkpoint (kept for the loads)."""
    checkpoint = measure_handler_save(groups, handler, rows, samples)
    checkpoint_bytes = folder_bytes(checkpoint)

    torch_file = work / "full_state.pt"
    seconds, _ = timed(lambda: torch_save_durably(full_state, torch_file))
    samples.add(TORCH_SAVE_ROW, seconds, torch_file.stat().st_size)

    raw_file = work / "raw.bin"
    seconds, _ = timed(lambda: raw_write(raw_file, checkpoint_bytes, block))
    samples.add(RAW_WRITE_ROW, seconds, checkpoint_bytes)
    return checkpoint


def measure_loads(
    groups: Groups,
    storage,
    checkpoint: Path,
    work: Path,
    rows: BackendRows,
    samples: Samples,
    block: memoryview,
    drop: bool,
) -> None:
    """One repeat of every load-side measurement, each from a cold page cache when `drop`."""
    measure_verify_and_load(groups, storage, checkpoint, rows, samples, drop)

    torch_file = work / "full_state.pt"
    drop_page_cache(drop)
    seconds, loaded = timed(lambda: torch.load(torch_file, weights_only=True))
    del loaded
    samples.add(TORCH_LOAD_ROW, seconds, torch_file.stat().st_size)

    raw_file = work / "raw.bin"
    drop_page_cache(drop)
    seconds, nbytes = timed(lambda: raw_read(raw_file, block))
    samples.add(RAW_READ_ROW, seconds, nbytes)


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
    """Runs in every FSDP actor: the pieces of an async save's blocked time on this rank, next to a plain copy.

    Each piece starts from the same `rank_state().state_dict()` the save builds; the copies are dropped before the next
    piece so that every one of them allocates fresh host memory, as a save does.
    """
    from rlrunner.backends.fsdp.dcp_state import new_stager

    pinned = torch.cuda.is_available()  # what the save's stager (new_stager) uses
    state_s, state = timed(lambda: worker.rank_state().state_dict())
    tensors = _local_tensors(state)

    def fresh_copy() -> list[torch.Tensor]:
        return [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned).copy_(t) for t in tensors]

    copy_s, copies = timed(fresh_copy)
    recopy_s, _ = timed(lambda: [c.copy_(t) for c, t in zip(copies, tensors)])  # into memory already touched
    copies.clear()  # freed before the next piece
    stager = new_stager()  # a fresh one, as the worker's first background save makes it
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
    """Runs in every actor: seconds of the rank's own part of start_save (its state dict + start_dcp_save)."""
    seconds, _ = timed(lambda: worker.start_checkpoint(url, 1, True, None))
    return seconds


def measure_async(groups: Groups, work: Path, rows: BackendRows, samples: Samples) -> None:
    """One repeat of the async save (blocked and background parts), its floor and the blocked time's pieces."""
    group = groups.actor
    folder = work / "async_shards"
    written = measure_manager_async(groups, folder, rows, samples)

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
    group.call_all("finish_checkpoint", timeout_s=groups.cfg.runner.recovery.checkpoint_timeout_s)  # the writes
    shutil.rmtree(folder)
    samples.add(RANK_START_ROW, max(ranks_s), written)
    samples.add(RANK_START_DRIVER_ROW, driver_s, written)


# -- the Megatron layout -------------------------------------------------------------------------------


def set_ckpt_format(groups: Groups, ckpt_format: str) -> None:
    """The format every rank of the Megatron group saves in from now on (actor.megatron.ckpt_format)."""
    import ray

    ray.get(
        [w.__ray_call__.remote(lambda self: setattr(self, "ckpt_format", ckpt_format)) for w in groups.actor.workers]
    )


def start_megatron_group(cfg, tp: int) -> Groups:
    """The Megatron actor group (tp ranks, dp 1) with optimizer state from one real update; prints what was built."""
    groups = start_groups(cfg)
    stats = create_optimizer_state(groups)
    print(
        f"megatron layout: {cfg.actor.num_workers} MegatronActorWorker ranks "
        f"(tp={tp}, dp={cfg.actor.num_workers // tp}), "
        f"same model; optimizer state from one real update (grad_norm {stats['grad_norm']:.3f}, "
        f"{int(stats['optimizer_state_tensors_per_rank'])} AdamW state tensors on rank 0)",
        flush=True,
    )
    return groups
