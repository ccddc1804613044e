"""The manifest: written last into a checkpoint, it is what makes a folder a checkpoint.

It lists every file with its size and CRC-32, the step, the world size, the backend and the
fingerprint of the config that shapes the model and optimizer. Verification compares the
folder against it: sizes only (cheap, for listing) or sizes and checksums (before a resume).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

from rlrunner.checkpoint.layout import MANIFEST_FILE
from rlrunner.storage import Storage

FORMAT = "rlrunner.checkpoint"
VERSION = 1


def file_record(storage: Storage, url: str) -> dict[str, Any]:
    """{"size": bytes, "crc32": "8 hex digits"} of a file, read in chunks (constant memory)."""
    return storage.checksum(url).as_dict()


def relative_files(storage: Storage, folder: str) -> dict[str, int]:
    """{relative POSIX path: size} of every file under `folder` (the manifest excluded), from one listing."""
    return {name: size for name, size in storage.walk(folder).items() if name != MANIFEST_FILE}


def build_manifest(
    step: int,
    world_size: int,
    backend: str,
    fingerprint: dict[str, Any],
    files: dict[str, dict[str, Any]],
    extra: dict[str, Any],
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


def write_manifest(storage: Storage, folder: str, manifest: dict[str, Any]) -> None:
    """Atomic and durable: a local write is fsync'd and renamed into place, an object store's PUT is all or nothing."""
    storage.write_bytes(storage.join(folder, MANIFEST_FILE), json.dumps(manifest, indent=1, sort_keys=True).encode())


class ManifestError(Exception):
    """The manifest is missing, unreadable or malformed: the folder is not a (complete) checkpoint."""


def read_manifest(storage: Storage, folder: str) -> dict[str, Any]:
    """The folder's manifest, checked for shape and types; ManifestError says why it is not one."""
    try:
        raw = storage.read_bytes(storage.join(folder, MANIFEST_FILE))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise ManifestError("no manifest.json (the save did not finish)") from None
    try:
        manifest = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"manifest.json is unreadable ({type(exc).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ManifestError("manifest.json is not an rlrunner checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise ManifestError(
            f"manifest.json has version {manifest.get('version')}, this rlrunner reads version {VERSION}"
        )
    for key in ("step", "world_size", "backend", "fingerprint", "files"):
        if key not in manifest:
            raise ManifestError(f"manifest.json lacks '{key}'")
    _check_types(manifest)
    return manifest


_CRC32 = re.compile(r"^[0-9a-f]{8}$")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is_int(value: Any) -> bool:
    # JSON true/false load as bool, which Python counts as int: a step of `true` is still wrong.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(manifest: dict[str, Any], key: str, minimum: int) -> None:
    value = manifest[key]
    if not _is_int(value):
        raise ManifestError(f"manifest.json: '{key}' must be an integer, got {_type_name(value)}")
    if value < minimum:
        raise ManifestError(f"manifest.json: '{key}' must be >= {minimum}, got {value}")


def _check_file_name(name: str) -> None:
    # Names are joined onto the checkpoint folder when verifying: keep them inside it.
    parts = name.split("/")
    if not name or name.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise ManifestError(
            f"manifest.json: 'files' has a name that is not a relative path inside the checkpoint: {name!r}"
        )


def _check_file_record(name: str, record: Any) -> None:
    if not isinstance(record, dict):
        raise ManifestError(f"manifest.json: 'files' entry {name!r} must be an object, got {_type_name(record)}")
    size, crc = record.get("size"), record.get("crc32")
    if not _is_int(size) or size < 0:
        shown = size if _is_int(size) else _type_name(size)
        raise ManifestError(
            f"manifest.json: 'files' entry {name!r} must have a non-negative integer 'size', got {shown}"
        )
    if not isinstance(crc, str) or not _CRC32.match(crc):
        shown = repr(crc) if isinstance(crc, str) else _type_name(crc)
        raise ManifestError(f"manifest.json: 'files' entry {name!r} must have a 'crc32' of 8 hex digits, got {shown}")


def _check_types(manifest: dict[str, Any]) -> None:
    """Raise ManifestError naming the first field whose type or value the readers of a manifest cannot use."""
    _check_int(manifest, "step", 0)
    _check_int(manifest, "world_size", 1)
    backend = manifest["backend"]
    if not isinstance(backend, str) or not backend:
        shown = repr(backend) if isinstance(backend, str) else _type_name(backend)
        raise ManifestError(f"manifest.json: 'backend' must be a non-empty string, got {shown}")
    if not isinstance(manifest["fingerprint"], dict):
        raise ManifestError(
            f"manifest.json: 'fingerprint' must be an object, got {_type_name(manifest['fingerprint'])}"
        )
    files = manifest["files"]
    if not isinstance(files, dict):
        raise ManifestError(f"manifest.json: 'files' must be an object, got {_type_name(files)}")
    for name, record in files.items():
        _check_file_name(name)
        _check_file_record(name, record)


@dataclass(frozen=True)
class Problem:
    """One way a checkpoint folder differs from its manifest."""

    file: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


def verify_files(
    storage: Storage, folder: str, manifest: dict[str, Any], checksums: bool, present: dict[str, int] | None = None
) -> list[Problem]:
    """Problems found (empty when the folder matches its manifest). Sizes come from one listing of the folder
    (`present`, {relative path: size}, when the caller has listed it already)."""
    problems = []
    present = storage.walk(folder) if present is None else present
    for name, expected in manifest["files"].items():
        if name not in present:
            problems.append(Problem(name, "missing"))
            continue
        size = present[name]
        if size != expected["size"]:
            problems.append(
                Problem(name, f"{size} bytes, the manifest says {expected['size']} (truncated or rewritten)")
            )
            continue
        if checksums:
            actual = file_record(storage, storage.join(folder, name))["crc32"]
            if actual != expected["crc32"]:
                problems.append(Problem(name, f"checksum {actual}, the manifest says {expected['crc32']} (corrupted)"))
    return problems
