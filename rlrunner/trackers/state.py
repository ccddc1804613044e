"""`<log_dir>/trackers.json`: each tracker's run to continue after a resume, e.g. {"wandb": {"run_id": "..."}}."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TRACKERS_FILE = "trackers.json"


def read_state(log_dir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The saved entries; {} when there is no file, and (with a warning) when it cannot be read."""
    path = Path(log_dir) / TRACKERS_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s (%s): the trackers start new runs", path, exc)
        return {}
    if not isinstance(state, dict) or not all(isinstance(entry, dict) for entry in state.values()):
        logger.warning("ignoring %s (not an object of objects): the trackers start new runs", path)
        return {}
    return state


def write_state(log_dir: str | os.PathLike, state: dict[str, dict[str, Any]]) -> None:
    """Replace the file atomically (a crash leaves the old one or the new one, never half of one)."""
    path = Path(log_dir) / TRACKERS_FILE
    tmp = path.with_name(f".{TRACKERS_FILE}.{os.getpid()}.tmp")
    with tmp.open("w") as handle:
        json.dump(state, handle, indent=2, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
