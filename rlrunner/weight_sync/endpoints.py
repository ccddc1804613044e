"""The two ends a weight sync plugs into: a source per training backend, a sink per rollout engine.

A **source** says which blocks of which Hugging Face tensors its actor rank holds (FSDP2 shards are dim-0 rows,
tensor-parallel slices are row or column blocks) and hands them over at each sync. A **sink** says which HF tensors
its engine wants (names, shapes, its dtype) and loads each whole tensor its own way once it has arrived: in place
into a model's own parameters, or through an engine's loader that fuses q/k/v or gate/up.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from rlrunner.weight_sync.plan import TensorSpec


@dataclass(frozen=True)
class Block:
    """Rows [start, stop) along `dim` of HF tensor `name` (full shape `shape`), held by this rank as `tensor`
    (shaped like the block; any dtype: the sync casts it to the sink's)."""

    name: str
    shape: tuple[int, ...]
    dim: int
    start: int
    stop: int
    tensor: torch.Tensor


def distinct_state_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's state-dict tensors by HF name, a tied weight once (under its first name): what a sink receives."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors[name] = tensor
    return tensors


def specs_of(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]


class WeightSource(ABC):
    """One actor rank's side of the sync."""

    @abstractmethod
    def blocks(self) -> list[Block]:
        """The blocks this rank sends, in a fixed order (the same at every sync, so the plan made at join holds).
        A rank that sends nothing (another replica of the same weights sends them) returns []."""

    def block_tensor(self, index: int, block: Block) -> torch.Tensor:
        """The values of block `index` of `blocks()` (which is `block`): asked for in order at each sync, each read
        before the next is asked for. By default the block's own tensor; a source whose blocks hold only shapes (its
        weights are gathered a unit at a time) gives the values here."""
        return block.tensor

    def end_of_sync(self) -> None:
        """The sync has read what it will of the blocks: called on every rank at every sync, one with no blocks too,
        and after a failure (a source that gathers its weights with other ranks finishes its walk over them here)."""


class WeightSink(ABC):
    """One rollout worker's side of the sync."""

    @abstractmethod
    def layout(self) -> list[TensorSpec]:
        """Every tensor the engine wants, once each (a tied weight under its first name), in HF names and the dtype it
        wants them in (the dtype they travel in)."""

    def target(self, spec: TensorSpec) -> torch.Tensor:
        """Where tensor `spec` is assembled: a contiguous tensor of its shape and dtype. By default a new one on the
        engine's device; an engine whose parameters are in HF layout returns its own, to be written in place."""
        return torch.empty(spec.shape, dtype=spec.dtype, device=self.device)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @abstractmethod
    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Tensor `name` has arrived whole in `tensor` (the one `target` gave): load it."""

    def finish(self) -> None:
        """Every tensor of this sync has been loaded (e.g. drop what was cached from the old weights)."""
