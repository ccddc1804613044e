"""Rank-side save and load of the Megatron (tensor-parallel) backend's training state, in Megatron-LM's layout.

    <actor folder>/iter_0000050/mp_rank_XX/model_optim_rng.pt   model shard, optimizer settings, LR schedule, RNG
    <actor folder>/iter_0000050/mp_rank_XX/distrib_optim.pt     Adam moments of that shard (all data-parallel slices)
    <actor folder>/latest_checkpointed_iteration.txt            written by the driver once every file is written

Data-parallel rank 0 of each tensor-parallel rank writes that rank's two files; `rng_state` holds one entry per
data-parallel rank (Megatron's list-of-dicts), gathered before the write, as are the moments (onto DP rank 0
only). A background save copies the state off the training tensors on the training thread (`MegatronRankState`) and
writes, or uploads, the files in a thread (the worker's `BackgroundSave`), so it blocks training only for the copy;
a synchronous save writes the live tensors, with no copy, before training goes on.

A load reads this rank's files when the tensor-parallel size is the saved one; with another size it reads every
saved rank's files and assembles this rank's tensors, one at a time, from the slices of the saved ones they cover,
through the HF layout (`MegatronShards`, read by the start-up's `iter_hf_to_megatron_rank`), so tp=2 resumes at
tp=1 and back. The files are memory-mapped, so a rank reads only what its part covers (a data-parallel rank, only
its slice of the moments). RNG states are restored only when both sizes match.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from rlrunner.backends.megatron.files import (
    distrib_optim_file,
    distrib_optim_state,
    rank_dirs,
    rank_file,
    rank_state,
    read_distrib_optim,
    read_rank,
    read_tracker,
    write_state_file,
)
from rlrunner.backends.megatron.layout import EXTRA_STATE, MegatronShards, iter_hf_to_megatron_rank
from rlrunner.storage import FileRecord, open_storage


@dataclass
class MegatronRankState:
    """What one tensor-parallel rank's files hold: CPU tensors copied off the live ones (a background save), or the
    live ones themselves (a synchronous save, written before the next step)."""

    iteration: int
    tp_rank: int
    args: argparse.Namespace
    model: dict[str, torch.Tensor | None]  # megatron-core names, `_extra_state` entries None as Megatron's
    optimizer: dict[str, Any]  # settings and where the moments are (our `optimizer` entry)
    scheduler: dict[str, Any]
    rng_state: list[dict[str, Any]]  # one entry per data-parallel rank
    step: int  # the optimizer's step count
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]

    def write(self, url: str, storage_options: Mapping[str, Any] | None) -> dict[str, FileRecord]:
        """Write both files under `url` (the checkpoint's actor folder); {relative name: size and CRC-32}."""
        storage = open_storage(url, storage_options)
        state = rank_state(self.iteration, self.model, self.args, self.optimizer, self.scheduler, self.rng_state)
        records = write_state_file(storage, url, rank_file(self.iteration, self.tp_rank), state)
        moments = distrib_optim_state(
            self.iteration, self.args.tensor_model_parallel_size, self.args.data_parallel_size, self.step,
            self.exp_avg, self.exp_avg_sq,
        )
        records.update(write_state_file(storage, url, distrib_optim_file(self.iteration, self.tp_rank), moments))
        return records


# -- loading -----------------------------------------------------------------------------------------


Pairs = Iterable[tuple[str, torch.Tensor]]


@dataclass
class LoadedRank:
    """This rank's training state read from a checkpoint (resharded to this rank's tensor-parallel size). The model
    and moments are (megatron-core name, tensor) pairs, read from the memory-mapped files as they are iterated: each
    once, in order."""

    model: Pairs
    step: int
    exp_avg: Pairs
    exp_avg_sq: Pairs
    scheduler: dict[str, Any]
    rng_state: dict[str, Any] | None  # None when the parallel sizes changed (a rank's RNG has no meaning then)


def _tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in state.items() if not key.endswith(EXTRA_STATE)}


def _resharded(shards: list[dict[str, torch.Tensor]], config: Any, tp: int, tp_rank: int, divisible_by: int) -> Pairs:
    """Tensor-parallel rank `tp_rank` of `tp`, one tensor at a time, from the saved ranks' dicts through the HF layout
    (exact): each tensor is assembled from the slices of the saved ones it covers, never from a whole HF dict."""
    tensors = MegatronShards(shards, config)
    return ((key, value) for key, value in iter_hf_to_megatron_rank(tensors, config, tp, tp_rank, divisible_by)
            if value is not None)


def load_rank(
    url: str,
    storage_options: Mapping[str, Any] | None,
    config: Any,
    tp: int,
    tp_rank: int,
    dp: int,
    dp_rank: int,
    divisible_by: int,
) -> LoadedRank:
    """Read the state of rank (dp_rank, tp_rank) from the checkpoint's actor folder `url` (the iteration its tracker
    names), resharding over tensor-parallel sizes as needed. The files are memory-mapped (a remote one is downloaded
    first): what this rank's part does not cover is never read into memory."""
    storage = open_storage(url, storage_options)
    iteration = read_tracker(storage, url)
    saved_tp = len(rank_dirs(storage, url, iteration))

    def read(rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
        state = read_rank(storage, url, iteration, rank, saved_tp, mmap=True)
        for key in ("optimizer", "opt_param_scheduler", "rng_state"):
            if key not in state:
                raise ValueError(f"{storage.join(url, rank_file(iteration, rank))} has no '{key}': a model-only checkpoint "
                                 "cannot be resumed (start from it with model.path instead)")
        moments = read_distrib_optim(storage, storage.join(url, distrib_optim_file(iteration, rank)), mmap=True)
        return state, moments

    if saved_tp == tp:
        state, moments = read(tp_rank)
        model, exp_avg, exp_avg_sq = (_tensors(state["model"]).items(), moments["exp_avg"].items(),
                                      moments["exp_avg_sq"].items())
        saved_dp = getattr(state["args"], "data_parallel_size", None)
        rng = state["rng_state"][dp_rank] if saved_dp == dp and len(state["rng_state"]) == dp else None
    else:
        states = [read(rank) for rank in range(saved_tp)]
        model = _resharded([_tensors(s["model"]) for s, _ in states], config, tp, tp_rank, divisible_by)
        exp_avg = _resharded([dict(m["exp_avg"]) for _, m in states], config, tp, tp_rank, divisible_by)
        exp_avg_sq = _resharded([dict(m["exp_avg_sq"]) for _, m in states], config, tp, tp_rank, divisible_by)
        state, moments = states[0]
        rng = None
    return LoadedRank(model, int(moments["step"]), exp_avg, exp_avg_sq, state["opt_param_scheduler"], rng)
