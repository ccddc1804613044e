"""Object stores and other fsspec filesystems (s3://, gs://, az://, hdfs://, ...)."""

from __future__ import annotations

import contextlib
import errno
import functools
import time
from datetime import datetime
from typing import Any, BinaryIO, Iterator

from fsspec.core import split_protocol
from fsspec.spec import AbstractBufferedFile

from rlrunner.errors import exception_chain
from rlrunner.storage.base import ChecksumWriter, FileRecord, Storage, naming

# No real folders (a folder is a key prefix), no rename, a single PUT (or multipart upload) is atomic per object.
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oci", "oss"})
# Conditional create through fsspec's pipe_file(mode="create"): s3fs sends `If-None-Match: *` on PutObject
# (and on CompleteMultipartUpload); gcsfs sends `ifGenerationMatch=0` (marked experimental by gcsfs).
EXCLUSIVE_CREATE = frozenset({"s3", "s3a", "gs", "gcs"})
_CONFLICT_RETRIES = 5


def share_botocore_data(fs: Any) -> None:
    """Give an s3fs filesystem the botocore session s3fs would make for it (`fs.kwargs`: a profile, say), but reading
    botocore's data files (the endpoints, the S3 API's model) through the process's one loader. s3fs makes a session
    per filesystem and each session parsed those files again, where a run opens a filesystem for every save and
    every check of a store (shared: 0.27x the CPU of an open, benchmarks/bench_s3_open.py). The files are read-only
    data, keyed by botocore's data path; credentials and configuration stay each session's own. Other filesystems are
    left as they are, as is an s3fs filesystem that already has a session."""
    if type(fs).__module__.split(".")[0] != "s3fs" or getattr(fs, "session", False) is not None:
        return
    from aiobotocore.session import AioSession

    session = AioSession(**getattr(fs, "kwargs", {}))
    session.register_component("data_loader", _botocore_loader(session.get_config_variable("data_path")))
    fs.session = session


@functools.lru_cache(maxsize=None)
def _botocore_loader(data_path: str | None) -> Any:
    from botocore.loaders import create_loader

    return create_loader(data_path)


class FsspecStorage(Storage):
    def __init__(self, url: str, protocol: str, fs: Any, storage_options: dict[str, Any]):
        super().__init__(url, storage_options)
        self.fs = fs
        self.protocol = protocol
        own = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self._protocols = {protocol, *own}
        self.is_object_store = protocol in OBJECT_STORES
        self.supports_exclusive_create = protocol in EXCLUSIVE_CREATE

    def _path(self, url: str) -> str:
        if split_protocol(url)[0] not in self._protocols:
            raise ValueError(f"{url} is not on the {self.protocol}:// storage {self.url}")
        return self.fs._strip_protocol(url).rstrip("/")

    def _ensure_parent(self, path: str) -> None:
        if not self.is_object_store and "/" in path:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)

    def exists(self, url: str) -> bool:
        path = self._path(url)
        with naming(url):
            return self.fs.exists(path)

    def is_dir(self, url: str) -> bool:
        path = self._path(url)
        with naming(url):
            return self.fs.isdir(path)

    def list(self, url: str, dirs_only: bool = False) -> list[str]:
        path = self._path(url)
        try:
            with naming(url):
                entries = self.fs.ls(path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        children: dict[str, bool] = {}
        for entry in entries:
            name = entry["name"].rstrip("/")
            child = name[len(path) + 1 :] if name.startswith(path + "/") else ""
            if child and "/" not in child:  # not the file itself, nor a folder marker
                children[child] = children.get(child, False) or entry.get("type") == "directory"
        return sorted(name for name, is_dir in children.items() if is_dir or not dirs_only)

    def walk(self, url: str) -> dict[str, int]:
        path = self._path(url)
        try:
            with naming(url):
                found = self.fs.find(path, detail=True)
        except FileNotFoundError:
            return {}
        files = {
            name[len(path) + 1 :]: int(info["size"])
            for name, info in found.items()
            if name.startswith(path + "/") and not name.endswith("/") and info.get("type", "file") == "file"
        }
        return dict(sorted(files.items()))

    def size(self, url: str) -> int:
        path = self._path(url)
        with naming(url):
            info = self.fs.info(path)
            if info.get("type") == "directory":
                raise IsADirectoryError(errno.EISDIR, "Is a directory", url)
            return int(info["size"])

    def modified(self, url: str) -> float | None:
        try:
            value = self.fs.modified(self._path(url))  # S3: the object's LastModified
        except (NotImplementedError, IsADirectoryError, KeyError, FileNotFoundError):
            return None
        if isinstance(value, datetime):
            return value.timestamp()
        return float(value) if isinstance(value, (int, float)) else None

    def read_bytes(self, url: str) -> bytes:
        path = self._path(url)
        with naming(url):
            return self.fs.cat_file(path)

    def write_bytes(self, url: str, data: bytes) -> FileRecord:
        """One PutObject on object stores (a multipart upload above 100 MB, also atomic per object)."""
        path = self._path(url)
        with naming(url):
            self._ensure_parent(path)
            self.fs.pipe_file(path, data)
        return FileRecord.of(data)

    def write_if_absent(self, url: str, data: bytes) -> bool:
        if not self.supports_exclusive_create:
            return super().write_if_absent(url, data)
        path = self._path(url)
        for attempt in range(_CONFLICT_RETRIES):
            try:
                with naming(url):
                    self.fs.pipe_file(path, data, mode="create")
                return True
            except FileExistsError:  # s3fs and gcsfs map the 412 of If-None-Match to it
                return False
            except OSError as exc:
                codes = _error_codes(exc)
                if "PreconditionFailed" in codes or "412" in codes:  # servers that omit the failed condition's name
                    return False
                if "ConditionalRequestConflict" in codes and attempt + 1 < _CONFLICT_RETRIES:
                    time.sleep(0.1 * 2**attempt)  # S3's 409: a racing conditional write is in flight; retry
                    continue
                raise
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def open_read(self, url: str) -> Iterator[BinaryIO]:
        path = self._path(url)
        with naming(url):
            handle = self.fs.open(path, "rb")
        with handle:
            yield handle

    @contextlib.contextmanager
    def open_write(self, url: str) -> Iterator[ChecksumWriter]:
        """On object stores the object appears at the end (PutObject, or CompleteMultipartUpload for large ones);
        on an error the upload is aborted, so no partial object is ever visible."""
        path = self._path(url)
        with naming(url):
            self._ensure_parent(path)
            handle = self.fs.open(path, "wb")
        try:
            yield ChecksumWriter(handle, url)
        except BaseException:
            self._abort(handle, path)
            raise
        with naming(url):
            handle.close()

    def _abort(self, handle: Any, path: str) -> None:
        if isinstance(handle, AbstractBufferedFile):
            with contextlib.suppress(Exception):
                handle.discard()  # s3fs: abort the multipart upload
            handle.closed = True  # so that neither close() nor __del__ commits the part written so far
            return
        with contextlib.suppress(Exception):
            handle.close()
        with contextlib.suppress(Exception):
            self.fs.rm_file(path)

    def makedirs(self, url: str) -> None:
        path = self._path(url)
        if not self.is_object_store:  # s3fs would create a *bucket* for a bare bucket name
            with naming(url):
                self.fs.makedirs(path, exist_ok=True)

    def delete(self, url: str) -> None:
        path = self._path(url)
        with contextlib.suppress(FileNotFoundError), naming(url):
            self.fs.rm_file(path)

    def copy_tree(self, source: str, target: str) -> None:
        """Server-side copies (S3 CopyObject), one object at a time: nothing passes through this machine."""
        for name in self.walk(source):
            src, dst = self._path(self.join(source, name)), self._path(self.join(target, name))
            with naming(self.join(source, name)):
                self._ensure_parent(dst)
                self.fs.copy(src, dst)

    def delete_tree(self, url: str) -> None:
        path = self._path(url)
        if self.is_object_store and "/" not in path:
            raise ValueError(f"refusing to delete a whole bucket: {url}")
        with contextlib.suppress(FileNotFoundError), naming(url):
            self.fs.rm(path, recursive=True)


def _error_codes(exc: BaseException) -> set[str]:
    """The service error codes and HTTP statuses (botocore's `response`) anywhere in `exc`'s chain."""
    codes = set()
    for err in exception_chain(exc):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            codes.add(str(response.get("Error", {}).get("Code")))
            codes.add(str(response.get("ResponseMetadata", {}).get("HTTPStatusCode")))
    return codes
