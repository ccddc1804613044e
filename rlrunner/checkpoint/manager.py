"""The CheckpointManager interface (one per training backend) and its FSDP2 + DCP implementation.

A manager only writes and reads its backend's shards under the folder it is given; the handler
decides when and where, and commits. A backend with another layout (e.g. Megatron's
`iter_0000050/mp_rank_00/...`) implements the same three members.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class CheckpointManager(Protocol):
    backend: str  # recorded in the manifest; a checkpoint is only loaded by the backend that wrote it

    @property
    def world_size(self) -> int: ...

    def save(self, path: Path, step: int) -> dict[str, dict[str, Any]]:
        """Write the training state under `path`; return {relative file: {"size", "crc32"}} for files written."""
        ...

    def load(self, path: Path) -> None:
        """Load the training state saved under `path` into the live workers."""
        ...


class FSDPCheckpointManager:
    """FSDP2 shards through torch.distributed.checkpoint, written by every actor rank in parallel."""

    backend = "fsdp2-dcp"

    def __init__(self, actor_group, timeout_s: float | None = None):
        self.actor_group = actor_group
        self.timeout_s = timeout_s  # runner.recovery.checkpoint_timeout_s: I/O has its own bound, not a step's

    @property
    def world_size(self) -> int:
        return self.actor_group.num_workers

    def save(self, path: Path, step: int) -> dict[str, dict[str, Any]]:
        path.mkdir(parents=True, exist_ok=True)
        files: dict[str, dict[str, Any]] = {}
        for written in self.actor_group.call_all("save_checkpoint", str(path), timeout_s=self.timeout_s):
            files.update(written)
        return files

    def load(self, path: Path) -> None:
        self.actor_group.call_all("load_checkpoint", str(path), timeout_s=self.timeout_s)
