"""Nested structures of tensors (dicts, lists, tuples of tensors and plain values), and the host memory they need."""

from __future__ import annotations

from typing import Any, Callable

import torch

# Values that hold no tensor and cannot change in place.
PLAIN_TYPES = frozenset({int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size})


def map_tensors(state: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`state` with every tensor replaced by `fn(tensor)`; containers rebuilt, other values kept."""
    if isinstance(state, torch.Tensor):
        return fn(state)
    if isinstance(state, dict):
        return {key: map_tensors(value, fn) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        if all(type(value) in PLAIN_TYPES for value in state):  # no tensor inside (Python's RNG state: 625 ints)
            return type(state)(state)
        return type(state)(map_tensors(value, fn) for value in state)
    return state


def tensor_bytes(state: Any) -> int:
    """The bytes of the tensors in `state`."""
    total = 0

    def count(tensor: torch.Tensor) -> None:
        nonlocal total
        total += tensor.numel() * tensor.element_size()

    map_tensors(state, count)
    return total
