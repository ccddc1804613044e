"""Small helpers every benchmark uses: timing, a private local Ray, work folders, logs, and what the machine is."""

from __future__ import annotations

import logging
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable


def timed(action: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds `action()` took, its result)."""
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


# The layout the figures of the benchmarks that take the default job's were measured with: one rollout worker (the
# default job had two from db3b9c9 to 8c35026) and two actor ranks (the default job's until 8c35026, one since).
ONE_ROLLOUT_WORKER = "rollout.num_workers=1"
TWO_ACTOR_RANKS = "actor.num_workers=2"


# -- Ray -----------------------------------------------------------------------------------------------


def ray_cpus(workers: float, cpus_per_worker: float) -> int:
    """Logical CPUs for `workers` workers of `cpus_per_worker` each, plus one for the driver's own tasks."""
    return max(2, math.ceil(workers * cpus_per_worker) + 1)


def start_local_ray(num_cpus: int, log_to_driver: bool = True) -> None:
    """A new local Ray private to this process (`address="local"`): never another driver's or a `ray start` cluster."""
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=log_to_driver,
    )


def stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def runs_in_embedded_ray(num_cpus: int, work: Path, names: list[Any], run: Callable[[Any], Any]) -> dict[Any, Any]:
    """{name: run(name)} for each of `names` in order, one after the other on one embedded local Ray of `num_cpus`
    started here and stopped after them; `work`, the runs' folder, is removed at the end either way."""
    import shutil

    from rlrunner.cluster.ray_setup import start_embedded

    try:
        start_embedded(num_cpus)
        return {name: run(name) for name in names}
    finally:
        stop_ray()
        shutil.rmtree(work, ignore_errors=True)


# -- files -----------------------------------------------------------------------------------------------


def make_workdir(parent: Path | None, prefix: str) -> Path:
    """A fresh folder under `parent` (default: the temp folder), made for this run."""
    parent = parent or Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines log ([] when it does not exist); stops at a line still being written."""
    from rlrunner.runner.metrics import read_records

    return read_records(path)


# -- the machine -------------------------------------------------------------------------------------------


def memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def command_line() -> str:
    return shlex.join([sys.executable, *sys.argv])


def cpu_model() -> str:
    """The processor's name from /proc/cpuinfo (Linux), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown processor"


def machine() -> str:
    """The cores, processor and the versions that shape the figures: Python, torch, Ray."""
    import ray
    import torch

    return (
        f"{os.cpu_count()} CPU cores ({platform.machine()}, {cpu_model()}), "
        f"Python {platform.python_version()}, torch {torch.__version__}, ray {ray.__version__}"
    )


def filesystem_of(path: Path) -> str:
    """'<device> (<fstype>, mounted on <mount>)' of the mount holding `path`, from /proc/mounts."""
    best = ("?", "?", "")
    resolved = str(path.resolve())
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype = line.split()[:3]
            if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[2]):
                best = (device, fstype, mount)
    except OSError:
        pass
    return f"{best[0]} ({best[1]}, mounted on {best[2] or '?'})"
