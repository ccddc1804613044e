"""What the recovery tests (test_recovery_*.py) share: the run on conftest's multi-node `cluster`, the comparison with
the session's reference run, and ways to kill or break workers at known points.

Layout: the head node has 1 CPU and takes the rollout worker; a worker node with 2 CPUs takes the two actor ranks (1 CPU
each, packed on one node). Every test that finishes its run ends with its metrics and final weights bit-identical to
the uninterrupted reference run's (tests/reference_runs.py: the same numbers, other CPUs per worker and timeouts).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import ray
from ray import cloudpickle
from reference_runs import REFERENCE_RUN, REFERENCE_STEPS, Reference

from rlrunner.cluster import parked_groups
from rlrunner.cluster.worker_group import WorkerGroup
from rlrunner.runner.supervisor import Supervisor
from rlrunner.tools.convert import load_model_weights

from conftest import TEST_LAYOUT, TINY_MODEL, Inspect, assert_bit_equal, read_metrics, run_config, without_time

STEPS = REFERENCE_STEPS  # 10, saves at 3, 6, 9 and 10
STEP_TIMEOUT_S = 30
RUN = [
    *REFERENCE_RUN,
    "cluster.cpus_per_actor_worker=1",
    "cluster.cpus_per_rollout_worker=1",
    f"runner.recovery.step_timeout_s={STEP_TIMEOUT_S}",
    "runner.recovery.wait_timeout_s=120",
]


def final_checkpoint(output_dir: Path) -> Path:
    return output_dir / "test" / "checkpoints" / f"global_step_{STEPS}"


def assert_matches_reference(output_dir: Path, reference: Reference) -> None:
    metrics = read_metrics(output_dir / "test" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert without_time(metrics) == without_time(reference.metrics)
    assert_bit_equal(load_model_weights(final_checkpoint(output_dir)), load_model_weights(reference.checkpoint(STEPS)))


def train_in_thread(runner: Supervisor) -> tuple[threading.Thread, list[BaseException]]:
    """`runner.run()` started in a daemon thread (Cluster.add_node must run in the main thread, Ray installs signal
    handlers there), and the list its error lands in, for the main thread to report."""
    errors: list[BaseException] = []

    def train() -> None:
        try:
            runner.run()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    return thread, errors


def recovery_events(output_dir: Path, event: str) -> list[dict]:
    path = output_dir / "test" / "recovery.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == event] if path.exists() else []


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)


def wait_for(condition: Callable[[], bool], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def assert_restored_from_memory(output_dir: Path, lost_steps: int = 0) -> dict:
    """One restart, loaded from the in-memory snapshot of the last completed step (minus `lost_steps`)."""
    [failure] = recovery_events(output_dir, "failure")
    assert failure["restore_from"] == "snapshot" and failure["lost_steps"] == lost_steps, failure
    [resumed] = recovery_events(output_dir, "resumed")
    assert resumed["source"] == "snapshot" and resumed["step"] == failure["step"] - lost_steps, resumed
    return failure


def driver_command(cluster, output_dir: Path, *overrides: str) -> list[str]:
    """The overrides of `python -m rlrunner.main_grpo` for RUN on `cluster`: run_config's, on the command line. The
    groups earlier tests' runs parked on the cluster give way first: that driver waits for their resources."""
    parked_groups.evict()
    base = [
        f"runner.output_dir={output_dir}",
        "runner.experiment_name=test",
        "runner.logger.progress_bar=false",
        "data.batch_size=4",
        "algorithm.group_size=4",
        "actor.micro_batch_size=4",
        f"cluster.ray_address={cluster.address}",
        *TINY_MODEL,
        *TEST_LAYOUT,
        "data.synthetic.val_size=0",
    ]
    return [*base, *RUN, *overrides]


# What Ray prints on a driver's stderr for its workers and raylet: each line prefixed "(name pid=N)", maybe coloured
_FORWARDED = re.compile(r"^(\x1b\[[0-9;]*m)?\([^)]*\)")


def driver_last_line(stderr: str) -> str:
    """The last line a driver wrote itself to `stderr`: the lines Ray forwards from workers (a library's warning, say)
    can come after it."""
    return [line for line in stderr.strip().splitlines() if not _FORWARDED.match(line)][-1]


# -- replacing code inside one worker process ------------------------------------------------------------------


def patch_worker_module(group: WorkerGroup, rank: int, module: str, name: str, make_replacement) -> None:
    """Replace a module-level function inside the process of `group`'s `rank` (Ray binds actor methods at creation).
    Unless the replacement kills that process (`dying`), the group is not kept for a later run: a module's patch would
    outlive `Worker.reinit`."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test helper module
    if make_replacement is not dying:
        group.reuse = False
    worker = group.workers[rank]

    def patch(self) -> None:
        import sys

        target = sys.modules[module]
        setattr(target, name, make_replacement(getattr(target, name)))

    try:
        ray.get(worker.__ray_call__.remote(patch))
    except ray.exceptions.ActorDiedError:
        # A `dying` patch can take its process before this call's answer has left it: the worker's next task (a
        # queued generation) calls the patched function at once, and Ray sends the answer asynchronously. Any other
        # patch must answer.
        if make_replacement is not dying:
            raise


def patch_worker_attribute(group: WorkerGroup, rank: int, name: str, make_replacement) -> None:
    """Replace an attribute of the worker object of `group`'s `rank` (e.g. the rollout worker's reward function). A
    kept worker's attributes go with `Worker.release`, so the patch never reaches a later run."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test helper module
    worker = group.workers[rank]

    def patch(self) -> None:
        setattr(self, name, make_replacement(getattr(self, name)))

    ray.get(worker.__ray_call__.remote(patch))


def dying(original):
    """A stand-in that kills its own process (a lost worker, at a known point of a step)."""

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    return die


def dying_sender(original):
    """A weight sender that kills its own process when it sends (a rank lost after its snapshot copy)."""

    class Sender:
        def __getattr__(self, name):
            return getattr(original, name)

        def send(self, *args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

    return Sender()


def raising(original):
    def boom(*args, **kwargs):
        raise RuntimeError("boom from worker code")

    return boom


def kill_in_next_update(runner: Supervisor, rank: int, after_steps: int) -> None:
    """Actor `rank` dies inside the update of step `after_steps` + 1 (in its log-probs, after the forward).

    The patch is sent from the driver's loop as that step starts (a callback wraps each attempt's `train_step`), so it
    reaches the rank before the update call does. Sent from a thread once `after_steps` steps are logged, it could
    arrive after the update call, which waits for no generation when the batch was generated ahead
    (`algorithm.policy_lag`), and the rank would die a step later."""
    killed: list[int] = []

    def patch_before_the_step(trainer) -> None:
        train_step = trainer.train_step
        if getattr(train_step, "kills_a_rank", False):  # the same trainer again (a rank replaced alone)
            return

        def patched_first(step: int) -> dict:
            if step == after_steps + 1 and not killed:
                killed.append(step)
                patch_worker_module(trainer.actor_group, rank, "rlrunner.backends.actor", "token_log_probs", dying)
            return train_step(step)

        patched_first.kills_a_rank = True
        trainer.train_step = patched_first

    runner.callbacks.append(Inspect(on_start=patch_before_the_step))


# -- warm spares -------------------------------------------------------------------------------------------------

SPARES = [
    "cluster.cpus_per_actor_worker=0.5",
    "cluster.cpus_per_rollout_worker=0.5",
    "cluster.spare_workers.actor=2",
    "cluster.spare_workers.rollout=1",
]


def spares_up(runner: Supervisor) -> bool:
    pools = runner.ctx.spare_pools
    return pools is not None and all(pool.all_up() for pool in pools.values())


def with_spares_up(tmp_path: Path, *overrides: str, on_start=None) -> Supervisor:
    """A run with warm spares whose first attempt trains once they are all up (started now, not after its first
    step); `on_start(trainer)` as each attempt is ready to train."""
    attempts: list[int] = []

    def wait_for_spares(trainer) -> None:
        attempts.append(1)
        if len(attempts) == 1:
            trainer.refill_spares()
            wait_for(lambda: spares_up(runner))
        if on_start is not None:
            on_start(trainer)

    runner = Supervisor(run_config(tmp_path, *RUN, *SPARES, *overrides), callbacks=[Inspect(on_start=wait_for_spares)])
    return runner
