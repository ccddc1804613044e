"""DCP's files for both backends: torch.distributed.checkpoint on any store, written with every file's size and CRC-32,
and read without running arbitrary pickles (FSDP's checkpoints and megatron-core's `torch_dist` format).

Stock DCP reads `.metadata` with `pickle.load` and every non-tensor item with
`torch.load` with weights_only off: a crafted checkpoint could run code on load. Here `.metadata`
goes through an unpickler that admits only DCP's metadata classes and torch's dtype, Size and
layout, and items go through `torch.load(weights_only=True)`, on local disks and remote stores alike.

`StorageFileSystem` gives DCP's file hooks on a `rlrunner.storage.Storage`, so DCP writes and reads
any URL (s3://, gs://, ...) directly. Unlike DCP's own fsspec writer (whose files commit on close,
so a write that fails halfway still leaves a partial object), a file written through it appears
whole or not at all, and its size and CRC-32 are counted from the bytes as they are uploaded; on a local disk
`checksumming_writer` counts them the same way.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from rlrunner.storage import ChecksumWriter, FileRecord, Storage, basename, open_storage

METADATA_FILE = ".metadata"
_RENAMED_SUFFIX = ".tmp"  # DCP writes `.metadata.tmp`, then renames it to `.metadata`

_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeMetadataError(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeMetadataError(f"checkpoint metadata refers to {module}.{name}, which a DCP .metadata never needs")


def _unpickle_metadata(handle: BinaryIO) -> Metadata:
    metadata = _MetadataUnpickler(handle).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadataError("checkpoint .metadata does not hold DCP metadata")
    return metadata


def read_metadata(dcp_url: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> Metadata:
    """The DCP `.metadata` of a folder (local path or URL), through the restricted unpickler."""
    return SafeFileSystemReader(dcp_url, storage_options).read_metadata()


def saved_keys(dcp_url: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> list[str]:
    """The flattened keys (e.g. "model.lm_head.weight") stored in a DCP folder."""
    return sorted(read_metadata(dcp_url, storage_options).state_dict_metadata)


class StorageFileSystem(FileSystemBase):
    """DCP's file hooks on a Storage; `records` holds {file name: {size, crc32}} of every file written.

    Files are written with `Storage.open_write`: whole or not at all (an upload aborted on error).
    A `*.tmp` file (DCP's `.metadata.tmp`) is held in memory and written under its final name by
    `rename`, since object stores have no rename: one PUT is already atomic there.
    """

    def __init__(self, storage: Storage):
        self.storage = storage
        self.records: dict[str, dict[str, Any]] = {}
        self._held: dict[str, tuple[bytes, FileRecord]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        url = os.fspath(path)
        if mode == "rb":
            # Downloaded whole first, in one sequential read: DCP's torch.load of each item seeks back to the
            # item's zip directory, which on a remote file means a new ranged GET per seek (measured 3x slower).
            with tempfile.TemporaryDirectory(prefix="rlrunner-dcp-") as folder:
                local = os.path.join(folder, basename(url))
                self.storage.get_file(url, local)
                with open(local, "rb") as handle:
                    yield handle
        elif mode == "wb" and url.endswith(_RENAMED_SUFFIX):
            buffer = io.BytesIO()
            writer = ChecksumWriter(buffer, url)
            yield writer
            self._held[url] = (buffer.getvalue(), writer.record())
        elif mode == "wb":
            with self.storage.open_write(url) as writer:
                yield writer
            self.records[basename(url)] = writer.record().as_dict()
        else:
            raise ValueError(f"DCP opened {url} in mode {mode!r}; only 'rb' and 'wb' are supported")

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        url, new_url = os.fspath(path), os.fspath(new_path)
        if url not in self._held:
            raise NotImplementedError(
                f"{self.storage.protocol}:// storage cannot rename {url}: only files written as *.tmp"
            )
        data, record = self._held.pop(url)
        self.storage.write_bytes(new_url, data)
        self.records[basename(new_url)] = record.as_dict()

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return self.storage.join(os.fspath(path), suffix)

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str:
        return os.fspath(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        self.storage.makedirs(os.fspath(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked by DCP on its own: we always hand it the reader or writer

    def exists(self, path: str | os.PathLike) -> bool:
        return self.storage.exists(os.fspath(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        self.storage.delete(os.fspath(path))

    def ls(self, path: str | os.PathLike) -> list[str]:
        url = os.fspath(path)
        return [self.storage.join(url, name) for name in self.storage.list(url)]


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader for a local folder or any URL, reading `.metadata` through the restricted unpickler.

    Pair it with `SafeLoadPlanner`, which loads non-tensor items with `torch.load(weights_only=True)`.
    `storage`, an open Storage that holds `path`, saves opening another connection to the store.
    """

    def __init__(
        self, path: str | os.PathLike, storage_options: dict[str, Any] | None = None, storage: Storage | None = None
    ):
        if storage is None:
            storage = open_storage(path, storage_options)
            path = storage.url  # normalized: an absolute local path, or the URL without a trailing slash
        super().__init__(os.fspath(path))
        if not storage.is_local:  # local folders keep DCP's own file hooks
            self.fs = StorageFileSystem(storage)
            self.path = os.fspath(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self.fs.concat_path(self.path, METADATA_FILE), "rb") as handle:
            metadata = _unpickle_metadata(handle)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # In file order, so a remote file is read front to back through its read-ahead buffer, never seeking back.
        def position(item: Any) -> tuple[str, int]:
            info = self.storage_data[item.storage_index]
            return info.relative_path, info.offset

        return super().read_data(dataclasses.replace(plan, items=sorted(plan.items, key=position)), planner)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, with non-tensor items read by `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class _ChecksummingFileSystem(FileSystem):
    """DCP's local filesystem, recording {file name: size and CRC-32} of every file written through it."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, dict[str, Any]] = {}

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            counted = ChecksumWriter(stream, str(path))
            yield counted
        self.records[Path(path).name] = counted.record().as_dict()

    def rename(self, path, new_path) -> None:  # DCP writes .metadata.tmp, then renames it
        super().rename(path, new_path)
        if Path(path).name in self.records:
            self.records[Path(new_path).name] = self.records.pop(Path(path).name)


def checksumming_writer(url: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> FileSystemWriter:
    """DCP's writer of one file per rank under `url`, recording what it wrote in `writer.fs.records`.

    A local folder gets fsync'd files; a remote URL objects uploaded through the Storage (durable once
    each upload returns, so no fsync: DCP would call os.sync() for a stream without a file descriptor).
    """
    storage = open_storage(url, storage_options)
    writer = FileSystemWriter(
        storage.url, single_file_per_rank=True, sync_files=storage.is_local, thread_count=1, overwrite=True
    )
    if storage.is_local:
        writer.fs = _ChecksummingFileSystem()
    else:
        writer.fs = StorageFileSystem(storage)
        writer.path = storage.url  # not DCP's Path of it (Path("s3://b") is "s3:/b")
    return writer
