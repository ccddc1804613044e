"""The launch script relaunches the driver after what a relaunch can mend, and after nothing else."""

from __future__ import annotations

import os
import subprocess

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("code, relaunched", [(4, False), (2, False), (3, False), (1, True), (137, True)])
def test_the_launch_script_relaunches_only_what_a_relaunch_can_mend(repo_root, tmp_path, code, relaunched):
    """A stand-in driver (the script runs $PYTHON) that exits with `code` once, then 0."""
    driver = tmp_path / "driver.sh"
    driver.write_text(
        f'#!/bin/bash\necho "$@" >> {tmp_path}/calls\n'
        f"[ -f {tmp_path}/ran ] && exit 0\ntouch {tmp_path}/ran\nexit {code}\n"
    )
    driver.chmod(0o755)
    result = subprocess.run(
        ["bash", str(repo_root / "launch/run_main_grpo.sh"), "runner.max_steps=3"],
        env={**os.environ, "PYTHON": str(driver), "RLRUNNER_RESTART_BACKOFF_S": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    calls = (tmp_path / "calls").read_text().splitlines()
    if relaunched:
        assert result.returncode == 0 and len(calls) == 2
        assert calls[1].endswith("runner.resume_dir=auto")
    else:
        assert result.returncode == code and len(calls) == 1
    if code == 4:
        assert result.stderr.strip().splitlines()[-1] == (
            "run_main_grpo.sh: failed in a way a relaunch cannot mend (exit code 4): not restarting"
        )
