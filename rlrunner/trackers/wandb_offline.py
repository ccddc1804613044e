"""Read back the history of an offline W&B run from its transaction logs (`run-<id>.wandb`); wandb has no reader.

An offline run writes one folder per launch, `<wandb_dir>/offline-run-<YYYYmmdd_HHMMSS>-<id>[-<n>]` (`-<n>` when
a folder of that second exists). Its `.wandb` file: a 7-byte header (`:W&B`, uint16 0xBEE1 little-endian, a
version byte), then LevelDB log records in 32 KiB blocks (the header is part of block 0). A record header is
crc32 (uint32 LE, zlib CRC-32 of the type byte and the payload), length (uint16 LE), type (1 full, 2 first,
3 middle, 4 last); a block's tail shorter than a header, or a zero header, is padding. A payload is a
`wandb_internal_pb2.Record`. The file of a killed writer may end inside a record: reading stops there.

What the file holds is what the run durably has: records a killed process had not flushed yet are not in it.
"""

from __future__ import annotations

import json
import logging
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

logger = logging.getLogger(__name__)

BLOCK_SIZE = 32 * 1024
HEADER = b":W&B" + struct.pack("<H", 0xBEE1)  # then one version byte
HEADER_SIZE = 7
RECORD_HEADER = struct.Struct("<IHB")  # crc32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
INTERNAL_KEYS = ("_step", "_runtime", "_timestamp")  # added by W&B to every history record; left out here


def run_folders(wandb_dir: str | Path, run_id: str) -> list[Path]:
    """The offline folders of run `run_id` that have its `.wandb` file, oldest first."""
    pattern = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    found = []
    root = Path(wandb_dir)
    if not root.is_dir():
        return []
    for folder in root.iterdir():
        match = pattern.fullmatch(folder.name)
        if match and (folder / f"run-{run_id}.wandb").is_file():
            found.append(((match.group(1), int(match.group(2) or 0)), folder))
    return [folder for _, folder in sorted(found)]


def payloads(handle: BinaryIO) -> Iterator[bytes]:
    """The complete, intact record payloads of a transaction log, in order; stops at the first damaged or cut one."""
    head = handle.read(HEADER_SIZE)
    if len(head) < HEADER_SIZE:
        return  # a file just created, or cut inside its header: no records yet
    if head[:6] != HEADER:
        raise ValueError("not a W&B transaction log (bad header)")
    offset = HEADER_SIZE  # position within the current block
    block = head + handle.read(BLOCK_SIZE - HEADER_SIZE)
    parts: list[bytes] | None = None
    while True:
        if BLOCK_SIZE - offset < RECORD_HEADER.size:  # padding at the end of the block
            block, offset = handle.read(BLOCK_SIZE), 0
            if not block:
                return
        if offset + RECORD_HEADER.size > len(block):
            return  # the file ends here (or inside a header: cut short)
        crc, length, kind = RECORD_HEADER.unpack_from(block, offset)
        if kind == 0 and length == 0:
            offset = BLOCK_SIZE  # zero header: the rest of the block is padding
            continue
        start = offset + RECORD_HEADER.size
        data = block[start : start + length]
        if len(data) < length or zlib.crc32(bytes([kind]) + data) != crc:
            return  # cut short by a killed writer, or damaged: nothing after it is trusted
        offset = start + length
        if kind == FULL and parts is None:
            yield data
        elif kind == FIRST and parts is None:
            parts = [data]
        elif kind == MIDDLE and parts is not None:
            parts.append(data)
        elif kind == LAST and parts is not None:
            parts.append(data)
            yield b"".join(parts)
            parts = None
        else:
            return  # fragments out of order: damaged


def _value(item: Any) -> Any:
    kind = item.WhichOneof("value")  # the typed form (x_history_value_encoding=typed); else the JSON one
    if kind is None:
        return json.loads(item.value_json) if item.value_json else None
    if kind == "none":
        return None
    if kind == "json":
        return json.loads(item.json)
    return getattr(item, kind)


def run_records(path: str | Path) -> Iterator[tuple[str | None, Any]]:
    """(kind, `wandb_internal_pb2.Record`) for each intact record of one `.wandb` file, in order, the kind being the
    record's `record_type` ("history", "config", "exit", ...); stops at the first damaged, cut or unparseable one.
    ValueError if the file is not a transaction log."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as handle:
        for payload in payloads(handle):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(payload)
            except Exception:  # passed its CRC but does not parse: stop as at damage
                logger.debug("%s: unreadable record; reading stops there", path)
                return
            yield record.WhichOneof("record_type"), record


def history_records(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """The (step, metrics) history records of one `.wandb` file, in order (W&B's `_step`, `_runtime`, `_timestamp`
    left out). A file that is not a transaction log counts as holding none (with a warning)."""
    found: list[tuple[int, dict[str, Any]]] = []
    try:
        for kind, record in run_records(path):
            if kind == "history":
                found.append((record.history.step.num, _metrics(record.history.item)))
    except ValueError as exc:
        logger.warning("%s: %s; taken as holding no steps", path, exc)
    return found


def _metrics(items: Any) -> dict[str, Any]:
    metrics = {}
    for item in items:
        key = item.key or "/".join(item.nested_key)
        if key not in INTERNAL_KEYS:
            metrics[key] = _value(item)
    return metrics


def offline_history(wandb_dir: str | Path, run_id: str) -> list[tuple[str, list[tuple[int, dict[str, Any]]]]]:
    """Each offline folder of run `run_id` in `wandb_dir` (oldest first) with the history records its file holds."""
    return [(str(folder), history_records(folder / f"run-{run_id}.wandb")) for folder in run_folders(wandb_dir, run_id)]


def offline_last_step(wandb_dir: str | Path, run_id: str) -> int:
    """The newest step any offline folder of run `run_id` durably holds; -1 if none."""
    steps = [step for _, records in offline_history(wandb_dir, run_id) for step, _ in records]
    return max(steps, default=-1)


def offline_config(wandb_dir: str | Path, run_id: str) -> dict[str, Any]:
    """The run config the offline folders of run `run_id` record (their run and config records applied in order;
    W&B's own `_wandb` entry left out)."""
    config: dict[str, Any] = {}
    for folder in run_folders(wandb_dir, run_id):
        for kind, record in run_records(folder / f"run-{run_id}.wandb"):
            if kind not in ("run", "config"):
                continue
            change = record.run.config if kind == "run" else record.config
            for item in change.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
            for item in change.remove:
                config.pop(item.key or "/".join(item.nested_key), None)
    config.pop("_wandb", None)
    return config
