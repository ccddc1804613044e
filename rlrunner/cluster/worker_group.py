"""A group of N Ray actors running one Worker class in a placement group, driven with one small API.

    group = WorkerGroup("actor", ActorWorker, 2, worker_kwargs={...}, distributed=True)  # placed, started, ready
    group.call_all("setup")                   # every rank, same arguments
    group.call_rank(0, "full_state_dict")     # one rank
    group.call_each("update", [(shard0,), (shard1,)])  # scatter: rank i gets args i; results in rank order

Every blocking call waits at most `timeout_s` (the group's `call_timeout_s` unless given), so a
dead or hung peer surfaces as an exception instead of a stuck driver; a rank that fails is
reported at once, without waiting for peers that may be stuck in a collective with it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlrunner.cluster import parked_groups
from rlrunner.cluster.actor_calls import (
    CallAbandoned,
    CallTimeoutError,
    WorkerRaised,
    drain,
    kill_quietly,
    remove_placement_group_quietly,
)
from rlrunner.cluster.ray_setup import cluster_lost, started_here
from rlrunner.cluster.resources import describe_missing_resources, fits_cluster, missing_resources
from rlrunner.errors import ClusterLostError, ResourceError, describe

logger = logging.getLogger(__name__)

_POLL_S = 0.2


def _raise_if_cluster_lost() -> None:
    reason = cluster_lost()
    if reason is not None:
        raise ClusterLostError(reason)


class WorkerGroup:
    def __init__(
        self,
        name: str,
        worker_cls: type,
        num_workers: int,
        worker_kwargs: dict[str, Any] | None = None,
        cpus_per_worker: float = 0.5,
        gpus_per_worker: float = 0.0,
        placement_strategy: str = "PACK",
        placement_timeout_s: float = 60.0,
        distributed: bool = False,
        call_timeout_s: float | None = None,
        start_timeout_s: float = 300.0,
        dist_timeout_s: float = 1800.0,
        abandon: Callable[[], bool] | None = None,
        wait: bool = True,
        workers_per_bundle: int = 1,
        spares: Sequence[Any] = (),
        reuse: bool = False,
    ):
        """Place the group and start its actors; with `wait`, also wait until they are ready (see `wait_ready`).

        `workers_per_bundle` consecutive ranks share one placement bundle, and a bundle is never split across
        nodes: a tensor-parallel group placed this way always runs on one node. `spares` (warm workers of the same
        class and arguments, already running: `rlrunner.cluster.spares`) become the first ranks, a whole number of
        bundles of them; only the other ranks are placed and started. With `reuse` and no spares, a group of the same
        shape parked by an earlier run of this driver (`finish`) is built again in its processes and placement.
        """
        if workers_per_bundle < 1 or num_workers % workers_per_bundle:
            raise ValueError(f"{name}: {num_workers} workers do not fill bundles of {workers_per_bundle}")
        if len(spares) % workers_per_bundle or len(spares) > num_workers:
            raise ValueError(
                f"{name}: {len(spares)} spares for {num_workers} workers in bundles of {workers_per_bundle}"
            )
        self.name = name
        self.num_workers = num_workers
        self.call_timeout_s = call_timeout_s
        self._bundle = {"CPU": cpus_per_worker}
        if gpus_per_worker:
            self._bundle["GPU"] = gpus_per_worker
        self.workers_per_bundle = workers_per_bundle
        self.placement_strategy = placement_strategy
        self.reuse = reuse
        self.distributed = distributed
        # the shape a parked group must have to be taken
        self._key = (name, worker_cls, num_workers, tuple(self._bundle.items()), workers_per_bundle, placement_strategy)
        self._remote_cls = ray.remote(worker_cls)
        self._worker_kwargs = dict(worker_kwargs or {})
        self._cpus, self._gpus = cpus_per_worker, gpus_per_worker
        self.start_timeout_s = start_timeout_s
        self.dist_timeout_s = dist_timeout_s
        self.hosts: list[dict] = []
        self._created = time.monotonic()
        self._starting: list[ray.ObjectRef] | None = None  # a reused group's rebuild (`Worker.reinit`)
        parked = parked_groups.take(self._key) if reuse and not spares else None
        if parked is not None:
            self.placement_groups, self.rank_bundles = parked.placement_groups, parked.rank_bundles
            self.idle_bundles, self.placement_wait_s, self.workers = parked.idle_bundles, 0.0, parked.workers
            kwargs = self._worker_kwargs
            self._starting = [
                worker.reinit.remote(rank, num_workers, **kwargs) for rank, worker in enumerate(self.workers)
            ]
            if wait:
                self.wait_ready(abandon)
            return
        adopted = len(spares)
        self.placement_groups: list[
            Any
        ] = []  # every placement group the group's ranks were placed in (removed with it)
        self.rank_bundles: list[tuple[Any, int] | None] = [None] * adopted  # rank -> its (placement group, bundle)
        self.idle_bundles: list[tuple[Any, int]] = []  # bundles left by a rank replaced by a spare: for a new rank
        self.placement_wait_s = 0.0
        if adopted < num_workers:
            group = self._place((num_workers - adopted) // workers_per_bundle, placement_timeout_s, abandon)
            self.rank_bundles += [(group, rank // workers_per_bundle) for rank in range(num_workers - adopted)]
        self.workers = list(spares) + [self._start_rank(rank) for rank in range(adopted, self.num_workers)]
        for rank, spare in enumerate(spares):
            spare.adopt.remote(rank, self.num_workers)  # runs before anything else this driver asks of it
        if wait:
            self.wait_ready(abandon)

    @property
    def placement_group(self) -> Any:
        """The placement group of the ranks placed when the group was made (None when spares took every rank)."""
        return self.placement_groups[0] if self.placement_groups else None

    def _place(self, bundles: int, timeout_s: float, abandon: Callable[[], bool] | None) -> Any:
        """A new placement group of `bundles` bundles, once the cluster fits it (the wait adds to
        `placement_wait_s`)."""
        per_bundle = {key: value * self.workers_per_bundle for key, value in self._bundle.items()}
        group = placement_group([dict(per_bundle) for _ in range(bundles)], strategy=self.placement_strategy)
        self.placement_groups.append(group)
        self.placement_wait_s += self._wait_for_placement(group, self._bundle, timeout_s, abandon)
        return group

    def _start_rank(self, rank: int) -> Any:
        """A new actor for `rank`, in its bundle."""
        group, index = self.rank_bundles[rank]
        return self._remote_cls.options(
            num_cpus=self._cpus,
            num_gpus=self._gpus,
            max_restarts=0,
            max_concurrency=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=index
            ),
        ).remote(rank=rank, world_size=self.num_workers, **self._worker_kwargs)

    def replace_ranks(
        self,
        ranks: Sequence[int],
        spares: Sequence[Any] = (),
        placement_timeout_s: float = 60.0,
        abandon: Callable[[], bool] | None = None,
    ) -> None:
        """Replace lost `ranks` in place, then form the group again (see `wait_ready`); the other ranks keep their
        processes and must have left their process group (`Worker.leave_process_group`).

        The first ranks take `spares` (their bundles are kept for a later replacement); the others start in their own
        bundle (freed when its actor died), else in one left idle, else in a new placement group of their own.
        """
        if len(spares) > len(ranks) or (spares and self.workers_per_bundle != 1):
            raise ValueError(
                f"{self.name}: {len(spares)} spares for ranks {list(ranks)} in bundles of {self.workers_per_bundle}"
            )
        started = time.monotonic()
        self.placement_wait_s = 0.0
        for rank in ranks:
            kill_quietly(self.workers[rank])
        for rank, spare in zip(ranks, spares):
            if self.rank_bundles[rank] is not None:
                self.idle_bundles.append(self.rank_bundles[rank])
            self.rank_bundles[rank] = None
            self.workers[rank] = spare
            spare.adopt.remote(rank, self.num_workers)
        for rank in ranks[len(spares) :]:
            if self.rank_bundles[rank] is None:
                self.rank_bundles[rank] = (
                    self.idle_bundles.pop() if self.idle_bundles else (self._place(1, placement_timeout_s, abandon), 0)
                )
            self.workers[rank] = self._start_rank(rank)
        self._created = started
        self.wait_ready(abandon)

    def placement_nodes(self) -> list[str]:
        """The nodes the group's placement bundles are on (known once placed; not those of adopted spares)."""
        from ray.util.placement_group import placement_group_table

        nodes: set[str] = set()
        for group in self.placement_groups:
            nodes |= set(placement_group_table(group).get("bundles_to_node_id", {}).values())
        return sorted(nodes)

    def wait_ready(self, abandon: Callable[[], bool] | None = None) -> None:
        """Wait until every actor has started (and joined the process group); shut the group down on failure.

        Starting a worker imports torch and builds its model: bounded by `start_timeout_s`, not the call limit.
        Groups created with `wait=False` can start side by side and be waited for one after the other.
        """
        try:
            starting, self._starting = self._starting or self.call_all_async("ping"), None
            self.hosts = self.get(starting, self.start_timeout_s, abandon)
            if self.distributed:
                host, port = self.get(self.workers[0].free_address.remote(), self.start_timeout_s, abandon)
                refs = self.call_all_async("init_process_group", host, port, self.dist_timeout_s)
                self.get(refs, self.start_timeout_s, abandon)
        except BaseException:
            self.shutdown()  # do not leak actors or the placement group of a group that never started
            raise
        self.start_s = time.monotonic() - self._created

    def _wait_for_placement(
        self,
        group: Any,
        bundle: dict[str, float],
        timeout_s: float,
        abandon: Callable[[], bool] | None,
        log_every_s: float = 10.0,
    ) -> float:
        """Seconds waited until the cluster fits the group; ResourceError (naming what is missing) after `timeout_s`,
        CallAbandoned when `abandon()` turns true."""
        started = time.monotonic()
        ready_ref = group.ready()
        next_log = started + log_every_s
        while True:
            remaining = timeout_s - (time.monotonic() - started)
            ready, _ = ray.wait([ready_ref], timeout=max(0.0, min(1.0, remaining)))
            if ready:
                return time.monotonic() - started
            # the groups an earlier run left parked give way to this one, unless it can never fit the cluster
            if fits_cluster(self.num_workers, bundle) and parked_groups.evict():
                continue
            waited = time.monotonic() - started
            if cluster_lost() is not None:
                remove_placement_group_quietly(group)
                _raise_if_cluster_lost()
            if waited >= timeout_s or (abandon is not None and abandon()):
                remove_placement_group_quietly(group)
                if waited < timeout_s:
                    raise CallAbandoned(f"stopped waiting for the cluster to fit the {self.name} group")
                raise ResourceError(describe_missing_resources(self.name, self.num_workers, bundle, timeout_s))
            if time.monotonic() < next_log:
                continue
            next_log += log_every_s
            logger.info(
                "waiting for the cluster to fit the %s group (%.0fs of %.0fs): %s",
                self.name,
                waited,
                timeout_s,
                missing_resources(self.num_workers, bundle),
            )

    # -- calls ---------------------------------------------------------------------------------

    def call_all_async(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        return [getattr(worker, method).remote(*args, **kwargs) for worker in self.workers]

    def call_each_async(self, method: str, per_rank_args: Sequence[tuple]) -> list[ray.ObjectRef]:
        if len(per_rank_args) != self.num_workers:
            raise ValueError(f"{self.name}: {len(per_rank_args)} argument tuples for {self.num_workers} workers")
        return [getattr(worker, method).remote(*args) for worker, args in zip(self.workers, per_rank_args)]

    def get(
        self,
        refs: Sequence[ray.ObjectRef] | ray.ObjectRef,
        timeout_s: float | None = None,
        abandon: Callable[[], bool] | None = None,
    ) -> Any:
        """The results, in order. Raises a failed rank's error as soon as it is known, CallTimeoutError after
        `timeout_s`, and CallAbandoned when `abandon()` turns true while waiting."""
        single = isinstance(refs, ray.ObjectRef)
        pending = [refs] if single else list(refs)
        order = list(pending)
        limit = timeout_s if timeout_s is not None else self.call_timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        results: dict[ray.ObjectRef, Any] = {}
        try:
            while pending:
                wait_s = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
                ready, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
                for ref in ready:
                    results[ref] = self._result(ref, order)
                if not pending:
                    break
                _raise_if_cluster_lost()
                if abandon is not None and abandon():
                    raise CallAbandoned(f"stopped waiting for the {self.name} group")
                if deadline is not None and time.monotonic() >= deadline:
                    raise CallTimeoutError(
                        f"the {self.name} group did not answer within {limit:g}s (runner.recovery.step_timeout_s)",
                        group=self.name,
                    )
        except BaseException:
            drain(pending)
            raise
        values = [results[ref] for ref in order]
        return values[0] if single else values

    def _result(self, ref: ray.ObjectRef, order: list[ray.ObjectRef]) -> Any:
        """`ray.get(ref)`, with an exception raised by the worker's own code named by group and rank."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc, ray.exceptions.RayActorError):
                raise
            where = f"{self.name} rank {order.index(ref)}" if len(order) == self.num_workers else f"{self.name} group"
            inner = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
            raise WorkerRaised(f"{where}: {describe(inner)}") from exc

    def call_all(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        return self.get(self.call_all_async(method, *args, **kwargs), timeout_s)

    def call_rank(self, rank: int, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        return self.get(getattr(self.workers[rank], method).remote(*args, **kwargs), timeout_s)

    def call_each(self, method: str, per_rank_args: Sequence[tuple], timeout_s: float | None = None) -> list[Any]:
        return self.get(self.call_each_async(method, per_rank_args), timeout_s)

    def dead_ranks(self, timeout_s: float = 1.0) -> list[int]:
        """Ranks Ray reports dead (their actor or node is gone), judged by a ping.

        A rank that is merely busy, or stuck in a collective behind a peer that raised, does not answer
        the ping in time either: that is not death, so it is not listed.
        """
        refs = {rank: worker.ping.remote() for rank, worker in enumerate(self.workers)}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        dead = []
        for rank, ref in refs.items():
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError:
                dead.append(rank)
            except Exception:  # still running something (busy, stuck): alive as far as Ray knows
                pass
        return dead

    def finish(self, close_timeout_s: float) -> None:
        """The run ended as it should: with `reuse` on a Ray this process started (parked workers would hold resources
        other drivers of a shared cluster wait for), the workers free what they hold (`Worker.release`, waiting at
        most `close_timeout_s`) and the group is parked for this driver's next run; else (or when a worker does not
        answer) `shutdown(close_timeout_s)`. A group that adopted spares is not kept: they hold resources of their own
        beside its placement group, which still holds the bundles of the ranks they replaced, so it would hold more
        than a new group of its shape (and keep a later run's spares from fitting)."""
        adopted_spares = self.idle_bundles or None in self.rank_bundles
        if not self.reuse or adopted_spares or not started_here() or cluster_lost() is not None:
            self.shutdown(close_timeout_s)
            return
        try:
            self.get(self.call_all_async("release"), close_timeout_s)
        except Exception as exc:
            logger.warning("%s group: not kept for the next run (%s)", self.name, describe(exc))
            self.shutdown()
            return
        parked_groups.park(self._key, self)

    def shutdown(self, close_timeout_s: float = 0.0) -> None:
        """Kill every actor and free the placement group; safe to call on a half-dead group. With `close_timeout_s`,
        first ask every worker to `close` (free what it holds, e.g. an engine's processes), waiting at most that."""
        if cluster_lost() is not None:
            return  # every call would block on a GCS that is gone; the cluster took the workers with it
        if close_timeout_s > 0:
            closing = self.call_all_async("close")
            ray.wait(closing, num_returns=len(closing), timeout=close_timeout_s)
            drain(closing)
        for worker in self.workers:
            kill_quietly(worker)
        for group in self.placement_groups:
            remove_placement_group_quietly(group)
