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
    kill,
    kill_in_next_update,
    recovery_events,
    wait_for,
)
from reference_runs import MEGATRON, Reference, reference_run

from rlrunner.runner.supervisor import Supervisor

from conftest import metrics_lines, once, run_config

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
    kill_in_next_update(runner, 1, 6, tmp_path)
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
    stopped_at = int(err.strip().splitlines()[-1].split("at step ")[1].split(";")[0])
    actor = tmp_path / "test" / "checkpoints" / f"global_step_{stopped_at}" / "actor"
    assert (actor / "latest_checkpointed_iteration.txt").read_text() == str(stopped_at)
    Supervisor(run_config(tmp_path, *RUN, *MEGATRON, "runner.resume_dir=auto")).run()
    assert_matches_reference(tmp_path, megatron_reference)
