"""An FSDP rank's state rebuilt from an in-memory snapshot taken at another data-parallel size (an elastic run that
shrank or grew).

Every DTensor of the state (the weights, Adam's moments) is sharded by rows, FSDP2's torch.chunk split, so the rows a
rank holds at one size are a range of the rows some ranks held at another: each old rank's part is read in turn (one
at a time, so a rank never holds more than its own state and one old part) and the overlap of its rows copied in.
The rest (the LR schedule, optimizer step counts, hyper-parameters) is the same on every old rank and taken from the
first part that has it; a rank's RNG state from its own old rank where there was one (the update draws no random
numbers; a rank beyond the old size keeps its own).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from rlrunner.backends.fsdp.weights import shard_rows
from rlrunner.backends.rank_parts import local_shard

_MISSING = object()


def _sharded(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and hasattr(tensor, "device_mesh")


def _blank(template: Any) -> Any:
    """The local state to fill: an empty local shard for each DTensor, a placeholder for everything else."""
    if _sharded(template):
        return torch.empty_like(local_shard(template))
    if isinstance(template, dict):
        return {key: _blank(value) for key, value in template.items()}
    if isinstance(template, (list, tuple)) and not all(isinstance(v, (int, float, str, bool)) for v in template):
        return [_blank(value) for value in template]
    return _MISSING


def _merge(template: Any, out: Any, saved: Any, old_rank: int, old_world: int, rank: int, world: int) -> Any:
    if _sharded(template):
        if saved is _MISSING:
            raise ValueError("a snapshot part lacks a sharded tensor of this rank's state")
        rows = template.shape[0]
        start, stop = shard_rows(rows, world, rank)
        old_start, old_stop = shard_rows(rows, old_world, old_rank)
        low, high = max(start, old_start), min(stop, old_stop)
        if low < high:
            out[low - start : high - start].copy_(saved[low - old_start : high - old_start])
        return out
    if isinstance(template, dict):
        given = saved if isinstance(saved, dict) else {}
        return {
            key: _merge(value, out[key], given.get(key, _MISSING), old_rank, old_world, rank, world)
            for key, value in template.items()
        }
    if isinstance(out, list):
        given = saved if isinstance(saved, (list, tuple)) and len(saved) == len(out) else [_MISSING] * len(out)
        merged = [_merge(t, o, s, old_rank, old_world, rank, world) for t, o, s in zip(template, out, given)]
        return type(template)(merged) if isinstance(template, tuple) else merged
    return saved if out is _MISSING else out  # the first part that has it


def _finish(template: Any, out: Any) -> Any:
    """Placeholders no part filled keep the live value (a new rank's RNG)."""
    if out is _MISSING:
        return template
    if isinstance(out, dict):
        return {key: _finish(template[key], value) for key, value in out.items()}
    if isinstance(out, (list, tuple)):
        merged = [_finish(t, o) for t, o in zip(template, out)]
        return type(template)(merged) if isinstance(template, tuple) else merged
    return out


def resharded_state(template: Any, parts: Iterable[tuple[int, Any]], old_world: int, rank: int, world: int) -> Any:
    """This rank's state at `world` ranks as local shards (`placed_like` makes them DTensors again), from the parts
    (old rank, its `local_tensors` state) of a snapshot taken at `old_world` ranks; `template` is the live state."""
    out = _blank(template)
    for old_rank, saved in parts:
        out = _merge(template, out, saved, old_rank, old_world, rank, world)
    return _finish(template, out)
