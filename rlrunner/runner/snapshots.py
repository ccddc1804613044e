"""In-memory snapshots of the actor: after a step, every actor rank's state copied into another node's host memory.

    store = SnapshotStore(cfg.runner.snapshot, reuse)  # once per run (its holders outlive the attempts)
    store.take(step, actor_group)                    # right after the step's update: returns at once
    store.finish(actor_group, driver_state, timeout_s)  # after the step's weight sync: the parts are held
    snapshot = store.newest(min_step, max_step)      # after a failure: the newest complete one, or None
    driver_state = store.load(snapshot, actor_group)

Each rank streams its state straight off the live tensors to a `SnapshotHolder` on another node than its own
(`holder_nodes`), over a TCP connection of its own from a thread of its own (`ActorWorker.start_snapshot`,
`rlrunner.backends.snapshot_stream`): it never holds a second copy of its state, and the weight sync, queued
after the start, runs meanwhile (with a policy lag, so does the wait for the generation ahead). The step completes only
once every part is held (`finish`), so a rank lost after that costs no completed step, and no update changes the
tensors while they are read. The driver's state of the step goes beside rank 0's part. The holders keep the newest
complete snapshot and the one arriving: the older one is dropped once every part of the newer one is in.

A snapshot is used only when every rank's part of the same step is held by a live holder (`newest_complete`). A part
that cannot be held (host memory short of `runner.snapshot.reserve_memory_gb`) leaves its step incomplete, with a
warning: recovery then falls back to the newest checkpoint on storage.

With `reuse` (`cluster.reuse_workers`) on a Ray this process started, a finished run's holders, emptied, are kept for
its next run (`parked_groups`, one per node), as its worker groups are: a holder is a Ray worker process, started in
about half a second of CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlrunner.cluster import parked_groups
from rlrunner.cluster.actor_calls import drain, kill_quietly
from rlrunner.cluster.ray_setup import alive_nodes, cluster_lost, started_here
from rlrunner.cluster.snapshot_holder import SnapshotHolder
from rlrunner.errors import describe

logger = logging.getLogger(__name__)

_ASK_TIMEOUT_S = 5.0  # how long a holder may take to say what it holds before it counts as lost


def holder_nodes(rank_nodes: Sequence[str], nodes: Sequence[str]) -> list[str]:
    """For each rank (running on `rank_nodes[rank]`), the node whose holder keeps its part.

    Nodes that run no rank of the group come first, so that losing one node never takes a rank together with
    another rank's part; among them the ranks are spread round-robin. Then any node but the rank's own; the rank's own
    node when the cluster has no other (the part then covers the loss of the rank's process, not of its node).
    """
    alive = sorted(set(nodes))
    free = [node for node in alive if node not in set(rank_nodes)]
    chosen = []
    for rank, own in enumerate(rank_nodes):
        candidates = free or [node for node in alive if node != own]
        chosen.append(candidates[rank % len(candidates)] if candidates else own)
    return chosen


def newest_complete(
    held: Mapping[str, Mapping[int, Sequence[int]]],
    world_size: int | Mapping[int, int],
    min_step: int = 0,
    max_step: int | None = None,
) -> tuple[int, dict[int, str]] | None:
    """The newest step from `min_step` to `max_step` whose every rank's part is held, with the node holding each rank's
    part; `held` is {node: {step: ranks}} of the live holders, `world_size` the ranks of every step or of each step
    ({step: ranks}: a step not in it is not complete). None when no step is complete."""
    sizes = world_size if isinstance(world_size, Mapping) else None
    where: dict[int, dict[int, str]] = {}
    for node in sorted(held):
        for step, ranks in held[node].items():
            for rank in ranks:
                where.setdefault(int(step), {}).setdefault(int(rank), node)
    complete = [
        step
        for step, ranks in where.items()
        if min_step <= step <= (step if max_step is None else max_step)
        and (sizes is None or step in sizes)
        and set(ranks) >= set(range(sizes[step] if sizes is not None else world_size))
    ]
    if not complete:
        return None
    step = max(complete)
    size = sizes[step] if sizes is not None else world_size
    return step, {rank: where[step][rank] for rank in range(size)}


@dataclass
class _Taken:
    """The snapshot started in this step: the ranks' start calls, then (`ask_finish`) their finish calls after them."""

    step: int
    nodes: list[str]  # the node holding each rank's part
    calls: list[ray.ObjectRef]
    starts: int  # how many of `calls` are starts

    @property
    def finish_asked(self) -> bool:
        return len(self.calls) > self.starts


@dataclass(frozen=True)
class Snapshot:
    step: int
    holders: dict[int, Any]  # rank -> the holder (a Ray actor) keeping its part; rank 0's also has the driver's state

    @property
    def world_size(self) -> int:
        """The actor ranks it was taken from (a group of another size loads it resharded)."""
        return len(self.holders)


class _KeptHolder:
    """A holder in `parked_groups` (it holds no resources and no torch: not counted among its workers)."""

    workers: list = []

    def __init__(self, holder: Any):
        self.holder = holder

    def dead_ranks(self, timeout_s: float) -> list[int]:
        try:
            ray.get(self.holder.ping.remote(), timeout=timeout_s)
            return []
        except Exception:
            return [0]

    def shutdown(self) -> None:
        kill_quietly(self.holder)


class SnapshotStore:
    def __init__(self, snapshot_cfg: Any, reuse: bool = False):
        self.enabled = bool(snapshot_cfg.enabled)
        self.reuse = reuse
        self.interval = int(snapshot_cfg.interval)
        self.reserve_bytes = int(snapshot_cfg.reserve_memory_gb * 2**30)
        self.holders: dict[str, Any] = {}  # node id -> its holder
        self.addresses: dict[str, tuple[Any, tuple[str, int, str]]] = {}  # node id -> (its holder, where it listens)
        self.in_flight: _Taken | None = None  # the snapshot started in this step
        self.complete_step: int | None = None  # the newest step known complete
        self.world_sizes: dict[int, int] = {}  # step -> the actor ranks its parts come from (an elastic run's vary)
        self._warned: str | None = None
        self._said_own_node = False
        # ((the actor group's id, the node of each rank), the node holding each rank's part)
        self._placed: tuple[tuple[int, list[str]], list[str]] | None = None

    def due(self, step: int) -> bool:
        return self.enabled and step % self.interval == 0

    # -- taking ----------------------------------------------------------------------------------

    def take(self, step: int, actor_group: Any) -> None:
        """Start `step`'s snapshot: called right after the update is asked for, so that each rank's start is queued
        behind its update and the rank streams its part (in a thread) the moment the update ends, while its next calls
        (the weight sync) run. Returns at once; `ask_finish` and `finish` wait for the parts."""
        self.in_flight = None
        if cluster_lost() is not None:
            return  # every GCS call would block until Ray gives up: the next call to a worker reports the loss
        nodes = self._holder_nodes(actor_group)
        try:
            addresses = [self._address(node) for node in nodes]
        except Exception as exc:  # a holder lost or not answering: this step has no snapshot, the run goes on
            self._forget_dead_holders(nodes)
            self._warn("incomplete", f"the in-memory snapshot of step {step} is skipped: {describe(exc)}")
            return
        self.world_sizes[step] = actor_group.num_workers
        starts = actor_group.call_each_async("start_snapshot", [(step, address) for address in addresses])
        self.in_flight = _Taken(step, nodes, starts, len(starts))

    def ask_finish(self, actor_group: Any, driver_state: dict[str, Any], timeout_s: float) -> None:
        """After the weight sync is asked for: `driver_state` goes beside rank 0's part, and each rank's wait for its
        part (`finish_snapshot`, at most half of `timeout_s`) is queued behind its sync, so that no round trip through
        the driver comes between them. `finish` takes the answers."""
        if self.in_flight is None:
            return
        taken = self.in_flight
        self._holder(taken.nodes[0]).put_driver_state.remote(taken.step, driver_state)
        taken.calls += actor_group.call_all_async("finish_snapshot", timeout_s / 2)

    def finish(self, actor_group: Any, driver_state: dict[str, Any], timeout_s: float) -> None:
        """Within the step `take` started, after its weight sync: wait until every rank's part is with its holder, so
        that once the step completes a lost rank costs no completed step, and no later update changes the tensors
        being read. `driver_state` goes beside rank 0's part (unless `ask_finish` sent it). A part a holder refused or
        lost leaves the step's snapshot incomplete, with a warning (as does a holder that takes half of `timeout_s`,
        the step's); a rank lost on the way fails the step."""
        if self.in_flight is None:
            return
        if not self.in_flight.finish_asked:
            self.ask_finish(actor_group, driver_state, timeout_s)
        taken, self.in_flight = self.in_flight, None
        step, nodes = taken.step, taken.nodes
        reasons = [r for r in actor_group.get(taken.calls, timeout_s)[taken.starts :] if r]
        if reasons:
            self._forget_dead_holders(nodes)
            self._warn(
                "incomplete",
                f"the in-memory snapshot of step {step} is incomplete, so a failure now recovers from the newest "
                f"checkpoint on storage: {reasons[0]}",
            )
            return
        self.complete_step = step
        self.world_sizes = {s: n for s, n in self.world_sizes.items() if s >= step}
        self._warned = None
        for holder in self.holders.values():
            holder.drop_before.remote(step)

    def abandon(self) -> None:
        """The step failed before `finish`: its calls' answers are not waited for (their errors are not reported)."""
        if self.in_flight is not None:
            drain(self.in_flight.calls)
            self.in_flight = None

    def _holder_nodes(self, actor_group: Any) -> list[str]:
        """Where each rank's part goes; chosen once per group (asking the GCS for the nodes every step would make a
        lost head node block the loop)."""
        rank_nodes = [host["node_id"] for host in actor_group.hosts]
        if self._placed is None or self._placed[0] != (id(actor_group), rank_nodes):  # a new group, or ranks replaced
            nodes = holder_nodes(rank_nodes, alive_nodes())
            if len(set(nodes) | set(rank_nodes)) == 1 and not self._said_own_node:
                self._said_own_node = True
                logger.info(
                    "in-memory snapshots are held on the ranks' own node (the cluster has no other): they "
                    "cover the loss of a worker process, not of the node"
                )
            self._placed = ((id(actor_group), rank_nodes), nodes)
        return self._placed[1]

    def _forget_dead_holders(self, nodes: Sequence[str]) -> None:
        for node in set(nodes):
            if node in self.holders and not self._alive(node):
                self.holders.pop(node)
                self._placed = None  # its parts go elsewhere from now on

    def _alive(self, node: str) -> bool:
        try:
            ray.get(self.holders[node].ping.remote(), timeout=_ASK_TIMEOUT_S)
            return True
        except Exception:
            return False

    def prepare(self) -> None:
        """Start a holder on every node, without waiting, so that they are up by the first snapshot (a node that joins
        later gets one when a part is first put there)."""
        if self.enabled:
            for node in alive_nodes():
                self._holder(node)

    def _warn(self, kind: str, message: str) -> None:
        if kind != self._warned:  # one line when the trouble starts or changes, not one per step
            logger.warning(message)
            self._warned = kind

    def _address(self, node: str) -> tuple[str, int, str]:
        """Where ranks send the parts that `node`'s holder keeps (asked once per holder)."""
        holder = self._holder(node)
        if self.addresses.get(node, (None,))[0] is not holder:
            self.addresses[node] = (holder, ray.get(holder.address.remote(), timeout=_ASK_TIMEOUT_S))
        return self.addresses[node][1]

    def _holder(self, node: str) -> Any:
        kept = parked_groups.take(("snapshot holder", node)) if self.reuse and node not in self.holders else None
        if kept is not None:
            kept.holder.reset.remote(self.reserve_bytes)  # before anything else this driver asks of it
            self.holders[node] = kept.holder
        if node not in self.holders:
            self.holders[node] = (
                ray.remote(SnapshotHolder)
                .options(
                    num_cpus=0,
                    max_restarts=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                )
                .remote(self.reserve_bytes)
            )
        return self.holders[node]

    # -- using -----------------------------------------------------------------------------------

    def newest(self, min_step: int = 0, max_step: int | None = None) -> Snapshot | None:
        """The newest complete snapshot from `min_step` to `max_step` (the last step the driver completed: a step's
        snapshot is taken before its weight sync, which may still fail), asked of the live holders; None if none."""
        self.in_flight = None  # judged by what the holders have: the attempt they belonged to failed
        if not self.enabled or not self.holders:
            return None
        asked = {node: holder.held.remote() for node, holder in self.holders.items()}
        ray.wait(list(asked.values()), num_returns=len(asked), timeout=_ASK_TIMEOUT_S)
        held: dict[str, dict[int, list[int]]] = {}
        for node, ref in asked.items():
            try:
                held[node] = ray.get(ref, timeout=0)
            except Exception:  # lost with its node, or not answering: its parts do not count
                self.holders.pop(node, None)
                self._placed = None
        found = newest_complete(held, self.world_sizes, min_step, max_step)
        if found is None:
            return None
        step, where = found
        return Snapshot(step, {rank: self.holders[node] for rank, node in where.items()})

    def load(self, snapshot: Snapshot, actor_group: Any, timeout_s: float) -> dict[str, Any]:
        """Every rank loads its part of `snapshot` straight from its holder (taken at another size: each rank reads
        the rows it now holds from every part, `load_resharded_snapshot`); the driver's state of that step."""
        if snapshot.world_size == actor_group.num_workers:
            parts = [(snapshot.holders[rank], snapshot.step) for rank in range(actor_group.num_workers)]
            actor_group.call_each("load_snapshot", parts, timeout_s=timeout_s)
        else:
            holders = [snapshot.holders[rank] for rank in range(snapshot.world_size)]
            actor_group.call_all("load_resharded_snapshot", holders, snapshot.step, timeout_s=timeout_s)
        return ray.get(snapshot.holders[0].get_driver_state.remote(snapshot.step), timeout=timeout_s)

    def forget(self) -> None:
        """Drop every holder (after the embedded Ray was restarted, they went with it)."""
        self.holders, self.addresses, self.in_flight, self.complete_step, self._placed = {}, {}, None, None, None
        self.world_sizes = {}

    def close(self) -> None:
        """The run is over: the holders, emptied, are kept for the driver's next run (`reuse` on a Ray this process
        started), else killed."""
        if cluster_lost(force=True) is not None:
            self.forget()  # every call would block on a GCS that is gone
            return
        keep = self.reuse and started_here()
        for node, holder in self.holders.items():
            if keep:
                holder.reset.remote(0)  # the parts go now, not when the next run takes it
                parked_groups.park(("snapshot holder", node), _KeptHolder(holder))
            else:
                kill_quietly(holder)
        self.forget()
