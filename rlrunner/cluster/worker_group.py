"""A group of N Ray actors running one Worker class in a placement group, driven with one small API.

    group = WorkerGroup("actor", ActorWorker, 2, worker_kwargs={...}, distributed=True)
    group.call_all("setup")                   # every rank, same arguments
    group.call_rank(0, "full_state_dict")     # one rank
    group.call_each("update", [(shard0,), (shard1,)])  # scatter: rank i gets args i; results in rank order

Every blocking call waits at most `timeout_s` (the group's `call_timeout_s` unless given), so a
dead or hung peer surfaces as an exception instead of a stuck driver.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlrunner.errors import ResourceError

logger = logging.getLogger(__name__)


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
    ):
        self.name = name
        self.num_workers = num_workers
        self.call_timeout_s = call_timeout_s
        bundle = {"CPU": cpus_per_worker}
        if gpus_per_worker:
            bundle["GPU"] = gpus_per_worker
        self.placement_group = placement_group([dict(bundle) for _ in range(num_workers)], strategy=placement_strategy)
        self._wait_for_placement(bundle, placement_timeout_s)
        remote_cls = ray.remote(worker_cls)
        self.workers = [
            remote_cls.options(
                num_cpus=cpus_per_worker,
                num_gpus=gpus_per_worker,
                max_restarts=0,
                max_concurrency=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=rank
                ),
            ).remote(rank=rank, world_size=num_workers, **(worker_kwargs or {}))
            for rank in range(num_workers)
        ]
        # Starting a worker imports torch and builds its model: bounded by its own, longer limit.
        self.hosts = self.call_all("ping", timeout_s=start_timeout_s)
        if distributed:
            host, port = self.call_rank(0, "free_address", timeout_s=start_timeout_s)
            self.call_all("init_process_group", host, port, call_timeout_s or 1800.0, timeout_s=start_timeout_s)

    def _wait_for_placement(self, bundle: dict[str, float], timeout_s: float) -> None:
        started = time.monotonic()
        ready, _ = ray.wait([self.placement_group.ready()], timeout=timeout_s)
        if ready:
            logger.debug("%s group placed in %.1fs", self.name, time.monotonic() - started)
            return
        remove_placement_group(self.placement_group)
        raise ResourceError(describe_missing_resources(self.name, self.num_workers, bundle, timeout_s))

    # -- calls ---------------------------------------------------------------------------------

    def call_all_async(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        return [getattr(worker, method).remote(*args, **kwargs) for worker in self.workers]

    def call_each_async(self, method: str, per_rank_args: Sequence[tuple]) -> list[ray.ObjectRef]:
        if len(per_rank_args) != self.num_workers:
            raise ValueError(f"{self.name}: {len(per_rank_args)} argument tuples for {self.num_workers} workers")
        return [getattr(worker, method).remote(*args) for worker, args in zip(self.workers, per_rank_args)]

    def get(self, refs: Sequence[ray.ObjectRef] | ray.ObjectRef, timeout_s: float | None = None) -> Any:
        try:
            return ray.get(refs, timeout=timeout_s if timeout_s is not None else self.call_timeout_s)
        except Exception:
            _drain(refs)
            raise

    def call_all(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        return self.get(self.call_all_async(method, *args, **kwargs), timeout_s)

    def call_rank(self, rank: int, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        return self.get(getattr(self.workers[rank], method).remote(*args, **kwargs), timeout_s)

    def call_each(self, method: str, per_rank_args: Sequence[tuple], timeout_s: float | None = None) -> list[Any]:
        return self.get(self.call_each_async(method, per_rank_args), timeout_s)

    def shutdown(self) -> None:
        """Kill every actor and free the placement group; safe to call on a half-dead group."""
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # already dead
                pass
        try:
            remove_placement_group(self.placement_group)
        except Exception:
            pass


def _drain(refs: Sequence[ray.ObjectRef] | ray.ObjectRef, timeout_s: float = 2.0) -> None:
    """Read what the other ranks returned after one failed, so Ray does not log their errors as unhandled."""
    pending = [refs] if isinstance(refs, ray.ObjectRef) else list(refs)
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except Exception:
            pass


def describe_missing_resources(name: str, num_workers: int, bundle: dict[str, float], waited_s: float) -> str:
    """One line: what the group asked for and what the cluster has in total and free."""
    total = ray.cluster_resources()
    free = ray.available_resources()
    wanted = {key: value * num_workers for key, value in bundle.items()}
    short = [
        f"{key} {wanted[key]:g} (cluster has {total.get(key, 0):g}, {free.get(key, 0):g} free)"
        for key in wanted
        if wanted[key] > free.get(key, 0) + 1e-9
    ]
    per_worker = ", ".join(f"{k}={v:g}" for k, v in bundle.items())
    needs = "; ".join(short) or "resources held by other placement groups"
    return (
        f"cannot place the {name} group ({num_workers} workers x {{{per_worker}}}) after waiting {waited_s:g}s: "
        f"needs {needs}"
    )
