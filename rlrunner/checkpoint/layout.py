"""Names in the checkpoint folder (the layout contract), with no I/O beyond listing a directory.

    <runner.output_dir>/<runner.experiment_name>/checkpoints/
      global_step_N/          a committed checkpoint (it has a manifest)
      .tmp-global_step_N-*    a save in progress, or one that was killed: never a checkpoint
      .trash-*                a checkpoint being deleted
      .replaced-global_step_N-*  the previous global_step_N while a new save of step N is swapped in
      abandoned/<time>/global_step_N   checkpoints of a branch left when a run resumed from an older one

Folders are URLs on a Storage (local paths are just another store); the dot-folders exist on local disks only,
where a save is staged and renamed into place. On object stores a save writes `global_step_N/` directly and
the manifest, written last, is the commit.
"""

from __future__ import annotations

import re

from rlrunner.storage import Storage, open_storage

CHECKPOINTS_DIR = "checkpoints"
STEP_PREFIX = "global_step_"
STAGING_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
REPLACED_PREFIX = ".replaced-"
ABANDONED_DIR = "abandoned"
MANIFEST_FILE = "manifest.json"
ACTOR_DIR = "actor"
DATA_FILE = "data/data.pt"
# Parts of the driver's state written to files of their own beside data.pt, and only when not empty (a checkpoint
# without one loads the part as {}): the batches an overlapped run generated ahead of its step (algorithm.policy_lag).
DATA_PART_FILES = {"in_flight": "data/in_flight.pt"}
HF_DIR = "huggingface"  # the HF config and tokenizer (no weights), beside a backend's actor files
ACTOR_HF_DIR = f"{ACTOR_DIR}/{HF_DIR}"

_STEP_NAME = re.compile(rf"^{STEP_PREFIX}(\d+)$")


def split_data_state(state: dict) -> dict[str, dict]:
    """The driver's state as {file in the checkpoint: what it holds}: data.pt, and each non-empty part of its own."""
    files = {DATA_FILE: {name: part for name, part in state.items() if name not in DATA_PART_FILES}}
    for name, file in DATA_PART_FILES.items():
        if state.get(name):
            files[file] = state[name]
    return files


def join_data_state(files: dict[str, dict]) -> dict:
    """The driver's state back from `files` ({file: its contents}, the checkpoint has no file of an empty part)."""
    return {**files[DATA_FILE], **{name: files.get(file, {}) for name, file in DATA_PART_FILES.items()}}


def experiment_url(output_dir: str, experiment_name: str, storage_options: dict | None = None) -> tuple[Storage, str]:
    """The storage holding `output_dir` and the experiment folder's URL on it (an absolute path when local)."""
    storage = open_storage(output_dir, storage_options)
    return storage, storage.join(storage.url, experiment_name)


def checkpoints_root(experiment: str) -> str:
    return f"{experiment.rstrip('/')}/{CHECKPOINTS_DIR}"


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def step_from_name(name: str) -> int | None:
    """The N of `global_step_N`, for listing and messages only: a checkpoint's real step is its manifest's."""
    match = _STEP_NAME.match(name)
    return int(match.group(1)) if match else None


def step_dirs(storage: Storage, root: str) -> list[str]:
    """URLs of the `global_step_N` folders under `root`, newest (largest N) first."""
    found = [name for name in storage.list(root, dirs_only=True) if step_from_name(name) is not None]
    return [storage.join(root, name) for name in sorted(found, key=step_from_name, reverse=True)]


def leftover_dirs(storage: Storage, root: str) -> list[str]:
    """Staging and trash folders: what a killed save or deletion left behind (local disks only)."""
    prefixes = (STAGING_PREFIX, TRASH_PREFIX, REPLACED_PREFIX)
    return [storage.join(root, name) for name in storage.list(root, dirs_only=True) if name.startswith(prefixes)]


def replaced_step_name(name: str) -> str | None:
    """`global_step_N` for a `.replaced-global_step_N-<id>` folder, else None."""
    if not name.startswith(REPLACED_PREFIX):
        return None
    return name[len(REPLACED_PREFIX) :].rsplit("-", 1)[0]
