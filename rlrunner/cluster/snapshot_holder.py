"""A snapshot holder: one process per node keeping actor ranks' in-memory snapshot parts in its host memory.

The driver runs one `SnapshotHolder` as a Ray actor on each node (`rlrunner.runner.snapshots`). Each actor rank's part
of a step's snapshot (its parameters, optimizer state, LR schedule and RNG, serialized by the rank: bytes) is put on a
holder on another node than the rank's own where the cluster has one, so that losing the rank's process or node leaves
the part alive; rank 0's part comes with the driver's state of that step (data position, step). A part is kept only
where the node keeps `reserve_bytes` of memory free with it; otherwise it is refused, with the reason.

Plain Python without torch or Ray imports: a holder starts in a fraction of a second and holds bytes only.
"""

from __future__ import annotations

import os
from typing import Any

from rlrunner.cluster.node import available_memory_bytes


class SnapshotHolder:
    def __init__(self, reserve_bytes: int):
        self.reserve_bytes = reserve_bytes
        self.parts: dict[tuple[int, int], Any] = {}  # (step, rank) -> the rank's part
        self.driver_states: dict[int, Any] = {}  # step -> the driver's state of that step

    def ping(self) -> int:
        return os.getpid()

    def put(self, step: int, rank: int, part: bytes | str, driver_state: Any = None) -> str | None:
        """Keep `rank`'s part of `step` (and the driver's state of `step`); None, or why it is not kept. A part that is
        a string is the rank's own reason for having none."""
        if isinstance(part, str):
            return part
        # The part is in this process already (Ray passed it in): what is checked is that keeping it leaves the node
        # its reserve.
        available = available_memory_bytes()
        if available < self.reserve_bytes:
            return (
                f"{available / 2**30:.1f} GiB of host memory free on the holder's node, below the "
                f"{self.reserve_bytes / 2**30:g} GiB reserve (runner.snapshot.reserve_memory_gb)"
            )
        self.parts[(step, rank)] = part
        if driver_state is not None:
            self.driver_states[step] = driver_state
        return None

    def held(self) -> dict[int, list[int]]:
        """{step: the ranks whose parts of that step are held here}."""
        steps: dict[int, list[int]] = {}
        for step, rank in self.parts:
            steps.setdefault(step, []).append(rank)
        return {step: sorted(ranks) for step, ranks in steps.items()}

    def get(self, step: int, rank: int) -> Any:
        return self.parts[(step, rank)]

    def get_driver_state(self, step: int) -> Any:
        return self.driver_states[step]

    def drop_before(self, step: int) -> None:
        """Free every part of a step older than `step` (once `step`'s snapshot is complete)."""
        self.parts = {key: part for key, part in self.parts.items() if key[0] >= step}
        self.driver_states = {s: state for s, state in self.driver_states.items() if s >= step}

    def reset(self, reserve_bytes: int) -> int:
        """Hold nothing, with `reserve_bytes` as the reserve: a holder kept for the driver's next run
        (`SnapshotStore.close`); returns `ping()`."""
        type(self).__init__(self, reserve_bytes)
        return self.ping()
