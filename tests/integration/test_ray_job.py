"""`ray job submit` of the launch script, for real: a head node of our own, a 2-step run, a clean stop.

The head runs with token authentication and a token of its own (never ~/.ray/auth_token), on free
ports, and is stopped by terminating the `ray start --block` process, never with `ray stop`, which
would stop every Ray on the machine. Its processes are found afterwards by a marker in their
environment (Ray workers get their own process groups, so the head's group is not enough).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from ports import free_ports

from conftest import TEST_LAYOUT, TINY_MODEL

pytestmark = pytest.mark.slow

TIMEOUT_S = 240  # the whole test, head start to job end (about 50 s on 2 cores)
_MARKER = "RLRUNNER_TEST_RAY_HEAD"


def head_env(temp_dir: Path, marker: str) -> dict[str, str]:
    """This machine's environment without any Ray settings, plus token auth with our own token file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    token = temp_dir / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), _MARKER: marker})
    return env


def start_head(ray: Path, temp_dir: Path, env: dict[str, str], ports: dict[str, int]) -> subprocess.Popen:
    command = [
        str(ray),
        "start",
        "--head",
        "--block",
        "--node-ip-address",
        "127.0.0.1",
        "--dashboard-host",
        "127.0.0.1",
        "--num-cpus",
        "2",
        "--temp-dir",
        str(temp_dir / "ray"),
        "--disable-usage-stats",
        "--include-log-monitor",
        "false",
    ]
    for flag, port in ports.items():
        command += [f"--{flag}", str(port)]
    with open(temp_dir / "head.log", "wb") as log:  # the child keeps its own copy of the handle
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def left(deadline: float) -> float:
    return max(1.0, deadline - time.monotonic())


def wait_for_dashboard(head: subprocess.Popen, url: str, token: str, deadline: float) -> None:
    request = urllib.request.Request(f"{url}/api/version", headers={"Authorization": f"Bearer {token}"})
    while time.monotonic() < deadline:
        assert head.poll() is None, f"ray start exited with code {head.returncode}"
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the head's dashboard did not come up")


def marked_pids(marker: str) -> list[int]:
    """Processes started with our marker in their environment: the head's, its workers', the job's."""
    found = []
    needle = f"{_MARKER}={marker}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:  # exited meanwhile, or not ours to read
                pass
    return found


def stop_head(head: subprocess.Popen, marker: str) -> list[int]:
    """SIGTERM `ray start --block` (it stops what it started), then SIGKILL whatever of ours is left; returns
    survivors."""
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(timeout=10)
    deadline = time.monotonic() + 15
    while (left := marked_pids(marker)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    return [pid for pid in marked_pids(marker) if not _is_zombie(pid)]


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def job_logs(temp_dir: Path, submission_id: str) -> str:
    """The job driver's log as the head wrote it (readable even when the dashboard is gone), and the head's log."""
    parts = []
    for path in sorted((temp_dir / "ray").glob(f"session_latest/logs/job-driver-{submission_id}.log")) + [
        temp_dir / "head.log"
    ]:
        parts.append(f"--- {path}\n{path.read_text(errors='replace')[-8000:]}")
    return "\n".join(parts)


def test_ray_job_submit_runs_the_launch_script(repo_root: Path, tmp_path: Path):
    deadline = time.monotonic() + TIMEOUT_S
    ray = Path(sys.executable).parent / "ray"
    # Not under tmp_path: Ray's socket paths (temp dir + session name + socket) must fit in 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="rlrj-", dir="/tmp"))
    marker = secrets.token_hex(8)
    env = head_env(temp_dir, marker)
    names = [
        "port",
        "dashboard-port",
        "ray-client-server-port",
        "node-manager-port",
        "object-manager-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
        "metrics-export-port",
    ]
    ports = dict(zip(names, free_ports(len(names))))
    dashboard = f"http://127.0.0.1:{ports['dashboard-port']}"
    submission_id = f"rlrunner-test-{marker}"
    head = start_head(ray, temp_dir, env, ports)
    submit_output = ""
    try:
        wait_for_dashboard(head, dashboard, Path(env["RAY_AUTH_TOKEN_PATH"]).read_text(), deadline)
        cli_env = {k: v for k, v in env.items() if k != _MARKER}  # the CLI is ours to wait for, not the head's
        # Without RAY_AUTH_MODE=token the CLI sends no token and the dashboard refuses it (what the README says).
        without_mode = {k: v for k, v in cli_env.items() if k != "RAY_AUTH_MODE"}
        refused = subprocess.run(
            [str(ray), "job", "list", "--address", dashboard],
            env=without_mode,
            capture_output=True,
            text=True,
            timeout=left(deadline),
        )
        assert refused.returncode != 0 and "Unauthorized" in refused.stdout + refused.stderr, (
            refused.stdout + refused.stderr
        )

        overrides = [
            *TINY_MODEL,
            *TEST_LAYOUT,
            "data.synthetic.val_size=0",
            "runner.max_steps=2",
            "data.batch_size=4",
            "algorithm.group_size=4",
            "actor.micro_batch_size=4",
            f"runner.output_dir={tmp_path}",
            "runner.logger.progress_bar=false",
        ]
        runtime_env = {"env_vars": {"PYTHON": sys.executable, "RLRUNNER_MAX_RESTARTS": "0"}}
        # the job's workers forked like the suite's (tests/forked_ray_workers.py): its runtime env's py_executable
        suite_runtime_env = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("runtime_env", {})
        if "py_executable" in suite_runtime_env:
            runtime_env["py_executable"] = suite_runtime_env["py_executable"]
        command = [
            str(ray),
            "job",
            "submit",
            "--address",
            dashboard,
            "--submission-id",
            submission_id,
            "--working-dir",
            str(repo_root),
            "--runtime-env-json",
            json.dumps(runtime_env),
            "--",
            "bash",
            "launch/run_main_grpo.sh",
            *overrides,
        ]
        try:
            result = subprocess.run(
                command, env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=left(deadline)
            )
            submit_output = result.stdout + result.stderr
        except subprocess.TimeoutExpired as exc:
            submit_output = "".join(_text(part) for part in (exc.stdout, exc.stderr))
            raise AssertionError(f"the job did not finish within {TIMEOUT_S}s") from None
        assert result.returncode == 0, f"ray job submit exited with {result.returncode}"
        assert f"Job '{submission_id}' succeeded" in submit_output
        # The driver joined this head through the RAY_ADDRESS the job supervisor set (no embedded Ray, no guessing).
        assert re.search(rf"ray_setup: connected to the Ray cluster at [0-9.]+:{ports['port']}\b", submit_output)

        experiment = tmp_path / "grpo-arith"
        assert len((experiment / "metrics.jsonl").read_text().splitlines()) == 2
        assert (experiment / "checkpoints" / "global_step_2" / "manifest.json").is_file()
        # The working dir went up without the git-ignored .venv/ (1.8 GB here): check what the head unpacked.
        unpacked = list((temp_dir / "ray").glob("session_latest/runtime_resources/working_dir_files/_ray_pkg_*/"))
        assert len(unpacked) == 1 and (unpacked[0] / "launch" / "run_main_grpo.sh").is_file()
        assert not (unpacked[0] / ".venv").exists()
        size = sum(p.stat().st_size for p in unpacked[0].rglob("*") if p.is_file())
        assert size < 20e6, f"the working dir upload is {size / 1e6:.0f} MB"
    except BaseException:
        print(f"--- ray job submit output\n{submit_output[-8000:]}\n{job_logs(temp_dir, submission_id)}")
        raise
    finally:
        survivors = stop_head(head, marker)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert survivors == [], f"processes of the test's Ray head still running: {survivors}"
