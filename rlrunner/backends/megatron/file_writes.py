"""Writing Megatron-LM's legacy per-rank checkpoint files (rlrunner.backends.megatron.files: their names, what each
holds, reading them) through the Storage interface.

Each file is checked loadable by the weights_only reader before it is written (`files.check_loadable`), so a save
fails at once instead of the resume that reads it. Writes stream through `Storage.open_write`, which computes each
file's size and CRC-32 as the bytes pass; a state whose tensors stand in for values produced as the file is written
(sharded weights) is written one tensor at a time, into torch.save's own file (`write_state_file`). The tracker,
`latest_checkpointed_iteration.txt`, is written after every rank file.
"""

from __future__ import annotations

import argparse
import struct
import tempfile
import zipfile
from typing import Any, Callable, Mapping, Sequence

import torch

from rlrunner.backends.megatron.files import (
    TRACKER_FILE,
    check_loadable,
    iteration_dir,
    megatron_args,
    rank_file,
    rank_state,
)
from rlrunner.backends.megatron.layout import DEFAULT_VOCAB_DIVISIBLE_BY, hf_to_megatron_rank
from rlrunner.storage import FileRecord, Storage


def write_rank_file(
    storage: Storage,
    root: str,
    iteration: int,
    tp_rank: int,
    model: Mapping[str, Any],
    args: argparse.Namespace,
    optimizer: Any = None,
    opt_param_scheduler: Any = None,
    rng_state: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, FileRecord]:
    """Write tensor-parallel rank `tp_rank`'s `model_optim_rng.pt` under `root`; {relative name: size and CRC-32}."""
    if not 0 <= tp_rank < args.tensor_model_parallel_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} is outside 0..{args.tensor_model_parallel_size - 1}")
    state = rank_state(iteration, model, args, optimizer, opt_param_scheduler, rng_state)
    return write_state_file(storage, root, rank_file(iteration, tp_rank), state)


def write_state_file(
    storage: Storage,
    root: str,
    name: str,
    state: Mapping[str, Any],
    deferred: Mapping[int, Callable[[], Any]] | None = None,
) -> dict[str, FileRecord]:
    """torch.save `state` to `root`/`name` (checked loadable with weights_only first); {name: size and CRC-32}.

    `deferred` maps `id(tensor)` of tensors in `state` that only stand for their values (their dtype and shape count,
    e.g. an untouched `torch.empty`) to a function giving the values, called once each, in the order the file holds
    them (the order `state` lists them), when its bytes are written: a file larger than memory is written one tensor
    at a time. The function may instead return an iterable of 1-D parts of the stand-in's dtype, its flat values in
    order, each written before the next is asked for: one tensor written a part at a time (a tensor-parallel rank's
    moments, received from its data-parallel ranks). The file is torch.save's own, byte for byte (`_write_streamed`)."""
    check_loadable(state, name)
    with storage.open_write(storage.join(root, name)) as writer:
        tensors = _tensors_in_save_order(state, []) if deferred else []
        if any(id(tensor) in deferred for tensor in tensors):
            _write_streamed(dict(state), tensors, deferred, writer)
        else:
            torch.save(dict(state), writer)
    return {name: writer.record()}


def _tensors_in_save_order(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors under `obj` in the order torch.save's pickler meets them (dicts in order, keys before values;
    lists and tuples in order): its storages' record names are their positions in this order."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, argparse.Namespace):
        _tensors_in_save_order(vars(obj), out)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _tensors_in_save_order(key, out)
            _tensors_in_save_order(value, out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors_in_save_order(value, out)
    return out


def _storage_records(skeleton: Any) -> list[tuple[int, int, int]]:
    """(storage index, data offset, size) of every `<archive>/data/<index>` record of a torch.save zip file, by
    offset. The offset is read from the record's local header (torch pads its extra field to align the data)."""
    records = []
    for info in zipfile.ZipFile(skeleton).infolist():
        folder, _, index = info.filename.rpartition("/")
        if not folder.endswith("/data") or not index.isdigit():
            continue
        skeleton.seek(info.header_offset)
        header = skeleton.read(30)
        if header[:4] != b"PK\x03\x04":
            raise ValueError(f"{info.filename}: no zip local header at {info.header_offset}")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        records.append((int(index), info.header_offset + 30 + name_len + extra_len, info.file_size))
    return sorted(records, key=lambda record: record[1])


BOUNCE_BYTES = 4 << 20  # a streamed save's copy buffer


def _write_streamed(
    state: dict[str, Any], tensors: list[torch.Tensor], deferred: Mapping[int, Callable[[], Any]], writer: Any
) -> None:
    """torch.save `state` into `writer`, asking `deferred` for the values of its stand-in tensors as their bytes are
    due. torch.save under `torch.serialization.skip_data` writes the file with room left for every tensor's bytes
    (into a sparse temporary file: no bytes written there), and the file is then copied through, each tensor's bytes
    put in its room; torch.load checks no CRC of skipped records (the zip's is left 0). `tensors`: the state's, in
    save order (`_tensors_in_save_order`)."""
    stored = [t for t in tensors if t.untyped_storage().nbytes()]
    if len({t.untyped_storage().data_ptr() for t in stored}) != len(stored):
        raise ValueError("a streamed save needs every tensor in its own storage")
    with tempfile.TemporaryFile() as skeleton:
        with torch.serialization.skip_data():
            torch.save(state, skeleton)
        records = _storage_records(skeleton)
        if sorted(index for index, _, _ in records) != list(range(len(tensors))):
            raise ValueError(f"torch.save wrote {len(records)} storages for the {len(tensors)} tensors of the state")
        skeleton.seek(0)
        position = 0
        # bytes go out through a buffer of their own: handing a tensor's own memory to the writer (numpy) would make
        # its storage fixed, and a gathered unit's storage is freed (resized) after it is written
        bounce = torch.empty(BOUNCE_BYTES, dtype=torch.uint8)
        for index, offset, size in records:
            _copy(skeleton, writer, offset - position)
            stand_in = tensors[index]
            produce = deferred.get(id(stand_in))
            if produce is None:  # a tensor of its own: torch.save writes its whole storage
                parts: Any = [torch.empty(0, dtype=torch.uint8).set_(stand_in.detach().cpu().untyped_storage())]
            else:
                parts = produce()
                if isinstance(parts, torch.Tensor):
                    if parts.dtype != stand_in.dtype or tuple(parts.shape) != tuple(stand_in.shape):
                        raise ValueError(
                            f"storage {index}: {parts.dtype} {tuple(parts.shape)} given for a stand-in of "
                            f"{stand_in.dtype} {tuple(stand_in.shape)}"
                        )
                    parts = [parts]
            written = 0
            for tensor in parts:
                if produce is not None and tensor.dtype != stand_in.dtype:
                    raise ValueError(
                        f"storage {index}: a part of {tensor.dtype} given for a stand-in of {stand_in.dtype}"
                    )
                data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                del tensor
                if written + data.numel() > size:
                    raise ValueError(f"storage {index}: more than the {size} bytes of its record given")
                for part in data.split(BOUNCE_BYTES):
                    bounce[: part.numel()].copy_(part)
                    writer.write(bounce[: part.numel()].numpy())
                written += data.numel()
                del data
            if written != size:
                raise ValueError(f"storage {index}: {written} bytes for a record of {size}")
            del parts
            skeleton.seek(offset + size)
            position = offset + size
        _copy(skeleton, writer, None)


def _copy(source: Any, target: Any, count: int | None, chunk: int = 1 << 20) -> None:
    """Copy `count` bytes (None: the rest) of `source` into `target`."""
    while count is None or count > 0:
        data = source.read(chunk if count is None else min(chunk, count))
        if not data:
            if count:
                raise ValueError(f"the skeleton file ended {count} bytes early")
            return
        target.write(data)
        if count is not None:
            count -= len(data)


def write_tracker(storage: Storage, root: str, iteration: int) -> dict[str, FileRecord]:
    """Write `latest_checkpointed_iteration.txt` (after every rank file: it must never name a partial iteration)."""
    iteration_dir(iteration)  # validates
    return {TRACKER_FILE: storage.write_bytes(storage.join(root, TRACKER_FILE), str(int(iteration)).encode())}


def write_model_checkpoint(
    storage: Storage,
    root: str,
    state: Mapping[str, torch.Tensor],
    config: Any,
    tp: int,
    iteration: int = 0,
    divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
) -> dict[str, FileRecord]:
    """A model-only Megatron checkpoint of an HF Qwen2 state dict, split `tp` ways: each rank's file, then the
    tracker. One rank's shard is in memory at a time besides `state`."""
    dtype = state["model.embed_tokens.weight"].dtype
    args = megatron_args(config, tp, divisible_by=divisible_by, dtype=dtype)
    records: dict[str, FileRecord] = {}
    for tp_rank in range(tp):
        shard = hf_to_megatron_rank(state, config, tp, tp_rank, divisible_by)
        records.update(write_rank_file(storage, root, iteration, tp_rank, shard, args))
        del shard
    records.update(write_tracker(storage, root, iteration))
    return records
