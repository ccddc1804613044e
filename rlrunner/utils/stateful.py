"""The one state protocol: a part of a run's state is `Stateful` (torchtitan's and DCP's `state_dict` /
`load_state_dict` pair), and what a checkpoint or an in-memory snapshot carries is a `StateParts` of named parts.

    parts = StateParts({"dataloader": loader, "runner": progress})
    saved = parts.state_dict()        # {"dataloader": loader.state_dict(), "runner": progress.state_dict()}
    parts.load_state_dict(saved)      # each part gets its own entry back; a missing or unknown part is an error

The driver's state (`rlrunner.runner.driver_state`) and each actor rank's (`ActorWorker.rank_state`) are such sets, and
both a checkpoint and a snapshot save and load them through this one pair of calls, so a part added to a set (the
in-flight batches of an overlapped run, say) is carried by both at once.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StateParts:
    """Named `Stateful` parts saved and loaded as one (a `Stateful` itself)."""

    def __init__(self, parts: Mapping[str, Stateful]):
        for name, part in parts.items():
            if not isinstance(part, Stateful):
                raise TypeError(f"state part {name!r} ({type(part).__name__}) has no state_dict/load_state_dict")
        self.parts = dict(parts)

    def __getitem__(self, name: str) -> Stateful:
        return self.parts[name]

    def names(self) -> list[str]:
        return list(self.parts)

    def without(self, names: Iterable[str]) -> StateParts:
        """These parts less `names` (a checkpoint that cannot restore a part, e.g. RNG at another rank count)."""
        dropped = set(names)
        return StateParts({name: part for name, part in self.parts.items() if name not in dropped})

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Give each part its own entry of `state`. Every part must be there and nothing else: a saved state from
        another set of parts is refused before any part is loaded."""
        missing = [name for name in self.parts if name not in state]
        unknown = [name for name in state if name not in self.parts]
        if missing or unknown:
            what = [f"no {name!r} part" for name in missing] + [f"an unknown {name!r} part" for name in unknown]
            raise ValueError(f"the saved state has {' and '.join(what)} (parts here: {', '.join(self.parts)})")
        for name, part in self.parts.items():
            part.load_state_dict(state[name])
