"""The checkpoint manager every backend uses: the actor ranks write and read their own files, straight to the store.

`start_save` has every rank start its save (`ActorWorker.start_checkpoint`); `finish_save` collects the files
each rank wrote once all have finished (polled without waiting, or waited for); `load` has every rank read
its state. A backend with files the driver must add or check (Megatron's tracker) overrides `after_write`
and `before_load`.
"""

from __future__ import annotations

from typing import Any, Mapping


class ActorCheckpointManager:
    def __init__(
        self,
        actor_group: Any,
        backend: str,
        timeout_s: float | None = None,
        background: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ):
        self.actor_group = actor_group
        self.backend = backend  # the manifest's "backend": the format of the files
        self.timeout_s = timeout_s  # runner.recovery.checkpoint_timeout_s: I/O has its own bound, not a step's
        self.background = background  # runner.async_save
        self.storage_options = dict(storage_options or {})  # runner.storage_options, for fsspec on every rank
        self.write_s: float | None = None  # the slowest rank's write time of the last finished save
        self._saving: tuple[str, int] | None = None  # (url, step) of the save in flight

    @property
    def world_size(self) -> int:
        return self.actor_group.num_workers

    def start_save(self, url: str, step: int) -> None:
        # No folder made here: the handler makes it through its Storage (object stores need none).
        self._saving = (str(url), step)
        self.actor_group.call_all(
            "start_checkpoint", str(url), step, self.background, self.storage_options, timeout_s=self.timeout_s
        )

    def finish_save(self, wait: bool) -> dict[str, dict[str, Any]] | None:
        if not wait and not all(self.actor_group.call_all("checkpoint_written")):
            return None
        results = self.actor_group.call_all("finish_checkpoint", timeout_s=self.timeout_s)
        self.write_s = max(result["write_s"] for result in results)
        files: dict[str, dict[str, Any]] = {}
        for result in results:
            files.update(result["files"])
        url, step = self._saving
        files.update(self.after_write(url, step))
        return files

    def save(self, url: str, step: int) -> dict[str, dict[str, Any]]:
        """Start and finish a save in one call (benchmarks, tools)."""
        self.start_save(url, step)
        return self.finish_save(wait=True)

    def load(self, url: str) -> None:
        self.before_load(str(url))
        self.actor_group.call_all("load_checkpoint", str(url), self.storage_options, timeout_s=self.timeout_s)

    # -- what a backend may add ------------------------------------------------------------------

    def after_write(self, url: str, step: int) -> dict[str, dict[str, Any]]:
        """Files the driver writes under `url` once every rank's have been written; {name: {"size", "crc32"}}."""
        return {}

    def before_load(self, url: str) -> None:
        """Checks or notes before the ranks read `url`."""
