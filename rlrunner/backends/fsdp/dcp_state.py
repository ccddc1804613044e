"""Rank-side save and load of an FSDP2 model, its optimizer and LR scheduler with torch.distributed.checkpoint.

Each rank writes its own shard file (`__<rank>_0.distcp`); rank 0 also writes `.metadata`. Every
rank stores its own RNG states under `rng.rank_<r>`, and gets them back when the checkpoint was
saved with the same number of ranks (with another number, DCP reshards the model and optimizer,
and the per-rank RNG has no meaning, so it is left as it is).

The folder is a local path or any URL (s3://, gs://, ...): every rank writes its shard straight to
the store, so no node needs a shared disk. Local folders use DCP's file writer (fsync'd files); a
remote store goes through `StorageFileSystem` (each object whole or not at all): `rlrunner.backends.dcp_files`.

A save can run in the background (`start_dcp_save(..., background=True)`): the state is copied
off the training tensors first (pinned host memory on GPU, a host copy on CPU), then DCP writes (or
uploads) the copy in a thread, with its collectives on a gloo group of their own so they never
interleave with training's. Every file's size and CRC-32 are computed from the bytes as they are
written, never by reading them back.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rlrunner.backends.background_save import BackgroundSave
from rlrunner.backends.dcp_files import SafeFileSystemReader, SafeLoadPlanner, checksumming_writer, saved_keys
from rlrunner.backends.fsdp.reused_state import Live, ReusedRead
from rlrunner.utils.stateful import StateParts

logger = logging.getLogger(__name__)

_RNG_KEY = re.compile(r"^rng\.rank_(\d+)\.")


def saved_world_size(dcp_url: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> int:
    """How many ranks wrote the checkpoint, from the per-rank RNG keys in its metadata."""
    return _ranks_saved(saved_keys(dcp_url, storage_options))


def _ranks_saved(keys) -> int:
    return len({int(m.group(1)) for key in keys if (m := _RNG_KEY.match(key))})


def fsdp_parts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """A rank's "model", "optimizer" and "scheduler" parts (`ActorWorker.state_parts`): DCP saves and loads them."""
    return {"model": FSDPModelState(model), "optimizer": FSDPOptimizerState(model, optimizer), "scheduler": scheduler}


class FSDPModelState:
    """The "model" part: the model's sharded state dict (DTensors), what DCP saves and reshards (read again only when
    a tensor was replaced: `reused_state`)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.reused = ReusedRead()

    def state_dict(self) -> dict[str, Any]:
        return self.reused.get(lambda: get_model_state_dict(self.model), self._live)

    def _live(self) -> Live:
        return Live([*self.model.parameters(), *self.model.buffers()])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


class FSDPOptimizerState:
    """The "optimizer" part: the optimizer's state keyed by parameter name, its moments sharded as their parameters."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        self.reused = ReusedRead()

    def state_dict(self) -> dict[str, Any]:
        state = self.reused.get(lambda: get_optimizer_state_dict(self.model, self.optimizer), self._live)
        saved, live = state["param_groups"], self.optimizer.param_groups
        if len(saved) != len(live) or any(set(s) != set(g) for s, g in zip(saved, live)):
            return get_optimizer_state_dict(self.model, self.optimizer)  # groups DCP lays out otherwise: read each time
        # The groups' settings as they are now (the schedule changes the learning rate every step), under the names
        # DCP gave their parameters.
        state["param_groups"] = [
            {**{key: value for key, value in group.items() if key != "params"}, "params": names["params"]}
            for group, names in zip(live, saved)
        ]
        return state

    def _live(self) -> Live:
        """The parameters and their state's tensors; the state's plain values and the groups' keys must not change
        either (the groups' values are read live)."""
        tensors, plain = [], []
        for group in self.optimizer.param_groups:
            plain.append(tuple(group))
            for param in group["params"]:
                tensors.append(param)
                for key, value in self.optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        tensors.append(value)
                    else:
                        plain.append((key, value))
        return Live(tensors, tuple(plain))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


def new_stager() -> DefaultStager:
    """DCP's stager for background saves: host copies (pinned where CUDA is), kept by a rank from one save to the next
    where it can be (`stager_for_next_save`), so that its host buffers are reused."""
    return DefaultStager(StagingOptions(torch.cuda.is_available(), False, False, False))


@functools.cache
def stagers_are_reusable() -> bool:
    """Whether this torch's DefaultStager can stage a second time. 2.13's can. 2.11's closes its inner stager after
    every stage, which empties the tables it copies with (and its cache), so its second stage fails with
    "KeyError: <class 'type'>" (seen on CUDA): there each save needs a stager of its own."""
    probe = new_stager()
    try:
        probe.stage({"step": 1})
        probe.stage({"step": 1})
        return True
    except KeyError:
        return False
    finally:
        probe.close()


def stager_for_next_save(stager: DefaultStager | None) -> DefaultStager:
    """The stager of a rank's next background save: its previous one where stagers are reusable, else a new one (the
    previous one closed: one save is in flight at a time, and the previous has finished)."""
    if stager is not None and stagers_are_reusable():
        return stager
    if stager is not None:
        stager.close()
    return new_stager()


def start_dcp_save(
    saver: BackgroundSave,
    url: str,
    state: dict[str, Any],
    background: bool,
    storage_options: dict[str, Any] | None,
    process_group: Any,
    stager: DefaultStager | None,
) -> None:
    """Write `state` under `url` (a local folder or any store's URL) through `saver`: with `background` (and a
    `stager`, whose host buffers are reused by every save) DCP's async_save returns once the state is copied off the
    live tensors and writes in its own thread; else the write happens here. Collectives go over `process_group`."""
    writer = checksumming_writer(url, storage_options)
    if background:
        saver.track(
            lambda: dcp.async_save(state, storage_writer=writer, process_group=process_group, async_stager=stager),
            lambda: writer.fs.records,
        )
    else:
        saver.run(lambda: _save(state, writer, process_group), background=False)


def _save(state: dict[str, Any], writer: FileSystemWriter, process_group: Any) -> dict[str, dict[str, Any]]:
    dcp.save(state, storage_writer=writer, process_group=process_group)
    return writer.fs.records


def load_fsdp_state(
    url: str, parts: StateParts, world_size: int, storage_options: dict[str, Any] | None = None
) -> bool:
    """Load the checkpoint under `url` (a local folder or any store's URL) into a rank's `parts` (`rank_state`),
    resharding as needed; the RNG only when it was saved by as many ranks. Returns whether RNG was restored."""
    reader = SafeFileSystemReader(url, storage_options)  # one connection for the metadata and the shards
    restore = _ranks_saved(reader.read_metadata().state_dict_metadata) == world_size
    if not restore:
        parts = parts.without(["rng"])  # each rank's RNG has no meaning at another rank count
    state = parts.state_dict()  # the live state: DCP loads into its tensors, resharding
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    parts.load_state_dict(state)
    return restore
