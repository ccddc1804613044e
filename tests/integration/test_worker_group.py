"""WorkerGroup on a real local Ray: calls on all ranks, one rank, scatter, a gloo process group, placement limits."""

from __future__ import annotations

import sys
import time

import pytest
import ray
from ray import cloudpickle

from rlrunner.cluster import parked_groups
from rlrunner.cluster.actor_calls import CallAbandoned, CallTimeoutError, WorkerRaised
from rlrunner.cluster.worker import Worker
from rlrunner.cluster.worker_group import WorkerGroup
from rlrunner.errors import ResourceError

# Ray workers cannot import this test module by name: ship its classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class SumWorker(Worker):
    def __init__(self, rank: int, world_size: int, offset: int = 0):
        super().__init__(rank, world_size)
        self.offset = offset

    def rank_plus(self, value: int) -> int:
        return self.rank + self.offset + value

    def all_reduce_rank(self) -> float:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(tensor)
        return float(tensor.item())

    def draw(self) -> list[float]:
        """Two numbers from torch's global generator (never seeded here)."""
        import torch

        return torch.rand(2).tolist()

    def remember(self, value: int) -> None:
        self.remembered = value

    def attributes(self) -> list[str]:
        return sorted(vars(self))

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def fail_on_rank(self, rank: int, seconds: float) -> int:
        """Rank `rank` raises at once; the others hang for `seconds` (like peers stuck in a collective)."""
        if self.rank == rank:
            raise RuntimeError(f"rank {rank} failed")
        time.sleep(seconds)
        return self.rank


def test_calls_scatter_and_process_group(ray_session):
    group = WorkerGroup("sum", SumWorker, 2, worker_kwargs={"offset": 10}, cpus_per_worker=0.25, distributed=True)
    try:
        assert group.call_all("rank_plus", 1) == [11, 12]
        assert group.call_rank(1, "rank_plus", 5) == 16
        assert group.call_each("rank_plus", [(100,), (200,)]) == [110, 211]
        assert group.call_all("all_reduce_rank") == [3.0, 3.0]
        assert [host["rank"] for host in group.hosts] == [0, 1]
        with pytest.raises(ValueError, match="argument tuples"):
            group.call_each("rank_plus", [(1,)])
    finally:
        group.shutdown()


def test_call_timeout_is_bounded(ray_session):
    group = WorkerGroup("slow", SumWorker, 1, cpus_per_worker=0.25, call_timeout_s=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(CallTimeoutError, match="the slow group did not answer within 0.5s"):
            group.call_all("sleep", 30)
        assert time.monotonic() - started < 10
    finally:
        group.shutdown()


def test_a_failing_rank_is_reported_without_waiting_for_hung_peers(ray_session):
    group = WorkerGroup("mixed", SumWorker, 2, cpus_per_worker=0.25, call_timeout_s=60)
    try:
        started = time.monotonic()
        with pytest.raises(WorkerRaised, match=r"^mixed rank 1: RuntimeError: rank 1 failed") as error:
            group.call_all("fail_on_rank", 1, 30)
        assert time.monotonic() - started < 10
        assert isinstance(error.value.__cause__, ray.exceptions.RayTaskError)
        # rank 0 is still sleeping in its call and rank 1 raised: neither is dead
        assert group.dead_ranks(timeout_s=1) == []
        ray.kill(group.workers[1], no_restart=True)
        deadline = time.monotonic() + 30  # ray.kill returns before the actor is gone
        while group.dead_ranks(timeout_s=1) != [1] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert group.dead_ranks(timeout_s=1) == [1]
    finally:
        group.shutdown()


def test_waiting_can_be_abandoned(ray_session):
    group = WorkerGroup("abandon", SumWorker, 1, cpus_per_worker=0.25)
    try:
        deadline = time.monotonic() + 1
        with pytest.raises(CallAbandoned):
            group.get(group.call_all_async("sleep", 30), abandon=lambda: time.monotonic() > deadline)
        assert time.monotonic() < deadline + 5
    finally:
        group.shutdown()


def test_unplaceable_group_fails_naming_missing_resources(ray_session):
    started = time.monotonic()
    with pytest.raises(ResourceError) as error:
        WorkerGroup("huge", SumWorker, 3, cpus_per_worker=100, placement_timeout_s=1)
    message = str(error.value)
    assert "huge group (3 workers x {CPU=100})" in message
    assert "CPU 300" in message and "cluster has 8" in message
    assert "\n" not in message
    assert time.monotonic() - started < 20
    # the failed group's placement group was released: a normal group still fits
    group = WorkerGroup("after", SumWorker, 1, cpus_per_worker=0.25)
    group.shutdown()


class BrokenWorker(Worker):
    def __init__(self, rank: int, world_size: int):
        super().__init__(rank, world_size)
        raise ValueError("cannot start")


def test_a_group_that_fails_to_start_releases_its_resources(ray_session):
    with pytest.raises(ray.exceptions.RayActorError, match="cannot start"):
        WorkerGroup("broken", BrokenWorker, 2, cpus_per_worker=3)
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]


def test_workers_per_bundle_keeps_consecutive_ranks_in_one_bundle(ray_session):
    from ray.util.placement_group import placement_group_table

    with pytest.raises(ValueError, match="tp: 3 workers do not fill bundles of 2"):
        WorkerGroup("tp", SumWorker, 3, cpus_per_worker=0.25, workers_per_bundle=2)
    group = WorkerGroup("tp", SumWorker, 4, cpus_per_worker=0.25, workers_per_bundle=2)
    try:
        bundles = placement_group_table(group.placement_group)["bundles"]
        assert list(bundles.values()) == [{"CPU": 0.5}, {"CPU": 0.5}]  # one bundle (one node) per pair of ranks
        assert group.call_all("rank_plus", 1) == [1, 2, 3, 4]  # all four ranks placed and running
    finally:
        group.shutdown()


def test_lost_ranks_are_replaced_in_place_and_the_process_group_formed_again(ray_session):
    """Rank 1 killed: the survivors leave their process group, a new process starts in rank 1's own bundle and the
    group (rank 0 keeps its process) all-reduces again. Then rank 0 is killed and a spare takes its place: its bundle
    is kept idle, and the next rank replaced without a spare starts there rather than in a new placement group."""
    group = WorkerGroup("sum", SumWorker, 3, cpus_per_worker=0.25, distributed=True)
    spare = None
    try:
        assert group.call_all("all_reduce_rank") == [6.0, 6.0, 6.0]
        pids = [host["pid"] for host in group.hosts]
        ray.kill(group.workers[1], no_restart=True)
        deadline = time.monotonic() + 30  # ray.kill returns before the actor is gone
        while group.dead_ranks() != [1] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert group.dead_ranks() == [1]
        for rank in (0, 2):
            group.call_rank(rank, "leave_process_group")
        group.replace_ranks([1])
        assert group.call_all("all_reduce_rank") == [6.0, 6.0, 6.0]
        new_pids = [host["pid"] for host in group.hosts]
        assert new_pids[0] == pids[0] and new_pids[2] == pids[2] and new_pids[1] != pids[1]
        assert [host["rank"] for host in group.hosts] == [0, 1, 2] and len(group.placement_groups) == 1

        spare = ray.remote(SumWorker).options(num_cpus=0.25).remote(rank=-1, world_size=0)
        ray.get(spare.ping.remote())
        ray.kill(group.workers[0], no_restart=True)
        for rank in (1, 2):
            group.call_rank(rank, "leave_process_group")
        group.replace_ranks([0], spares=[spare])
        assert group.workers[0] is spare and group.call_all("all_reduce_rank") == [6.0, 6.0, 6.0]
        assert group.rank_bundles[0] is None and len(group.idle_bundles) == 1

        ray.kill(group.workers[0], no_restart=True)  # the adopted spare: it has no bundle, so it takes the idle one
        for rank in (1, 2):
            group.call_rank(rank, "leave_process_group")
        group.replace_ranks([0])
        assert group.call_all("all_reduce_rank") == [6.0, 6.0, 6.0]
        assert group.idle_bundles == [] and len(group.placement_groups) == 1
        with pytest.raises(ValueError, match="spares"):
            group.replace_ranks([0], spares=[spare, spare])
    finally:
        group.shutdown()


def test_a_finished_group_is_built_again_in_its_processes_by_the_next_group_of_its_shape(ray_session):
    """`finish` with `reuse` parks the group (its workers released); the next group of the same shape takes its
    processes and placement, built with its own arguments as a new process would be: nothing kept from the last run,
    torch's generator where a new process has it, the process group formed again. Another shape starts its own."""
    shape = {"cpus_per_worker": 0.25, "distributed": True, "reuse": True}
    first = WorkerGroup("sum", SumWorker, 2, worker_kwargs={"offset": 10}, **shape)
    groups = [first]
    try:
        draws = first.call_all("draw")
        first.call_all("remember", 5)
        assert first.call_all("all_reduce_rank") == [3.0, 3.0]
        first.finish(10.0)
        second = WorkerGroup("sum", SumWorker, 2, worker_kwargs={"offset": 20}, **shape)
        groups.append(second)
        assert [h["pid"] for h in second.hosts] == [h["pid"] for h in first.hosts]
        assert second.placement_groups == first.placement_groups
        assert second.call_all("draw") == draws
        kept = second.call_all("attributes")
        assert second.call_all("rank_plus", 1) == [21, 22] and second.call_all("all_reduce_rank") == [3.0, 3.0]
        second.finish(10.0)

        other = WorkerGroup("sum", SumWorker, 3, worker_kwargs={"offset": 0}, **shape)  # another shape
        groups.append(other)
        assert not {h["pid"] for h in other.hosts} & {h["pid"] for h in first.hosts}
        assert kept == other.call_all("attributes")[:2] and "remembered" not in kept[0]  # nothing left of the first
        other.shutdown()
        third = WorkerGroup("sum", SumWorker, 2, worker_kwargs={"offset": 30}, **shape)  # still parked meanwhile
        groups.append(third)
        assert [h["pid"] for h in third.hosts] == [h["pid"] for h in first.hosts]
        third.finish(10.0)
        ray.kill(third.workers[1], no_restart=True)  # a parked worker lost: its group is not taken
        deadline = time.monotonic() + 30  # ray.kill returns before the actor is gone
        while third.dead_ranks(timeout_s=1) != [1] and time.monotonic() < deadline:
            time.sleep(0.1)
        fourth = WorkerGroup("sum", SumWorker, 2, worker_kwargs={"offset": 40}, **shape)
        groups.append(fourth)
        assert not {h["pid"] for h in fourth.hosts} & {h["pid"] for h in first.hosts}
        assert fourth.call_all("all_reduce_rank") == [3.0, 3.0]
        fourth.finish(10.0)
        plain = WorkerGroup("sum", SumWorker, 2, worker_kwargs={"offset": 40}, cpus_per_worker=0.25)
        groups.append(plain)  # reuse off: a group of its own, shut down by finish
        assert not {h["pid"] for h in plain.hosts} & {h["pid"] for h in fourth.hosts}
        plain.finish(10.0)
        # ray.kill is asked, not waited for: a ping sent at once may still be answered by a rank not yet killed
        deadline = time.monotonic() + 10.0
        while (dead := plain.dead_ranks(timeout_s=1.0)) != [0, 1] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert dead == [0, 1]
    finally:
        parked_groups.evict()
        for group in groups:
            group.shutdown()


def test_parked_groups_give_way_to_a_group_that_does_not_fit_beside_them(ray_session):
    parked = WorkerGroup("sum", SumWorker, 2, cpus_per_worker=0.5, reuse=True)
    big = None
    try:
        parked.finish(10.0)
        total = ray.cluster_resources()["CPU"]
        big = WorkerGroup("big", SumWorker, 2, cpus_per_worker=total / 2, reuse=True, placement_timeout_s=30)
        assert big.call_all("rank_plus", 1) == [1, 2]
        assert parked.dead_ranks(timeout_s=10.0) == [0, 1]
        assert parked_groups.take(parked._key) is None
    finally:
        parked_groups.evict()
        parked.shutdown()
        if big is not None:
            big.shutdown()


def test_a_group_the_cluster_can_never_fit_leaves_the_parked_groups_alone(ray_session):
    """No eviction makes it fit: the parked group is kept, alive, for the next group of its shape."""
    parked = WorkerGroup("sum", SumWorker, 2, cpus_per_worker=0.5, reuse=True)
    try:
        parked.finish(10.0)
        total = ray.cluster_resources()["CPU"]
        with pytest.raises(ResourceError, match="cannot place the huge group"):
            WorkerGroup("huge", SumWorker, 2, cpus_per_worker=total, reuse=True, placement_timeout_s=2)
        assert parked_groups.take(parked._key) is parked
    finally:
        parked_groups.evict()
        parked.shutdown()
