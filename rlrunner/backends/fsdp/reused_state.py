"""DCP's state dicts of a rank's model and optimizer, read once and handed out again while the live tensors are the
same ones.

    reused = ReusedRead()
    state = reused.get(lambda: get_model_state_dict(model), lambda: Live([*model.parameters(), *model.buffers()]))

`get_model_state_dict` and `get_optimizer_state_dict` work out every parameter's name on each call: most of the 6 ms
an actor rank of the default job spent starting its part of a snapshot, every step. Their tensors alias the live
ones, so a dict read at one step holds the values of the next steps too (updates are in place), for as long as no live
tensor is replaced (a load, the optimizer's first step). A read records the live tensors (the objects, held so that no
other can take their place) and where each one's values are; a later `get` that finds the same objects with their
values at the same addresses hands the dict out again, its containers copied; else it reads anew. A dict whose
tensors do not all alias live ones (a copy) is never handed out twice. Values that change beside the tensors (the
optimizer's learning rate) are the caller's to refresh (`FSDPOptimizerState`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from rlrunner.utils.tensors import map_tensors


def _values(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding `tensor`'s values on this rank: a DTensor's local shard."""
    with torch.no_grad():  # to_local outside no_grad goes through autograd: 20 times slower
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class Live:
    """What a state dict was read from: the live tensors, where their values are, and plain values beside them."""

    def __init__(self, tensors: Iterable[torch.Tensor], plain: tuple = ()):
        self.tensors = list(tensors)
        self.addresses = [_values(t).data_ptr() for t in self.tensors]
        self.plain = plain

    def same(self, other: Live) -> bool:
        return (
            len(self.tensors) == len(other.tensors)
            and all(a is b for a, b in zip(self.tensors, other.tensors))
            and self.addresses == other.addresses
            and self.plain == other.plain
        )


def _aliases_live(state: Any, live: Live) -> bool:
    """Whether every tensor of `state` has its values where a live tensor's are (it reads the live values)."""
    addresses = set(live.addresses)
    found = []
    map_tensors(state, lambda t: found.append(_values(t).data_ptr() in addresses))
    return all(found)


class ReusedRead:
    """One part's state dict, read again only when its live tensors changed (see the module's docstring)."""

    def __init__(self) -> None:
        self.state: Any = None
        self.live: Live | None = None
        self.reads = 0  # how many times the state dict was read (the rest were handed out again)

    def get(self, read: Callable[[], Any], live: Callable[[], Live]) -> Any:
        now = live()
        if self.live is None or not self.live.same(now):
            state = read()
            self.reads += 1
            now = live()  # the read may make tensors (DCP gives an optimizer without state its state first)
            if not _aliases_live(state, now):
                self.state, self.live = None, None
                return state
            self.state, self.live = state, now
        return map_tensors(self.state, lambda t: t)  # the containers copied: a caller may change them
