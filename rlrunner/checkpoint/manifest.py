"""The manifest: written last into a checkpoint, it is what makes a folder a checkpoint.

It lists every file with its size and CRC-32, the step, the world size, the backend and the
fingerprint of the config that shapes the model and optimizer. Verification compares the
folder against it: sizes only (cheap, for listing) or sizes and checksums (before a resume).
"""

from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlrunner.checkpoint.layout import MANIFEST_FILE
from rlrunner.utils.fs import atomic_write_bytes

FORMAT = "rlrunner.checkpoint"
VERSION = 1
_CHUNK = 8 << 20


def file_record(path: Path) -> dict[str, Any]:
    """{"size": bytes, "crc32": "8 hex digits"} of a file, read in chunks (constant memory)."""
    crc = 0
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"size": size, "crc32": f"{crc:08x}"}


def relative_files(folder: Path) -> list[str]:
    """Every file under `folder`, as sorted POSIX paths relative to it (the manifest excluded)."""
    files = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            relative = Path(dirpath, name).relative_to(folder).as_posix()
            if relative != MANIFEST_FILE:
                files.append(relative)
    return sorted(files)


def build_manifest(
    step: int, world_size: int, backend: str, fingerprint: dict[str, Any], files: dict[str, dict[str, Any]], extra: dict[str, Any]
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "world_size": world_size,
        "backend": backend,
        "created_unix": time.time(),
        "fingerprint": fingerprint,
        "files": dict(sorted(files.items())),
        **extra,
    }


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    atomic_write_bytes(folder / MANIFEST_FILE, json.dumps(manifest, indent=1, sort_keys=True).encode())


class ManifestError(Exception):
    """The manifest is missing or unreadable: the folder is not a (complete) checkpoint."""


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError("no manifest.json (the save did not finish)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"manifest.json is unreadable ({type(exc).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ManifestError("manifest.json is not an rlrunner checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise ManifestError(f"manifest.json has version {manifest.get('version')}, this rlrunner reads version {VERSION}")
    for key in ("step", "world_size", "backend", "fingerprint", "files"):
        if key not in manifest:
            raise ManifestError(f"manifest.json lacks '{key}'")
    return manifest


@dataclass(frozen=True)
class Problem:
    """One way a checkpoint folder differs from its manifest."""

    file: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


def verify_files(folder: Path, manifest: dict[str, Any], checksums: bool) -> list[Problem]:
    """Problems found (empty when the folder matches its manifest). Stops reading a file at its first fault."""
    problems = []
    for name, expected in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            problems.append(Problem(name, "missing"))
            continue
        size = path.stat().st_size
        if size != expected["size"]:
            problems.append(Problem(name, f"{size} bytes, the manifest says {expected['size']} (truncated or rewritten)"))
            continue
        if checksums:
            actual = file_record(path)["crc32"]
            if actual != expected["crc32"]:
                problems.append(Problem(name, f"checksum {actual}, the manifest says {expected['crc32']} (corrupted)"))
    return problems
