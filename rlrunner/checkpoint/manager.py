"""The CheckpointManager interface (one per training backend) and its FSDP2 + DCP implementation.

A manager only writes and reads its backend's shards under the folder it is given (a URL string: a
local path or any store's URL); the handler decides when and where, makes the folder through its
Storage, and commits. A save has two halves, so that the files can be written in
the background while training goes on: `start_save` returns once the state is safe from training
(copied off the live tensors, or fully written for a synchronous save), `finish_save` reports the
files once every rank's write has finished. A backend with another layout (e.g. Megatron's
`iter_0000050/mp_rank_00/...`) implements the same members.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from rlrunner.checkpoint.megatron_files import rank_dirs, read_tracker, write_tracker
from rlrunner.storage import open_storage

logger = logging.getLogger(__name__)


class CheckpointManager(Protocol):
    backend: str  # recorded in the manifest; a checkpoint is only loaded by the backend that wrote it

    @property
    def world_size(self) -> int: ...

    def start_save(self, url: str, step: int) -> None:
        """Begin writing the training state under `url`; training may change the live state once this returns."""
        ...

    def finish_save(self, wait: bool) -> dict[str, dict[str, Any]] | None:
        """{relative file: {"size", "crc32"}} of every file written once all writes have finished (raising their
        error if one failed); None when `wait` is false and some write is still going on."""
        ...

    def load(self, url: str) -> None:
        """Load the training state saved under `url` into the live workers."""
        ...


class FSDPCheckpointManager:
    """FSDP2 shards through torch.distributed.checkpoint, written by every actor rank in parallel, straight to
    the store (each rank opens its own connection with `storage_options`)."""

    backend = "fsdp2-dcp"

    def __init__(
        self,
        actor_group,
        timeout_s: float | None = None,
        background: bool = False,
        storage_options: dict[str, Any] | None = None,
    ):
        self.actor_group = actor_group
        self.timeout_s = timeout_s  # runner.recovery.checkpoint_timeout_s: I/O has its own bound, not a step's
        self.background = background  # runner.async_save
        self.storage_options = dict(storage_options or {})  # runner.storage_options, for fsspec on every rank
        self.write_s: float | None = None  # the slowest rank's write time of the last finished save

    @property
    def world_size(self) -> int:
        return self.actor_group.num_workers

    def start_save(self, url: str, step: int) -> None:
        # No folder made here: the handler makes it through its Storage (object stores need none).
        self.actor_group.call_all(
            "start_checkpoint", str(url), self.background, self.storage_options, timeout_s=self.timeout_s
        )

    def finish_save(self, wait: bool) -> dict[str, dict[str, Any]] | None:
        if not wait and not all(self.actor_group.call_all("checkpoint_written")):
            return None
        results = self.actor_group.call_all("finish_checkpoint", timeout_s=self.timeout_s)
        self.write_s = max(result["write_s"] for result in results)
        files: dict[str, dict[str, Any]] = {}
        for result in results:
            files.update(result["files"])
        return files

    def save(self, url: str, step: int) -> dict[str, dict[str, Any]]:
        """Start and finish a save in one call (benchmarks, tools)."""
        self.start_save(url, step)
        return self.finish_save(wait=True)

    def load(self, url: str) -> None:
        self.actor_group.call_all("load_checkpoint", str(url), self.storage_options, timeout_s=self.timeout_s)


class MegatronCheckpointManager(FSDPCheckpointManager):
    """The Megatron backend's files (`iter_XXXXXXX/mp_rank_XX/{model_optim_rng,distrib_optim}.pt`), written by data-parallel
    rank 0 of each tensor-parallel rank, straight to the store; the driver writes `latest_checkpointed_iteration.txt`
    once every rank's files are written, so the tracker never names a partial iteration (and the manifest, written
    after it, commits the whole)."""

    backend = "megatron-tp"

    def __init__(self, actor_group, timeout_s: float | None = None, background: bool = False,
                 storage_options: dict[str, Any] | None = None, tensor_parallel_size: int = 1):
        super().__init__(actor_group, timeout_s, background, storage_options)
        self.tensor_parallel_size = tensor_parallel_size

    def load(self, url: str) -> None:
        storage = open_storage(str(url), self.storage_options)
        saved_tp = len(rank_dirs(storage, str(url), read_tracker(storage, str(url))))
        if saved_tp != self.tensor_parallel_size:
            logger.warning(
                "resharding %s from tensor-parallel size %d to %d through the HF layout: model and optimizer moments are "
                "resharded, per-rank RNG states are not restored", url, saved_tp, self.tensor_parallel_size,
            )
        super().load(url)

    def start_save(self, url: str, step: int) -> None:
        self._url, self._step = str(url), step
        self.actor_group.call_all(
            "start_checkpoint", self._url, self.background, self.storage_options, step, timeout_s=self.timeout_s
        )

    def finish_save(self, wait: bool) -> dict[str, dict[str, Any]] | None:
        files = super().finish_save(wait)
        if files is None:
            return None
        storage = open_storage(self._url, self.storage_options)
        files.update({name: record.as_dict() for name, record in write_tracker(storage, self._url, self._step).items()})
        return files
