"""An actor rank's state as named `Stateful` parts (`rlrunner.utils.stateful`): "model", "optimizer", "scheduler" (the
backend's, `ActorWorker.state_parts`) and "rng" (every backend's, `RankRNG`), read off and loaded into the live objects.

An in-memory snapshot serializes `rank_state().state_dict()` with each DTensor as its local shard (`local_tensors`) and
loads it back placed as the live state's DTensors are (`placed_like`); a checkpoint writes the same parts in its
backend's files (FSDP: DCP saves and loads exactly these parts; Megatron: its per-tensor-parallel-rank files).
"""

from __future__ import annotations

from typing import Any

import torch

from rlrunner.utils.rng import capture_rng, restore_rng
from rlrunner.utils.tensors import map_tensors


class RankRNG:
    """The "rng" part: this process's RNG states, keyed by rank (DCP merges every rank's keys into one checkpoint)."""

    def __init__(self, rank: int):
        self.key = f"rank_{rank}"

    def state_dict(self) -> dict[str, Any]:
        return {self.key: capture_rng()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng(state[self.key])


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise), detached."""
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach()


def local_tensors(state: Any) -> Any:
    """`state` with every DTensor replaced by this rank's shard of it: what a snapshot serializes."""
    return map_tensors(state, local_shard)


def placed_like(saved: Any, template: Any) -> Any:
    """`saved` (`local_tensors` of a state) with each local shard made a DTensor again where `template` (the live
    state of a rank with the same layout) has one at the same place; everything else as saved."""
    if isinstance(saved, torch.Tensor):
        if not hasattr(template, "device_mesh"):
            return saved
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            saved.to(template.device),
            template.device_mesh,
            template.placements,
            run_check=False,
            shape=template.shape,
            stride=template.stride(),
        )
    if isinstance(saved, dict):
        templates = template if isinstance(template, dict) else {}
        return {key: placed_like(value, templates.get(key)) for key, value in saved.items()}
    if isinstance(saved, (list, tuple)):
        same_shape = isinstance(template, (list, tuple)) and len(template) == len(saved)
        templates = template if same_shape else [None] * len(saved)
        return type(saved)(placed_like(value, like) for value, like in zip(saved, templates))
    return saved
