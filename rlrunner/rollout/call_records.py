"""Where a rollout worker's tool calls are recorded (the `Recorder` of `rlrunner.agents.environments`): the run's call
ledger, a Ray actor on the driver's node (`rlrunner.runner.tool_records`), or one in the worker's own process when the
caller gave none (a benchmark, a test that drives the worker by hand)."""

from __future__ import annotations

import threading
from typing import Any

import ray

from rlrunner.agents.ledger import CallLedger


class LedgerActorRecorder:
    """Records in the driver's ledger actor: lookups wait for its answer; records are sent as the calls return (from
    the tool pool's thread), those that return while a send is under way together as soon as it is held (one actor
    call per call made would cost the ledger and the worker a share of a core), and `flush` waits until every one is
    held."""

    def __init__(self, ledger: Any, owner: str):
        self.ledger, self.owner = ledger, owner
        self._waiting: list[tuple[tuple, dict]] = []  # returned, not sent yet
        self._sent: list[Any] = []  # sends not yet known to be held
        self._lock = threading.RLock()  # a send's completion callback may run at once, in the sending thread

    def begin(self, entries: list[tuple[tuple, str]]) -> list[dict | None]:
        return ray.get(self.ledger.begin.remote(self.owner, entries))

    def record(self, key: tuple, record: dict) -> None:
        with self._lock:
            self._waiting.append((key, record))
            if not self._sent:
                self._send()

    def _send(self) -> None:
        ref = self.ledger.record.remote(self._waiting)
        self._waiting = []
        self._sent.append(ref)
        ref.future().add_done_callback(lambda _: self._held(ref))

    def _held(self, ref: Any) -> None:
        with self._lock:
            if ref in self._sent:
                self._sent.remove(ref)
            if self._waiting and not self._sent:
                self._send()

    def flush(self) -> None:
        with self._lock:
            if self._waiting:
                self._send()
            sent = list(self._sent)
        ray.get(sent)


class LocalRecorder:
    """A ledger in this process: a trajectory generated again in the same worker replays its calls."""

    def __init__(self) -> None:
        self.ledger = CallLedger()
        self._lock = threading.Lock()

    def begin(self, entries: list[tuple[tuple, str]]) -> list[dict | None]:
        with self._lock:
            return self.ledger.begin("local", entries)

    def record(self, key: tuple, record: dict) -> None:
        with self._lock:
            self.ledger.record([(key, record)])

    def flush(self) -> None:
        """Nothing to wait for: records are kept as they come."""
