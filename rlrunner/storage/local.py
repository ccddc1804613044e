"""Local (and mounted network) disks: plain paths, fsync'd writes, atomic renames, O_EXCL-style creates."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import BinaryIO, Iterator

from rlrunner.storage.base import ChecksumWriter, FileRecord, Storage, naming
from rlrunner.utils.fs import atomic_write_bytes, fsync_dir

# errnos of filesystems without hard links (some FUSE and SMB mounts): fall back to O_EXCL
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK, errno.EXDEV}


def local_path(url: str) -> str:
    """An absolute path for a local path or `file://` URL (`~` expanded, symlinks kept)."""
    if url.startswith("file://"):
        url = url[len("file://") :]
        if url.startswith("localhost/"):
            url = url[len("localhost") :]
    return os.path.abspath(os.path.expanduser(url))


def _tmp_beside(path: str) -> str:
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.{uuid.uuid4().hex[:8]}.tmp")


class LocalStorage(Storage):
    protocol = "file"
    is_local = True
    supports_exclusive_create = True

    def _path(self, url: str) -> str:
        if "://" in url and not url.startswith("file://"):
            raise ValueError(f"{url} is not on the local storage {self.url}")
        return local_path(url)

    def exists(self, url: str) -> bool:
        return os.path.exists(self._path(url))

    def is_dir(self, url: str) -> bool:
        return os.path.isdir(self._path(url))

    def list(self, url: str, dirs_only: bool = False) -> list[str]:
        path = self._path(url)
        try:
            with naming(url), os.scandir(path) as entries:
                return sorted(e.name for e in entries if not dirs_only or e.is_dir())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def walk(self, url: str) -> dict[str, int]:
        root = self._path(url)
        found = {}
        with naming(url):
            for dirpath, _, names in os.walk(root):
                for name in names:
                    full = os.path.join(dirpath, name)
                    if os.path.isfile(full):
                        found[os.path.relpath(full, root).replace(os.sep, "/")] = os.path.getsize(full)
        return dict(sorted(found.items()))

    def size(self, url: str) -> int:
        path = self._path(url)
        with naming(url):
            if os.path.isdir(path):
                raise IsADirectoryError(errno.EISDIR, "Is a directory", url)
            return os.stat(path).st_size

    def modified(self, url: str) -> float | None:
        try:
            return os.stat(self._path(url)).st_mtime
        except FileNotFoundError:
            return None

    def read_bytes(self, url: str) -> bytes:
        with naming(url), open(self._path(url), "rb") as handle:
            return handle.read()

    def write_bytes(self, url: str, data: bytes) -> FileRecord:
        path = self._path(url)
        with naming(url):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write_bytes(Path(path), data)
        return FileRecord.of(data)

    def write_if_absent(self, url: str, data: bytes) -> bool:
        """Written whole to a temporary file, then hard-linked into place: link(2) fails if the name exists,
        so exactly one racer wins and no one ever sees a partial file. Without hard links: O_CREAT|O_EXCL."""
        path = self._path(url)
        if os.path.lexists(path):  # the common lost race, without writing anything
            return False
        with naming(url):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = _tmp_beside(path)
            try:
                with open(tmp, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.link(tmp, path)
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in _NO_HARD_LINKS:
                    raise
                return self._create_exclusive(path, data)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            fsync_dir(Path(path).parent)
        return True

    @staticmethod
    def _create_exclusive(path: str, data: bytes) -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        fsync_dir(Path(path).parent)
        return True

    @contextlib.contextmanager
    def open_read(self, url: str) -> Iterator[BinaryIO]:
        with naming(url):
            handle = open(self._path(url), "rb")
        with handle:
            yield handle

    @contextlib.contextmanager
    def open_write(self, url: str) -> Iterator[ChecksumWriter]:
        """Streams into a temporary file beside `url`; on success fsync, rename into place, fsync the folder."""
        path = self._path(url)
        tmp = _tmp_beside(path)
        with naming(url):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            handle = open(tmp, "wb")
        try:
            writer = ChecksumWriter(handle, url)
            yield writer
            with naming(url):
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()
                os.replace(tmp, path)
                fsync_dir(Path(path).parent)
        finally:
            handle.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def makedirs(self, url: str) -> None:
        with naming(url):
            os.makedirs(self._path(url), exist_ok=True)

    def delete(self, url: str) -> None:
        with contextlib.suppress(FileNotFoundError), naming(url):
            os.unlink(self._path(url))

    def delete_tree(self, url: str) -> None:
        with contextlib.suppress(FileNotFoundError), naming(url):
            shutil.rmtree(self._path(url))

    def rename_dir(self, source: str, target: str) -> None:
        """os.rename, then fsync of the folders whose entries changed. Refuses an existing `target`."""
        src, dst = self._path(source), self._path(target)
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "File exists", target)
        with naming(source):
            if not os.path.isdir(src):
                raise (
                    NotADirectoryError(errno.ENOTDIR, "Not a directory", source)
                    if os.path.exists(src)
                    else FileNotFoundError(errno.ENOENT, "No such file or directory", source)
                )
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.rename(src, dst)
            fsync_dir(Path(dst).parent)
            if os.path.dirname(src) != os.path.dirname(dst):
                fsync_dir(Path(src).parent)
