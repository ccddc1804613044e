"""An embedded Ray is private to its driver: a second run on this machine starts its own, never joins the first's.

Two drivers side by side, with no RAY_ADDRESS and no `ray start` cluster: run B must start an embedded Ray
of its own (Ray's `address="auto"` would join run A's, since it takes any Ray GCS process on the machine),
and A ending first must not take B down. Each test gives its drivers a RAY_TMPDIR of its own, so Ray's
bootstrap file (`ray start` writes it, and so does `ray.cluster_utils.Cluster`) is the test's alone: a
cluster of another test or person on this machine is not seen.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ports import free_port

from conftest import TEST_LAYOUT, TINY_MODEL, read_metrics

pytestmark = pytest.mark.slow

RUN = [
    "runner.logger.progress_bar=false",
    "runner.logger.backends=[]",
    "data.batch_size=4",
    "algorithm.group_size=4",
    "actor.micro_batch_size=4",
    "cluster.num_cpus=2",
    "rollout.max_new_tokens=2",
    "data.synthetic.num_problems=26",
    "runner.save_interval=1000",
    *TINY_MODEL,
    *TEST_LAYOUT,
    "data.synthetic.val_size=0",
]
LONG = "runner.max_steps=5000"  # both runs are stopped (SIGTERM: a clean stop, exit code 3) long before
EMBEDDED = "ray_setup: started an embedded local Ray"
JOINED = "ray_setup: connected to the"
_MARKER = "RLRUNNER_TEST_EMBEDDED_RAY"


@pytest.fixture
def driver_env(subprocess_env):
    """No RAY_ADDRESS, a RAY_TMPDIR of the test's own (short: Ray's socket paths must fit 107 bytes), and a marker
    in the environment to find what is left of the drivers and their Rays afterwards (Ray workers get process
    groups of their own; a worker forked by the suite's server, tests/forked_ray_workers.py, shows the server's
    environment, but goes with its client, which has the marker)."""
    ray_tmpdir = tempfile.mkdtemp(prefix="rlre-", dir="/tmp")
    marker = secrets.token_hex(8)
    env = {k: v for k, v in subprocess_env.items() if k != "RAY_ADDRESS"}
    env.update({"RAY_TMPDIR": ray_tmpdir, _MARKER: marker})
    yield env
    kill_marked(marker)
    shutil.rmtree(ray_tmpdir, ignore_errors=True)


def kill_marked(marker: str) -> None:
    needle = f"{_MARKER}={marker}".encode()
    for _ in range(20):
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours
                pass
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def start_driver(env: dict, output_dir: Path, log: Path, *overrides: str) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlrunner.main_grpo",
                *RUN,
                f"runner.output_dir={output_dir}",
                "runner.experiment_name=test",
                *overrides,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=out,
        )


def wait_for(condition, what: str, drivers: dict[str, tuple[subprocess.Popen, Path]], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for name, (process, log) in drivers.items():
            assert process.poll() is None, (
                f"run {name} exited with code {process.returncode}:\n{log.read_text()[-3000:]}"
            )
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def said_how_it_got_ray(log: Path):
    return lambda: EMBEDDED in log.read_text() or JOINED in log.read_text()


def steps(output_dir: Path) -> int:
    path = output_dir / "test" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_second_run_starts_its_own_ray_and_outlives_the_first(tmp_path, driver_env):
    a_out, b_out, a_log, b_log = tmp_path / "a", tmp_path / "b", tmp_path / "a.log", tmp_path / "b.log"
    a = start_driver(driver_env, a_out, a_log, LONG)
    b = None
    try:
        wait_for(said_how_it_got_ray(a_log), "run A's Ray", {"A": (a, a_log)})
        assert EMBEDDED in a_log.read_text(), a_log.read_text()[-3000:]

        b = start_driver(driver_env, b_out, b_log, LONG)
        both = {"A": (a, a_log), "B": (b, b_log)}
        wait_for(said_how_it_got_ray(b_log), "run B's Ray", both)
        assert EMBEDDED in b_log.read_text() and JOINED not in b_log.read_text(), b_log.read_text()[-3000:]

        # A ends first (a clean stop on SIGTERM, which also shuts its embedded Ray down) while B still runs.
        wait_for(lambda: steps(a_out) >= 1, "run A's first step", both)
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=60) == 3, a_log.read_text()[-3000:]
        assert "is gone" not in a_log.read_text()

        # B trains on after A's Ray went down, then stops cleanly too (its own Ray was never A's)
        after_a = steps(b_out)
        wait_for(lambda: steps(b_out) >= after_a + 2, "two more steps of run B", {"B": (b, b_log)})
        b.send_signal(signal.SIGTERM)
        assert b.wait(timeout=60) == 3, b_log.read_text()[-3000:]
        assert "is gone" not in b_log.read_text()
        stopped_at = steps(b_out)
        assert [m["step"] for m in read_metrics(b_out / "test" / "metrics.jsonl")] == list(range(1, stopped_at + 1))
    finally:
        for process in (a, b):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()


def test_a_stale_ray_start_address_falls_back_to_an_embedded_ray_at_once(driver_env):
    """A `ray start` cluster that died without `ray stop` (or a killed `ray.cluster_utils.Cluster`) leaves its address
    in Ray's bootstrap file: nothing answers there, so the driver starts its own Ray without waiting on it."""
    port = free_port()  # a port nobody listens on
    bootstrap = Path(driver_env["RAY_TMPDIR"]) / "ray" / "ray_current_cluster"
    bootstrap.parent.mkdir(parents=True)
    bootstrap.write_text(f"127.0.0.1:{port}")
    code = (
        "import logging; logging.basicConfig(level=logging.INFO); "
        "from rlrunner.cluster.ray_setup import init_ray; print(init_ray(None, 1))"
    )
    # Ray's own connect would retry the dead address for many minutes before giving up.
    result = subprocess.run([sys.executable, "-c", code], env=driver_env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.split() == ["embedded"], result.stdout + result.stderr[-3000:]
    assert (
        "not joining the `ray start` cluster recorded on this machine, "
        f"the Ray cluster's head node (GCS at 127.0.0.1:{port}) is gone"
    ) in result.stderr
