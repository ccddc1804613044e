"""Rank-side save and load of the Megatron (tensor-parallel) backend's training state, in Megatron-LM's layout.

    <actor folder>/iter_0000050/mp_rank_XX/model_optim_rng.pt    model shard, optimizer settings, LR schedule, RNG
    <actor folder>/iter_0000050/mp_rank_XX/distrib_optim.pt      the Adam moments of tensor-parallel rank XX
    <actor folder>/latest_checkpointed_iteration.txt             written by the driver once every file is written

Data-parallel rank 0 of each tensor-parallel rank writes both files: the `model_optim_rng.pt` (the weights are the
same on every replica; its `rng_state` holds one entry per data-parallel rank, Megatron's list-of-dicts, gathered
before the write), and the `distrib_optim.pt`, into which the other data-parallel ranks stream their slices of the
moments a chunk at a time as it is written (`moment_save`): nothing is gathered. A background save copies the state
off the training tensors on the training thread (`MegatronRankState`) and writes, or uploads, the files in a thread
(the worker's `BackgroundSave`), so it blocks training only for the copy; a synchronous save writes the live tensors,
with no copy, before training goes on.

A load reads this rank's files when the tensor-parallel size is the saved one: the weights from its
`model_optim_rng.pt`, and only its own slice of the moments (at any data-parallel size; older checkpoints' per
data-parallel rank slice files too). With another tensor-parallel size it reads every saved rank's files and
assembles this rank's tensors, one at a time, from the slices of the saved ones they cover, through the HF layout
(`MegatronShards`, read by the start-up's `iter_hf_to_megatron_rank`), so tp=2 resumes at tp=1 and back. The files
are memory-mapped, so a rank reads only what its part covers. RNG states are restored only when both sizes match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from rlrunner.backends.megatron.distrib_optim import MOMENTS, DistributedAdamW
from rlrunner.backends.megatron.file_writes import write_state_file
from rlrunner.backends.megatron.files import rank_dirs, rank_file, read_rank, read_tracker
from rlrunner.backends.megatron.layout import EXTRA_STATE, iter_hf_to_megatron_rank
from rlrunner.backends.megatron.moment_files import SavedMoments, read_moments
from rlrunner.backends.megatron.to_hf import MegatronShards
from rlrunner.storage import FileRecord, open_storage


@dataclass
class MegatronRankState:
    """The files one (data-parallel, tensor-parallel) rank writes, by path relative to the checkpoint's actor folder:
    CPU tensors copied off the live ones (a background save), or the live ones themselves (a synchronous save,
    written before the next step)."""

    files: dict[str, dict[str, Any]]
    # stand-in tensors whose values are read as the file is written (sharded weights, the moments received from the
    # other DP ranks: `write_state_file`), and what to run, in order, once the files are written, or failed (the walk
    # over the weight units every DP rank makes, finished; then the moments' transfers, completed)
    deferred: dict[int, Callable[[], Any]] = field(default_factory=dict)
    after: tuple[Callable[[], None], ...] = ()

    def write(self, url: str, storage_options: Mapping[str, Any] | None) -> dict[str, FileRecord]:
        """Write every file under `url` (the checkpoint's actor folder); {relative name: size and CRC-32}."""
        try:
            storage = open_storage(url, storage_options)
            records: dict[str, FileRecord] = {}
            for name, state in self.files.items():
                records.update(write_state_file(storage, url, name, state, self.deferred))
            return records
        finally:
            _run_all(self.after)


def _run_all(steps: tuple[Callable[[], None], ...]) -> None:
    """Run every step, each one even when one before it failed (the peers wait on each); then raise the first error."""
    error: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 (raised below)
            error = error or exc
    if error is not None:
        raise error


# -- loading -----------------------------------------------------------------------------------------


Pairs = Iterable[tuple[str, torch.Tensor]]


@dataclass
class LoadedRank:
    """This rank's training state read from a checkpoint (resharded to this rank's tensor-parallel size). The model is
    (megatron-core name, tensor) pairs, read from the memory-mapped files as they are iterated: each once, in order.
    The moments are the saved rank's files (`saved`) when the tensor-parallel size is the saved one, else pairs like
    the model's (`exp_avg`, `exp_avg_sq`)."""

    model: Pairs
    step: int
    scheduler: dict[str, Any]
    rng_state: dict[str, Any] | None  # None when the parallel sizes changed (a rank's RNG has no meaning then)
    saved: SavedMoments | None = None
    exp_avg: Pairs | None = None
    exp_avg_sq: Pairs | None = None

    def load_moments(self, optimizer: DistributedAdamW) -> None:
        """Load the moments into `optimizer`: its own slice only, or each resharded tensor's part in its slice."""
        if self.saved is not None:
            optimizer.load_flat_state(self.step, self.saved.layout, self.saved.flat)
        else:
            optimizer.load_full_state({"step": self.step, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq})


def _tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in state.items() if not key.endswith(EXTRA_STATE)}


def _resharded(
    shards: list[Mapping[str, torch.Tensor]], config: Any, tp: int, tp_rank: int, divisible_by: int
) -> Pairs:
    """Tensor-parallel rank `tp_rank` of `tp`, one tensor at a time, from the saved ranks' dicts through the HF layout
    (exact): each tensor is assembled from the slices of the saved ones it covers, never from a whole HF dict."""
    tensors = MegatronShards(shards, config)
    return (
        (key, value)
        for key, value in iter_hf_to_megatron_rank(tensors, config, tp, tp_rank, divisible_by)
        if value is not None
    )


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

    def read(rank: int) -> tuple[dict[str, Any], SavedMoments]:
        state = read_rank(storage, url, iteration, rank, saved_tp, mmap=True)
        for key in ("optimizer", "opt_param_scheduler", "rng_state"):
            if key not in state:
                raise ValueError(
                    f"{storage.join(url, rank_file(iteration, rank))} has no '{key}': a model-only checkpoint "
                    "cannot be resumed (start from it with model.path instead)"
                )
        # saved by the same layout, this rank's own moment file holds its slice: opened first, it is the only one read
        same_layout = saved_tp == tp and getattr(state["args"], "data_parallel_size", None) == dp
        return state, read_moments(storage, url, iteration, rank, dp_rank=dp_rank if same_layout else 0)

    if saved_tp == tp:
        state, moments = read(tp_rank)
        saved_dp = getattr(state["args"], "data_parallel_size", None)
        rng = state["rng_state"][dp_rank] if saved_dp == dp and len(state["rng_state"]) == dp else None
        return LoadedRank(
            _tensors(state["model"]).items(), moments.step, state["opt_param_scheduler"], rng, saved=moments
        )
    states = [read(rank) for rank in range(saved_tp)]
    model = _resharded([_tensors(s["model"]) for s, _ in states], config, tp, tp_rank, divisible_by)
    exp_avg, exp_avg_sq = (
        _resharded([m.tensors(key) for _, m in states], config, tp, tp_rank, divisible_by) for key in MOMENTS
    )
    state, moments = states[0]
    return LoadedRank(model, moments.step, state["opt_param_scheduler"], None, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
