"""Storage: one small interface over local disks and fsspec stores (s3://, gs://, hdfs://, ...). URLs are strings.

    storage = open_storage("s3://bucket/runs", {"client_kwargs": {"endpoint_url": ...}})
    url = storage.join(storage.url, "exp", "checkpoints")
    storage.list(url, dirs_only=True); storage.write_bytes(storage.join(url, "x"), b"...")

A local path (absolute, relative, `~`) or `file://` URL opens a LocalStorage (fsync'd atomic writes, atomic
directory rename); anything else a FsspecStorage. Never build remote URLs with pathlib (`s3://b` -> `s3:/b`).
Knows nothing of checkpoints: the checkpoint handler and managers sit on top of it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import re
from typing import Any, Mapping

from rlrunner.errors import ConfigError, first_line
from rlrunner.storage.base import ChecksumWriter, FileRecord, Storage, basename, join, parent
from rlrunner.storage.local import LocalStorage, local_path

logger = logging.getLogger(__name__)

__all__ = [
    "open_storage",
    "Storage",
    "FileRecord",
    "ChecksumWriter",
    "join",
    "parent",
    "basename",
    "is_url",
    "add_storage_options_argument",
]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://(.*)$", re.S)
_COLLAPSED = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+:/(?!/)")  # `s3:/bucket`: what pathlib makes of `s3://bucket`
_LOCAL_PROTOCOLS = {"file", "local"}


def is_url(text: str) -> bool:
    """Whether `text` names a remote store (`proto://...` other than `file://`), not a local path."""
    match = _URL.match(text)
    return bool(match) and match.group(1).lower() not in _LOCAL_PROTOCOLS


def open_storage(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> Storage:
    """The Storage for `url`; ConfigError (one line) for a malformed URL or a protocol whose package is missing.

    `storage_options` go to the fsspec filesystem (e.g. s3fs: `key`, `secret`, `client_kwargs.endpoint_url`);
    without them credentials and endpoints come from the usual places (AWS_* variables, ~/.aws). Listing and
    instance caches are always off: a checkpoint discovery must never see a stale listing.
    """
    text = os.fspath(url) if isinstance(url, os.PathLike) else url
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"a storage location must be a non-empty path or URL, got {url!r}")
    text = text.strip()
    options = dict(storage_options or {})
    if "::" in text:
        raise ConfigError(
            f"{text}: chained fsspec URLs (caches) are not supported for checkpoints; give the store's own URL"
        )
    match = _URL.match(text)
    if match is None:
        if _COLLAPSED.match(text):
            raise ConfigError(
                f"{text} looks like a URL that lost a slash (pathlib turns s3://b into s3:/b): "
                f"write {text.replace(':/', '://', 1)}"
            )
        return LocalStorage(local_path(text), options)
    protocol, rest = match.group(1).lower(), match.group(2)
    if protocol in _LOCAL_PROTOCOLS:
        if not (rest.startswith("/") or rest.startswith("localhost/")):
            raise ConfigError(f"{text}: a file URL needs an absolute path, as in file:///abs/path")
        return LocalStorage(local_path("file://" + rest), options)
    if not rest.strip("/"):
        raise ConfigError(f"{text}: the URL names no bucket or host")
    cls = _filesystem_class(protocol, text)
    options = _without_caches(cls, options)
    try:
        fs = cls(**{**cls._get_kwargs_from_urls(text), **options})
    except Exception as exc:
        hint = _fsspec_hint(protocol) if isinstance(exc, (ImportError, OSError)) else ""  # e.g. HDFS's libjvm
        raise ConfigError(
            f"{text}: cannot open the {protocol}:// filesystem ({type(exc).__name__}: {first_line(str(exc))}){hint}"
        ) from exc
    from rlrunner.storage.remote import FsspecStorage, share_botocore_data  # fsspec's imports only for a store

    share_botocore_data(fs)
    return FsspecStorage(text.rstrip("/"), protocol, fs, options)


def _fsspec_hint(protocol: str) -> str:
    from fsspec.registry import known_implementations

    err = known_implementations.get(protocol, {}).get("err")
    return f"; fsspec says: {err}" if err else ""


def _filesystem_class(protocol: str, url: str) -> type:
    from fsspec.registry import get_filesystem_class, known_implementations

    try:
        return get_filesystem_class(protocol)
    except ValueError:
        raise ConfigError(
            f"{url}: fsspec knows no protocol '{protocol}://' (see fsspec.available_protocols())"
        ) from None
    except ImportError as exc:
        known = known_implementations.get(protocol, {})
        package = known.get("class", "").split(".", 1)[0]
        if package in ("", "fsspec"):  # a class inside fsspec: what is missing is the module it imports
            missing = getattr(exc.__cause__, "name", None) or getattr(exc, "name", None)
            package = (missing or "").split(".", 1)[0]
        advice = f"pip install {package}" if package else "install its fsspec implementation"
        raise ConfigError(
            f"{url}: the {protocol}:// protocol needs a package that is not installed: {advice}{_fsspec_hint(protocol)}"
        ) from None


def _without_caches(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """Turn off fsspec's listings cache (a stale listing could hide or resurrect a checkpoint) and its instance
    cache (an instance shared with code that turned listings caching on)."""
    if options.get("use_listings_cache"):
        logger.warning("storage_options.use_listings_cache is ignored: checkpoint discovery needs fresh listings")
    parameters = inspect.signature(cls.__init__).parameters
    if "use_listings_cache" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        options["use_listings_cache"] = False
    options["skip_instance_cache"] = True
    return options


def _json_object(text: str) -> dict[str, Any]:
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(options).__name__}")
    return options


def add_storage_options_argument(parser: argparse.ArgumentParser, *names: str) -> None:
    """`--storage_options '<json>'` for a CLI that takes URLs: `args.storage_options` is a dict ({} by default);
    argparse reports bad JSON as a usage error (exit 2)."""
    parser.add_argument(
        *(names or ("--storage_options",)),
        dest="storage_options",
        type=_json_object,
        default={},
        metavar="JSON",
        help='options for the fsspec filesystem of a URL, e.g. \'{"client_kwargs": {"endpoint_url": "..."}}\' '
        "(credentials otherwise come from the usual places: AWS_* variables, ~/.aws)",
    )
