"""Shared fixtures: one local Ray instance for the whole session, and small fast run configs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# `model.*` settings of a one-layer model for tests that build models directly (no config loading).
TINY_MODEL_CFG = {
    "path": None,
    "dtype": "float32",
    "attn_implementation": "sdpa",
    "override_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    },
}

# A model small enough that a GRPO step takes well under a second on one CPU core.
TINY_MODEL = [
    "+model.override_config.hidden_size=32",
    "+model.override_config.intermediate_size=64",
    "+model.override_config.num_hidden_layers=2",
    "+model.override_config.num_attention_heads=2",
    "+model.override_config.num_key_value_heads=1",
]


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray with more logical CPUs than cores, so that several small worker groups fit on 2 cores.

    Module-scoped: the recovery tests run their own multi-node cluster instead.
    """
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def run_config(tmp_path: Path, *overrides: str):
    """A config for a short run writing under tmp_path (tiny model, small batch, no progress bar)."""
    from rlrunner.config import load_config

    base = [
        f"runner.output_dir={tmp_path}",
        "runner.experiment_name=test",
        "runner.max_steps=4",
        "runner.logger.progress_bar=false",
        "data.batch_size=4",
        "algorithm.group_size=4",
        "actor.micro_batch_size=4",
        "cluster.cpus_per_actor_worker=0.5",
        "cluster.cpus_per_rollout_worker=0.5",
        "cluster.placement_timeout_s=30",
        *TINY_MODEL,
    ]
    return load_config(base + list(overrides))


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def without_time(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


@pytest.fixture
def subprocess_env(repo_root) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(repo_root) + os.pathsep + env.get("PYTHONPATH", "")
    return env
