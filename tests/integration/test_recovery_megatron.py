"""The same failures with the Megatron (tensor-parallel) backend on a real multi-node Ray cluster (recovery_helpers.py):
tp=2 on the actor node's 2 CPUs, compared with the session's Megatron reference run.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from recovery_helpers import (
    RUN,
    assert_matches_reference,
    assert_restored_from_memory,
    driver_command,
    driver_last_line,
    kill,
    kill_in_next_update,
    recovery_events,
    wait_for,
)
from reference_runs import MEGATRON, NUMERICS, Reference, reference_run

from rlrunner.runner.supervisor import Supervisor
from rlrunner.tools.convert import load_model_weights

from conftest import assert_bit_equal, metrics_lines, once, read_metrics, run_config, without_time

pytestmark = [pytest.mark.slow, pytest.mark.multinode]


@pytest.fixture(scope="module")
def megatron_reference(cluster, tmp_path_factory) -> Reference:
    """The session's Megatron reference run (trained on this module's cluster if no module before trained it)."""
    return reference_run("megatron", tmp_path_factory)


def test_megatron_rollout_worker_then_tensor_parallel_rank_killed_mid_step(cluster, megatron_reference, tmp_path):
    """The rollout worker killed after step 3: the tensor-parallel ranks' channels are joined again with the new
    rollout worker (each sends its own slices) and no step is lost. Then tp rank 1 dies in the update after step 6 and
    comes back from the in-memory snapshot. (Both in one run: one run's start-up less for the suite.)"""
    runner = Supervisor(run_config(tmp_path, *RUN, *MEGATRON))
    once(lambda: metrics_lines(tmp_path) >= 3, lambda: kill(runner.trainer.rollout_group.hosts[0]["pid"]))
    kill_in_next_update(runner, 1, 6)
    runner.run()
    [repair] = recovery_events(tmp_path, "rollout_repaired")
    assert "rollout rank 0" in repair["cause"] and repair["lost_steps"] == 0 and repair["step"] in (4, 5), repair
    failure = assert_restored_from_memory(tmp_path)
    assert "actor rank 1" in failure["cause"] and failure["step"] >= 6, failure
    assert_matches_reference(tmp_path, megatron_reference)


def test_megatron_sigterm_writes_an_emergency_checkpoint_then_auto_resumes(
    cluster, megatron_reference, tmp_path, subprocess_env
):
    driver = subprocess.Popen(
        [sys.executable, "-m", "rlrunner.main_grpo", *driver_command(cluster, tmp_path, *MEGATRON)],
        env=subprocess_env,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: metrics_lines(tmp_path) >= 4)
    driver.send_signal(signal.SIGTERM)
    _, err = driver.communicate(timeout=60)
    assert driver.returncode == 3, err
    stopped_at = int(driver_last_line(err).split("at step ")[1].split(";")[0])
    actor = tmp_path / "test" / "checkpoints" / f"global_step_{stopped_at}" / "actor"
    assert (actor / "latest_checkpointed_iteration.txt").read_text() == str(stopped_at)
    Supervisor(run_config(tmp_path, *RUN, *MEGATRON, "runner.resume_dir=auto")).run()
    assert_matches_reference(tmp_path, megatron_reference)


def test_megatron_dp2_tp2_rank_killed_mid_update_is_replaced_within_seconds(cluster, tmp_path):
    """At dp 2 x tp 2 an actor rank dies in the update: the survivors that leave their process group keep their
    processes; one blocked in a tensor-parallel collective with a partner that already left is replaced too, after
    LEAVE_TIMEOUT_S rather than the step timeout; no step is lost and the run ends bit-identical to the uninterrupted
    run at the same layout (its own: dp 2 reduces in another order than the session's tp 2 x dp 1 reference)."""
    from rlrunner.runner.actor_repair import LEAVE_TIMEOUT_S

    layout = [
        *NUMERICS,
        *MEGATRON,
        "runner.max_steps=5",
        "runner.save_interval=5",
        "actor.num_workers=4",
        "cluster.cpus_per_actor_worker=0.5",
        "cluster.cpus_per_rollout_worker=1",
        "runner.recovery.step_timeout_s=90",
        "runner.recovery.wait_timeout_s=120",
    ]
    Supervisor(run_config(tmp_path / "whole", *layout)).run()
    runner = Supervisor(run_config(tmp_path / "killed", *layout))
    kill_in_next_update(runner, 3, 2)
    runner.run()
    failure = assert_restored_from_memory(tmp_path / "killed")
    assert "actor rank 3" in failure["cause"] and failure["replaced"] == "actor ranks 3", failure
    [resumed] = recovery_events(tmp_path / "killed", "resumed")
    assert 3 in resumed["replaced_ranks"] and resumed["leave_s"] < LEAVE_TIMEOUT_S + 5, resumed
    whole, killed = (read_metrics(tmp_path / run / "test" / "metrics.jsonl") for run in ("whole", "killed"))
    assert [m["step"] for m in killed] == [1, 2, 3, 4, 5] and without_time(killed) == without_time(whole)
    last = "test/checkpoints/global_step_5"
    assert_bit_equal(load_model_weights(tmp_path / "killed" / last), load_model_weights(tmp_path / "whole" / last))
