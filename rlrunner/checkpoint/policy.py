"""Pure decisions of the checkpoint handler: when to save, what to keep, whether configs match."""

from __future__ import annotations

from typing import Any, Iterable, Mapping


def should_save(step: int, save_interval: int, last_step: int) -> bool:
    """Every `save_interval` steps (when > 0), and always at the last step."""
    return step == last_step or (save_interval > 0 and step % save_interval == 0)


def steps_to_delete(complete_steps: Iterable[int], max_keep: int | None) -> list[int]:
    """The oldest complete checkpoints beyond the newest `max_keep` (None keeps all; the newest is never listed)."""
    if max_keep is None:
        return []
    ordered = sorted(set(complete_steps), reverse=True)
    return sorted(ordered[max(1, max_keep) :])


def flatten(prefix: str, value: Any) -> dict[str, Any]:
    """{"a.b.c": leaf} for nested mappings; lists and scalars are leaves."""
    if isinstance(value, Mapping):
        flat: dict[str, Any] = {}
        for key in sorted(value):
            flat.update(flatten(f"{prefix}.{key}" if prefix else str(key), value[key]))
        return flat
    return {prefix: value}


def fingerprint_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """'key (checkpoint X, run Y)' for every key whose value differs or exists on one side only."""
    differences = []
    for key in sorted(set(saved) | set(current)):
        left, right = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if _normalise(left) != _normalise(right):
            differences.append(f"{key} (checkpoint {left!r}, run {right!r})")
    return differences


def _normalise(value: Any) -> Any:
    # JSON turns tuples into lists; ints and floats of the same value are the same setting.
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    return value
