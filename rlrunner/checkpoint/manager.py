"""The CheckpointManager interface: what the handler calls to write and read one training backend's files.

A manager only writes and reads its backend's shards under the folder it is given (a URL string: a
local path or any store's URL); the handler decides when and where, makes the folder through its
Storage, and commits. A save has two halves, so that the files can be written in
the background while training goes on: `start_save` returns once the state is safe from training
(copied off the live tensors, or fully written for a synchronous save), `finish_save` reports the
files once every rank's write has finished. A backend with another layout (e.g. Megatron's
`iter_0000050/mp_rank_00/...`) implements the same members. The backends' managers are in
`rlrunner.backends` (`ActorCheckpointManager` and its subclasses).
"""

from __future__ import annotations

from typing import Any, Protocol


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
