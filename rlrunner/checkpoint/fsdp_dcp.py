"""Rank-side save and load of an FSDP2 model, its optimizer and LR scheduler with torch.distributed.checkpoint.

Each rank writes its own shard file (`__<rank>_0.distcp`); rank 0 also writes `.metadata`. Every
rank stores its own RNG states under `rng.rank_<r>`, and gets them back when the checkpoint was
saved with the same number of ranks (with another number, DCP reshards the model and optimizer,
and the per-rank RNG has no meaning, so it is left as it is).
"""

from __future__ import annotations

import logging
import os
import random
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rlrunner.checkpoint.manifest import file_record
from rlrunner.checkpoint.safe_dcp import METADATA_FILE, SafeFileSystemReader, SafeLoadPlanner, saved_keys

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


def saved_world_size(dcp_dir: str | Path) -> int:
    """How many ranks wrote the checkpoint, from the per-rank RNG keys in its metadata."""
    ranks = {int(m.group(1)) for key in saved_keys(dcp_dir) if (m := _RNG_KEY.match(key))}
    return len(ranks)


def save_fsdp_state(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, rank: int
) -> dict[str, dict[str, Any]]:
    """Write this rank's part of the checkpoint; returns {file name: {size, crc32}} for the files it wrote."""
    folder = Path(path)
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "scheduler": scheduler.state_dict(),
        "rng": {f"rank_{rank}": capture_rng()},
    }
    writer = FileSystemWriter(folder, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
    dcp.save(state, storage_writer=writer)
    # dcp.save returns after the coordinator has written .metadata, so rank 0 can record it too.
    mine = [name for name in os.listdir(folder) if name.startswith(f"__{rank}_") and name.endswith(".distcp")]
    if rank == 0:
        mine.append(METADATA_FILE)
    return {name: file_record(folder / name) for name in sorted(mine)}


def load_fsdp_state(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, rank: int, world_size: int
) -> bool:
    """Load the shards into the live model/optimizer (resharding as needed); returns whether RNG was restored."""
    saved_world = saved_world_size(path)
    restore = saved_world == world_size
    state: dict[str, Any] = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "scheduler": scheduler.state_dict(),
    }
    if restore:
        state["rng"] = {f"rank_{rank}": capture_rng()}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if restore:
        restore_rng(state["rng"][f"rank_{rank}"])
    return restore
