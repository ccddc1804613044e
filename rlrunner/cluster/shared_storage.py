"""Is the checkpoint folder the same folder on every node? A probe file written by the driver, read by every worker.

Each worker that sees the driver's probe writes one of its own, which the driver must see in turn.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Sequence

from rlrunner.errors import StorageNotSharedError


def answer_probe(directory: str, token: str, node: str) -> str | None:
    """Worker side: None when `node` sees the driver's probe in `directory` (and leaves its own), else why not."""
    probe = Path(directory) / f".probe-{token}"
    try:
        seen = probe.read_text()
    except OSError as exc:
        return f"node {node} cannot read {probe} ({exc.strerror or type(exc).__name__})"
    if seen != token:
        return f"node {node} reads other content in {probe}"
    (Path(directory) / f".probe-{token}-{node}-{os.getpid()}").write_text(token)
    return None


def check_shared_folder(folder: Path, groups: Sequence) -> None:
    """Driver side: raise StorageNotSharedError unless every worker of `groups` shares `folder` with the driver."""
    folder.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    (folder / f".probe-{token}").write_text(token)
    try:
        problems = [p for group in groups for p in group.call_all("probe_storage", str(folder), token) if p]
        expected = sum(group.num_workers for group in groups)
        seen = len(list(folder.glob(f".probe-{token}-*")))
        if not problems and seen != expected:
            problems.append(f"the driver sees {seen} of the {expected} probe files the workers wrote")
        if problems:
            raise StorageNotSharedError(
                f"the checkpoint folder {folder} is not the same folder on every node: {problems[0]}; "
                "put runner.output_dir on storage that every node mounts at the same path"
            )
    finally:
        for leftover in folder.glob(f".probe-{token}*"):
            leftover.unlink(missing_ok=True)
