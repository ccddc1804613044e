"""An elastic run on a real multi-node Ray cluster (conftest's `cluster`): the node with both actor ranks is preempted
and not replaced, the run trains on at data-parallel size 1 from the in-memory snapshot resharded, then the node comes
back and the run grows back to 2 ranks at a step boundary; it ends with the uninterrupted reference run's metrics and
weights, bit for bit (the FSDP update is layout-invariant: actor.layout_invariant resolves on for an elastic run). And
Megatron at dp 2 x tp 2 losing a tensor-parallel group's node trains on at dp 1."""

from __future__ import annotations

import threading
import time

import pytest
import ray
from recovery_helpers import RUN, assert_matches_reference, recovery_events, train_in_thread, wait_for
from reference_runs import MEGATRON, NUMERICS, Reference, reference_run

from rlrunner.runner.supervisor import Supervisor

from conftest import Inspect, metrics_lines, read_metrics, run_config

pytestmark = [pytest.mark.slow, pytest.mark.multinode]

# The actor group (2 x 0.75 CPU, one bundle) fits only the 2-CPU worker node; the head node (1 CPU) then holds one
# actor rank and the rollout worker, not both ranks.
ELASTIC = [
    *RUN,
    "cluster.cpus_per_actor_worker=0.75",
    "cluster.cpus_per_rollout_worker=0.25",
    "cluster.placement_strategy=STRICT_PACK",
    "runner.recovery.shrink_after_s=1",
]


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory) -> Reference:
    return reference_run("fsdp", tmp_path_factory)


def test_a_preempted_node_shrinks_the_run_then_it_grows_back_with_the_same_weights(cluster, reference, tmp_path):
    node_back = threading.Event()

    def hold_the_shrunk_attempt(trainer) -> None:
        if trainer.ctx.layout.actor_ranks == 1:  # a 10-step run would otherwise end before the node is back
            assert node_back.wait(120)

    runner = Supervisor(run_config(tmp_path, *ELASTIC), callbacks=[Inspect(hold_the_shrunk_attempt)])
    trainer, errors = train_in_thread(runner)
    wait_for(lambda: metrics_lines(tmp_path) >= 3)
    cluster.remove_node(cluster.actor_node)  # preempted, no replacement for now
    wait_for(lambda: bool(recovery_events(tmp_path, "failure")) or not trainer.is_alive())
    assert not errors, errors
    shrunk_at = metrics_lines(tmp_path)
    time.sleep(2.0)  # past shrink_after_s: the run has shrunk
    cluster.actor_node = cluster.add_node(num_cpus=2)  # capacity returns
    wait_for(lambda: sum(node["Alive"] for node in ray.nodes()) >= 2)
    node_back.set()
    trainer.join(timeout=240)
    assert not trainer.is_alive() and not errors, errors

    [shrink] = recovery_events(tmp_path, "shrink")
    assert (shrink["old_actor_ranks"], shrink["new_actor_ranks"]) == (2, 1), shrink
    assert shrink["lost_steps"] <= 1 and shrink["time_to_step_s"] < 60, shrink
    assert shrink["restore_from"] == "snapshot", shrink  # the parts held off the lost node, resharded to 1 rank
    [grow] = recovery_events(tmp_path, "grow")
    assert (grow["old_actor_ranks"], grow["new_actor_ranks"]) == (1, 2) and grow["lost_steps"] == 0, grow
    sizes = [m["actor/dp_size"] for m in read_metrics(tmp_path / "test" / "metrics.jsonl")]
    assert 1 in sizes[shrunk_at - 1 :] and sizes[-1] == 2 and sizes[0] == 2, sizes
    assert_matches_reference(tmp_path, reference)


def test_megatron_dp2_tp2_losing_a_tensor_parallel_group_trains_on_at_dp1(cluster, tmp_path):
    """Megatron at dp 2 x tp 2, one tensor-parallel group per node (SPREAD): the worker node goes for good, and the run
    trains on at dp 1 x tp 2 from the newest checkpoint (the backend does not reshard snapshots); the same math at
    another size, so its bits are not compared."""
    layout = [
        *NUMERICS,
        *MEGATRON,
        "runner.max_steps=6",
        "runner.save_interval=2",
        "actor.num_workers=4",
        "cluster.cpus_per_actor_worker=0.4",
        "cluster.cpus_per_rollout_worker=0.2",
        "cluster.placement_strategy=SPREAD",
        "runner.recovery.shrink_after_s=1",
        "runner.recovery.step_timeout_s=60",
        "runner.recovery.wait_timeout_s=120",
    ]
    runner = Supervisor(run_config(tmp_path, *layout))
    trainer, errors = train_in_thread(runner)
    wait_for(lambda: (tmp_path / "test" / "checkpoints" / "global_step_2").is_dir() and metrics_lines(tmp_path) >= 3)
    assert cluster.actor_node.node_id in {host["node_id"] for host in runner.trainer.actor_group.hosts}
    cluster.remove_node(cluster.actor_node)  # one tensor-parallel group's node, for good
    try:
        trainer.join(timeout=240)
        assert not trainer.is_alive() and not errors, errors
    finally:
        cluster.actor_node = cluster.add_node(num_cpus=2)  # the next tests' cluster
    [shrink] = recovery_events(tmp_path, "shrink")
    assert (shrink["old_actor_ranks"], shrink["new_actor_ranks"]) == (4, 2), shrink
    assert shrink["restore_from"] == "checkpoint" and shrink["lost_steps"] <= 2, shrink
    metrics = read_metrics(tmp_path / "test" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert metrics[0]["actor/dp_size"] == 2 and metrics[-1]["actor/dp_size"] == 1
