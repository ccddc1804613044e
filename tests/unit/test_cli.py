"""Bad input through the real entry point: one line on stderr naming the problem, the right exit code."""

from __future__ import annotations

import json

import pytest

from rlrunner.main_grpo import main

from conftest import error_line


def test_print_config_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--cfg", "runner.max_steps=7"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 7" in out and "log_path: ./logs/grpo-arith" in out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["runner.max_steps=abc"], "bad value for config key 'runner.max_steps'"),
        (["actorr.num_workers=2"], "unknown config key 'actorr'"),
        (
            ["data.batch_size=6", "actor.micro_batch_size=64"],
            "(data.batch_size 6 x algorithm.group_size 16 / actor.num_workers 1 = 96) "
            "must be a multiple of actor.micro_batch_size (64)",
        ),
        (["actor.micro_batch_tokens=0"], "actor.micro_batch_tokens must be positive, got 0"),
        (["actor.num_workers=3"], "must be divisible by actor.num_workers (3)"),
        (
            ["data.batch_size=16", "actor.mini_batch_size=5"],
            "data.batch_size (16) must be a multiple of actor.mini_batch_size (5)",
        ),
        (["algorithm.group_size=1"], "algorithm.group_size must be at least 2"),
        (["reward.verifier=nope"], "reward.verifier must be one of arithmetic, math or null, got 'nope'"),
        (["reward.on_error=skip"], "reward.on_error must be 'raise' or 'zero', got 'skip'"),
        (["reward.function=my reward"], "reward.function must be 'path/to/file.py:name' or 'package.module:name'"),
        (
            ["algorithm.adv_estimator=ppo"],
            "algorithm.adv_estimator must be one of grpo, rloo, reinforce_plus_plus_baseline, got 'ppo'",
        ),
        (["algorithm.loss_agg_mode=mean"], "algorithm.loss_agg_mode must be one of token-mean, seq-mean-token-sum"),
        (["algorithm.policy_lag=-1"], "algorithm.policy_lag must be 0 (synchronous) or more, got -1"),
        (
            ["algorithm.policy_lag=1"],
            "algorithm.policy_lag=1 trains on samples 1 update(s) old: set algorithm.rollout_correction.tis_cap",
        ),
        (
            ["runner.logger.backends=[neptune]"],
            "runner.logger.backends: unknown tracker 'neptune' (choose from tensorboard, wandb, mlflow)",
        ),
        (["rollout.val.num_samples=0"], "rollout.val.num_samples must be >= 1, got 0"),
        (["actor.fsdp.unit=layer"], "actor.fsdp.unit must be one of auto, decoder_layer, linear, model, got 'layer'"),
        (["actor.fsdp_unit=linear"], "config key 'actor.fsdp_unit' is now 'actor.fsdp.unit'"),
        (["actor.shard_gradients=false"], "config key 'actor.shard_gradients' is now 'actor.megatron.shard_gradients'"),
        (["+actor.shard_weights=false"], "config key 'actor.shard_weights' is now 'actor.megatron.shard_weights'"),
        (["model.path=/nonexistent/model"], "model.path does not exist: /nonexistent/model"),
        (["--config-name", "nope"], "config 'nope' not found"),
    ],
)
def test_config_errors(overrides, expected, capsys):
    assert main(overrides) == 2
    assert expected in error_line(capsys)


def test_model_path_that_is_not_a_hf_model(tmp_path, capsys):
    (tmp_path / "weights.bin").write_bytes(b"0")
    assert main([f"model.path={tmp_path}"]) == 2
    assert "is not a Hugging Face model folder (no config.json)" in error_line(capsys)


def test_missing_data_file(tmp_path, capsys):
    missing = tmp_path / "train.jsonl"
    assert main([f"data.train_files={missing}", "runner.logger.backends=[]"]) == 2
    assert f"data file not found: {missing}" in error_line(capsys)


def test_data_file_without_prompt_field(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    assert main([f"data.train_files={data}", "runner.logger.backends=[]"]) == 2
    line = error_line(capsys)
    assert "record 0 has no 'prompt' field" in line and "question" in line


def test_bad_resume_dir_is_reported_before_ray_starts(tmp_path, capsys):
    import ray

    assert not ray.is_initialized()
    missing = tmp_path / "checkpoints" / "global_step_5"
    assert main([f"runner.output_dir={tmp_path}", f"runner.resume_dir={missing}", "runner.logger.backends=[]"]) == 2
    assert error_line(capsys) == f"rlrunner: error: runner.resume_dir does not exist: {missing}"
    assert not ray.is_initialized(), "the error must come before Ray's start-up"


def test_a_reward_function_that_cannot_load_is_refused_before_ray_starts(tmp_path, capsys):
    """Loaded once in a scoring process of the driver's: the file, and what is wrong with it, in one line."""
    import ray

    missing = tmp_path / "my_reward.py"
    assert main([f"reward.function={missing}:compute_score", "runner.logger.backends=[]"]) == 2
    assert error_line(capsys) == f"rlrunner: error: reward.function: file not found: {missing}"
    missing.write_text("def score(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n")
    assert main([f"reward.function={missing}", "runner.logger.backends=[]"]) == 2
    assert error_line(capsys) == f"rlrunner: error: reward.function: {missing} has no 'compute_score'"
    assert not ray.is_initialized()


def test_a_tools_file_an_environment_or_a_parser_that_cannot_load_is_refused_before_ray_starts(tmp_path, capsys):
    """rollout.multi_turn's code, loaded once in a tool process of the driver's: one line, exit code 2, no Ray."""
    import ray

    tools = tmp_path / "tools.py"
    base = [f"runner.output_dir={tmp_path}", "runner.logger.backends=[]"]
    assert main([*base, f"rollout.multi_turn.tools={tools}"]) == 2
    assert error_line(capsys) == f"rlrunner: error: rollout.multi_turn.tools: file not found: {tools}"
    tools.write_text("import no_such_module_here\n")
    assert main([*base, f"rollout.multi_turn.tools={tools}"]) == 2
    assert error_line(capsys) == (
        f"rlrunner: error: rollout.multi_turn.tools: {tools} does not import: "
        "ModuleNotFoundError: No module named 'no_such_module_here'"
    )
    tools.write_text("def helper(x):\n    return x\n")
    assert main([*base, f"rollout.multi_turn.tools={tools}"]) == 2
    assert "has no tools (public functions with type hints and a docstring)" in error_line(capsys)
    assert main([*base, f"rollout.multi_turn.env={tools}:Game"]) == 2
    assert error_line(capsys) == f"rlrunner: error: rollout.multi_turn.env: {tools} has no 'Game'"
    assert main([*base, f"rollout.multi_turn.env={tools}:helper"]) == 2
    assert "'helper' in" in error_line(capsys)  # not a class with reset() and step()
    tools.write_text(
        'def f(x: int) -> int:\n    """Double.\n\n    Args:\n        x: a number\n    """\n    return 2 * x\n'
    )
    parser = tmp_path / "parser.py"
    assert main([*base, f"rollout.multi_turn.tools={tools}", f"rollout.multi_turn.parser={parser}:parse"]) == 2
    assert error_line(capsys) == f"rlrunner: error: rollout.multi_turn.parser: file not found: {parser}"
    assert main([*base, f"rollout.multi_turn.tools={tools}", f"rollout.multi_turn.env={tools}:X"]) == 2
    assert "rollout.multi_turn.tools and rollout.multi_turn.env are both set" in error_line(capsys)
    assert main([*base, f"rollout.multi_turn.tools={tools}", "rollout.multi_turn.parser=xml"]) == 2
    assert "rollout.multi_turn.parser must be one of hermes or 'path/to/file.py:function'" in error_line(capsys)
    assert not ray.is_initialized()


def test_a_cluster_that_does_not_answer_is_one_line_and_exit_code_1(tmp_path, capsys):
    """cluster.ray_address where nothing listens: said at once (Ray would retry its GCS for minutes), no traceback."""
    import socket

    import ray

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    assert main([f"cluster.ray_address={address}", f"runner.output_dir={tmp_path}", "runner.logger.backends=[]"]) == 1
    assert error_line(capsys) == (
        f"rlrunner: error: cannot join the Ray cluster at {address}: nothing answers there (Connection refused); start "
        "it (`ray start --head` on its head node) or set cluster.ray_address / RAY_ADDRESS to its address"
    )
    assert not ray.is_initialized()


def test_an_embedded_ray_that_does_not_start_is_one_line_and_exit_code_1(tmp_path, subprocess_env):
    """Its temporary folder a file: Ray's own error, in one line, exit code 1 (the launch script relaunches it)."""
    import subprocess
    import sys

    (tmp_path / "not_a_folder").write_text("")
    env = {**subprocess_env, "TMPDIR": str(tmp_path / "not_a_folder")}
    command = [sys.executable, "-m", "rlrunner.main_grpo", f"runner.output_dir={tmp_path}", "runner.logger.backends=[]"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("rlrunner: error:")]
    assert line.startswith("rlrunner: error: the embedded Ray did not start: NotADirectoryError: ") and line.endswith(
        "a relaunch may mend it (or start one with `ray start --head` and run again)"
    )
