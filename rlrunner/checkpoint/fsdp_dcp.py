"""Rank-side save and load of an FSDP2 model, its optimizer and LR scheduler with torch.distributed.checkpoint.

Each rank writes its own shard file (`__<rank>_0.distcp`); rank 0 also writes `.metadata`. Every
rank stores its own RNG states under `rng.rank_<r>`, and gets them back when the checkpoint was
saved with the same number of ranks (with another number, DCP reshards the model and optimizer,
and the per-rank RNG has no meaning, so it is left as it is).

The folder is a local path or any URL (s3://, gs://, ...): every rank writes its shard straight to
the store, so no node needs a shared disk. Local folders use DCP's file writer (fsync'd files); a
remote store goes through `StorageFileSystem` (each object whole or not at all).

A save can run in the background (`ShardSaver.start(..., background=True)`): the state is copied
off the training tensors first (pinned host memory on GPU, a host copy on CPU), then DCP writes (or
uploads) the copy in a thread, with its collectives on a gloo group of their own so they never
interleave with training's. Every file's size and CRC-32 are computed from the bytes as they are
written, never by reading them back.
"""

from __future__ import annotations

import io
import logging
import os
import random
import re
import time
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rlrunner.checkpoint.safe_dcp import SafeFileSystemReader, SafeLoadPlanner, StorageFileSystem, saved_keys
from rlrunner.storage import ChecksumWriter, open_storage

logger = logging.getLogger(__name__)

_RNG_KEY = re.compile(r"^rng\.rank_(\d+)\.")


def capture_rng() -> dict[str, Any]:
    """This process's RNG states, as tensors and plain tuples (loadable with weights_only=True)."""
    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def saved_world_size(dcp_url: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> int:
    """How many ranks wrote the checkpoint, from the per-rank RNG keys in its metadata."""
    return _ranks_saved(saved_keys(dcp_url, storage_options))


def _ranks_saved(keys) -> int:
    return len({int(m.group(1)) for key in keys if (m := _RNG_KEY.match(key))})


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


def fsdp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, rank: int) -> dict[str, Any]:
    """The state DCP saves: model and optimizer shards, the LR scheduler, this rank's RNG states."""
    return {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "scheduler": scheduler.state_dict(),
        "rng": {f"rank_{rank}": capture_rng()},
    }


class ShardSaver:
    """One rank's save in flight (at most one): started, then finished (waited for, or polled)."""

    def __init__(self, process_group=None):
        self.process_group = process_group  # a gloo group of the actor ranks for checkpoint collectives only
        self._future: Future | None = None
        self._writer: FileSystemWriter | None = None
        self._started = 0.0
        self._write_s: float | None = None
        self._stager: DefaultStager | None = None  # kept: its host (pinned on GPU) buffers are reused by every save

    @property
    def written(self) -> bool:
        """Whether the save in flight is done writing (or failed): `finish` will not wait."""
        if self._future is None:
            raise RuntimeError("no checkpoint save in flight on this rank")
        return self._future.done()

    def start(
        self, url: str, state: dict[str, Any], background: bool, storage_options: dict[str, Any] | None = None
    ) -> None:
        """Write `state` under `url` (a local folder or any store's URL); with `background`, return once it is
        copied off the live tensors (the write or upload then goes on in a thread)."""
        if self._future is not None:
            raise RuntimeError("a checkpoint save is already in flight on this rank")
        self._writer = checksumming_writer(url, storage_options)
        self._started, self._write_s = time.monotonic(), None
        if background:
            if self._stager is None:
                self._stager = DefaultStager(StagingOptions(torch.cuda.is_available(), False, False, False))
            self._future = dcp.async_save(
                state, storage_writer=self._writer, process_group=self.process_group, async_stager=self._stager
            )
            self._future.add_done_callback(self._record_time)
        else:
            future: Future = Future()
            try:
                dcp.save(state, storage_writer=self._writer, process_group=self.process_group)
                future.set_result(None)
            except BaseException as exc:  # DCP raises CheckpointException, a BaseException
                future.set_exception(exc)
            self._record_time(future)
            self._future = future

    def _record_time(self, _future: Future) -> None:
        self._write_s = time.monotonic() - self._started

    def finish(self) -> dict[str, Any]:
        """Wait for the save in flight: {"files": {name: {size, crc32}}, "write_s": seconds}, or its error.

        The files are the ones this rank wrote (its shard; rank 0 also `.metadata`).
        """
        if self._future is None:
            raise RuntimeError("no checkpoint save in flight on this rank")
        future, writer = self._future, self._writer
        self._future = self._writer = None
        future.result()
        return {"files": dict(sorted(writer.fs.records.items())), "write_s": self._write_s}


def load_fsdp_state(
    url: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    rank: int,
    world_size: int,
    storage_options: dict[str, Any] | None = None,
) -> bool:
    """Load the shards under `url` (a local folder or any store's URL) into the live model/optimizer, resharding
    as needed; returns whether RNG was restored."""
    reader = SafeFileSystemReader(url, storage_options)  # one connection for the metadata and the shards
    saved_world = _ranks_saved(reader.read_metadata().state_dict_metadata)
    restore = saved_world == world_size
    state: dict[str, Any] = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "scheduler": scheduler.state_dict(),
    }
    if restore:
        state["rng"] = {f"rank_{rank}": capture_rng()}
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if restore:
        restore_rng(state["rng"][f"rank_{rank}"])
    return restore
