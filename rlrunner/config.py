"""The run configuration, loaded: composed by Hydra's compose API from `configs/` on top of the schema
(`rlrunner/schema.py`), resolved, then checked (`rlrunner/config_checks.py`); every problem is one ConfigError line.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlrunner.config_checks import validate_config
from rlrunner.errors import ConfigError, first_line
from rlrunner.schema import GRPOConfig

DEFAULT_CONFIG_NAME = "grpo"
_SCHEMA_NAME = "grpo_schema"
# keys that moved: an old name is refused with its new one
MOVED_KEYS = {
    "actor.fsdp_unit": "actor.fsdp.unit",
    "actor.shard_gradients": "actor.megatron.shard_gradients",
    "actor.shard_weights": "actor.megatron.shard_weights",
}


def default_config_dir() -> Path:
    """``configs/`` beside the package (the repository layout), or $RLRUNNER_CONFIG_DIR."""
    env = os.environ.get("RLRUNNER_CONFIG_DIR")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "configs"


@functools.cache  # once per process: building the structured node is a third of a compose (Hydra copies it on load)
def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=_SCHEMA_NAME, node=GRPOConfig)


def load_config(
    overrides: list[str] | None = None,
    config_name: str = DEFAULT_CONFIG_NAME,
    config_dir: str | Path | None = None,
) -> DictConfig:
    """Compose ``config_name`` from ``config_dir`` with Hydra overrides; raise ConfigError on any problem.

    The compose API is used instead of ``@hydra.main`` so that Hydra neither changes the working
    directory nor writes output folders, and so errors can be reported in one line.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    directory = Path(config_dir) if config_dir else default_config_dir()
    if not directory.is_dir():
        raise ConfigError(f"config directory not found: {directory}")
    if not (directory / f"{config_name}.yaml").is_file():
        raise ConfigError(f"config '{config_name}' not found in {directory}")
    for override in overrides or []:
        _refuse_moved_key(override.split("=", 1)[0].lstrip("+~"))
    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(directory.resolve()), version_base=None):
            cfg = compose(config_name=config_name, overrides=list(overrides or []))
    except Exception as exc:  # Hydra wraps OmegaConf errors in several layers
        raise ConfigError(_describe_hydra_error(exc)) from None
    finally:
        GlobalHydra.instance().clear()
    try:
        OmegaConf.resolve(cfg)
    except Exception as exc:
        raise ConfigError(f"config interpolation failed: {first_line(str(exc)) or type(exc).__name__}") from None
    OmegaConf.set_struct(cfg, True)
    validate_config(cfg)
    return cfg


def _describe_hydra_error(exc: BaseException) -> str:
    """One line naming the offending key, from the chain of Hydra / OmegaConf exceptions."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    chain: list[BaseException] = []
    node: BaseException | None = exc
    while node is not None and node not in chain:
        chain.append(node)
        node = node.__cause__ or node.__context__
    for err in chain:
        full_key = getattr(err, "full_key", None)
        if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and full_key:
            if full_key in MOVED_KEYS:
                return _moved_key_message(full_key)
            return f"unknown config key '{full_key}' (check its spelling; `--cfg` prints every key)"
        if isinstance(err, ValidationError) and full_key:
            return f"bad value for config key '{full_key}': {first_line(str(err)) or type(err).__name__}"
    message = first_line(str(exc)) or type(exc).__name__
    if message.startswith("Could not override"):
        # e.g. "Could not override 'runner.foo'." when the cause has no key attached
        return f"{message.rstrip('.')} : {first_line(str(chain[-1])) or type(chain[-1]).__name__}"
    return f"config error: {message}"


def _refuse_moved_key(key: str) -> None:
    if key in MOVED_KEYS:
        raise ConfigError(_moved_key_message(key))


def _moved_key_message(key: str) -> str:
    return (
        f"config key '{key}' is now '{MOVED_KEYS[key]}' (backend options sit under actor.fsdp.* and actor.megatron.*)"
    )


def config_to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)
