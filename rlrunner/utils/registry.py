"""Registries of lazy entries: a name maps to "module:attr", imported only when the entry is used.

    LOSSES = {"ppo_clip": "rlrunner.algorithms.policy_losses:ppo_clip"}
    check_name(LOSSES, "gspo", "algorithm.policy_loss")      # ConfigError naming the key and the choices
    loss = load_entry(LOSSES, "ppo_clip", "algorithm.policy_loss")

Checking a config imports nothing heavy; a new variant is one module (or function) and one line in its registry.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from rlrunner.errors import ConfigError


def check_name(registry: Mapping[str, str], name: str, key: str) -> None:
    """ConfigError naming `key` and the choices unless `name` is in `registry`."""
    if name not in registry:
        raise ConfigError(f"{key} must be one of {', '.join(registry)}, got '{name}'")


def import_attr(entry: str) -> Any:
    """The object named by "module:attr" (imported now)."""
    module, _, attr = entry.partition(":")
    return getattr(importlib.import_module(module), attr)


def load_entry(registry: Mapping[str, str], name: str, key: str) -> Any:
    """The object registered as `name` (imported now); ConfigError naming `key` for an unknown name."""
    check_name(registry, name, key)
    return import_attr(registry[name])
