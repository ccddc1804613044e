"""docs/your-task.md, run as a user runs it: the page's commands and files, through the launch script, with both
trackers for real (W&B offline, read back from its files; MLflow's own sqlite store, read back with MlflowClient).

The page's command runs with a shorter schedule appended (12 steps, a checkpoint and a validation every 4), in a
folder of its own. Its driver is killed mid-run (SIGKILL: the launch script relaunches it from the last checkpoint),
the relaunched one is stopped (SIGTERM: the emergency checkpoint), and the command runs again with
`runner.resume_dir=auto` to the end. Every step, validation included, is then in metrics.jsonl once, and in each
tracker's one run once, with the same values.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import read_metrics

pytestmark = pytest.mark.slow

SHORTER = ["runner.max_steps=12", "runner.save_interval=4", "runner.val_interval=4"]


def page_commands(repo_root: Path) -> list[list[str]]:
    """The commands of the page's "One command" block, each as its words (continuation lines joined)."""
    import shlex

    page = (repo_root / "docs" / "your-task.md").read_text()
    block = re.search(r"## One command\n.*?```bash\n(.*?)```", page, re.S).group(1)
    return [shlex.split(command) for command in block.replace("\\\n", " ").strip().splitlines()]


def wait_until(condition, timeout_s: float, what: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the launch script ended ({process.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def last_step(log_dir: Path) -> int:
    path = log_dir / "metrics.jsonl"
    steps = (
        [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]
        if path.exists()
        else []
    )
    return max(steps, default=-1)


def drivers(script: subprocess.Popen) -> list[psutil.Process]:
    """The launch script's live driver processes (one, or none between a driver's death and its relaunch)."""
    found = []
    for child in psutil.Process(script.pid).children():
        try:  # a killed driver the script has not reaped yet is a zombie: not a driver any more
            if child.status() != psutil.STATUS_ZOMBIE and "rlrunner.main_grpo" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:  # ZombieProcess included
            pass
    return found


def untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("time/") and k != "step"}


def test_the_your_task_page_runs_with_validation_and_both_trackers_through_a_kill_and_a_stop(repo_root, tmp_path):
    for name in ("examples", "launch"):
        (tmp_path / name).symlink_to(repo_root / name)
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "RLRUNNER_RESTART_BACKOFF_S": "0",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "WANDB_SILENT": "true",
        "PYTHONPATH": str(repo_root),
    }
    env.pop("WANDB_SERVICE", None)  # a service of this test process's own W&B runs: the drivers start their own
    make_data, launch = page_commands(repo_root)
    assert make_data[:2] == ["python", "examples/your_task/make_data.py"] and launch[:2] == [
        "bash",
        "launch/run_main_grpo.sh",
    ]
    subprocess.run(
        [sys.executable, *make_data[1:]], cwd=tmp_path, env=env, check=True, capture_output=True, timeout=120
    )
    command = [*launch, *SHORTER]
    log_dir = tmp_path / "logs" / "your-task"

    script = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_until(lambda: last_step(log_dir) >= 6, 300, "step 6", script)
        [first] = drivers(script)
        first.kill()  # the launch script relaunches it with runner.resume_dir=auto: from global_step_4
        first.wait(30)
        wait_until(lambda: any(p.pid != first.pid for p in drivers(script)), 120, "the relaunch", script)
        wait_until(lambda: last_step(log_dir) >= 9, 300, "step 9 in the relaunched driver", script)
        script.send_signal(signal.SIGTERM)
        _, stderr = script.communicate(timeout=300)
    finally:
        if script.poll() is None:
            script.kill()
    assert script.returncode == 3, stderr[-3000:]
    assert "restart 1 of 3 with runner.resume_dir=auto" in stderr
    stopped_at = last_step(log_dir)
    assert 9 <= stopped_at < 12
    resumed = subprocess.run(
        [*command, "runner.resume_dir=auto"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    records = read_metrics(log_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(13))
    by_step = {r["step"]: r for r in records}
    validated = [r["step"] for r in records if "val/reward_mean" in r]
    assert validated == [0, 4, 8, 12]
    for step in validated:  # both data sources of the page's files, in the validation metrics
        assert {"val/add/reward_mean", "val/add/accuracy", "val/copy/reward_mean", "val/copy/accuracy"} <= set(
            by_step[step]
        )
    assert "reward/acc" in by_step[12]  # the add scorer's dict key

    # MLflow: one run in the experiment's own store, every step of every metric once, with metrics.jsonl's values
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{log_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rlrunner")
    runs = client.search_runs([experiment.experiment_id])
    trackers = json.loads((log_dir / "trackers.json").read_text())
    assert [run.info.run_id for run in runs] == [trackers["mlflow"]["run_id"]]
    assert runs[0].info.status == "FINISHED"
    for key in ("rollout/reward_mean", "actor/loss", "val/copy/accuracy", "reward/acc"):
        history = client.get_metric_history(runs[0].info.run_id, key)
        steps = sorted(m.step for m in history)
        assert steps == sorted(s for s, r in by_step.items() if key in r), key
        assert all(m.value == by_step[m.step][key] for m in history), key
    assert (
        client.get_run(runs[0].info.run_id).data.params["reward.function"]
        == "examples/your_task/reward.py:compute_score"
    )

    # W&B offline: one folder per launch (three), all the same run; every step once across them, the same values
    from rlrunner.trackers.wandb_offline import offline_history

    folders = offline_history(log_dir / "wandb", trackers["wandb"]["run_id"])
    assert len(folders) == 3, [name for name, _ in folders]
    logged = [(step, metrics) for _, history in folders for step, metrics in history]
    assert sorted(step for step, _ in logged) == list(range(13))
    for step, metrics in logged:
        assert untimed(metrics) == untimed(by_step[step]), step
