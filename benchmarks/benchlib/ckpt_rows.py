"""bench_checkpoint.py's rows: the seconds and bytes of every repeat, and the name of every row."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence


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


def megatron_rows(tp: int, dp: int = 1, ckpt_format: str = "torch") -> BackendRows:
    """The rows of the Megatron backend's checkpoints in `ckpt_format` (actor.megatron.ckpt_format) at tp x dp."""
    layout_name = f"megatron {ckpt_format} (tp={tp}, dp={dp})"
    return BackendRows(
        save=f"{layout_name}: CheckpointHandler.save",
        sync=f"  of which MegatronCheckpointManager.save ({ckpt_format})",
        verify=f"{layout_name}: inspect_checkpoint(checksums=True)",
        load=f"{layout_name}: MegatronCheckpointManager.load",
        blocked=f"{layout_name} async save: blocked in start_save (background=True)",
        wait=f"{layout_name} async save: background write, finish_save(wait=True) right after",
        write_s=f"{layout_name} async save: manager.write_s (slowest rank, start to written)",
    )


# The FSDP backend's manager is the shared ActorCheckpointManager (get_backend("fsdp").checkpoint_manager(...)).
SYNC_ROW = "  of which fsdp ActorCheckpointManager.save"  # start_save + finish_save, background=False
COPY_FLOOR = "copy floor: the saved state's tensors -> fresh host tensors (slowest rank)"
BLOCKED_ROW = "async save: blocked in start_save (background=True)"
WAIT_ROW = "async save: background write, finish_save(wait=True) right after"
WRITE_S_ROW = "async save: manager.write_s (slowest rank, start to written)"
STATE_ROW = "rank: rank_state().state_dict() (views, no copy)"
STAGE_ROW = "rank: DefaultStager.stage(that state dict) (the async save's copy)"
RECOPY_ROW = "rank: copy into host tensors already allocated (memcpy alone)"
PING_ROW = "driver: Ray round trip, call_all('ping')"
RANK_START_ROW = "rank: its part of start_save (rank_state().state_dict() + start_dcp_save), timed on the rank"
RANK_START_DRIVER_ROW = "driver: the same call (same save), timed on the driver"
ASYNC_ROWS = [COPY_FLOOR, BLOCKED_ROW, WAIT_ROW, WRITE_S_ROW]
PIECE_ROWS = [RANK_START_ROW, RANK_START_DRIVER_ROW, STATE_ROW, STAGE_ROW, RECOPY_ROW, PING_ROW]
FSDP_ROWS = BackendRows(
    save="rlrunner CheckpointHandler.save",
    sync=SYNC_ROW,
    verify="rlrunner inspect_checkpoint(checksums=True)",
    load="rlrunner fsdp ActorCheckpointManager.load",
    blocked=BLOCKED_ROW,
    wait=WAIT_ROW,
    write_s=WRITE_S_ROW,
)
TORCH_SAVE_ROW, RAW_WRITE_ROW = "torch.save + fsync (one file)", "raw write + fsync"
TORCH_LOAD_ROW, RAW_READ_ROW = "torch.load(weights_only=True)", "raw read"


def save_rows(megatron: Sequence[BackendRows]) -> list[str]:
    """The save section: rlrunner's FSDP rows, the Megatron backend's in each format measured, then the plain
    baselines."""
    middle = [name for rows in megatron for name in (rows.save, rows.sync)]
    return [FSDP_ROWS.save, FSDP_ROWS.sync, *middle, TORCH_SAVE_ROW, RAW_WRITE_ROW]


def load_rows(megatron: Sequence[BackendRows]) -> list[str]:
    middle = [name for rows in megatron for name in (rows.verify, rows.load)]
    return [FSDP_ROWS.verify, FSDP_ROWS.load, *middle, TORCH_LOAD_ROW, RAW_READ_ROW]


# -- an object store (--output URL) ------------------------------------------------------------------

PLAIN_PUT_ROW = "s3fs put of the same objects (one thread per shard)"
PLAIN_GET_ROW = "s3fs get of the same objects (one thread per shard)"


def remote_save_rows(megatron: Sequence[BackendRows]) -> list[str]:
    middle = [name for rows in megatron for name in (rows.save, rows.sync)]
    return [FSDP_ROWS.save, FSDP_ROWS.sync, *middle, PLAIN_PUT_ROW]


def remote_load_rows(megatron: Sequence[BackendRows]) -> list[str]:
    middle = [name for rows in megatron for name in (rows.verify, rows.load)]
    return [FSDP_ROWS.verify, FSDP_ROWS.load, *middle, PLAIN_GET_ROW]
