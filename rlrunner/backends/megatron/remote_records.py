"""Reading part of a torch.save file on an object store without downloading it whole.

A torch.save file is a zip: the pickled structure (`data.pkl`), a few small records, and one uncompressed record per
tensor storage (`<archive>/data/<index>`), then the central directory. `open_remote_file` copies everything but the
storages' bytes into a sparse local file (ranged reads: the central directory, each record's local header, the small
records), loads that memory-mapped (`files.load_file`: weights_only, with exactly its allowed classes), and returns
its content with a reader of any range of its tensors' elements, fetched from the store by a ranged read when asked
for. The tensors of the returned content stand on the holes of the sparse file: their shapes and dtypes are the
file's, their values are not (zeros); only the reader gives values. A data-parallel rank that loads its slice of a
tensor-parallel rank's `distrib_optim.pt` from a store so reads its own slice, not the file.
"""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
import zipfile
from typing import Any, BinaryIO, Callable

import torch

from rlrunner.backends.megatron.files import load_file
from rlrunner.storage import Storage

RangeReader = Callable[[torch.Tensor, int, int], torch.Tensor]  # (a tensor of the content, start, stop) -> values


def _is_storage_record(name: str) -> bool:
    folder, _, index = name.rpartition("/")
    return folder.endswith("/data") and index.isdigit()


def _write_skeleton(source: BinaryIO, target: BinaryIO) -> list[int]:
    """Copy the zip `source` into `target` (of the same size, sparse) but for its storage records' bytes; their data
    offsets."""
    size = source.seek(0, os.SEEK_END)
    archive = zipfile.ZipFile(source)
    target.truncate(size)
    offsets = []
    for info in archive.infolist():
        source.seek(info.header_offset)
        header = source.read(30)
        if header[:4] != b"PK\x03\x04":
            raise ValueError(f"{info.filename}: no zip local header at {info.header_offset}")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        data_offset = info.header_offset + 30 + name_len + extra_len
        stored = _is_storage_record(info.filename)
        if stored:
            offsets.append(data_offset)
        source.seek(info.header_offset)
        target.seek(info.header_offset)
        target.write(source.read(data_offset - info.header_offset + (0 if stored else info.compress_size)))
    source.seek(archive.start_dir)  # the central directory and the end records
    target.seek(archive.start_dir)
    target.write(source.read())
    return offsets


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors(value, out)
    return out


def open_remote_file(storage: Storage, url: str) -> tuple[Any, RangeReader]:
    """(the content of torch.save file `url`, whose tensors hold no values; a reader of elements [start, stop) of any
    1-D contiguous tensor of it, from the store). A file that is not a torch.save zip is a ValueError naming it."""
    handle, path = tempfile.mkstemp(prefix="rlrunner-megatron-", suffix=".pt")
    os.close(handle)
    try:
        with storage.open_read(url) as source, open(path, "r+b") as target:
            offsets = _write_skeleton(source, target)
        state = load_file(path, mmap=True)
    except (zipfile.BadZipFile, RuntimeError, EOFError, struct.error) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{url} cannot be read (truncated or corrupt?): {reason}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # the memory map made from it stays valid
    # every storage is a view of one map of the whole file: its place there is its record's data offset
    pointers = sorted({t.untyped_storage().data_ptr() for t in _tensors(state, []) if t.untyped_storage().nbytes()})
    base = pointers[0] - min(offsets) if pointers and offsets else 0
    if any(pointer - base not in offsets for pointer in pointers):
        raise ValueError(f"{url}: its tensors do not map onto its storage records")

    def read(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if tensor.dim() != 1 or not tensor.is_contiguous() or not 0 <= start <= stop <= tensor.numel():
            raise ValueError(f"{url}: elements {start}:{stop} of a tensor of shape {tuple(tensor.shape)}")
        size = tensor.element_size()
        offset = tensor.untyped_storage().data_ptr() - base + (tensor.storage_offset() + start) * size
        count = (stop - start) * size
        with storage.open_read(url) as source:
            source.seek(offset)
            data = source.read(count)
        if len(data) != count:
            raise ValueError(f"{url} ended {count - len(data)} bytes early (truncated?)")
        return torch.frombuffer(bytearray(data), dtype=tensor.dtype) if count else torch.empty(0, dtype=tensor.dtype)

    return state, read
