"""Bad input through the launch script and on a real Ray: one line naming the problem, the right exit code."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlrunner.main_grpo import main

from conftest import TEST_LAYOUT, TINY_MODEL, error_line

pytestmark = pytest.mark.slow


def test_unknown_key_through_the_launch_script(repo_root, subprocess_env, tmp_path):
    result = subprocess.run(
        ["bash", str(repo_root / "launch/run_main_grpo.sh"), "runner.save_intervall=5"],
        cwd=tmp_path,
        env={**subprocess_env, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-2:] == [
        "rlrunner: error: unknown config key 'runner.save_intervall' (check its spelling; `--cfg` prints every key)",
        "run_main_grpo.sh: configuration error (exit code 2): not restarting",
    ]
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == [], "Hydra must not write output folders"


def test_more_workers_than_the_cluster_can_place(ray_session, tmp_path, capsys):
    code = main(
        [
            f"runner.output_dir={tmp_path}",
            *TEST_LAYOUT,
            "actor.num_workers=4",
            "cluster.cpus_per_actor_worker=4",
            "cluster.placement_timeout_s=2",
            "runner.logger.backends=[]",
            *TINY_MODEL,
            "data.synthetic.val_size=0",
        ]
    )
    assert code == 1
    line = error_line(capsys)
    assert "cannot place the actor group (4 workers x {CPU=4}) after waiting 2s: needs CPU 16" in line
