"""The Storage interface, the checksumming writer, URL helpers and error naming shared by the backends."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, BinaryIO, ContextManager, Iterator

CHUNK = 8 << 20  # bytes per read when streaming


@dataclass(frozen=True)
class FileRecord:
    """Size and CRC-32 (zlib's IEEE CRC, as 8 hex digits) of a file's bytes."""

    size: int
    crc32: str

    @classmethod
    def of(cls, data: bytes | bytearray | memoryview) -> "FileRecord":
        return cls(len(data), f"{zlib.crc32(data):08x}")

    def as_dict(self) -> dict[str, Any]:
        return {"size": self.size, "crc32": self.crc32}


class ChecksumWriter:
    """Wraps a binary stream: counts the size and CRC-32 of the bytes as they pass, so no one reads them back.

    What `Storage.open_write` yields; it can also wrap any writable binary stream.
    """

    def __init__(self, stream: Any, url: str | None = None):
        self._stream = stream
        self._url = url
        self._crc = 0
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):  # a raw stream may take only part of it
                taken = self._stream.write(view[done:])
                done = len(view) if taken is None else done + taken
        except OSError as exc:
            if self._url is None:
                raise
            raise with_url(exc, self._url)
        self._crc = zlib.crc32(view, self._crc)
        self.size += len(view)
        return len(view)

    def record(self) -> FileRecord:
        return FileRecord(self.size, f"{self._crc:08x}")

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self._stream.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def fileno(self) -> int:
        """The underlying file's descriptor, so writers can fsync it (AttributeError where there is none, e.g. S3)."""
        return self._stream.fileno()

    def close(self) -> None:  # the underlying stream is closed by whoever opened it
        pass


def join(base: str, *parts: str) -> str:
    """`base/part/...` with single slashes; parts are relative ('..' is refused). Keeps the URL's protocol."""
    segments = [s for part in parts for s in part.split("/") if s]
    if ".." in segments:
        raise ValueError(f"'..' in a storage path: {parts}")
    return "/".join([base.rstrip("/")] + segments) if segments else base


def basename(url: str) -> str:
    """The last segment of a URL or path (`global_step_5` of `s3://b/run/checkpoints/global_step_5/`)."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def parent(url: str) -> str:
    """The URL one level up; a bucket or `/` is its own parent."""
    stripped = url.rstrip("/")
    head, sep, _ = stripped.rpartition("/")
    if not sep or head.endswith(":/") or head.endswith(":"):  # `s3://bucket`, `file:`
        return stripped or url
    return head or "/"


def with_url(exc: OSError, url: str) -> OSError:
    """The same kind of OSError (same errno) whose message names `url`; raise it inside `except` to keep the original
    as context."""
    if url in str(exc):
        return exc
    code = exc.errno if isinstance(exc.errno, int) else None
    if isinstance(exc, FileNotFoundError):
        code = errno.ENOENT
    detail = exc.strerror or str(exc)
    if not detail or detail.strip("'\"[]") in url:  # the backend's message is only its own form of the path
        detail = os.strerror(code) if code else type(exc).__name__
    try:
        return type(exc)(code, detail, url) if code else type(exc)(f"{detail}: {url}")
    except Exception:  # a subclass with another constructor
        return OSError(code, detail, url) if code else OSError(f"{detail}: {url}")


@contextlib.contextmanager
def naming(url: str) -> Iterator[None]:
    """Errors from a storage backend come out as OSErrors whose message names `url` (FileNotFoundError when missing)."""
    try:
        yield
    except OSError as exc:
        raise with_url(exc, url)
    except Exception as exc:  # a library's own error (e.g. botocore's): keep its words, add the URL
        raise OSError(errno.EIO, f"{type(exc).__name__}: {str(exc).strip()}", url)


class Storage(ABC):
    """One filesystem, addressed by URL strings (`s3://bucket/key`, `/abs/path`). Get one with `open_storage`.

    Every method takes full URLs on this storage (build them with `join`). Missing files raise
    FileNotFoundError; other failures raise OSError naming the URL. A "folder" on an object store is
    a key prefix: it exists while some object is under it, and `list`/`walk` of a missing folder are empty.
    """

    protocol: str = "file"
    is_local: bool = False
    supports_exclusive_create: bool = False

    def __init__(self, url: str, storage_options: dict[str, Any]):
        self.url = url  # the root it was opened with, normalized
        self.storage_options = storage_options  # as a fsspec filesystem takes them (e.g. for DCP's FsspecWriter)

    @property
    def supports_rename(self) -> bool:
        """Whether `rename_dir` exists: atomic directory rename (local disks only)."""
        return self.is_local

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __reduce__(self):  # pickles as (url, options): a worker re-opens its own connection
        from rlrunner.storage import open_storage

        return open_storage, (self.url, self.storage_options)

    def join(self, base: str, *parts: str) -> str:
        return join(base, *parts)

    # -- what is there --------------------------------------------------------------------------

    @abstractmethod
    def exists(self, url: str) -> bool:
        """Whether a file or a (non-empty, on object stores) folder is at `url`."""

    @abstractmethod
    def is_dir(self, url: str) -> bool:
        """Whether `url` is a folder (on object stores: a prefix with objects under it)."""

    @abstractmethod
    def list(self, url: str, dirs_only: bool = False) -> list[str]:
        """Sorted names of the children of folder `url` (files and folders, hidden ones too); [] if there is none."""

    @abstractmethod
    def walk(self, url: str) -> dict[str, int]:
        """Every file under folder `url`, recursively: {relative POSIX path: size in bytes}, sorted; {} if none."""

    @abstractmethod
    def size(self, url: str) -> int:
        """Size in bytes of file `url`."""

    def modified(self, url: str) -> float | None:
        """When file `url` was last written, in seconds by the *store's* clock (None where it keeps no time).

        Only differences of two such times mean anything (a naive timestamp's zone cancels out)."""
        return None

    # -- read and write -------------------------------------------------------------------------

    @abstractmethod
    def read_bytes(self, url: str) -> bytes:
        """The whole content of file `url`."""

    @abstractmethod
    def write_bytes(self, url: str, data: bytes) -> FileRecord:
        """Replace `url` with `data`, atomically and durably (readers see the old or the new file, never a part)."""

    def write_if_absent(self, url: str, data: bytes) -> bool:
        """Create `url` with `data` only if nothing is there; True if this call created it. One winner among racers.

        Only where `supports_exclusive_create`; elsewhere NotImplementedError.
        """
        raise NotImplementedError(f"{self.protocol}:// storage has no conditional create ({url})")

    @abstractmethod
    def open_read(self, url: str) -> ContextManager[BinaryIO]:
        """A binary file open for (streaming, seekable) reading."""

    @abstractmethod
    def open_write(self, url: str) -> ContextManager[ChecksumWriter]:
        """A streaming writer for `url` that counts size and CRC-32 (`.record()`).

        The file appears whole when the `with` block ends without error, and not at all if it raises.
        """

    def checksum(self, url: str) -> FileRecord:
        """Size and CRC-32 of file `url`, read in chunks."""
        crc = size = 0
        with self.open_read(url) as handle:
            while chunk := handle.read(CHUNK):
                crc = zlib.crc32(chunk, crc)
                size += len(chunk)
        return FileRecord(size, f"{crc:08x}")

    def put_file(self, local_path: str, url: str) -> FileRecord:
        """Upload (copy) local file `local_path` to `url`, whole or not at all."""
        with open(local_path, "rb") as source, self.open_write(url) as target:
            shutil.copyfileobj(source, target, CHUNK)
        return target.record()

    def get_file(self, url: str, local_path: str) -> None:
        """Download (copy) `url` to the local file `local_path`, replacing it whole."""
        tmp = os.path.join(
            os.path.dirname(os.path.abspath(local_path)), f".{os.path.basename(local_path)}.{uuid.uuid4().hex[:8]}.tmp"
        )
        try:
            with self.open_read(url) as source, open(tmp, "wb") as target:
                shutil.copyfileobj(source, target, CHUNK)
            os.replace(tmp, local_path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    # -- folders and deletion -------------------------------------------------------------------

    @abstractmethod
    def makedirs(self, url: str) -> None:
        """Create folder `url` and its parents (nothing to do on object stores, where folders are implied)."""

    @abstractmethod
    def delete(self, url: str) -> None:
        """Delete file `url`; a missing file is not an error (so cleanup can be repeated)."""

    @abstractmethod
    def delete_tree(self, url: str) -> None:
        """Delete folder `url` and everything under it; a missing folder is not an error."""

    def copy_tree(self, source: str, target: str) -> None:
        """Copy every file under folder `source` to the same relative path under `target` (streamed, each file
        whole)."""
        for name in self.walk(source):
            with self.open_read(join(source, name)) as reader, self.open_write(join(target, name)) as writer:
                shutil.copyfileobj(reader, writer, CHUNK)

    def rename_dir(self, source: str, target: str) -> None:
        """Atomically rename folder `source` to `target` (which must not exist). Only where `supports_rename`."""
        raise NotImplementedError(f"{self.protocol}:// storage has no atomic rename ({source})")
