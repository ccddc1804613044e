"""The suite's stand-in for Ray's `setup_worker.py`: the first process of every Ray worker that a Ray started by the
test process runs (`forked_ray_workers.serve_ray_workers` points `ray_constants.SETUP_WORKER_FILENAME` here).

Ray's own imports Ray (0.7 s of CPU, for every worker the suite starts) to read the worker's runtime env context, set
its environment variables and exec its `py_executable` through bash. When that executable is the fork server's client
(tests/forked_ray_workers.py) and the context asks nothing else (no command prefix, no other entrypoint, a Python
worker), this script does the same with the standard library and becomes the client itself: one interpreter start of
a few milliseconds instead of three. Anything else is handed to Ray's own script, unchanged.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys

from forked_ray_workers import client_socket, run_client


def _ray_setup_worker() -> str:
    (ray_folder,) = importlib.util.find_spec("ray").submodule_search_locations  # found, not imported
    return os.path.join(ray_folder, "_private", "workers", "setup_worker.py")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(add_help=False)  # the two options Ray's script reads, parsed as it does
    parser.add_argument("--serialized-runtime-env-context", type=str)
    parser.add_argument("--language", type=str)
    args, passthrough = parser.parse_known_args(argv)
    context = json.loads(args.serialized_runtime_env_context or "{}")
    socket_path = client_socket(context.get("py_executable") or "")
    if (
        socket_path is None
        or args.language != "PYTHON"
        or context.get("command_prefix")
        or context.get("override_worker_entrypoint")
    ):
        os.execv(sys.executable, [sys.executable, _ray_setup_worker(), *argv])
    # Ray's update_envs: ${X} expanded from the environment, what is left of an unknown one removed
    for key, value in (context.get("env_vars") or {}).items():
        os.environ[key] = re.sub(r"\$\{[A-Z0-9_]+\}", "", os.path.expandvars(value))
    run_client(socket_path, passthrough)


if __name__ == "__main__":
    main(sys.argv[1:])
