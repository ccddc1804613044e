"""The driver or a node lost on a real multi-node Ray cluster (recovery_helpers.py): a node preempted and replaced,
SIGTERM and its emergency checkpoint, a second signal, the launch script relaunching a dead driver, a wall-time stop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import ray
from recovery_helpers import (
    RUN,
    assert_matches_reference,
    driver_command,
    driver_last_line,
    recovery_events,
    train_in_thread,
    wait_for,
)
from reference_runs import Reference, reference_run

from rlrunner.checkpoint import layout
from rlrunner.errors import StoppedEarly
from rlrunner.runner.stopping import StopRequest
from rlrunner.runner.supervisor import Supervisor
from rlrunner.storage import basename

from conftest import LOCAL, metrics_lines, once, run_config

pytestmark = [pytest.mark.slow, pytest.mark.multinode]


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory) -> Reference:
    """The session's FSDP reference run (trained on this module's cluster if no module before trained it)."""
    return reference_run("fsdp", tmp_path_factory)


@pytest.mark.parametrize("strategy", ["PACK", "STRICT_SPREAD"])
def test_node_lost_and_replaced(cluster, reference, tmp_path, strategy):
    """PACK: both actor ranks on the actor node, their snapshot parts in the head node's holder: restored from memory.
    STRICT_SPREAD: one rank on each node, each rank's part on the other node: the lost node takes a rank and the
    other rank's part, the snapshot is incomplete, and the checkpoint on storage is loaded."""
    runner = Supervisor(run_config(tmp_path, *RUN, f"cluster.placement_strategy={strategy}"))
    trainer, errors = train_in_thread(runner)
    # after step 4, and once step 3's checkpoint is committed (saved in the background): the fallback has one
    wait_for(lambda: metrics_lines(tmp_path) >= 4 and (tmp_path / "test" / "checkpoints" / "global_step_3").is_dir())
    cluster.remove_node(cluster.actor_node)  # preemption
    wait_for(lambda: bool(recovery_events(tmp_path, "failure")))
    time.sleep(1.0)  # the driver is now waiting for the cluster to fit the actor group again
    cluster.actor_node = cluster.add_node(num_cpus=2)
    trainer.join(timeout=240)
    assert not trainer.is_alive() and not errors, errors
    [failure] = recovery_events(tmp_path, "failure")
    [resumed] = recovery_events(tmp_path, "resumed")
    assert resumed["wait_s"] >= 0.5  # it waited for the replacement node
    if strategy == "PACK":
        assert "actor rank 0" in failure["cause"] and "actor rank 1" in failure["cause"]
        # the newest parts may still have been on their way from the lost node: at most that step is redone
        assert failure["restore_from"] == "snapshot" and failure["lost_steps"] <= 1, failure
    else:
        assert failure["restore_from"] == "checkpoint" and resumed["source"] == "checkpoint", failure
        assert resumed["step"] % 3 == 0 and failure["lost_steps"] <= 3
    assert_matches_reference(tmp_path, reference)


def test_sigterm_writes_an_emergency_checkpoint_then_auto_resumes(cluster, reference, tmp_path, subprocess_env):
    driver = subprocess.Popen(
        [sys.executable, "-m", "rlrunner.main_grpo", *driver_command(cluster, tmp_path)],
        env=subprocess_env,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: metrics_lines(tmp_path) >= 4)
    driver.send_signal(signal.SIGTERM)
    _, err = driver.communicate(timeout=60)
    assert driver.returncode == 3, err
    last_line = driver_last_line(err)
    assert (
        last_line.startswith("rlrunner: stopped: SIGTERM received at step ")
        and "resume with runner.resume_dir=auto" in last_line
    )
    stopped_at = int(last_line.split("at step ")[1].split(";")[0])
    assert (tmp_path / "test" / "checkpoints" / f"global_step_{stopped_at}" / "manifest.json").is_file()
    assert metrics_lines(tmp_path) == stopped_at  # the abandoned step (if any) was not logged

    Supervisor(run_config(tmp_path, *RUN, "runner.resume_dir=auto")).run()
    assert_matches_reference(tmp_path, reference)


def test_a_second_signal_exits_at_once(cluster, tmp_path, subprocess_env):
    driver = subprocess.Popen(
        [sys.executable, "-m", "rlrunner.main_grpo", *driver_command(cluster, tmp_path)],
        env=subprocess_env,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: metrics_lines(tmp_path) >= 4)
    # an actor rank stops answering, so the update in flight can never finish: only a second signal ends the run
    # this cluster's actor ranks (asked of its GCS), not every FSDPActorWorker process on the machine
    actor_pids = [
        actor["Pid"]
        for actor in ray._private.state.actors().values()
        if actor["ActorClassName"] == "FSDPActorWorker" and actor["State"] == "ALIVE"
    ]
    assert len(actor_pids) == 2
    for pid in actor_pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        driver.send_signal(signal.SIGTERM)
        time.sleep(1.5)
        assert driver.poll() is None, "the first SIGTERM must wait for the step in flight"
        started = time.monotonic()
        driver.send_signal(signal.SIGTERM)
        _, err = driver.communicate(timeout=30)
        assert time.monotonic() - started < 15
    finally:
        for pid in actor_pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert driver.returncode == 143, err
    assert "rlrunner: stopped at once by a second SIGTERM; the last committed checkpoint is intact" in err
    root = tmp_path / "test" / "checkpoints"
    complete = [basename(u) for u in layout.step_dirs(LOCAL, str(root))]
    assert all((root / name / "manifest.json").is_file() for name in complete)


def test_launch_script_relaunches_a_dead_driver(cluster, reference, tmp_path, subprocess_env, repo_root):
    env = {**subprocess_env, "PYTHON": sys.executable, "RLRUNNER_RESTART_BACKOFF_S": "0"}
    script = subprocess.Popen(
        ["bash", str(repo_root / "launch/run_main_grpo.sh"), *driver_command(cluster, tmp_path)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: metrics_lines(tmp_path) >= 5)
    [driver_pid] = [
        int(p) for p in subprocess.run(["pgrep", "-P", str(script.pid)], capture_output=True, text=True).stdout.split()
    ]
    os.kill(driver_pid, signal.SIGKILL)  # the driver's node "dies"
    _, err = script.communicate(timeout=240)
    assert script.returncode == 0, err
    assert "run_main_grpo.sh: the driver exited with code 137: restart 1 of 3 with runner.resume_dir=auto in 0s" in err
    assert "run_main_grpo.sh: the run finished" in err
    assert_matches_reference(tmp_path, reference)


def test_launch_script_does_not_retry_a_configuration_error(repo_root, subprocess_env, tmp_path):
    result = subprocess.run(
        ["bash", str(repo_root / "launch/run_main_grpo.sh"), "runner.nope=1"],
        cwd=tmp_path,
        env={**subprocess_env, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip().splitlines()[-1] == "run_main_grpo.sh: configuration error (exit code 2): not restarting"
    )
    assert result.stderr.count("rlrunner: error:") == 1


def test_stop_request_from_wall_time_saves_and_stops(cluster, tmp_path):
    runner = Supervisor(run_config(tmp_path, *RUN), StopRequest(max_wall_time_s=3600))
    once(lambda: metrics_lines(tmp_path) >= 4, lambda: setattr(runner.stop, "max_wall_time_s", 0.0))
    with pytest.raises(StoppedEarly, match=r"runner.max_wall_time_s=0 reached at step \d+; saved global_step_\d+"):
        runner.run()
