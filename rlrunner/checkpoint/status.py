"""What a folder under `checkpoints/` is: a complete checkpoint, or why it is not one (verified against its
manifest)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlrunner.checkpoint import layout
from rlrunner.checkpoint.manifest import ManifestError, read_manifest, verify_files
from rlrunner.storage import Storage, basename

COMPLETE, INCOMPLETE, CORRUPT = "complete", "incomplete", "corrupt"


@dataclass
class CheckpointStatus:
    """What a folder under `checkpoints/` is: a complete checkpoint, or why it is not one."""

    url: str
    status: str
    step: int | None
    size_bytes: int
    reasons: list[str] = field(default_factory=list)
    manifest: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return basename(self.url)


def inspect_checkpoint(storage: Storage, url: str, checksums: bool) -> CheckpointStatus:
    """Verify one folder against its manifest (sizes always, CRC-32s when `checksums`)."""
    present = storage.walk(url)  # one listing for the size and the verification (a request per call on a store)
    size = sum(present.values())
    try:
        manifest = read_manifest(storage, url)
    except ManifestError as exc:
        return CheckpointStatus(url, INCOMPLETE, layout.step_from_name(basename(url)), size, [str(exc)])
    problems = verify_files(storage, url, manifest, checksums, present)
    status = CORRUPT if problems else COMPLETE
    return CheckpointStatus(url, status, int(manifest["step"]), size, [str(p) for p in problems], manifest)


def scan_checkpoints(storage: Storage, root: str, checksums: bool = False) -> list[CheckpointStatus]:
    """Every `global_step_N` folder under `root`, newest first, with its status."""
    return [inspect_checkpoint(storage, url, checksums) for url in layout.step_dirs(storage, root)]
