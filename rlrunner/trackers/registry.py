"""The trackers by name, and the check of `runner.logger.backends` the driver runs before anything starts.

Imports no tracker package (torch, wandb, mlflow): `check_backends` only looks whether they are installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

from rlrunner.errors import ConfigError

KEY = "runner.logger.backends"

TRACKERS = {
    "tensorboard": "rlrunner.trackers.tensorboard:TensorBoardTracker",
    "wandb": "rlrunner.trackers.wandb_tracker:WandbTracker",
    "mlflow": "rlrunner.trackers.mlflow_tracker:MlflowTracker",
}

# the package each tracker needs; its pip extra is the tracker's name: pip install 'rlrunner[<name>]'
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def missing_package(name: str, packages: Mapping[str, str] = PACKAGES) -> str | None:
    """The package tracker `name` needs when it is not installed, else None (found without importing it)."""
    package = packages.get(name)
    if package is None:
        return None
    try:
        found = importlib.util.find_spec(package) is not None
    except ValueError:  # imported already, without a spec
        found = True
    return None if found else package


def check_backends(backends: list[str], packages: Mapping[str, str] = PACKAGES) -> None:
    """ConfigError (one line) for an unknown or repeated tracker name, or a tracker whose package is missing."""
    if isinstance(backends, str) or not all(isinstance(name, str) for name in backends):
        raise ConfigError(f"{KEY} must be a list of tracker names ({', '.join(TRACKERS)}), got {backends!r}")
    seen: set[str] = set()
    for name in backends:
        if name not in TRACKERS:
            raise ConfigError(f"{KEY}: unknown tracker '{name}' (choose from {', '.join(TRACKERS)})")
        if name in seen:
            raise ConfigError(f"{KEY}: '{name}' is listed twice")
        seen.add(name)
        package = missing_package(name, packages)
        if package is not None:
            raise ConfigError(f"{KEY} has {name}, which needs the {package} package: pip install 'rlrunner[{name}]'")
