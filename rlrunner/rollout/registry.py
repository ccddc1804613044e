"""The rollout engines by name (`rollout.engine`): a new engine is one module and one line here."""

from __future__ import annotations

from rlrunner.errors import ConfigError
from rlrunner.rollout.base import RolloutEngine
from rlrunner.rollout.hf import HFEngine

ENGINES: dict[str, type[RolloutEngine]] = {"hf": HFEngine}


def get_engine(name: str) -> type[RolloutEngine]:
    """The engine class called `name`, or a ConfigError naming the choices."""
    engine = ENGINES.get(name)
    if engine is None:
        raise ConfigError(f"rollout.engine must be one of {', '.join(ENGINES)}, got '{name}'")
    return engine
