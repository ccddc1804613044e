"""The pure parts of in-memory snapshots and warm spares: where each rank's part goes, which step is complete, what a
holder keeps, where a spare goes."""

from __future__ import annotations

import io

import torch

from rlrunner.backends.actor import serialize
from rlrunner.cluster.snapshot_holder import SnapshotHolder
from rlrunner.cluster.spares import spare_node
from rlrunner.runner.snapshots import holder_nodes, newest_complete
from rlrunner.utils.rng import capture_rng
from rlrunner.utils.tensors import tensor_bytes


def test_parts_go_first_to_nodes_that_run_no_rank():
    # ranks on a and b, c runs none: one node's loss never takes a rank and another rank's part
    assert holder_nodes(["a", "b"], ["a", "b", "c"]) == ["c", "c"]
    assert holder_nodes(["a", "a", "b", "b"], ["a", "b", "c", "d"]) == ["c", "d", "c", "d"]  # spread round-robin


def test_parts_go_to_another_node_when_every_node_runs_a_rank():
    assert holder_nodes(["a", "b"], ["a", "b"]) == ["b", "a"]
    assert holder_nodes(["a", "b", "c"], ["a", "b", "c"]) == ["b", "c", "a"]
    for rank, node in enumerate(holder_nodes(["a", "b", "c"], ["a", "b", "c"])):
        assert node != ["a", "b", "c"][rank]


def test_a_single_node_holds_its_own_ranks_parts():
    assert holder_nodes(["a", "a"], ["a"]) == ["a", "a"]


def test_the_newest_step_with_every_part_held_is_complete():
    held = {"a": {4: [0], 5: [0, 1]}, "b": {4: [1]}}
    assert newest_complete(held, world_size=2) == (5, {0: "a", 1: "a"})
    # rank 1's part of step 5 lost with its holder: step 4, whose parts are spread over both holders
    assert newest_complete({"a": {4: [0], 5: [0]}, "b": {4: [1]}}, world_size=2) == (4, {0: "a", 1: "b"})


def test_no_complete_step_or_none_new_enough_gives_none():
    assert newest_complete({"a": {5: [0]}}, world_size=2) is None
    assert newest_complete({}, world_size=1) is None
    assert newest_complete({"a": {3: [0, 1]}}, world_size=2, min_step=4) is None  # the checkpoint is newer
    assert newest_complete({"a": {4: [0, 1]}}, world_size=2, min_step=4) == (4, {0: "a", 1: "a"})


def test_a_snapshot_of_a_step_the_driver_did_not_complete_is_not_used():
    # step 5's parts were copied after its update, then its weight sync failed: the driver completed step 4 only
    held = {"a": {4: [0, 1], 5: [0, 1]}}
    assert newest_complete(held, world_size=2, max_step=4) == (4, {0: "a", 1: "a"})
    assert newest_complete({"a": {5: [0, 1]}}, world_size=2, max_step=4) is None


def test_a_holder_keeps_parts_and_drops_older_steps():
    holder = SnapshotHolder(reserve_bytes=0)
    assert holder.put(4, 0, b"rank0-step4", driver_state={"step": 4}) is None
    assert holder.put(4, 1, b"rank1-step4") is None
    assert holder.put(5, 0, b"rank0-step5", driver_state={"step": 5}) is None
    assert holder.held() == {4: [0, 1], 5: [0]}
    assert holder.get(4, 1) == b"rank1-step4" and holder.get_driver_state(4) == {"step": 4}
    holder.drop_before(5)
    assert holder.held() == {5: [0]} and holder.driver_states == {5: {"step": 5}}


def test_a_holder_kept_for_the_next_run_is_emptied_and_takes_that_runs_reserve():
    holder = SnapshotHolder(reserve_bytes=0)
    holder.put(4, 0, b"rank0-step4", driver_state={"step": 4})
    assert holder.reset(2**62) == holder.ping()
    assert holder.held() == {} and holder.driver_states == {}
    assert "below the" in holder.put(1, 0, b"part")  # the new reserve holds


def test_a_holder_refuses_a_part_that_would_eat_its_nodes_reserve():
    holder = SnapshotHolder(reserve_bytes=2**62)
    reason = holder.put(1, 0, b"part")
    assert "below the" in reason and "runner.snapshot.reserve_memory_gb" in reason
    assert holder.held() == {}


def test_a_rank_without_a_part_passes_its_reason_on():
    holder = SnapshotHolder(reserve_bytes=0)
    assert holder.put(1, 0, "actor rank 0: no room") == "actor rank 0: no room"
    assert holder.held() == {}


def test_a_serialized_part_reads_back_with_weights_only_and_is_a_copy():
    live = {
        "model": {"w": torch.arange(6.0).view(2, 3)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}],
        },
    }
    part = serialize({"state": live, "rng": capture_rng()})
    live["model"]["w"].add_(1)  # the training goes on: the part must not change
    saved = torch.load(io.BytesIO(part), weights_only=True)
    assert torch.equal(saved["state"]["model"]["w"], torch.arange(6.0).view(2, 3))
    assert saved["state"]["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert tensor_bytes(live) == 6 * 4 + 4


def test_spares_go_off_the_nodes_of_the_group_they_cover_and_spread():
    assert spare_node(["a", "b", "c"], avoid=["a"], spares_on=[]) == "b"
    assert spare_node(["a", "b", "c"], avoid=["a"], spares_on=["b"]) == "c"
    assert spare_node(["a", "b"], avoid=["a", "b"], spares_on=["a"]) == "b"  # every node runs the group: spread
    assert spare_node([], avoid=[], spares_on=[]) is None
