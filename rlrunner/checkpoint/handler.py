"""The CheckpointHandler: decides when and where to save, commits, discovers, verifies and retains.

Commit protocol of `global_step_N` (a killed save never becomes a checkpoint):
  1. the backend's manager writes its shards into `checkpoints/.tmp-global_step_N-<id>/actor/`,
     each file fsync'd, possibly in the background (`begin_save`, then `finish_save` when every
     rank's write has finished); the handler writes `data/data.pt` and any extra files;
  2. the handler checks that every file is there with the size its writer reported;
  3. `manifest.json` is written last (atomically, fsync'd): files, sizes, CRC-32s, step, world size,
     backend, config fingerprint;
  4. the staging folder is renamed to `global_step_N` and the parent folder fsync'd;
  5. retention deletes the oldest complete checkpoints beyond `runner.max_ckpt_to_keep`.
A folder without a valid manifest is not a checkpoint; "latest" is found by verifying, never by
trusting a name.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from rlrunner.checkpoint import layout
from rlrunner.checkpoint.manager import CheckpointManager
from rlrunner.checkpoint.manifest import (
    ManifestError,
    build_manifest,
    file_record,
    read_manifest,
    relative_files,
    verify_files,
    write_manifest,
)
from rlrunner.checkpoint.policy import fingerprint_differences, should_save, steps_to_delete
from rlrunner.errors import CheckpointError, CheckpointSaveError, is_storage_full_or_forbidden
from rlrunner.utils.fs import atomic_write_bytes, fsync_dir, fsync_file

logger = logging.getLogger(__name__)

COMPLETE, INCOMPLETE, CORRUPT = "complete", "incomplete", "corrupt"


@dataclass
class CheckpointStatus:
    """What a folder under `checkpoints/` is: a complete checkpoint, or why it is not one."""

    path: Path
    status: str
    step: int | None
    size_bytes: int
    reasons: list[str] = field(default_factory=list)
    manifest: dict[str, Any] | None = None


def inspect_checkpoint(path: Path, checksums: bool) -> CheckpointStatus:
    """Verify one folder against its manifest (sizes always, CRC-32s when `checksums`)."""
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0
    try:
        manifest = read_manifest(path)
    except ManifestError as exc:
        return CheckpointStatus(path, INCOMPLETE, layout.step_from_name(path.name), size, [str(exc)])
    problems = verify_files(path, manifest, checksums)
    status = CORRUPT if problems else COMPLETE
    return CheckpointStatus(path, status, int(manifest["step"]), size, [str(p) for p in problems], manifest)


def scan_checkpoints(root: Path, checksums: bool = False) -> list[CheckpointStatus]:
    """Every `global_step_N` folder under `root`, newest first, with its status."""
    return [inspect_checkpoint(path, checksums) for path in layout.step_dirs(root)]


@dataclass
class PendingSave:
    """A save begun and not yet committed: its staging folder and what the commit will write."""

    step: int
    staging: Path
    manager: CheckpointManager
    data_bytes: bytes  # data/data.pt, serialised when the save began
    write_extra: Callable[[Path], None] | None
    extra_manifest: dict[str, Any]


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint to resume from."""

    path: Path
    step: int
    world_size: int
    manifest: dict[str, Any]


class CheckpointHandler:
    def __init__(
        self,
        experiment: Path,
        save_interval: int,
        max_keep: int | None,
        fingerprint: dict[str, Any],
        verify_checksums: bool = True,
    ):
        self.experiment = experiment
        self.root = layout.checkpoints_root(experiment)
        self.save_interval = save_interval
        self.max_keep = max_keep
        self.fingerprint = fingerprint
        self.verify_checksums = verify_checksums

    # -- when ----------------------------------------------------------------------------------

    def should_save(self, step: int, last_step: int) -> bool:
        return should_save(step, self.save_interval, last_step)

    def describe_schedule(self) -> str:
        if self.save_interval <= 0:
            return f"runner.save_interval={self.save_interval}: periodic checkpoints are off (the last step is still saved)"
        keep = "all" if self.max_keep is None else f"the newest {self.max_keep}"
        return f"checkpoints every {self.save_interval} steps and at the last step into {self.root} (keeping {keep})"

    # -- save ----------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        manager: CheckpointManager,
        data_state: dict[str, Any],
        write_extra: Callable[[Path], None] | None = None,
        extra_manifest: dict[str, Any] | None = None,
    ) -> Path:
        """Write and commit `global_step_<step>`; on any failure nothing is committed and the error says so."""
        return self.finish_save(self.begin_save(step, manager, data_state, write_extra, extra_manifest), wait=True)

    def begin_save(
        self,
        step: int,
        manager: CheckpointManager,
        data_state: dict[str, Any],
        write_extra: Callable[[Path], None] | None = None,
        extra_manifest: dict[str, Any] | None = None,
    ) -> PendingSave:
        """Start `global_step_<step>` in a staging folder; the manager may go on writing in the background.

        Everything the commit needs from the driver (the data position, the manifest's extras) is taken now.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f"{layout.STAGING_PREFIX}{layout.step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
        pending = PendingSave(step, staging, manager, _torch_bytes(data_state), write_extra, dict(extra_manifest or {}))
        with self._failing_save(pending):
            staging.mkdir()
            manager.start_save(staging / layout.ACTOR_DIR, step)
        return pending

    def finish_save(self, pending: PendingSave, wait: bool) -> Path | None:
        """Commit `pending` once every rank's write has finished (waiting for it with `wait`); None if not yet.

        Only a committed checkpoint counts, and only after the commit may retention delete anything.
        """
        final = self.root / layout.step_dir_name(pending.step)
        with self._failing_save(pending):
            actor_files = pending.manager.finish_save(wait)
            if actor_files is None:
                return None
            staging = pending.staging
            files = {f"{layout.ACTOR_DIR}/{name}": record for name, record in actor_files.items()}
            data_path = staging / layout.DATA_FILE
            data_path.parent.mkdir(parents=True)
            atomic_write_bytes(data_path, pending.data_bytes)
            if pending.write_extra is not None:
                pending.write_extra(staging)
            for name in relative_files(staging):
                if name not in files:  # written here (e.g. by save_pretrained), not by a worker: make it durable too
                    fsync_file(staging / name)
                    files[name] = file_record(staging / name)
            self._check_reported_files(staging, files)
            for folder in {staging / Path(name).parent for name in files}:
                fsync_dir(folder)
            manager = pending.manager
            manifest = build_manifest(pending.step, manager.world_size, manager.backend, self.fingerprint, files, pending.extra_manifest)
            write_manifest(staging, manifest)
            self._commit(staging, final)
        size = sum(r["size"] for r in files.values())
        write_s = getattr(manager, "write_s", None)
        if write_s:
            logger.info("saved checkpoint %s (%.1f MB; shards written in %.2fs, %.2f GB/s)", final, size / 1e6, write_s,
                        sum(r["size"] for r in actor_files.values()) / write_s / 1e9)
        else:
            logger.info("saved checkpoint %s (%.1f MB)", final, size / 1e6)
        self.apply_retention(keep=final)
        return final

    @contextmanager
    def _failing_save(self, pending: PendingSave) -> Iterator[None]:
        """On any failure: nothing committed, the staging folder removed, one CheckpointSaveError naming the cause."""
        try:
            yield
        except BaseException as exc:
            space = free_space(self.root)  # measured before the staging folder's space is given back
            shutil.rmtree(pending.staging, ignore_errors=True)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            newest = self.newest_complete()
            kept = f"the newest complete checkpoint is still {newest.name}" if newest else "there is no complete checkpoint yet"
            permanent = is_storage_full_or_forbidden(exc) or space.endswith(_FULL_NOTE)
            name = layout.step_dir_name(pending.step)
            raise CheckpointSaveError(f"saving {name} failed: {root_cause(exc)} ({space}); {kept}", permanent) from exc

    def _check_reported_files(self, staging: Path, files: dict[str, dict[str, Any]]) -> None:
        """Every file a worker wrote must be visible here, at its size: catches a folder that is not shared."""
        for name, record in files.items():
            path = staging / name
            if not path.is_file():
                raise CheckpointSaveError(
                    f"{name} was written by a worker but is not visible to the driver at {path}: "
                    "checkpoints must be on storage shared by every node"
                )
            if path.stat().st_size != record["size"]:
                raise CheckpointSaveError(f"{name} is {path.stat().st_size} bytes here, its writer reported {record['size']}")

    def _commit(self, staging: Path, final: Path) -> None:
        if final.exists():
            # A step saved again (e.g. replayed after its first save was found corrupt): swap the new one in,
            # then drop the old. A crash between the two renames is repaired by remove_leftovers().
            replaced = self.root / f"{layout.REPLACED_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, replaced)
            os.rename(staging, final)
            fsync_dir(self.root)
            shutil.rmtree(replaced, ignore_errors=True)
        else:
            os.rename(staging, final)
            fsync_dir(self.root)

    # -- discover and retain -------------------------------------------------------------------

    def newest_complete(self) -> Path | None:
        for status in scan_checkpoints(self.root):
            if status.status == COMPLETE:
                return status.path
        return None

    def apply_retention(self, keep: Path | None = None) -> None:
        """Delete the oldest complete checkpoints beyond `max_keep`; never `keep` (the one just committed)."""
        if self.max_keep is None:
            return
        complete = {s.step: s.path for s in scan_checkpoints(self.root) if s.status == COMPLETE}
        for step in steps_to_delete(complete, self.max_keep):
            if complete[step] == keep:
                continue
            self.delete(complete[step])
            logger.info("deleted %s (runner.max_ckpt_to_keep=%d)", complete[step].name, self.max_keep)

    def delete(self, path: Path) -> None:
        """Rename out of the namespace first, so a crash mid-delete leaves no half-checkpoint behind."""
        trash = self.root / f"{layout.TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, trash)
        fsync_dir(self.root)
        shutil.rmtree(trash, ignore_errors=True)

    def remove_leftovers(self) -> None:
        """Delete what killed saves and deletions left (only safe while holding the experiment lock).

        A checkpoint that was being replaced when the run died is put back if its replacement never arrived.
        """
        for leftover in layout.leftover_dirs(self.root):
            original = layout.replaced_step_name(leftover.name)
            if original is not None and not (self.root / original).exists():
                os.rename(leftover, self.root / original)
                fsync_dir(self.root)
                logger.info("restored %s, which a save that did not finish was replacing", original)
                continue
            logger.info("removing %s, left by a save or deletion that did not finish", leftover.name)
            shutil.rmtree(leftover, ignore_errors=True)

    def start_branch(self, checkpoint: Checkpoint) -> list[str]:
        """Move the checkpoints newer than an explicitly chosen one out of the way (never deleted).

        Resuming from an older checkpoint starts a new branch of the run: "newest complete", `auto` and
        retention must only ever see that branch. The old branch's newer folders go to
        `checkpoints/abandoned/<time>/`; returns their names.
        """
        newer = [
            path for path in layout.step_dirs(self.root)
            if path.resolve() != checkpoint.path.resolve() and layout.step_from_name(path.name) >= checkpoint.step
        ]
        if not newer:
            return []
        destination = self.root / layout.ABANDONED_DIR / time.strftime("%Y%m%d-%H%M%S")
        while destination.exists():  # two branches started within a second
            destination = destination.with_name(destination.name + "-" + uuid.uuid4().hex[:4])
        destination.mkdir(parents=True)
        for path in sorted(newer, key=lambda p: layout.step_from_name(p.name)):
            os.rename(path, destination / path.name)
        fsync_dir(destination)
        fsync_dir(self.root)
        moved = sorted((p.name for p in newer), key=layout.step_from_name)
        logger.warning(
            "resuming from %s (step %d) starts a new branch: moved the old branch's newer checkpoints %s to %s",
            checkpoint.path.name, checkpoint.step, ", ".join(moved), destination,
        )
        return moved

    # -- resume --------------------------------------------------------------------------------

    def find_resume(self, resume_dir: str | None) -> Checkpoint | None:
        """The checkpoint to resume from for `runner.resume_dir` (None: fresh start), or a CheckpointError."""
        if resume_dir is None:
            newest = self.newest_complete()
            if newest is not None:
                raise CheckpointError(
                    f"{self.experiment} already has checkpoints (newest {newest.name}) and runner.resume_dir is null: "
                    "set runner.resume_dir=auto to continue, or choose another runner.experiment_name"
                )
            return None
        if resume_dir == "auto":
            return self._find_auto()
        return self._check_explicit(resume_dir)

    def _find_auto(self) -> Checkpoint | None:
        for status in scan_checkpoints(self.root):
            if status.status == COMPLETE and self.verify_checksums:
                status = inspect_checkpoint(status.path, checksums=True)
            if status.status == COMPLETE:
                logger.info("resuming from %s (step %d), the newest complete checkpoint", status.path, status.step)
                return self._accept(status)
            logger.warning("skipping %s: %s (%s)", status.path.name, status.status, "; ".join(status.reasons))
        logger.info("runner.resume_dir=auto: no complete checkpoint in %s, starting fresh", self.root)
        return None

    def _check_explicit(self, resume_dir: str) -> Checkpoint:
        given = Path(resume_dir).expanduser()
        if not given.exists():
            raise CheckpointError(f"runner.resume_dir does not exist: {resume_dir}")
        path = given.resolve()
        if not path.is_dir():
            raise CheckpointError(f"runner.resume_dir is not a directory: {resume_dir}")
        status = inspect_checkpoint(path, checksums=self.verify_checksums)
        if status.status == INCOMPLETE:
            hint = ""
            if layout.step_dirs(path) or layout.step_dirs(path / layout.CHECKPOINTS_DIR):
                hint = " (it holds global_step_* folders: name one of them, or use runner.resume_dir=auto)"
            raise CheckpointError(f"runner.resume_dir {resume_dir} is not a complete checkpoint: {status.reasons[0]}{hint}")
        if status.status == CORRUPT:
            raise CheckpointError(f"runner.resume_dir {resume_dir} fails verification: {'; '.join(status.reasons)}")
        logger.info("resuming from %s (step %d)", path, status.step)
        return self._accept(status)

    def _accept(self, status: CheckpointStatus) -> Checkpoint:
        manifest = status.manifest
        differences = fingerprint_differences(manifest["fingerprint"], self.fingerprint)
        if differences:
            raise CheckpointError(
                f"checkpoint {status.path} was saved with a different model/optimizer config: {', '.join(differences)}"
            )
        return Checkpoint(status.path, int(manifest["step"]), int(manifest["world_size"]), manifest)

    def load(self, checkpoint: Checkpoint, manager: CheckpointManager) -> dict[str, Any]:
        """Load the backend's shards into the workers; returns the driver's data state (`data/data.pt`)."""
        if checkpoint.manifest["backend"] != manager.backend:
            raise CheckpointError(
                f"checkpoint {checkpoint.path} was written by the {checkpoint.manifest['backend']} backend, this run uses {manager.backend}"
            )
        if checkpoint.world_size != manager.world_size:
            logger.warning(
                "resharding %s from %d to %d actor ranks: model and optimizer are resharded, per-rank RNG states are not restored",
                checkpoint.path.name, checkpoint.world_size, manager.world_size,
            )
        try:
            manager.load(checkpoint.path / layout.ACTOR_DIR)
            return torch.load(checkpoint.path / layout.DATA_FILE, weights_only=True)
        except BaseException as exc:  # DCP raises CheckpointException, a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise CheckpointError(f"loading checkpoint {checkpoint.path} failed: {root_cause(exc)}") from exc


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


_NEARLY_FULL_BYTES = 64 << 20
_FULL_NOTE = ": the disk is probably full"


def free_space(path: Path) -> str:
    """How much room is left where checkpoints go: libraries do not always pass ENOSPC on as such."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return f"free space of {path} unknown"
    note = f"{human_bytes(free)} free on the disk holding {path}"
    return f"{note}{_FULL_NOTE}" if free < _NEARLY_FULL_BYTES else note


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def root_cause(exc: BaseException) -> str:
    """The innermost error's one-line description, through Ray's and DCP's wrapping (first failing rank)."""
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        return f"rank {rank}: {root_cause(inner)}"
    cause = getattr(exc, "cause", None) or exc.__cause__
    if cause is not None and cause is not exc:
        return root_cause(cause)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
