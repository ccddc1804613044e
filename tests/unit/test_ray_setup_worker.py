"""tests/ray_setup_worker.py, the suite's stand-in for Ray's setup_worker.py, run as the raylet runs it: a context
naming the fork server's client becomes that client in the same process, with the context's environment; any other
goes to Ray's own script. The worker is a Python one-liner that prints what it got; a context meant for Ray's script
marks its route in RLRUNNER_ROUTE, which the stand-in would not have set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from forked_ray_workers import SETUP_WORKER, client_command

WORKER = ["-c", "import os; print(*(os.environ.get(k) for k in ('RLRUNNER_T', 'RLRUNNER_ROUTE')), os.getpid())"]


def run_setup(context: dict) -> tuple[list[str], int]:
    """The stand-in run on `context` with the one-liner as the worker: the words it printed, and the stand-in's pid."""
    command = [sys.executable, SETUP_WORKER, f"--serialized-runtime-env-context={json.dumps(context)}"]
    env = {**os.environ, "RLRUNNER_T": "before", "RLRUNNER_ROUTE": "stand-in"}
    process = subprocess.Popen([*command, "--language=PYTHON", *WORKER], stdout=subprocess.PIPE, text=True, env=env)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    return out.split(), process.pid


def test_the_fork_servers_client_runs_in_the_same_process_with_the_contexts_environment(tmp_path: Path):
    # no server listens on this socket: the client execs the worker as Ray would have, in its own process
    context = {"py_executable": client_command(str(tmp_path / "none.sock")), "env_vars": {"RLRUNNER_T": "${HOME}/x"}}
    (value, route, pid), setup_pid = run_setup(context)
    assert (value, route, int(pid)) == (f"{os.environ['HOME']}/x", "stand-in", setup_pid)


def test_any_other_context_goes_to_rays_own_setup_worker():
    marked = "env RLRUNNER_ROUTE=ray " + sys.executable
    for context, route in (
        ({}, "stand-in"),  # no py_executable (a worker started before any job): Ray's script runs its own Python
        ({"py_executable": marked}, "ray"),
        ({"py_executable": client_command("/tmp/x.sock"), "command_prefix": ["RLRUNNER_ROUTE=ray", "&&"]}, "ray"),
    ):
        (value, got, _), _ = run_setup({**context, "env_vars": {"RLRUNNER_T": "set"}})
        assert (value, got) == ("set", route), context
