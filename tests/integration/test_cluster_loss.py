"""Losing the Ray cluster itself: the embedded one's node (restarted in-job), or the head of a joined one (the driver
exits).

The embedded Ray's raylet is SIGKILLed, as the kernel's OOM killer does; the run must notice at once
(not wait `wait_timeout_s` for resources nobody will add), start a fresh Ray, resume from the newest
checkpoint and end bit-identical to an uninterrupted run (the session's reference run, tests/reference_runs.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray
from ports import free_port
from reference_runs import NUMERICS, Reference, reference_run

from rlrunner.cluster.ray_setup import init_ray
from rlrunner.runner.supervisor import Supervisor
from rlrunner.tools.convert import load_model_weights

from conftest import (
    TEST_LAYOUT,
    TINY_MODEL,
    assert_bit_equal,
    metrics_lines,
    read_metrics,
    run_config,
    without_time,
)

pytestmark = pytest.mark.slow

STEPS = 8
RUN = [
    *NUMERICS,
    f"runner.max_steps={STEPS}",
    "runner.save_interval=3",
    "runner.recovery.step_timeout_s=30",
    "runner.recovery.wait_timeout_s=300",  # a run that waited for a lost node would take this long: it must not
]


def connect() -> None:
    init_ray("local", 4)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    """The session's FSDP reference run (trained in a local Ray of its own if no module before trained it)."""
    return reference_run("fsdp", tmp_path_factory)


@pytest.fixture(autouse=True)
def no_ray_before_or_after():
    if ray.is_initialized():
        ray.shutdown()
    yield
    ray.shutdown()


def recovery_events(output_dir: Path, event: str) -> list[dict]:
    import json

    path = output_dir / "test" / "recovery.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == event] if path.exists() else []


def test_the_embedded_ray_losing_its_node_is_restarted_in_job(reference, tmp_path):
    import threading

    out = tmp_path / "killed"
    runner = Supervisor(run_config(out, *RUN))
    killed: list[int] = []

    def kill_raylet() -> None:
        deadline = time.monotonic() + 120
        committed = out / "test" / "checkpoints" / "global_step_3" / "manifest.json"  # a background save commits later
        while not (metrics_lines(out) >= 4 and committed.exists()) and time.monotonic() < deadline:
            time.sleep(0.01)
        node = ray._private.worker._global_node
        raylet = node.all_processes["raylet"][0].process
        killed.append(raylet.pid)
        os.kill(raylet.pid, signal.SIGKILL)
        raylet.wait()  # gone for good before its workers go (else the run may see a lost worker first)
        # Its workers exit once they notice their raylet is gone; kill them now, as the OOM killer taking the
        # node's processes would, so the run cannot finish its last steps before it notices (a race otherwise).
        for group in runner.trainer.groups():
            for host in group.hosts:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(host["pid"], signal.SIGKILL)

    threading.Thread(target=kill_raylet, daemon=True).start()
    started = time.monotonic()
    runner.run(connect)
    assert killed, "the raylet was never killed"
    assert time.monotonic() - started < 200  # far below wait_timeout_s: nothing waited for the dead node
    [failure] = recovery_events(out, "failure")
    assert failure["cause"].startswith("cluster lost: the embedded Ray's raylet"), failure
    [resumed] = recovery_events(out, "resumed")
    assert resumed["step"] == 3
    assert ray._private.worker._global_node.all_processes["raylet"][0].process.pid != killed[0]  # a fresh Ray
    metrics = read_metrics(out / "test" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert without_time(metrics) == without_time(reference.metrics[:STEPS])
    assert_bit_equal(load_model_weights(out / f"test/checkpoints/global_step_{STEPS}"), reference.weights(STEPS))


def test_a_joined_cluster_whose_head_is_gone_ends_the_driver_for_a_relaunch(tmp_path, subprocess_env):
    """Not a wait: the driver exits with code 1 (the launch script relaunches that) and one line naming the cause."""
    env = {**subprocess_env, "RAY_AUTH_MODE": "token"}
    temp_dir = tempfile.mkdtemp(prefix="rlr-head-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    port = free_port()
    head = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("ray")),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            f"--temp-dir={temp_dir}",
            "--node-ip-address=127.0.0.1",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    driver = None
    try:
        overrides = [
            f"runner.output_dir={tmp_path}",
            "runner.experiment_name=test",
            "runner.logger.progress_bar=false",
            "data.batch_size=4",
            "algorithm.group_size=4",
            "actor.micro_batch_size=4",
            f"cluster.ray_address=127.0.0.1:{port}",
            "runner.max_steps=200",
            "runner.save_interval=2",
            "data.synthetic.num_problems=26",
            "rollout.max_new_tokens=2",
            *TINY_MODEL,
            *TEST_LAYOUT,
            "data.synthetic.val_size=0",
        ]
        deadline = time.monotonic() + 60
        while driver is None:
            probe = subprocess.run(
                [sys.executable, "-c", f"import ray; ray.init(address='127.0.0.1:{port}', logging_level='ERROR')"],
                env=env,
                capture_output=True,
                timeout=60,
            )
            if probe.returncode == 0:
                driver = subprocess.Popen(
                    [sys.executable, "-m", "rlrunner.main_grpo", *overrides], env=env, stderr=subprocess.PIPE, text=True
                )
            else:
                assert time.monotonic() < deadline, probe.stderr.decode()[-2000:]
                time.sleep(1)
        deadline = time.monotonic() + 120
        while metrics_lines(tmp_path) < 2:
            assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()[1][-3000:]
            time.sleep(0.05)
        os.killpg(head.pid, signal.SIGKILL)  # the head node is preempted: GCS, raylet and the workers on it
        subprocess.run(["pkill", "-9", "-f", temp_dir], check=False)
        killed_at = time.monotonic()
        _, err = driver.communicate(timeout=90)
        assert time.monotonic() - killed_at < 60
        assert driver.returncode == 1, err[-3000:]
        lines = [line for line in err.splitlines() if line.startswith("rlrunner: error:")]
        assert len(lines) == 1 and "the Ray cluster's head node (GCS at " in lines[0] and "is gone" in lines[0], err[
            -3000:
        ]
        assert "relaunched" in lines[0]
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        subprocess.run(["pkill", "-9", "-f", temp_dir], check=False)
        shutil.rmtree(temp_dir, ignore_errors=True)
