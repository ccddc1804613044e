"""The training-backend seam: everything the driver, the config checks and the offline tools need from a backend.

A backend is one package under `rlrunner/backends/` with a `TrainingBackend` subclass and one line in
`rlrunner/backends/registry.py`. It brings:
  * its actor worker class (a subclass of `rlrunner.backends.actor.ActorWorker`: the update loop is shared, the
    model, gradient reduction, optimizer step, checkpoint files and weight-sync source are the backend's);
  * its checkpoint manager (what the handler calls to write and read the actor's files);
  * how actor ranks are laid out (`RankMap`: which ranks see the same data) and its config and model checks;
  * the reader of its checkpoints' weights, which the converters and `model.path` use.
Nothing outside a backend's package branches on which backend runs.

A backend's `TrainingBackend` subclass is what the config checks use before anything starts, so its module
imports the backend's heavy parts (torch.distributed, the model, the file formats) inside the methods that
need them: `python -m rlrunner.main_grpo --cfg` or a mistyped key need not load them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TypeVar

if TYPE_CHECKING:
    import torch

    from rlrunner.models.hf_tensors import HFTensors
    from rlrunner.storage import Storage

T = TypeVar("T")


@dataclass(frozen=True)
class RankMap:
    """The actor ranks as (data-parallel, tensor-parallel) pairs, tensor-parallel innermost (Megatron's order):
    rank = dp_rank * tp + tp_rank. The `tp` ranks of one data-parallel rank compute on the same rows of the batch."""

    dp: int
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def scatter(self, per_dp_rank: Sequence[T]) -> list[T]:
        """Each data-parallel rank's argument repeated for its `tp` ranks: one entry per actor rank."""
        if len(per_dp_rank) != self.dp:
            raise ValueError(f"{len(per_dp_rank)} shards for {self.dp} data-parallel ranks")
        return [item for item in per_dp_rank for _ in range(self.tp)]

    def collect(self, per_rank: Sequence[T]) -> list[T]:
        """One result per data-parallel rank (its tensor-parallel rank 0's), so that each sample counts once."""
        if len(per_rank) != self.world_size:
            raise ValueError(f"{len(per_rank)} results for {self.world_size} actor ranks")
        return list(per_rank[:: self.tp])


class TrainingBackend(ABC):
    name: str  # the value of actor.training_backend
    checkpoint_format: str  # the manifest's "backend": a checkpoint is only resumed by the backend that wrote it
    # its update can be the same, bit for bit, at any power-of-two data-parallel size (actor.layout_invariant)
    layout_invariant = False
    # its ranks load an in-memory snapshot taken at another data-parallel size (`load_resharded_snapshot`)
    reshards_snapshots = False

    @property
    @abstractmethod
    def worker_class(self) -> type:
        """The actor worker class (an `ActorWorker`) a WorkerGroup runs."""

    def rank_map(self, actor_cfg: Mapping[str, Any]) -> RankMap:
        """How `actor.num_workers` ranks divide into data- and tensor-parallel ranks (checked by `check_config`)."""
        tp = int(actor_cfg["tensor_model_parallel_size"])
        return RankMap(dp=int(actor_cfg["num_workers"]) // tp, tp=tp)

    def check_config(self, cfg: Any) -> None:
        """Raise ConfigError (one line naming the key) for settings this backend cannot run; before anything starts."""

    def check_model(self, hf_config: Any, actor_cfg: Mapping[str, Any]) -> None:
        """Raise ConfigError (one line) when this backend cannot train this model with these settings."""

    @abstractmethod
    def checkpoint_manager(
        self,
        actor_group: Any,
        rank_map: RankMap,
        timeout_s: float | None,
        background: bool,
        storage_options: Mapping[str, Any] | None,
    ) -> Any:
        """The `rlrunner.checkpoint.manager.CheckpointManager` that saves and loads this group's state (its ranks laid
        out as `rank_map` says; I/O calls bounded by `timeout_s`; `background`: runner.async_save)."""

    @abstractmethod
    def find_checkpoint(self, storage: Storage, url: str) -> str | None:
        """The folder under `url` holding this backend's actor files (`url` itself, its `actor/` of a global_step_N
        folder, or a converter's output folder), or None when there is none."""

    @abstractmethod
    def read_hf_weights(self, storage: Storage, root: str, config: Any) -> dict[str, torch.Tensor]:
        """The model's full weights in HF layout (a tied output weight left out) from the checkpoint at `root` (what
        `find_checkpoint` returned). At most about one copy of the weights in memory."""

    def hf_tensors(self, storage: Storage, root: str, config: Any) -> HFTensors:
        """The same weights read in slices by name (what a training rank starting from the checkpoint reads its
        part through). By default `read_hf_weights` whole; a backend whose files can be sliced reads only the
        slices asked for."""
        from rlrunner.models.hf_tensors import StateDict, tied_aliases

        return StateDict(self.read_hf_weights(storage, root, config), aliases=tied_aliases(config))
