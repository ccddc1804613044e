"""Surviving failures on a real multi-node Ray cluster (ray.cluster_utils.Cluster, several raylets on this machine).

Layout: the head node has 1 CPU and takes the rollout worker; a worker node with 2 CPUs takes the two
FSDP actor ranks (1 CPU each, packed on one node). Every test ends with the run finished and its
metrics and final weights bit-identical to an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import ray
import torch
from ray import cloudpickle

from conftest import LOCAL, TINY_MODEL, Inspect, metrics_lines, once, read_metrics, run_config, without_time
from rlrunner.checkpoint import layout
from rlrunner.tools.convert import load_model_weights
from rlrunner.errors import RecoveryExhaustedError, StoppedEarly, WorkerError
from rlrunner.runner.supervisor import Supervisor
from rlrunner.runner.stopping import StopRequest
from rlrunner.storage import basename

STEPS = 10
STEP_TIMEOUT_S = 30
RUN = [
    "data.synthetic.num_problems=26",
    f"runner.max_steps={STEPS}",
    "runner.save_interval=3",
    "rollout.max_new_tokens=2",
    "cluster.cpus_per_actor_worker=1",
    "cluster.cpus_per_rollout_worker=1",
    f"runner.recovery.step_timeout_s={STEP_TIMEOUT_S}",
    "runner.recovery.wait_timeout_s=120",
]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes.actor_node = nodes.add_node(num_cpus=2)  # where the actor group packs; replaced by the node-loss test
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, logging_level="WARNING")
    yield nodes
    ray.shutdown()
    nodes.shutdown()


@dataclass
class Reference:
    metrics: list[dict]
    weights: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory) -> Reference:
    out = tmp_path_factory.mktemp("reference")
    Supervisor(run_config(out, *RUN)).run()
    return Reference(read_metrics(out / "test" / "metrics.jsonl"), load_model_weights(final_checkpoint(out)))


def final_checkpoint(output_dir: Path) -> Path:
    return output_dir / "test" / "checkpoints" / f"global_step_{STEPS}"


def assert_matches_reference(output_dir: Path, reference: Reference) -> None:
    metrics = read_metrics(output_dir / "test" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert without_time(metrics) == without_time(reference.metrics)
    weights = load_model_weights(final_checkpoint(output_dir))
    assert all(torch.equal(weights[k], reference.weights[k]) for k in reference.weights)


def recovery_events(output_dir: Path, event: str) -> list[dict]:
    path = output_dir / "test" / "recovery.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == event] if path.exists() else []


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)


def dying(original):
    """A stand-in that kills its own process (a lost worker, at a known point of a step)."""

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    return die


def kill_in_next_update(runner: Supervisor, rank: int, after_steps: int, tmp_path: Path) -> threading.Thread:
    """Actor `rank` dies inside the first update after `after_steps` logged steps (in its log-probs, after the forward)."""
    return once(lambda: metrics_lines(tmp_path) >= after_steps,
                lambda: patch_worker_module(runner.trainer.actor_group.workers[rank], "rlrunner.backends.actor",
                                            "token_log_probs", dying))


def assert_restored_from_memory(output_dir: Path, lost_steps: int = 0) -> dict:
    """One restart, loaded from the in-memory snapshot of the last completed step (minus `lost_steps`)."""
    [failure] = recovery_events(output_dir, "failure")
    assert failure["restore_from"] == "snapshot" and failure["lost_steps"] == lost_steps, failure
    [resumed] = recovery_events(output_dir, "resumed")
    assert resumed["source"] == "snapshot" and resumed["step"] == failure["step"] - lost_steps, resumed
    return failure


def worker_pids(trainer) -> dict[str, list[int]]:
    return {group.name: [host["pid"] for host in group.hosts] for group in trainer.groups()}


def test_actor_ranks_killed_mid_save_then_mid_step_come_back(cluster, reference, tmp_path):
    """Rank 0 is killed while the first checkpoint is staged: the half-written save never counts. Then rank 1 dies in
    the update after step 6: no step is redone, since the newest snapshot (the last completed step's) is in the head
    node's holder, and only the lost rank is replaced: rank 0 and the rollout worker keep their processes (the same
    attempt goes on). (Both in one run: one run's start-up less for the suite.)"""
    pids: list[dict[str, list[int]]] = []
    runner = Supervisor(run_config(tmp_path, *RUN), callbacks=[Inspect(on_start=lambda t: pids.append(worker_pids(t)))])
    root = tmp_path / "test" / "checkpoints"
    staged = lambda: root.is_dir() and any(p.name.startswith(layout.STAGING_PREFIX) for p in root.iterdir())  # noqa: E731
    once(staged, lambda: kill(runner.trainer.actor_group.hosts[0]["pid"]))
    kill_in_next_update(runner, 1, 6, tmp_path)
    runner.run()
    mid_save, mid_step = recovery_events(tmp_path, "failure")
    assert "actor rank 0" in mid_save["cause"] and mid_save["step"] < 6, mid_save
    assert "actor rank 1" in mid_step["cause"] and mid_step["step"] >= 6, mid_step
    assert mid_step["restore_from"] == "snapshot" and mid_step["lost_steps"] == 0, mid_step
    assert mid_step["replaced"] == "actor ranks 1" and mid_step["teardown_s"] == 0.0, mid_step
    resumed = recovery_events(tmp_path, "resumed")[-1]
    assert resumed["source"] == "snapshot" and resumed["step"] == mid_step["step"], resumed
    assert resumed["replaced_ranks"] == [1] and resumed["spares_used"] == 0, resumed
    before, after = pids[-2:]
    assert after["rollout"] == before["rollout"] and after["actor"][0] == before["actor"][0], pids
    assert after["actor"][1] != before["actor"][1], pids
    assert_matches_reference(tmp_path, reference)


def dying_sender(original):
    """A weight sender that kills its own process when it sends (a rank lost after its snapshot copy)."""

    class Sender:
        def __getattr__(self, name):
            return getattr(original, name)

        def send(self, *args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

    return Sender()


def test_actor_rank_killed_around_its_snapshot_copy(cluster, reference, tmp_path):
    """The copy of step k is made after k's update, before k's weight sync. Rank 0 dies inside its copy (step k's
    snapshot is incomplete) after step 2; its replacement dies after its copy, in the weight sync, after step 6 (that
    step's snapshot is whole, but the driver never completed the step). Either way step k-1's snapshot is used, and no
    completed step is redone. (Two failures in one run: one run's start-up less for the suite.)"""
    runner = Supervisor(run_config(tmp_path, *RUN))

    def die_in_the_copy_then_in_the_weight_sync() -> None:
        wait_for(lambda: metrics_lines(tmp_path) >= 2)
        patch_worker_module(runner.trainer.actor_group.workers[0], "rlrunner.backends.actor", "serialize", dying)
        wait_for(lambda: metrics_lines(tmp_path) >= 6 and len(recovery_events(tmp_path, "resumed")) == 1)
        patch_worker_attribute(runner.trainer.actor_group.workers[0], "weight_sync", dying_sender)

    threading.Thread(target=die_in_the_copy_then_in_the_weight_sync, daemon=True).start()
    runner.run()
    failures, resumed = recovery_events(tmp_path, "failure"), recovery_events(tmp_path, "resumed")
    assert len(failures) == 2 and len(resumed) == 2, (failures, resumed)
    assert 2 <= failures[0]["step"] < 6 <= failures[1]["step"], failures
    for failure, back in zip(failures, resumed):
        assert "actor rank 0" in failure["cause"], failure
        assert failure["restore_from"] == "snapshot" and failure["lost_steps"] == 0, failure
        assert back["source"] == "snapshot" and back["step"] == failure["step"], back
        # Rank 1 was in its weight sync, blocked on the rollout worker, whose wait on rank 0's channel failed: the
        # rollout worker closed its channels, so rank 1's sync failed at once and it left its process group, instead
        # of waiting for the channel's timeout (runner.recovery.step_timeout_s) first.
        assert back["replaced_ranks"] == [0] and back["leave_s"] < STEP_TIMEOUT_S / 2, back
    assert_matches_reference(tmp_path, reference)


def test_snapshots_short_of_memory_are_skipped_and_storage_is_used(cluster, reference, tmp_path, caplog):
    """No node can keep the reserve: every snapshot is refused with one warning, and recovery loads the checkpoint."""
    runner = Supervisor(run_config(tmp_path, *RUN, "runner.snapshot.reserve_memory_gb=1000000"))
    # rank 1 dies in the first update after step 4 once step 3's checkpoint is committed: a background save still
    # being written when a rank dies is never committed (CI at 455a254 saw it so, on a busy machine, and recovery
    # rightly started over from step 0)
    committed = tmp_path / "test" / "checkpoints" / "global_step_3" / "manifest.json"
    once(lambda: metrics_lines(tmp_path) >= 4 and committed.is_file(),
         lambda: patch_worker_module(runner.trainer.actor_group.workers[1], "rlrunner.backends.actor",
                                     "token_log_probs", dying))
    with caplog.at_level("WARNING", logger="rlrunner.runner.snapshots"):
        runner.run()
    warnings = [r.getMessage() for r in caplog.records if "runner.snapshot.reserve_memory_gb" in r.getMessage()]
    assert len(warnings) == 1 and "recovers from the newest checkpoint on storage" in warnings[0], warnings
    [failure] = recovery_events(tmp_path, "failure")
    assert failure["restore_from"] == "checkpoint" and failure["lost_steps"] <= 3
    assert [e["step"] for e in recovery_events(tmp_path, "resumed")] == [3]
    assert_matches_reference(tmp_path, reference)


def assert_rollout_repaired_alone(output_dir: Path, runner: Supervisor, times: int = 1) -> list[dict]:
    """`times` rollout repairs inside the first attempt: no restart, no checkpoint loaded, no step lost."""
    assert recovery_events(output_dir, "failure") == [] and recovery_events(output_dir, "resumed") == []
    repairs = recovery_events(output_dir, "rollout_repaired")
    assert len(repairs) == times and all(r["lost_steps"] == 0 for r in repairs), repairs
    assert runner.trainer.rollout_repairs == 0  # reset by the steps completed after the repair
    return repairs


SPARES = ["cluster.cpus_per_actor_worker=0.5", "cluster.cpus_per_rollout_worker=0.5", "cluster.spare_workers.actor=2",
          "cluster.spare_workers.rollout=1"]


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


@pytest.mark.parametrize("replace_alone", [True, False])
def test_warm_spares_replace_a_lost_actor_rank_without_process_starts(cluster, reference, tmp_path, replace_alone):
    """Spares start off the nodes of the groups they cover where CPUs allow. The lost rank replaced alone takes the one
    actor spare; with `replace_lost_ranks=false` the restart takes all three spares (two actor ranks and a rollout
    worker). Either way the snapshot is restored and no process is started."""
    pids: list[dict[str, list[int]]] = []
    only_one = ["cluster.spare_workers.actor=1", "cluster.spare_workers.rollout=0"] if replace_alone else []
    runner = with_spares_up(tmp_path, f"runner.recovery.replace_lost_ranks={str(replace_alone).lower()}", *only_one,
                            on_start=lambda t: pids.append(worker_pids(t)))
    once(lambda: metrics_lines(tmp_path) >= 2,
         lambda: patch_worker_module(runner.trainer.actor_group.workers[1], "rlrunner.backends.actor",
                                     "token_log_probs", dying))
    runner.run()
    failure = assert_restored_from_memory(tmp_path)
    assert failure["replaced"] == ("actor ranks 1" if replace_alone else "both groups"), failure
    [resumed] = recovery_events(tmp_path, "resumed")
    assert resumed["spares_used"] == (1 if replace_alone else 3), resumed
    before, after = pids
    kept = set(before["actor"] + before["rollout"]) & set(after["actor"] + after["rollout"])
    assert kept == ({before["actor"][0], *before["rollout"]} if replace_alone else set()), pids
    assert_matches_reference(tmp_path, reference)


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

    runner = Supervisor(run_config(tmp_path, *RUN, "runner.recovery.step_timeout_s=6"),
                        callbacks=[Inspect(on_start=stop_before_generation_8)])

    def kill_after_step_4() -> None:
        wait_for(lambda: metrics_lines(tmp_path) >= 4)
        killed.append(runner.trainer.rollout_group.hosts[0]["pid"])
        kill(killed[0])

    threading.Thread(target=kill_after_step_4, daemon=True).start()
    runner.run()
    assert len(set(killed)) == 2, killed  # the second signal reached the replacement
    lost, hung = assert_rollout_repaired_alone(tmp_path, runner, times=2)
    assert "rollout rank 0" in lost["cause"] and lost["step"] in (5, 6), lost
    assert hung["cause"].startswith("hang: the rollout group did not answer within 6s") and hung["phase"] == "generation"
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
    assert len(recovery_events(tmp_path, "rollout_repaired")) <= 1  # the first repair, unless the second kill cut it short
    failures = recovery_events(tmp_path, "failure")
    assert len(failures) == 1 and "rollout rank 0" in failures[0]["cause"], failures
    assert_matches_reference(tmp_path, reference)


def test_restarts_are_bounded(cluster, tmp_path):
    runner = Supervisor(run_config(tmp_path, *RUN, "runner.recovery.max_restarts=0"))
    once(lambda: metrics_lines(tmp_path) >= 2, lambda: kill(runner.trainer.actor_group.hosts[0]["pid"]))
    with pytest.raises(RecoveryExhaustedError, match=r"giving up after 0 in-job restarts without progress in between \(runner.recovery.max_restarts\); last failure: ") as error:
        runner.run()
    assert error.value.exit_code == 1  # one failure, not a repeated one: a relaunch may get past it


def test_restarts_used_up_on_the_same_error_are_not_relaunched(cluster, tmp_path):
    """A rank dies at the same point every time (before anything new is saved): after the restarts, exit code 4."""
    runner = Supervisor(run_config(tmp_path, *RUN, "runner.recovery.max_restarts=1"))
    kills: list[int] = []

    def kill_actor_rank_0() -> None:
        deadline = time.monotonic() + 120
        while len(kills) < 2 and time.monotonic() < deadline:
            group = runner.trainer.actor_group if runner.trainer is not None else None
            if group is not None and group.hosts and group.hosts[0]["pid"] not in kills and metrics_lines(tmp_path) >= 1:
                kills.append(group.hosts[0]["pid"])
                kill(kills[-1])
            time.sleep(0.01)

    threading.Thread(target=kill_actor_rank_0, daemon=True).start()
    with pytest.raises(RecoveryExhaustedError, match=r"last failure \(the same each time\): worker lost") as error:
        runner.run()
    assert error.value.exit_code == 4 and len(kills) == 2


@pytest.mark.parametrize("strategy", ["PACK", "STRICT_SPREAD"])
def test_node_lost_and_replaced(cluster, reference, tmp_path, strategy):
    """PACK: both actor ranks on the actor node, their snapshot parts in the head node's holder: restored from memory.
    STRICT_SPREAD: one rank on each node, each rank's part on the other node: the lost node takes a rank and the
    other rank's part, the snapshot is incomplete, and the checkpoint on storage is loaded."""
    runner = Supervisor(run_config(tmp_path, *RUN, f"cluster.placement_strategy={strategy}"))
    errors: list[BaseException] = []

    def train() -> None:
        try:
            runner.run()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    # Cluster.add_node must run in the main thread (Ray installs signal handlers there): train in a thread
    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    # after step 4, and once step 3's checkpoint is committed (saved in the background): the fallback has one
    wait_for(lambda: metrics_lines(tmp_path) >= 4 and (tmp_path / "test" / "checkpoints" / "global_step_3").is_dir())
    cluster.remove_node(cluster.actor_node)  # preemption
    wait_for(lambda: bool(recovery_events(tmp_path, "failure")))
    time.sleep(1.0)  # the driver is now waiting for the cluster to fit the actor group again
    cluster.actor_node = cluster.add_node(num_cpus=2)
    trainer.join(timeout=240)
    assert not trainer.is_alive() and not errors, errors
    [failure] = recovery_events(tmp_path, "failure")
    [resumed] = recovery_events(tmp_path, "resumed")
    assert resumed["wait_s"] >= 0.5  # it waited for the replacement node
    if strategy == "PACK":
        assert "actor rank 0" in failure["cause"] and "actor rank 1" in failure["cause"]
        # the newest parts may still have been on their way from the lost node: at most that step is redone
        assert failure["restore_from"] == "snapshot" and failure["lost_steps"] <= 1, failure
    else:
        assert failure["restore_from"] == "checkpoint" and resumed["source"] == "checkpoint", failure
        assert resumed["step"] % 3 == 0 and failure["lost_steps"] <= 3
    assert_matches_reference(tmp_path, reference)


def driver_command(cluster, output_dir: Path, *overrides: str) -> list[str]:
    base = [f"runner.output_dir={output_dir}", "runner.experiment_name=test", "runner.logger.progress_bar=false",
            "data.batch_size=4", "algorithm.group_size=4", "actor.micro_batch_size=4",
            f"cluster.ray_address={cluster.address}", *TINY_MODEL, "data.synthetic.val_size=0"]
    return [*base, *RUN, *overrides]


def wait_for(condition: Callable[[], bool], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_sigterm_writes_an_emergency_checkpoint_then_auto_resumes(cluster, reference, tmp_path, subprocess_env):
    driver = subprocess.Popen([sys.executable, "-m", "rlrunner.main_grpo", *driver_command(cluster, tmp_path)],
                              env=subprocess_env, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: metrics_lines(tmp_path) >= 4)
    driver.send_signal(signal.SIGTERM)
    _, err = driver.communicate(timeout=60)
    assert driver.returncode == 3, err
    last_line = err.strip().splitlines()[-1]
    assert last_line.startswith("rlrunner: stopped: SIGTERM received at step ") and "resume with runner.resume_dir=auto" in last_line
    stopped_at = int(last_line.split("at step ")[1].split(";")[0])
    assert (tmp_path / "test" / "checkpoints" / f"global_step_{stopped_at}" / "manifest.json").is_file()
    assert metrics_lines(tmp_path) == stopped_at  # the abandoned step (if any) was not logged

    Supervisor(run_config(tmp_path, *RUN, "runner.resume_dir=auto")).run()
    assert_matches_reference(tmp_path, reference)


def test_a_second_signal_exits_at_once(cluster, tmp_path, subprocess_env):
    driver = subprocess.Popen([sys.executable, "-m", "rlrunner.main_grpo", *driver_command(cluster, tmp_path)],
                              env=subprocess_env, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: metrics_lines(tmp_path) >= 4)
    # an actor rank stops answering, so the update in flight can never finish: only a second signal ends the run
    actor_pids = [int(p) for p in subprocess.run(["pgrep", "-f", "ray::FSDPActorWorker"], capture_output=True, text=True).stdout.split()]
    for pid in actor_pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        driver.send_signal(signal.SIGTERM)
        time.sleep(1.5)
        assert driver.poll() is None, "the first SIGTERM must wait for the step in flight"
        started = time.monotonic()
        driver.send_signal(signal.SIGTERM)
        _, err = driver.communicate(timeout=30)
        assert time.monotonic() - started < 15
    finally:
        for pid in actor_pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert driver.returncode == 143, err
    assert "rlrunner: stopped at once by a second SIGTERM; the last committed checkpoint is intact" in err
    root = tmp_path / "test" / "checkpoints"
    complete = [basename(u) for u in layout.step_dirs(LOCAL, str(root))]
    assert all((root / name / "manifest.json").is_file() for name in complete)


def test_launch_script_relaunches_a_dead_driver(cluster, reference, tmp_path, subprocess_env, repo_root):
    env = {**subprocess_env, "PYTHON": sys.executable, "RLRUNNER_RESTART_BACKOFF_S": "0"}
    script = subprocess.Popen(["bash", str(repo_root / "launch/run_main_grpo.sh"), *driver_command(cluster, tmp_path)],
                              env=env, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: metrics_lines(tmp_path) >= 5)
    [driver_pid] = [int(p) for p in subprocess.run(["pgrep", "-P", str(script.pid)], capture_output=True, text=True).stdout.split()]
    os.kill(driver_pid, signal.SIGKILL)  # the driver's node "dies"
    _, err = script.communicate(timeout=240)
    assert script.returncode == 0, err
    assert "run_main_grpo.sh: the driver exited with code 137: restart 1 of 3 with runner.resume_dir=auto in 0s" in err
    assert "run_main_grpo.sh: the run finished" in err
    assert_matches_reference(tmp_path, reference)


def test_launch_script_does_not_retry_a_configuration_error(repo_root, subprocess_env, tmp_path):
    result = subprocess.run(["bash", str(repo_root / "launch/run_main_grpo.sh"), "runner.nope=1"], cwd=tmp_path,
                            env={**subprocess_env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "run_main_grpo.sh: configuration error (exit code 2): not restarting"
    assert result.stderr.count("rlrunner: error:") == 1


def test_stop_request_from_wall_time_saves_and_stops(cluster, tmp_path):
    runner = Supervisor(run_config(tmp_path, *RUN), StopRequest(max_wall_time_s=3600))
    once(lambda: metrics_lines(tmp_path) >= 4, lambda: setattr(runner.stop, "max_wall_time_s", 0.0))
    with pytest.raises(StoppedEarly, match=r"runner.max_wall_time_s=0 reached at step \d+; saved global_step_\d+"):
        runner.run()


def patch_worker_module(worker, module: str, name: str, make_replacement) -> None:
    """Replace a module-level function inside one worker process (Ray binds actor methods at creation)."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module

    def patch(self) -> None:
        import sys

        target = sys.modules[module]
        setattr(target, name, make_replacement(getattr(target, name)))

    ray.get(worker.__ray_call__.remote(patch))


def patch_worker_attribute(worker, name: str, make_replacement) -> None:
    """Replace an attribute of one worker object (e.g. the rollout worker's reward function)."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module

    def patch(self) -> None:
        setattr(self, name, make_replacement(getattr(self, name)))

    ray.get(worker.__ray_call__.remote(patch))


def raising(original):
    def boom(*args, **kwargs):
        raise RuntimeError("boom from worker code")

    return boom


def test_an_exception_in_worker_code_during_a_collective_ends_the_run_without_retries(cluster, tmp_path):
    runner = Supervisor(run_config(tmp_path, *RUN))
    # rank 1 raises in its log-probs after the forward's all-gathers; rank 0 then waits in the backward's reduce-scatter
    once(lambda: metrics_lines(tmp_path) >= 2,
         lambda: patch_worker_module(runner.trainer.actor_group.workers[1], "rlrunner.backends.actor", "token_log_probs", raising))
    started = time.monotonic()
    with pytest.raises(WorkerError) as error:
        runner.run()
    assert str(error.value) == "actor rank 1: RuntimeError: boom from worker code (an error in worker code: not retried)"
    assert error.value.exit_code == 4
    assert recovery_events(tmp_path, "failure") == []  # not one in-job restart
    assert time.monotonic() - started < 60  # nobody waited for the step timeout (30 s) behind the stuck rank 0


def test_a_save_slower_than_a_step_bound_is_not_a_hang(cluster, tmp_path):
    """Checkpoint I/O has its own bound (runner.recovery.checkpoint_timeout_s), also for the process group."""

    def slow(original):
        def save(*args, **kwargs):
            time.sleep(4)  # longer than the step bound below (3 s)
            return original(*args, **kwargs)

        return save

    runner = Supervisor(run_config(tmp_path, *RUN, "runner.max_steps=4", "runner.save_interval=2",
                                   "runner.recovery.step_timeout_s=3", "runner.recovery.checkpoint_timeout_s=60"))
    once(lambda: runner.trainer is not None and runner.trainer.actor_group is not None and len(runner.trainer.actor_group.hosts) == 2,
         lambda: [patch_worker_module(w, "rlrunner.backends.fsdp.worker", "fsdp_state", slow) for w in runner.trainer.actor_group.workers])
    runner.run()
    assert recovery_events(tmp_path, "failure") == []
    blocked = {m["step"]: m["time/save_s"] for m in read_metrics(tmp_path / "test" / "metrics.jsonl") if "time/save_s" in m}
    assert blocked[2] > 3 and blocked[4] > 3  # each save outlasted the step bound and was not taken for a hang


# -- the same failures with the Megatron (tensor-parallel) backend: tp=2 on the actor node's 2 CPUs ---------------

MEGATRON = ["model.override_config.num_key_value_heads=2", "actor.training_backend=megatron",
            "actor.tensor_model_parallel_size=2"]


@pytest.fixture(scope="module")
def megatron_reference(cluster, tmp_path_factory) -> Reference:
    out = tmp_path_factory.mktemp("megatron_reference")
    Supervisor(run_config(out, *RUN, *MEGATRON)).run()
    return Reference(read_metrics(out / "test" / "metrics.jsonl"), load_model_weights(final_checkpoint(out)))


def test_megatron_rollout_worker_then_tensor_parallel_rank_killed_mid_step(cluster, megatron_reference, tmp_path):
    """The rollout worker killed after step 3: the tensor-parallel ranks' channels are joined again with the new
    rollout worker (each sends its own slices) and no step is lost. Then tp rank 1 dies in the update after step 6 and
    comes back from the in-memory snapshot. (Both in one run: one run's start-up less for the suite.)"""
    runner = Supervisor(run_config(tmp_path, *RUN, *MEGATRON))
    once(lambda: metrics_lines(tmp_path) >= 3, lambda: kill(runner.trainer.rollout_group.hosts[0]["pid"]))
    kill_in_next_update(runner, 1, 6, tmp_path)
    runner.run()
    [repair] = recovery_events(tmp_path, "rollout_repaired")
    assert "rollout rank 0" in repair["cause"] and repair["lost_steps"] == 0 and repair["step"] in (4, 5), repair
    failure = assert_restored_from_memory(tmp_path)
    assert "actor rank 1" in failure["cause"] and failure["step"] >= 6, failure
    assert_matches_reference(tmp_path, megatron_reference)


def test_megatron_sigterm_writes_an_emergency_checkpoint_then_auto_resumes(cluster, megatron_reference, tmp_path, subprocess_env):
    driver = subprocess.Popen([sys.executable, "-m", "rlrunner.main_grpo", *driver_command(cluster, tmp_path, *MEGATRON)],
                              env=subprocess_env, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: metrics_lines(tmp_path) >= 4)
    driver.send_signal(signal.SIGTERM)
    _, err = driver.communicate(timeout=60)
    assert driver.returncode == 3, err
    stopped_at = int(err.strip().splitlines()[-1].split("at step ")[1].split(";")[0])
    actor = tmp_path / "test" / "checkpoints" / f"global_step_{stopped_at}" / "actor"
    assert (actor / "latest_checkpointed_iteration.txt").read_text() == str(stopped_at)
    Supervisor(run_config(tmp_path, *RUN, *MEGATRON, "runner.resume_dir=auto")).run()
    assert_matches_reference(tmp_path, megatron_reference)
