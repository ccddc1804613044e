"""The rollout engines by name (`rollout.engine`): a new engine is one module and one line here.

Each entry is "module:class", imported when the engine is built, so that checking a config does not import every
engine (an engine may import a large library, such as vLLM).
"""

from __future__ import annotations

import importlib

from rlrunner.errors import ConfigError

ENGINES: dict[str, str] = {"hf": "rlrunner.rollout.hf:HFEngine", "vllm": "rlrunner.rollout.vllm_engine:VLLMEngine"}


def check_engine(name: str) -> None:
    """ConfigError naming the choices unless `name` is a registered engine."""
    if name not in ENGINES:
        raise ConfigError(f"rollout.engine must be one of {', '.join(ENGINES)}, got '{name}'")


def get_engine(name: str) -> type:
    """The `RolloutEngine` subclass called `name` (imported now)."""
    check_engine(name)
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)
