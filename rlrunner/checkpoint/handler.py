"""The CheckpointHandler: decides when and where to save, commits, retains, cleans up and starts branches.

Finding the checkpoint to resume from (verified, its config checked) and loading it is its base class's,
`CheckpointReader` (resume.py). Commit protocol of `global_step_N` (a killed save never becomes a checkpoint):
  1. the backend's manager writes its shards under `<save folder>/actor/`, each file durable
     (fsync'd locally, a whole object on a store), possibly in the background (`begin_save`, then
     `finish_save` when every rank's write has finished); the handler writes `data/data.pt` (and
     `data/in_flight.pt` when an overlapped run has batches generated ahead) and any extra files;
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
from rlrunner.checkpoint.diagnostics import FULL_NOTE, free_space, root_cause
from rlrunner.checkpoint.manager import CheckpointManager
from rlrunner.checkpoint.manifest import build_manifest, relative_files, write_manifest
from rlrunner.checkpoint.policy import should_save, steps_to_delete
from rlrunner.checkpoint.resume import Checkpoint, CheckpointReader
from rlrunner.checkpoint.status import COMPLETE, scan_checkpoints
from rlrunner.errors import CheckpointSaveError, is_storage_full_or_forbidden
from rlrunner.storage import Storage, basename
from rlrunner.utils.fs import fsync_dir

logger = logging.getLogger(__name__)


@dataclass
class PendingSave:
    """A save begun and not yet committed: the folder it writes into and what the commit will write."""

    step: int
    folder: str  # a staging folder on local disks, `global_step_N` itself on object stores
    manager: CheckpointManager
    data_files: dict[str, bytes]  # data/data.pt and the driver's parts of their own, serialised when the save began
    write_extra: Callable[[str], None] | None
    extra_manifest: dict[str, Any]


class CheckpointHandler(CheckpointReader):
    """An experiment's checkpoints, written: saved on schedule, committed, retained, leftovers removed, branches."""

    def __init__(
        self,
        storage: Storage,
        experiment: str,
        save_interval: int,
        max_keep: int | None,
        fingerprint: dict[str, Any],
        verify_checksums: bool = True,
    ):
        super().__init__(storage, experiment, fingerprint, verify_checksums)
        self.save_interval = save_interval
        self.max_keep = max_keep

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
            return (
                f"runner.save_interval={self.save_interval}: periodic checkpoints are off "
                "(the last step is still saved)"
            )
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
        folder = (
            self._url(f"{layout.STAGING_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
            if self.stages_locally
            else self._url(name)
        )
        data_files = {file: _torch_bytes(part) for file, part in layout.split_data_state(data_state).items()}
        pending = PendingSave(step, folder, manager, data_files, write_extra, dict(extra_manifest or {}))
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
            for name, data in pending.data_files.items():
                files[name] = storage.write_bytes(storage.join(folder, name), data).as_dict()
            if pending.write_extra is not None:
                files.update(self._write_extra_files(folder, pending.write_extra))
            self._check_reported_files(folder, files)
            if storage.is_local:  # the files' directory entries (DCP fsyncs the files, not their folders)
                for sub in {storage.join(folder, name).rsplit("/", 1)[0] for name in files}:
                    fsync_dir(Path(sub))
            manager = pending.manager
            manifest = build_manifest(
                pending.step, manager.world_size, manager.backend, self.fingerprint, files, pending.extra_manifest
            )
            write_manifest(storage, folder, manifest)
            if self.stages_locally:
                self._commit_staged(folder, final)
        size = sum(r["size"] for r in files.values())
        write_s = getattr(manager, "write_s", None)
        if write_s:
            logger.info(
                "saved checkpoint %s (%.1f MB; shards written in %.2fs, %.2f GB/s)",
                final,
                size / 1e6,
                write_s,
                sum(r["size"] for r in actor_files.values()) / write_s / 1e9,
            )
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
            kept = (
                f"the newest complete checkpoint is still {basename(newest)}"
                if newest
                else "there is no complete checkpoint yet"
            )
            permanent = is_storage_full_or_forbidden(exc) or space.endswith(FULL_NOTE)
            name = layout.step_dir_name(pending.step)
            raise CheckpointSaveError(f"saving {name} failed: {root_cause(exc)} ({space}); {kept}", permanent) from exc

    def _remove_quietly(self, folder: str) -> None:
        try:
            self._delete_in_place(folder)
        except (
            Exception
        ) as exc:  # a leftover without a manifest is never a checkpoint, and is removed at the next start
            logger.warning("could not remove the unfinished save %s: %s", folder, exc)

    def _check_reported_files(self, folder: str, files: dict[str, dict[str, Any]]) -> None:
        """Every file a worker wrote must be visible here, at its size: catches a folder that is not shared."""
        present = relative_files(self.storage, folder)
        for name, record in files.items():
            if name not in present:
                raise CheckpointSaveError(
                    f"{name} was written by a worker but is not visible to the driver at "
                    f"{self.storage.join(folder, name)}: "
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

    # -- retain, clean up, branch --------------------------------------------------------------

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
                    logger.info(
                        "removing %s, left by a save or deletion that did not finish (%s)",
                        status.name,
                        status.reasons[0],
                    )
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
            url
            for url in layout.step_dirs(storage, self.root)
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
            checkpoint.name,
            checkpoint.step,
            ", ".join(moved),
            destination,
        )
        return moved


def _same_location_key(storage: Storage, url: str) -> str:
    """A comparable key for a checkpoint folder: the real path on local disks (symlinks resolved), else the URL."""
    return os.path.realpath(url) if storage.is_local else f"{storage.protocol}://{url.split('://', 1)[-1].rstrip('/')}"


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
