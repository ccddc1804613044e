"""The rollout engines by name (`rollout.engine`): a new engine is one module and one line here.

Each entry is "module:class" (`rlrunner/utils/registry.py`), imported when the engine is built, so that checking a
config does not import every engine (an engine may import a large library, such as vLLM).
"""

from __future__ import annotations

from rlrunner.utils.registry import check_name, load_entry

ENGINES: dict[str, str] = {"hf": "rlrunner.rollout.hf:HFEngine", "vllm": "rlrunner.rollout.vllm_engine:VLLMEngine"}


def check_engine(name: str) -> None:
    """ConfigError naming the choices unless `name` is a registered engine."""
    check_name(ENGINES, name, "rollout.engine")


def get_engine(name: str) -> type:
    """The `RolloutEngine` subclass called `name` (imported now)."""
    return load_entry(ENGINES, name, "rollout.engine")
