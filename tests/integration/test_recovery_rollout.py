"""The rollout worker lost or hung on a real multi-node Ray cluster (recovery_helpers.py): repaired alone, from a warm
spare or a fresh process, without a lost step; repairs bounded.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
from recovery_helpers import (
    RUN,
    assert_matches_reference,
    kill,
    recovery_events,
    wait_for,
    with_spares_up,
)
from reference_runs import Reference, reference_run

from rlrunner.runner.supervisor import Supervisor

from conftest import Inspect, metrics_lines, once, run_config

pytestmark = [pytest.mark.slow, pytest.mark.multinode]


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory) -> Reference:
    """The session's FSDP reference run (trained on this module's cluster if no module before trained it)."""
    return reference_run("fsdp", tmp_path_factory)


def assert_rollout_repaired_alone(output_dir: Path, runner: Supervisor, times: int = 1) -> list[dict]:
    """`times` rollout repairs inside the first attempt: no restart, no checkpoint loaded, no step lost."""
    assert recovery_events(output_dir, "failure") == [] and recovery_events(output_dir, "resumed") == []
    repairs = recovery_events(output_dir, "rollout_repaired")
    assert len(repairs) == times and all(r["lost_steps"] == 0 for r in repairs), repairs
    assert runner.trainer.rollout_repairs == 0  # reset by the steps completed after the repair
    return repairs


def test_a_warm_spare_replaces_a_lost_rollout_worker(cluster, reference, tmp_path):
    runner = with_spares_up(tmp_path, "cluster.spare_workers.actor=0")  # no actor spares: none would be used
    once(lambda: metrics_lines(tmp_path) >= 4, lambda: kill(runner.trainer.rollout_group.hosts[0]["pid"]))
    runner.run()
    [repair] = assert_rollout_repaired_alone(tmp_path, runner)
    assert repair["spares_used"] == 1, repair
    assert_matches_reference(tmp_path, reference)


def test_a_killed_then_a_hung_rollout_worker_cost_no_step(cluster, reference, tmp_path):
    """The rollout worker killed after step 4; its replacement stopped (SIGSTOP, a hang) just before step 8's
    generation is asked of it: the generation passes the step's time bound. Each time the rollout group alone is
    replaced and no step is lost. (Both in one run: one run's start-up less for the suite.)"""
    killed: list[int] = []

    def stop_before_generation_8(trainer) -> None:
        # Stopped from a thread at some moment after step 7, the worker could be caught between two generations, and
        # the hang would surface in the next weight sync instead (a hang of both groups, repaired as one): the stop is
        # sent from the driver's loop, right before it asks for the generation.
        generate = trainer.generate

        def generate_after_stop(step: int, prompts):
            if step == 8 and len(killed) == 1:
                killed.append(trainer.rollout_group.hosts[0]["pid"])
                kill(killed[1], signal.SIGSTOP)
            return generate(step, prompts)

        trainer.generate = generate_after_stop

    runner = Supervisor(
        run_config(tmp_path, *RUN, "runner.recovery.step_timeout_s=6"),
        callbacks=[Inspect(on_start=stop_before_generation_8)],
    )

    def kill_after_step_4() -> None:
        wait_for(lambda: metrics_lines(tmp_path) >= 4)
        killed.append(runner.trainer.rollout_group.hosts[0]["pid"])
        kill(killed[0])

    threading.Thread(target=kill_after_step_4, daemon=True).start()
    runner.run()
    assert len(set(killed)) == 2, killed  # the second signal reached the replacement
    lost, hung = assert_rollout_repaired_alone(tmp_path, runner, times=2)
    assert "rollout rank 0" in lost["cause"] and lost["step"] in (5, 6), lost
    assert (
        hung["cause"].startswith("hang: the rollout group did not answer within 6s") and hung["phase"] == "generation"
    )
    assert hung["step"] == 8, hung
    assert_matches_reference(tmp_path, reference)


def test_rollout_repairs_are_bounded_then_the_attempt_is_repaired(cluster, reference, tmp_path):
    """With max_restarts=1, a rollout worker lost again before a step completes (the replacement killed as soon as it
    is up) is not repaired alone a second time: the supervisor repairs the whole attempt from the checkpoint."""
    runner = Supervisor(run_config(tmp_path, *RUN, "runner.recovery.max_restarts=1"))
    killed: list[int] = []

    def kill_two_rollout_workers() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(killed) < 2:
            trainer = runner.trainer
            group = trainer.rollout_group if trainer is not None and metrics_lines(tmp_path) >= 4 else None
            if group is not None and group.hosts and group.hosts[0]["pid"] not in killed:
                killed.append(group.hosts[0]["pid"])
                kill(killed[-1])
            time.sleep(0.002)

    threading.Thread(target=kill_two_rollout_workers, daemon=True).start()
    runner.run()
    assert len(killed) == 2
    assert (
        len(recovery_events(tmp_path, "rollout_repaired")) <= 1
    )  # the first repair, unless the second kill cut it short
    failures = recovery_events(tmp_path, "failure")
    assert len(failures) == 1 and "rollout rank 0" in failures[0]["cause"], failures
    assert_matches_reference(tmp_path, reference)
