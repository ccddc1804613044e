"""Finding the checkpoint to resume from, and loading it: the reading side of an experiment's checkpoints.

`CheckpointReader` is the base of `CheckpointHandler` (handler.py, the writing side: save, commit, retain). The
newest complete checkpoint is found by verifying each `global_step_N` (status.py), never by trusting a name.
`runner.resume_dir` picks `auto` (the newest that verifies, its CRC-32s too with `runner.verify_checksums`), an
explicit folder (a local path or a URL on any store), or null (a fresh start, refused if the experiment already has
checkpoints). A checkpoint is accepted only if its config fingerprint matches this run's, and loaded only by the
backend that wrote it.
"""

from __future__ import annotations

import io
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from rlrunner.checkpoint import layout
from rlrunner.checkpoint.diagnostics import root_cause
from rlrunner.checkpoint.manager import CheckpointManager
from rlrunner.checkpoint.policy import fingerprint_differences
from rlrunner.checkpoint.status import (
    COMPLETE,
    CORRUPT,
    INCOMPLETE,
    CheckpointStatus,
    inspect_checkpoint,
    scan_checkpoints,
)
from rlrunner.errors import CheckpointError
from rlrunner.storage import Storage, basename, is_url, open_storage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint to resume from."""

    url: str
    step: int
    world_size: int
    manifest: dict[str, Any]
    storage: Storage

    @property
    def name(self) -> str:
        return basename(self.url)


class CheckpointReader:
    """An experiment's checkpoints, read: the newest complete one, the one to resume from, and its load."""

    def __init__(self, storage: Storage, experiment: str, fingerprint: dict[str, Any], verify_checksums: bool = True):
        self.storage = storage
        self.experiment = experiment
        self.root = layout.checkpoints_root(experiment)
        self.fingerprint = fingerprint
        self.verify_checksums = verify_checksums

    # -- discover ------------------------------------------------------------------------------

    def newest_complete(self) -> str | None:
        for status in scan_checkpoints(self.storage, self.root):
            if status.status == COMPLETE:
                return status.url
        return None

    # -- resume --------------------------------------------------------------------------------

    def find_resume(self, resume_dir: str | None) -> Checkpoint | None:
        """The checkpoint to resume from for `runner.resume_dir` (None: fresh start), or a CheckpointError."""
        if resume_dir is None:
            newest = self.newest_complete()
            if newest is not None:
                raise CheckpointError(
                    f"{self.experiment} already has checkpoints (newest {basename(newest)}) "
                    "and runner.resume_dir is null: "
                    "set runner.resume_dir=auto to continue, or choose another runner.experiment_name"
                )
            return None
        if resume_dir == "auto":
            return self._find_auto()
        return self._check_explicit(resume_dir)

    def _find_auto(self) -> Checkpoint | None:
        for status in scan_checkpoints(self.storage, self.root):
            if status.status == COMPLETE and self.verify_checksums:
                status = inspect_checkpoint(self.storage, status.url, checksums=True)
            if status.status == COMPLETE:
                logger.info("resuming from %s (step %d), the newest complete checkpoint", status.url, status.step)
                return self._accept(self.storage, status)
            logger.warning("skipping %s: %s (%s)", status.name, status.status, "; ".join(status.reasons))
        logger.info("runner.resume_dir=auto: no complete checkpoint in %s, starting fresh", self.root)
        return None

    def _check_explicit(self, resume_dir: str) -> Checkpoint:
        storage, url = self._resume_location(resume_dir)
        if not storage.exists(url):
            raise CheckpointError(f"runner.resume_dir does not exist: {resume_dir}")
        if not storage.is_dir(url):
            raise CheckpointError(f"runner.resume_dir is not a directory: {resume_dir}")
        status = inspect_checkpoint(storage, url, checksums=self.verify_checksums)
        if status.status == INCOMPLETE:
            hint = ""
            if layout.step_dirs(storage, url) or layout.step_dirs(storage, storage.join(url, layout.CHECKPOINTS_DIR)):
                hint = " (it holds global_step_* folders: name one of them, or use runner.resume_dir=auto)"
            raise CheckpointError(
                f"runner.resume_dir {resume_dir} is not a complete checkpoint: {status.reasons[0]}{hint}"
            )
        if status.status == CORRUPT:
            raise CheckpointError(f"runner.resume_dir {resume_dir} fails verification: {'; '.join(status.reasons)}")
        logger.info("resuming from %s (step %d)", url, status.step)
        return self._accept(storage, status)

    def _resume_location(self, resume_dir: str) -> tuple[Storage, str]:
        """The storage and URL of an explicit resume_dir: a local path (symlinks resolved) or a URL on any store."""
        if is_url(resume_dir):
            same_store = resume_dir.split("://", 1)[0].lower() == self.storage.protocol
            storage = self.storage if same_store else open_storage(resume_dir, self.storage.storage_options)
            return storage, resume_dir.rstrip("/")
        storage = self.storage if self.storage.is_local else open_storage(resume_dir)
        return storage, os.path.realpath(os.path.expanduser(resume_dir.removeprefix("file://")))

    def _accept(self, storage: Storage, status: CheckpointStatus) -> Checkpoint:
        manifest = status.manifest
        differences = fingerprint_differences(manifest["fingerprint"], self.fingerprint)
        if differences:
            raise CheckpointError(
                f"checkpoint {status.url} was saved with a different model/optimizer config: {', '.join(differences)}"
            )
        return Checkpoint(status.url, int(manifest["step"]), int(manifest["world_size"]), manifest, storage)

    def load(self, checkpoint: Checkpoint, manager: CheckpointManager) -> dict[str, Any]:
        """Load the backend's shards into the workers; returns the driver's state (`data/data.pt`, and the parts in
        files of their own: `layout.DATA_PART_FILES`)."""
        if checkpoint.manifest["backend"] != manager.backend:
            raise CheckpointError(
                f"checkpoint {checkpoint.url} was written by the {checkpoint.manifest['backend']} backend, "
                f"this run uses {manager.backend}"
            )
        if checkpoint.world_size != manager.world_size:
            logger.warning(
                "resharding %s from %d to %d actor ranks: model and optimizer are resharded, "
                "per-rank RNG states are not restored",
                checkpoint.name,
                checkpoint.world_size,
                manager.world_size,
            )
        storage = checkpoint.storage
        try:
            manager.load(storage.join(checkpoint.url, layout.ACTOR_DIR))
            listed = checkpoint.manifest["files"]
            names = [layout.DATA_FILE, *(name for name in layout.DATA_PART_FILES.values() if name in listed)]
            files = {
                name: torch.load(io.BytesIO(storage.read_bytes(storage.join(checkpoint.url, name))), weights_only=True)
                for name in names
            }
            return layout.join_data_state(files)
        except BaseException as exc:  # DCP raises CheckpointException, a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise CheckpointError(f"loading checkpoint {checkpoint.url} failed: {root_cause(exc)}") from exc
