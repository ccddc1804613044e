"""Fakes of the lease tests (tests/integration/test_lock.py): a clock whose time passes at once when slept on, and a
storage whose modification times come from that clock."""

from __future__ import annotations

import math
import threading
import time

from rlrunner.experiment.lease import Clock
from rlrunner.experiment.lock import ExperimentLock

BUSY_LIMIT_S = 10.0  # real seconds a thread woken by the fake clock may take to go back to sleep (storage calls)


class FakeClock(Clock):
    """Lease time that passes only when someone sleeps on it (or calls advance), and then at once, for every lease
    of the test (share one). Heartbeat threads wait on it: moving time past their next beat wakes them, and
    advance() returns only once each woken thread has beaten and waits again (or has ended), so that what a test
    sees after a sleep is what the lease would have done in that time, without waiting for it."""

    def __init__(self) -> None:
        self._wall, self._mono = time.time(), 1000.0  # wall time starts now: records stay plausible
        self._cond = threading.Condition()
        self._sleepers: dict[threading.Thread, float] = {}  # thread -> monotonic deadline, while in wait()
        self._woken: set[threading.Thread] = set()  # woken by time and not yet waiting again

    def now(self) -> float:
        with self._cond:
            return self._wall

    def monotonic(self) -> float:
        with self._cond:
            return self._mono

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        me = threading.current_thread()
        with self._cond:
            self._woken.discard(me)
            deadline = self._sleepers[me] = self._mono + seconds
            self._cond.notify_all()
            try:
                while not event.is_set() and self._mono < deadline:
                    self._cond.wait(0.005)  # Event.set() notifies no one: look again soon
            finally:
                del self._sleepers[me]
                if not event.is_set():
                    self._woken.add(me)
                self._cond.notify_all()
            return event.is_set()

    def beating(self, holder: ExperimentLock) -> ExperimentLock:
        """Return once `holder`'s heartbeat thread waits on this clock for its next beat (a thread just started
        might otherwise miss time that passes before it first waits)."""
        thread, give_up = holder._impl._thread, time.monotonic() + BUSY_LIMIT_S
        with self._cond:
            while thread not in self._sleepers:
                assert thread.is_alive() and time.monotonic() < give_up, (
                    "the heartbeat thread never waited on the fake clock"
                )
                self._cond.wait(0.005)
        return holder

    def advance(self, seconds: float) -> None:
        with self._cond:
            target = self._mono + seconds
            while True:
                self._settle()
                step_to = min([d for d in self._sleepers.values() if d <= target], default=target)
                self._wall += step_to - self._mono
                self._mono = step_to
                self._cond.notify_all()
                if step_to >= target:
                    break
            self._settle()

    def _settle(self) -> None:
        """Wait (under the lock) until no thread is due to wake and every woken one waits again or has ended."""
        give_up = time.monotonic() + BUSY_LIMIT_S
        while True:
            self._woken = {thread for thread in self._woken if thread.is_alive()}
            if not self._woken and all(d > self._mono for d in self._sleepers.values()):
                return
            assert time.monotonic() < give_up, f"threads woken by the fake clock still busy: {self._woken}"
            self._cond.wait(0.005)


class StampedStorage:
    """A storage whose modification times (the store's clock, S3's LastModified) come from a FakeClock, in whole
    seconds like S3's: the store itself (moto) stamps objects with the real time, which the fake clock cannot move.
    Everything else goes to the real store. Stamps are shared by every view made with the same `stamps`."""

    def __init__(self, storage, clock: FakeClock, stamps: dict[str, float]):
        self._storage, self._clock, self._stamps = storage, clock, stamps

    def __getattr__(self, name: str):
        return getattr(self._storage, name)

    def _stamp(self, url: str) -> None:
        self._stamps[url] = float(math.floor(self._clock.now()))

    def write_bytes(self, url: str, data: bytes):
        record = self._storage.write_bytes(url, data)
        self._stamp(url)
        return record

    def write_if_absent(self, url: str, data: bytes) -> bool:
        created = self._storage.write_if_absent(url, data)
        if created:
            self._stamp(url)
        return created

    def delete(self, url: str) -> None:
        self._storage.delete(url)
        self._stamps.pop(url, None)

    def modified(self, url: str) -> float | None:
        return self._stamps.get(url) if self._storage.modified(url) is not None else None
