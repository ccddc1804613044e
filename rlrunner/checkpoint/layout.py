"""Names in the checkpoint folder (the layout contract), with no I/O beyond listing a directory.

    <runner.output_dir>/<runner.experiment_name>/checkpoints/
      global_step_N/          a committed checkpoint (it has a manifest)
      .tmp-global_step_N-*    a save in progress, or one that was killed: never a checkpoint
      .trash-*                a checkpoint being deleted
      .replaced-global_step_N-*  the previous global_step_N while a new save of step N is swapped in
      abandoned/<time>/global_step_N   checkpoints of a branch left when a run resumed from an older one
"""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINTS_DIR = "checkpoints"
STEP_PREFIX = "global_step_"
STAGING_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
REPLACED_PREFIX = ".replaced-"
ABANDONED_DIR = "abandoned"
MANIFEST_FILE = "manifest.json"
ACTOR_DIR = "actor"
DATA_FILE = "data/data.pt"
HF_DIR = "actor/huggingface"

_STEP_NAME = re.compile(rf"^{STEP_PREFIX}(\d+)$")


def experiment_dir(output_dir: str | Path, experiment_name: str) -> Path:
    return Path(output_dir).expanduser().resolve() / experiment_name


def checkpoints_root(experiment: Path) -> Path:
    return experiment / CHECKPOINTS_DIR


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def step_from_name(name: str) -> int | None:
    """The N of `global_step_N`, for listing and messages only: a checkpoint's real step is its manifest's."""
    match = _STEP_NAME.match(name)
    return int(match.group(1)) if match else None


def step_dirs(root: Path) -> list[Path]:
    """The `global_step_N` folders under `root`, newest (largest N) first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_from_name(p.name) is not None]
    return sorted(found, key=lambda p: step_from_name(p.name), reverse=True)


def leftover_dirs(root: Path) -> list[Path]:
    """Staging and trash folders: what a killed save or deletion left behind."""
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and p.name.startswith((STAGING_PREFIX, TRASH_PREFIX, REPLACED_PREFIX))]


def replaced_step_name(name: str) -> str | None:
    """`global_step_N` for a `.replaced-global_step_N-<id>` folder, else None."""
    if not name.startswith(REPLACED_PREFIX):
        return None
    return name[len(REPLACED_PREFIX):].rsplit("-", 1)[0]
