"""The CheckpointHandler: decides when and where to save, commits, discovers, verifies and retains.

Commit protocol of `global_step_N` (a killed save never becomes a checkpoint):
  1. the backend's manager writes its shards under `<save folder>/actor/`, each file durable
     (fsync'd locally, a whole object on a store), possibly in the background (`begin_save`, then
     `finish_save` when every rank's write has finished); the handler writes `data/data.pt` and any
     extra files;
  2. the handler checks that every file is there with the size its writer reported;
  3. `manifest.json` is written last (atomically): files, sizes, CRC-32s, step, world size,
     backend, config fingerprint;
  4. on local disks the save folder is a staging folder `.tmp-global_step_N-<id>`, renamed to
     `global_step_N` and the parent fsync'd; on object stores (no rename) the save folder is
     `global_step_N` itself and the manifest is the commit;
  5. retention deletes the oldest complete checkpoints beyond `runner.max_ckpt_to_keep`
     (on object stores the manifest first, so a half-deleted folder never verifies).
A folder without a valid manifest is not a checkpoint; "latest" is found by verifying, never by
trusting a name. Every location is a URL string on a Storage (a local path is one too).
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from rlrunner.checkpoint import layout
from rlrunner.checkpoint.manager import CheckpointManager
from rlrunner.checkpoint.diagnostics import FULL_NOTE, free_space, root_cause
from rlrunner.checkpoint.manifest import build_manifest, relative_files, write_manifest
from rlrunner.checkpoint.policy import fingerprint_differences, should_save, steps_to_delete
from rlrunner.checkpoint.status import COMPLETE, CORRUPT, INCOMPLETE, CheckpointStatus, inspect_checkpoint, scan_checkpoints
from rlrunner.errors import CheckpointError, CheckpointSaveError, is_storage_full_or_forbidden
from rlrunner.storage import Storage, basename, is_url, open_storage
from rlrunner.utils.fs import fsync_dir

logger = logging.getLogger(__name__)

@dataclass
class PendingSave:
    """A save begun and not yet committed: the folder it writes into and what the commit will write."""

    step: int
    folder: str  # a staging folder on local disks, `global_step_N` itself on object stores
    manager: CheckpointManager
    data_bytes: bytes  # data/data.pt, serialised when the save began
    write_extra: Callable[[str], None] | None
    extra_manifest: dict[str, Any]


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


class CheckpointHandler:
    def __init__(
        self,
        storage: Storage,
        experiment: str,
        save_interval: int,
        max_keep: int | None,
        fingerprint: dict[str, Any],
        verify_checksums: bool = True,
    ):
        self.storage = storage
        self.experiment = experiment
        self.root = layout.checkpoints_root(experiment)
        self.save_interval = save_interval
        self.max_keep = max_keep
        self.fingerprint = fingerprint
        self.verify_checksums = verify_checksums

    @property
    def stages_locally(self) -> bool:
        """Local disks stage a save and rename it into place; stores without rename write in place."""
        return self.storage.supports_rename

    def _url(self, *parts: str) -> str:
        return self.storage.join(self.root, *parts)

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
        write_extra: Callable[[str], None] | None = None,
        extra_manifest: dict[str, Any] | None = None,
    ) -> str:
        """Write and commit `global_step_<step>`; on any failure nothing is committed and the error says so."""
        return self.finish_save(self.begin_save(step, manager, data_state, write_extra, extra_manifest), wait=True)

    def begin_save(
        self,
        step: int,
        manager: CheckpointManager,
        data_state: dict[str, Any],
        write_extra: Callable[[str], None] | None = None,
        extra_manifest: dict[str, Any] | None = None,
    ) -> PendingSave:
        """Start `global_step_<step>`; the manager may go on writing in the background.

        `write_extra(folder)` is called at the commit with a local folder whose files are added to the
        checkpoint (e.g. the HF config and tokenizer). Everything the commit needs from the driver (the
        data position, the manifest's extras) is taken now.
        """
        name = layout.step_dir_name(step)
        folder = self._url(f"{layout.STAGING_PREFIX}{name}-{uuid.uuid4().hex[:8]}") if self.stages_locally else self._url(name)
        pending = PendingSave(step, folder, manager, _torch_bytes(data_state), write_extra, dict(extra_manifest or {}))
        with self._failing_save(pending):
            if not self.stages_locally and self.storage.exists(folder):
                # Saving a step again on a store without rename: the old one stops being a checkpoint first.
                self._delete_in_place(folder)
            self.storage.makedirs(self.storage.join(folder, layout.ACTOR_DIR))
            manager.start_save(self.storage.join(folder, layout.ACTOR_DIR), step)
        return pending

    def finish_save(self, pending: PendingSave, wait: bool) -> str | None:
        """Commit `pending` once every rank's write has finished (waiting for it with `wait`); None if not yet.

        Only a committed checkpoint counts, and only after the commit may retention delete anything.
        """
        final = self._url(layout.step_dir_name(pending.step))
        storage = self.storage
        with self._failing_save(pending):
            actor_files = pending.manager.finish_save(wait)
            if actor_files is None:
                return None
            folder = pending.folder
            files = {f"{layout.ACTOR_DIR}/{name}": record for name, record in actor_files.items()}
            files[layout.DATA_FILE] = storage.write_bytes(storage.join(folder, layout.DATA_FILE), pending.data_bytes).as_dict()
            if pending.write_extra is not None:
                files.update(self._write_extra_files(folder, pending.write_extra))
            self._check_reported_files(folder, files)
            if storage.is_local:  # the files' directory entries (DCP fsyncs the files, not their folders)
                for sub in {storage.join(folder, name).rsplit("/", 1)[0] for name in files}:
                    fsync_dir(Path(sub))
            manager = pending.manager
            manifest = build_manifest(pending.step, manager.world_size, manager.backend, self.fingerprint, files, pending.extra_manifest)
            write_manifest(storage, folder, manifest)
            if self.stages_locally:
                self._commit_staged(folder, final)
        size = sum(r["size"] for r in files.values())
        write_s = getattr(manager, "write_s", None)
        if write_s:
            logger.info("saved checkpoint %s (%.1f MB; shards written in %.2fs, %.2f GB/s)", final, size / 1e6, write_s,
                        sum(r["size"] for r in actor_files.values()) / write_s / 1e9)
        else:
            logger.info("saved checkpoint %s (%.1f MB)", final, size / 1e6)
        self.apply_retention(keep=final)
        return final

    def _write_extra_files(self, folder: str, write_extra: Callable[[str], None]) -> dict[str, dict[str, Any]]:
        """Files a library writes into a local folder (save_pretrained), copied into the checkpoint durably."""
        records = {}
        with tempfile.TemporaryDirectory(prefix="rlrunner-extra-") as local:
            write_extra(local)
            for dirpath, _, names in os.walk(local):
                for file_name in names:
                    full = os.path.join(dirpath, file_name)
                    relative = os.path.relpath(full, local).replace(os.sep, "/")
                    records[relative] = self.storage.put_file(full, self.storage.join(folder, relative)).as_dict()
        return records

    @contextmanager
    def _failing_save(self, pending: PendingSave) -> Iterator[None]:
        """On any failure: nothing committed, the save's folder removed, one CheckpointSaveError naming the cause."""
        try:
            yield
        except BaseException as exc:
            space = free_space(self.storage, self.root)  # measured before the save's space is given back
            self._remove_quietly(pending.folder)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            newest = self.newest_complete()
            kept = f"the newest complete checkpoint is still {basename(newest)}" if newest else "there is no complete checkpoint yet"
            permanent = is_storage_full_or_forbidden(exc) or space.endswith(FULL_NOTE)
            name = layout.step_dir_name(pending.step)
            raise CheckpointSaveError(f"saving {name} failed: {root_cause(exc)} ({space}); {kept}", permanent) from exc

    def _remove_quietly(self, folder: str) -> None:
        try:
            self._delete_in_place(folder)
        except Exception as exc:  # a leftover without a manifest is never a checkpoint, and is removed at the next start
            logger.warning("could not remove the unfinished save %s: %s", folder, exc)

    def _check_reported_files(self, folder: str, files: dict[str, dict[str, Any]]) -> None:
        """Every file a worker wrote must be visible here, at its size: catches a folder that is not shared."""
        present = relative_files(self.storage, folder)
        for name, record in files.items():
            if name not in present:
                raise CheckpointSaveError(
                    f"{name} was written by a worker but is not visible to the driver at {self.storage.join(folder, name)}: "
                    "checkpoints must be on storage shared by every node"
                )
            if present[name] != record["size"]:
                raise CheckpointSaveError(f"{name} is {present[name]} bytes here, its writer reported {record['size']}")

    def _commit_staged(self, staging: str, final: str) -> None:
        storage = self.storage
        if storage.exists(final):
            # A step saved again (e.g. replayed after its first save was found corrupt): swap the new one in,
            # then drop the old. A crash between the two renames is repaired by remove_leftovers().
            replaced = self._url(f"{layout.REPLACED_PREFIX}{basename(final)}-{uuid.uuid4().hex[:8]}")
            storage.rename_dir(final, replaced)
            storage.rename_dir(staging, final)
            storage.delete_tree(replaced)
        else:
            storage.rename_dir(staging, final)

    # -- discover and retain -------------------------------------------------------------------

    def newest_complete(self) -> str | None:
        for status in scan_checkpoints(self.storage, self.root):
            if status.status == COMPLETE:
                return status.url
        return None

    def apply_retention(self, keep: str | None = None) -> None:
        """Delete the oldest complete checkpoints beyond `max_keep`; never `keep` (the one just committed)."""
        if self.max_keep is None:
            return
        complete = {s.step: s.url for s in scan_checkpoints(self.storage, self.root) if s.status == COMPLETE}
        for step in steps_to_delete(complete, self.max_keep):
            if complete[step] == keep:
                continue
            self.delete(complete[step])
            logger.info("deleted %s (runner.max_ckpt_to_keep=%d)", basename(complete[step]), self.max_keep)

    def delete(self, url: str) -> None:
        """Never leaves a half-deleted folder that verifies: renamed out of the namespace first on local disks,
        its manifest deleted first on stores without rename."""
        if self.stages_locally:
            trash = self._url(f"{layout.TRASH_PREFIX}{basename(url)}-{uuid.uuid4().hex[:8]}")
            self.storage.rename_dir(url, trash)
            self.storage.delete_tree(trash)
        else:
            self._delete_in_place(url)

    def _delete_in_place(self, url: str) -> None:
        self.storage.delete(self.storage.join(url, layout.MANIFEST_FILE))
        self.storage.delete_tree(url)

    def remove_leftovers(self) -> None:
        """Delete what killed saves and deletions left (only safe while holding the experiment lock).

        Local disks: staging, trash and replaced folders; a checkpoint that was being replaced when the run
        died is put back if its replacement never arrived. Stores without rename: `global_step_N` folders
        without a manifest (a save or deletion that did not finish).
        """
        storage = self.storage
        if not self.stages_locally:
            for status in scan_checkpoints(storage, self.root):
                if status.manifest is None:
                    logger.info("removing %s, left by a save or deletion that did not finish (%s)", status.name, status.reasons[0])
                    storage.delete_tree(status.url)
            return
        for leftover in layout.leftover_dirs(storage, self.root):
            original = layout.replaced_step_name(basename(leftover))
            if original is not None and not storage.exists(self._url(original)):
                storage.rename_dir(leftover, self._url(original))
                logger.info("restored %s, which a save that did not finish was replacing", original)
                continue
            logger.info("removing %s, left by a save or deletion that did not finish", basename(leftover))
            storage.delete_tree(leftover)

    def start_branch(self, checkpoint: Checkpoint) -> list[str]:
        """Move the checkpoints newer than an explicitly chosen one out of the way (never deleted).

        Resuming from an older checkpoint starts a new branch of the run: "newest complete", `auto` and
        retention must only ever see that branch. The old branch's newer folders go to
        `checkpoints/abandoned/<time>/`; returns their names.
        """
        storage = self.storage
        chosen = _same_location_key(checkpoint.storage, checkpoint.url)
        newer = [
            url for url in layout.step_dirs(storage, self.root)
            if _same_location_key(storage, url) != chosen and layout.step_from_name(basename(url)) >= checkpoint.step
        ]
        if not newer:
            return []
        stamp = time.strftime("%Y%m%d-%H%M%S")
        destination = self._url(layout.ABANDONED_DIR, stamp)
        while storage.exists(destination):  # two branches started within a second
            destination = self._url(layout.ABANDONED_DIR, f"{stamp}-{uuid.uuid4().hex[:4]}")
        moved = sorted((basename(url) for url in newer), key=layout.step_from_name)
        for name in moved:
            source, target = self._url(name), storage.join(destination, name)
            if self.stages_locally:
                storage.rename_dir(source, target)
            else:  # copied whole (manifest included) before the original stops being a checkpoint
                storage.copy_tree(source, target)
                self._delete_in_place(source)
        logger.warning(
            "resuming from %s (step %d) starts a new branch: moved the old branch's newer checkpoints %s to %s",
            checkpoint.name, checkpoint.step, ", ".join(moved), destination,
        )
        return moved

    # -- resume --------------------------------------------------------------------------------

    def find_resume(self, resume_dir: str | None) -> Checkpoint | None:
        """The checkpoint to resume from for `runner.resume_dir` (None: fresh start), or a CheckpointError."""
        if resume_dir is None:
            newest = self.newest_complete()
            if newest is not None:
                raise CheckpointError(
                    f"{self.experiment} already has checkpoints (newest {basename(newest)}) and runner.resume_dir is null: "
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
            raise CheckpointError(f"runner.resume_dir {resume_dir} is not a complete checkpoint: {status.reasons[0]}{hint}")
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
        """Load the backend's shards into the workers; returns the driver's data state (`data/data.pt`)."""
        if checkpoint.manifest["backend"] != manager.backend:
            raise CheckpointError(
                f"checkpoint {checkpoint.url} was written by the {checkpoint.manifest['backend']} backend, this run uses {manager.backend}"
            )
        if checkpoint.world_size != manager.world_size:
            logger.warning(
                "resharding %s from %d to %d actor ranks: model and optimizer are resharded, per-rank RNG states are not restored",
                checkpoint.name, checkpoint.world_size, manager.world_size,
            )
        storage = checkpoint.storage
        try:
            manager.load(storage.join(checkpoint.url, layout.ACTOR_DIR))
            data = storage.read_bytes(storage.join(checkpoint.url, layout.DATA_FILE))
            return torch.load(io.BytesIO(data), weights_only=True)
        except BaseException as exc:  # DCP raises CheckpointException, a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise CheckpointError(f"loading checkpoint {checkpoint.url} failed: {root_cause(exc)}") from exc


def _same_location_key(storage: Storage, url: str) -> str:
    """A comparable key for a checkpoint folder: the real path on local disks (symlinks resolved), else the URL."""
    return os.path.realpath(url) if storage.is_local else f"{storage.protocol}://{url.split('://', 1)[-1].rstrip('/')}"


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
