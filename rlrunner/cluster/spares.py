"""Warm spares: worker processes of a group started ahead, so that a replaced group does not wait for new processes.

    pool = SparePool("actor", worker_cls, worker_kwargs, count=2, cpus=0.5, gpus=0.0)
    pool.refill(avoid_nodes)    # start the missing spares (never waits), preferably off `avoid_nodes`
    spares = pool.take(n)       # up to n spares, those up (warmed) first, then those still starting
    WorkerGroup(..., spares=spares)  # they become ranks 0..k-1 of the new group (`Worker.adopt`)

A spare is an actor of the group's worker class built with the group's arguments and no rank yet: its process has
imported torch, transformers and the worker's modules and run `Worker.warm_up` (an actor spare runs the model's code
once), and a rollout spare has built its engine. Each spare holds its
own resources (not a placement-group bundle of the group), placed with a soft preference for a node that runs none of
the group's ranks (not the node whose loss it covers), going elsewhere when that node is full. A spare the cluster
cannot place yet waits in Ray's queue; a group placed meanwhile takes it all the same and waits for it (it is ahead of
a new process). One left over, not up when a group is placed, is stopped (it must not take the group's resources) and
started again once the group is placed.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlrunner.cluster import parked_groups
from rlrunner.cluster.actor_calls import kill_quietly
from rlrunner.cluster.ray_setup import alive_nodes, cluster_lost

logger = logging.getLogger(__name__)

SPARE_RANK = -1  # the rank of a spare until a group adopts it


def spare_node(nodes: Sequence[str], avoid: Sequence[str], spares_on: Sequence[str]) -> str | None:
    """The node for one more spare: one that runs none of the group's ranks (`avoid`), the one with the fewest spares
    (`spares_on`) first; any node when every one runs a rank; None when there is no node."""
    candidates = [node for node in sorted(set(nodes)) if node not in set(avoid)] or sorted(set(nodes))
    if not candidates:
        return None
    return min(candidates, key=lambda node: list(spares_on).count(node))


class SparePool:
    def __init__(
        self, name: str, worker_cls: type, worker_kwargs: dict[str, Any], count: int, cpus: float, gpus: float = 0.0
    ):
        self.name = name
        self.count = count
        self.worker_kwargs = worker_kwargs
        self.cpus, self.gpus = cpus, gpus
        self.remote_cls = ray.remote(worker_cls)
        self.spares: list[tuple[Any, str, ray.ObjectRef]] = []  # (actor, its node, its start: a ping)
        self.covering: list[str] = []  # the nodes of the spares handed to the current group (they run it now)
        self._said_waiting = False

    def refill(self, avoid_nodes: Sequence[str] = ()) -> None:
        """Start spares until the pool has `count` (never waits). Groups an earlier run of this driver parked give
        way first: a spare waits in Ray's queue for resources, where nothing would make them give way later."""
        if len(self.spares) >= self.count:
            return
        parked_groups.evict()
        nodes = alive_nodes()
        while len(self.spares) < self.count:
            node = spare_node(nodes, [*avoid_nodes, *self.covering], [n for _, n, _ in self.spares])
            if node is None:
                return
            actor = self.remote_cls.options(
                num_cpus=self.cpus,
                num_gpus=self.gpus,
                max_restarts=0,
                max_concurrency=1,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True, _spill_on_unavailable=True),
            ).remote(rank=SPARE_RANK, world_size=0, **self.worker_kwargs)
            self.spares.append((actor, node, actor.warm_up.remote()))

    def take(self, n: int, multiple_of: int = 1, placing: bool = True) -> list[Any]:
        """Up to `n` spares, a multiple of `multiple_of` of them (a tensor-parallel group is placed whole): those up
        first, then those still starting (the group waits for them as for its own new processes, which they are ahead
        of); the dead ones are dropped. With `placing` (a group is about to be placed), the others still starting are
        stopped. Never waits."""
        if not self.spares:
            return []
        ready, _ = ray.wait([ping for _, _, ping in self.spares], num_returns=len(self.spares), timeout=0)
        up, starting = [], []
        for actor, node, ping in self.spares:
            if ping in ready:
                try:
                    ray.get(ping, timeout=0)
                except Exception:  # died while waiting (its node went): not a spare any more
                    continue
                up.append((actor, node, ping))
            else:
                starting.append((actor, node, ping))
        candidates = up + starting
        usable = min(n, len(candidates)) // multiple_of * multiple_of
        if len(up) < min(n, self.count) and not self._said_waiting:
            self._said_waiting = True
            logger.warning(
                "%d of %d %s spares are up (cluster.spare_workers.%s): the group waits for the others to "
                "finish starting",
                len(up),
                min(n, self.count),
                self.name,
                self.name,
            )
        taken, rest = candidates[:usable], candidates[usable:]
        # A spare left still starting is stopped, so that it cannot take the resources the group about to be placed
        # needs (a spare waiting in Ray's queue would get them first); the refill after the placement starts it again.
        if placing:
            for actor, _, ping in rest:
                if ping not in ready:
                    kill_quietly(actor)
        self.spares = [spare for spare in rest if spare[2] in ready or not placing]
        self.covering = (self.covering if not placing else []) + [node for _, node, _ in taken]
        return [actor for actor, _, _ in taken]

    def all_up(self) -> bool:
        """Whether the pool holds `count` spares and every one is up (never waits)."""
        pings = [ping for _, _, ping in self.spares]
        return len(pings) == self.count and len(ray.wait(pings, num_returns=len(pings), timeout=0)[0]) == len(pings)

    def close(self) -> None:
        """Kill the spares: the run is over."""
        if cluster_lost(force=True) is None:
            for actor, _, _ in self.spares:
                kill_quietly(actor)
        self.spares = []

    def forget(self) -> None:
        """Drop every spare (the embedded Ray was restarted: they went with it)."""
        self.spares = []
