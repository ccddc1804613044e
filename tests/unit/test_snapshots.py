"""The pure parts of in-memory snapshots and warm spares: where each rank's part goes, which step is complete, what a
holder keeps, where a spare goes."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch

from rlrunner.backends import snapshot_stream
from rlrunner.backends.snapshot_stream import SkeletonCache, SnapshotStream, byte_views, join_state, split_state
from rlrunner.cluster.snapshot_holder import SnapshotHolder
from rlrunner.cluster.spares import spare_node
from rlrunner.runner.snapshots import holder_nodes, newest_complete
from rlrunner.utils.rng import capture_rng
from rlrunner.utils.tensors import tensor_bytes

from conftest import assert_bit_equal


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


def live_state() -> dict:
    return {
        "model": {
            "w": torch.arange(6.0).view(2, 3),
            "b": torch.arange(5, dtype=torch.bfloat16)[::2],
            "big": torch.arange(2**18, dtype=torch.float32),  # sent from its own memory, not copied
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "mask": torch.tensor([True, False]), "empty": torch.ones(0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}],
        },
        "rng": capture_rng(),
    }


def assert_same_state(got: dict, expected: dict) -> None:
    assert_bit_equal(got["model"], expected["model"])
    assert_bit_equal(got["optimizer"]["state"][0], expected["optimizer"]["state"][0])
    assert got["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    assert_bit_equal({"torch": got["rng"]["torch"]}, {"torch": expected["rng"]["torch"]})
    assert got["rng"]["python"] == expected["rng"]["python"]


def read_back(holder: SnapshotHolder, step: int, rank: int, chunk_bytes: int) -> dict:
    """What `fetch_part` reads through Ray, read in this process."""
    skeleton, scalars, num_chunks = holder.get(step, rank, chunk_bytes)
    chunks = [holder.get_chunk(step, rank, i, chunk_bytes) for i in range(num_chunks)]
    return join_state(skeleton, chunks, json.loads(scalars))


def send(holder: SnapshotHolder, step: int, rank: int, state: dict) -> str | None:
    return SnapshotStream(step, rank, holder.address(), state).wait(timeout_s=30)


@pytest.mark.parametrize("chunk_bytes", [7, 2**16])
def test_a_part_sent_to_a_holder_reads_back_bit_for_bit(chunk_bytes):
    holder = SnapshotHolder(reserve_bytes=0)
    assert send(holder, 3, 1, live_state()) is None
    assert holder.held() == {3: [1]}
    _, _, num_chunks = holder.get(3, 1, chunk_bytes)
    assert num_chunks == -(-tensor_bytes(live_state()) // chunk_bytes)
    assert_same_state(read_back(holder, 3, 1, chunk_bytes), live_state())


def test_a_holder_keeps_whole_parts_and_drops_older_steps():
    holder = SnapshotHolder(reserve_bytes=0)
    for step, rank in [(4, 0), (4, 1), (5, 0)]:
        assert send(holder, step, rank, {"w": torch.full((3,), float(10 * step + rank))}) is None
    holder.put_driver_state(4, {"step": 4})
    holder.put_driver_state(5, {"step": 5})
    assert holder.held() == {4: [0, 1], 5: [0]}
    assert_bit_equal(read_back(holder, 4, 1, 4), {"w": torch.full((3,), 41.0)})
    assert holder.get_driver_state(4) == {"step": 4}
    holder.drop_before(5)
    assert holder.held() == {5: [0]} and holder.driver_states == {5: {"step": 5}}


def test_a_ranks_parts_go_over_one_kept_connection_and_a_broken_one_is_replaced():
    holder = SnapshotHolder(reserve_bytes=0)
    address = holder.address()
    assert send(holder, 1, 0, {"w": torch.full((3,), 1.0)}) is None
    connection = snapshot_stream._KEPT_CONNECTIONS.take(address)
    assert connection is not None  # kept after its part was held
    snapshot_stream._KEPT_CONNECTIONS.put(address, connection)
    for step in (2, 3):
        assert send(holder, step, 0, {"w": torch.full((3,), float(step))}) is None
    assert snapshot_stream._KEPT_CONNECTIONS.take(address) is connection  # the holder read parts 2 and 3 from it
    # The connection broke since the last part (as when the holder ended it): the next part goes on a new one.
    connection.socket.shutdown(socket.SHUT_RDWR)
    snapshot_stream._KEPT_CONNECTIONS.put(address, connection)
    assert send(holder, 4, 0, {"w": torch.full((3,), 4.0)}) is None
    assert holder.held() == {1: [0], 2: [0], 3: [0], 4: [0]}
    for step in (1, 2, 3, 4):
        assert_bit_equal(read_back(holder, step, 0, 5), {"w": torch.full((3,), float(step))})
    kept = snapshot_stream._KEPT_CONNECTIONS.take(address)
    assert kept is not None and kept is not connection
    kept.close()


def test_a_sender_lost_halfway_leaves_nothing_held():
    holder = SnapshotHolder(reserve_bytes=0)
    host, port, token = holder.address()
    listening = threading.active_count()
    header = {"token": token, "step": 1, "rank": 0, "skeleton_bytes": 4, "scalars_bytes": 2, "total_bytes": 100}
    with socket.create_connection((host, port), timeout=10) as connection:
        connection.sendall(json.dumps(header).encode() + b"\nskel[]")
        assert connection.makefile("rb").readline() == b"\n"  # go on
        connection.sendall(bytes(60))  # then the rank dies
    deadline = time.monotonic() + 10
    while threading.active_count() > listening and time.monotonic() < deadline:
        time.sleep(0.01)  # the holder's thread for the connection sees it closed, and ends
    assert threading.active_count() == listening
    assert holder.held() == {}


def test_a_sender_without_the_holders_token_is_not_read():
    holder = SnapshotHolder(reserve_bytes=0)
    host, port, _ = holder.address()
    for garbage in (b"[1, 2]\n", b"not json\n", b"{}\n"):
        with socket.create_connection((host, port), timeout=10) as connection:
            connection.sendall(garbage)
            assert connection.makefile("rb").readline() == b""  # closed without an answer
    reason = SnapshotStream(1, 0, (host, port, "not-the-token"), {"w": torch.ones(4)}).wait(timeout_s=30)
    assert "actor rank 0's part was lost on the way" in reason and "closed the connection" in reason
    assert holder.held() == {}


def test_a_part_given_up_on_a_stuck_holder_is_cut_off_before_wait_returns():
    """A holder that stops reading: the wait gives the part up after its timeout and cuts the connection, so that the
    tensors can change (the next update) with nothing more of them sent."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        stream = SnapshotStream(1, 0, ("127.0.0.1", listener.getsockname()[1], "token"), {"w": torch.ones(2**24)})
        connection, _ = listener.accept()
        with connection:
            connection.makefile("rb").readline()  # the header; the skeleton is left unread
            connection.sendall(b"\n")  # go on, then read nothing more
            started = time.monotonic()
            reason = stream.wait(timeout_s=0.5)
            assert reason == "actor rank 0's part was still on its way after 0.5 s"
            assert time.monotonic() - started < 10 and stream._sent.done()
            received = b""
            connection.settimeout(10)
            while chunk := connection.recv(2**20):  # what reached the holder ends: the sender cut the connection
                received += chunk
            assert len(received) < 2**26


def test_a_holder_refuses_a_part_that_would_eat_its_nodes_reserve():
    holder = SnapshotHolder(reserve_bytes=2**62)
    reason = send(holder, 1, 0, {"w": torch.ones(2**18)})
    assert "a 1 MiB part" in reason and "below the" in reason and "runner.snapshot.reserve_memory_gb" in reason
    assert holder.held() == {}


def test_a_dropped_parts_memory_takes_the_next_part_of_its_size_without_the_reserve_check():
    holder = SnapshotHolder(reserve_bytes=0)
    for step in (1, 2):
        assert send(holder, step, 0, {"w": torch.full((4,), float(step))}) is None
    holder.drop_before(2)  # step 1's part goes: its memory stays for the next part of its size
    holder.reserve_bytes = 2**62  # a part needing new memory is refused from now on
    assert send(holder, 3, 0, {"w": torch.full((4,), 3.0)}) is None
    assert_bit_equal(read_back(holder, 3, 0, 4), {"w": torch.full((4,), 3.0)})
    assert "below the" in send(holder, 4, 0, {"w": torch.ones(8)})  # another size: new memory, refused
    holder.drop_before(3)  # step 2's part goes, its buffer kept
    holder.drop_before(3)  # again (nothing to drop): step 2's buffer, which no part took since, is freed
    assert "below the" in send(holder, 5, 0, {"w": torch.ones(4)}) and holder.held() == {3: [0]}


def test_a_holder_kept_for_the_next_run_is_emptied_and_takes_that_runs_reserve():
    holder = SnapshotHolder(reserve_bytes=0)
    address = holder.address()
    assert send(holder, 4, 0, {"w": torch.ones(2)}) is None
    holder.put_driver_state(4, {"step": 4})
    assert holder.reset(2**62) == holder.ping()
    assert holder.held() == {} and holder.driver_states == {}
    assert holder.address() == address  # it goes on listening where it did
    assert "below the" in send(holder, 5, 0, {"w": torch.ones(2)})  # the new reserve holds


def test_a_part_cut_off_the_live_tensors_is_a_copy():
    live = live_state()
    skeleton, tensors = split_state(live)
    sent = b"".join(bytes(view) for view in byte_views(tensors))  # what a holder receives
    assert len(sent) == tensor_bytes(live)
    live["model"]["w"].add_(1)  # the training goes on once the part is held: the part must not change
    assert_same_state(join_state(skeleton, [sent]), live_state())


def split_and_join(cache: SkeletonCache, state: dict) -> tuple[bytes, dict]:
    skeleton, scalars, tensors = cache.split(state)
    sent = json.loads(json.dumps(scalars))  # as they go over the wire
    return skeleton, join_state(skeleton, [b"".join(bytes(view) for view in byte_views(tensors))], sent)


def test_a_skeleton_is_written_again_only_when_the_structure_changes():
    cache = SkeletonCache()
    first, _ = split_and_join(cache, live_state())
    state = live_state()
    state["model"]["w"].add_(7)  # new tensor values, the same structure: the skeleton is the last one
    skeleton, joined = split_and_join(cache, state)
    assert skeleton is first
    assert_same_state(joined, state)
    # New scalars, of the same types (an LR schedule's step, a scheduled learning rate, Python's RNG): the skeleton is
    # the last one, and the part reads back with the new values, exactly and of the same types.
    state = live_state()
    state["scheduler"] = {"last_epoch": 7, "_last_lr": [0.1 / 3], "name": "cosine", "verbose": False, "x": None}
    first, _ = split_and_join(cache, state)
    state = live_state()
    state["optimizer"]["param_groups"][0].update(lr=float("inf"), betas=(-0.0, 1 / 7))
    state["scheduler"] = {"last_epoch": 8, "_last_lr": [2**70 / 3], "name": "linear", "verbose": True, "x": None}
    state["rng"]["python"] = (3, tuple(range(625)), None)
    skeleton, joined = split_and_join(cache, state)
    assert skeleton is first
    assert_same_state(joined, state)
    assert joined["scheduler"] == state["scheduler"] and type(joined["scheduler"]["last_epoch"]) is int
    assert str(joined["optimizer"]["param_groups"][0]["betas"][0]) == "-0.0"
    assert type(joined["rng"]["python"][1]) is tuple
    for change in (
        lambda s: s["optimizer"]["param_groups"][0].update(lr=1),  # a scalar's type
        lambda s: s["model"].update(w=torch.zeros(3, 2)),  # a shape
        lambda s: s["model"].update(w=s["model"]["w"].double()),  # a dtype
        lambda s: s["optimizer"]["state"].update({1: {"step": torch.tensor(1.0)}}),  # a key
    ):
        state = live_state()
        change(state)
        skeleton, joined = split_and_join(cache, state)
        assert skeleton is not first
        assert skeleton == split_state(state)[0]
        assert joined["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
        assert_same_state(joined, state)
        first = skeleton


def test_a_skeleton_with_a_value_that_can_change_in_place_is_never_reused():
    cache = SkeletonCache()
    state = {"w": torch.ones(2), "extra": {"seen": bytearray(b"a")}}
    first, _, _ = cache.split(state)
    state["extra"]["seen"][0] = ord("b")  # the same object, changed: only writing the skeleton again shows it
    skeleton, _, _ = cache.split(state)
    assert skeleton is not first and skeleton != first


def test_a_part_with_bytes_beyond_its_tensors_is_refused():
    skeleton, _ = split_state({"w": torch.ones(2)})
    with pytest.raises(ValueError, match="more bytes than its tensors"):
        join_state(skeleton, [bytes(8), b"x"])
    with pytest.raises(ValueError, match="more scalars than its skeleton"):
        join_state(skeleton, [bytes(8)], [3])


def test_spares_go_off_the_nodes_of_the_group_they_cover_and_spread():
    assert spare_node(["a", "b", "c"], avoid=["a"], spares_on=[]) == "b"
    assert spare_node(["a", "b", "c"], avoid=["a"], spares_on=["b"]) == "c"
    assert spare_node(["a", "b"], avoid=["a", "b"], spares_on=["a"]) == "b"  # every node runs the group: spread
    assert spare_node([], avoid=[], spares_on=[]) is None


def test_a_rank_whose_update_failed_sends_no_part(tmp_path):
    """The driver queues a rank's snapshot start behind its update: after an update that raised, the rank's state is
    no step's, and the start refuses to send it."""
    from rlrunner.backends.fsdp.worker import FSDPActorWorker

    from conftest import actor_worker_kwargs, run_config

    worker = FSDPActorWorker(0, 1, **actor_worker_kwargs(run_config(tmp_path)))
    with pytest.raises(KeyError):
        worker.update({})  # a shard without its tensors: raises before it changes anything
    holder = SnapshotHolder(reserve_bytes=0)
    with pytest.raises(RuntimeError, match=r"^actor rank 0: no snapshot part of step 3: its update failed$"):
        worker.start_snapshot(3, holder.address())
    assert holder.held() == {}


def test_an_elastic_runs_snapshots_are_complete_at_the_size_each_was_taken():
    # step 4 taken by 4 ranks, step 5 by 2 (the group shrank): 5 is complete with its 2 parts
    held = {"a": {4: [0, 1, 2, 3], 5: [0, 1]}}
    assert newest_complete(held, world_size={4: 4, 5: 2}) == (5, {0: "a", 1: "a"})
    # step 5 taken by 4 ranks, 2 parts held: incomplete; a step of unknown size is never complete
    assert newest_complete(held, world_size={4: 4, 5: 4}) == (4, {0: "a", 1: "a", 2: "a", 3: "a"})
    assert newest_complete(held, world_size={5: 4}) is None
