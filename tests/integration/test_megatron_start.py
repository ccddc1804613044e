"""Starting a Megatron run: the parallel settings and models it refuses in one line before any worker starts, and a
start from a model folder (HF or converted to Megatron's layout) with exactly the folder's weights."""

from __future__ import annotations

import pytest
from reference_runs import assert_same_weights, start_weights

from rlrunner.errors import ConfigError
from rlrunner.runner.supervisor import Supervisor

from conftest import run_config, run_toolkit

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["actor.tensor_model_parallel_size=2"],
            "actor.tensor_model_parallel_size=2 needs actor.training_backend=megatron",
        ),
        (
            ["actor.training_backend=megatron", "actor.tensor_model_parallel_size=2", "actor.num_workers=3"],
            "actor.num_workers (3) must be a multiple of actor.tensor_model_parallel_size (2)",
        ),
        (["actor.training_backend=deepspeed"], "actor.training_backend must be one of fsdp, megatron, got 'deepspeed'"),
        (
            ["actor.megatron.shard_gradients=false"],
            "actor.megatron.shard_gradients=false needs actor.training_backend=megatron",
        ),
        (
            ["actor.megatron.shard_weights=false"],
            "actor.megatron.shard_weights=false needs actor.training_backend=megatron",
        ),
        (
            ["actor.training_backend=megatron", "actor.megatron.shard_gradients=false"],
            "actor.megatron.shard_weights=true needs actor.megatron.shard_gradients=true",
        ),
    ],
    ids=[
        "tp_without_megatron",
        "workers_not_a_multiple",
        "unknown_backend",
        "whole_gradients_without_megatron",
        "whole_weights_without_megatron",
        "sharded_weights_with_whole_gradients",
    ],
)
def test_parallel_config_errors_are_one_line(tmp_path, overrides, expected):
    with pytest.raises(ConfigError) as error:
        run_config(tmp_path, *overrides)
    assert str(error.value).startswith(expected)


def test_a_model_that_does_not_split_is_refused_before_workers_start(tmp_path):
    # the test model has one query group: it cannot be split over two tensor-parallel ranks
    cfg = run_config(tmp_path, "actor.training_backend=megatron", "actor.tensor_model_parallel_size=2")
    with pytest.raises(
        ConfigError, match=r"tensor_model_parallel_size=2: cannot split num_key_value_heads \(query groups\)=1"
    ):
        Supervisor(cfg)


@pytest.mark.parametrize("folder, backend", [("hf", "fsdp"), ("hf", "megatron"), ("megatron", "megatron")])
def test_a_run_starts_from_a_model_folder_exactly(ray_session, tmp_path, folder, backend):
    """model.path at an HF folder (each rank reads only its rows and columns of the safetensors; the tied output layer
    from the embedding, which the folder does not repeat) or at convert_hf_to_megatron.py's output: the run starts from
    the folder's weights exactly."""
    from rlrunner.backends.registry import check_model_path

    from megatron_models import TIED, save_hf_folder

    path, hf_model = save_hf_folder(tmp_path / "hf", TIED)  # tied embeddings: lm_head is the embedding
    if folder == "megatron":
        path = tmp_path / "megatron"
        run_toolkit(
            "convert_hf_to_megatron",
            "--hf_path",
            str(tmp_path / "hf"),
            "--output_path",
            str(path),
            "--tensor_model_parallel_size",
            "2",
        )
        check_model_path(str(path))
    # the test config's model overrides, made to agree with the folder's shape
    overrides = [
        f"model.path={path}",
        f"actor.training_backend={backend}",
        "model.override_config.num_attention_heads=4",
        "model.override_config.num_key_value_heads=4",
    ]
    if backend == "megatron":
        overrides.append("actor.tensor_model_parallel_size=2")
    weights = start_weights(run_config(tmp_path / "run", *overrides, "runner.max_steps=1"))
    assert_same_weights(weights, hf_model.state_dict())  # the HF model's key order
