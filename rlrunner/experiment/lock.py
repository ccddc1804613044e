"""One run per experiment folder, on any storage.

Local disks: an exclusive flock on `<experiment>/.rlrunner.lock`, which the kernel releases when its holder
dies, so a crashed run never leaves it stuck (flock is per host on some network filesystems; NFS v4 and Lustre
enforce it across nodes). Object stores: a lease of generation objects (`rlrunner.experiment.lease`).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from typing import Any

from rlrunner.errors import ExperimentLockedError
from rlrunner.experiment.lease import CLOCK_SLACK_S, LOCK_NAME, SYSTEM_CLOCK, Clock, Lease, clock, current_lease
from rlrunner.storage import Storage
from rlrunner.storage.local import local_path


class ExperimentLock:
    """Held by at most one run per experiment: `with ExperimentLock(storage, url): ...` or acquire()/release().

    While it is held, `lost()` says why this holder no longer owns it (None while it does): the runner should
    check it before it commits anything to the experiment. `clock` is where it reads the time and waits (tests
    pass one whose time passes at once).
    """

    def __init__(
        self,
        storage: Storage,
        experiment_url: str,
        heartbeat_s: float = 30.0,
        stale_after_s: float = 300.0,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ):
        if heartbeat_s <= 0 or stale_after_s <= 2 * heartbeat_s:
            raise ValueError(
                f"experiment lock: stale_after_s ({stale_after_s}) must be more than twice heartbeat_s ({heartbeat_s}) "
                "and heartbeat_s positive, so that one late heartbeat does not lose the lock"
            )
        self.storage = storage
        self.experiment_url = experiment_url
        self._impl: _Flock | Lease = (
            _Flock(experiment_url, clock)
            if storage.is_local
            else Lease(storage, experiment_url, heartbeat_s, stale_after_s, clock=clock)
        )

    def acquire(self) -> None:
        """Take the lock, or raise ExperimentLockedError naming the holder."""
        self._impl.acquire()

    def release(self) -> None:
        """Give the lock up (nothing to do when not held). Never raises: a lease that cannot be marked
        released lapses after stale_after_s."""
        self._impl.release()

    def lost(self) -> str | None:
        """Why this holder no longer owns the lock; None while it does (and always on local disks). Never blocks."""
        return self._impl.lost()

    def __enter__(self) -> "ExperimentLock":
        self.acquire()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.release()


def describe_holder(storage: Storage, experiment_url: str, *, clock: Clock = SYSTEM_CLOCK) -> str | None:
    """Who holds the experiment's lock ("pid 12 on host-a, since ..."), or None when no one does. Reads only."""
    if storage.is_local:
        return _Flock(experiment_url, clock).holder()
    lock_dir = storage.join(experiment_url, LOCK_NAME)
    current = current_lease(storage, lock_dir)
    if current is None or (current.record or {}).get("released"):
        return None
    text = current.describe(age=None)
    if current.record is not None:  # no clock probe here (it would write): this host's clock, and said so
        age = clock.now() - float(current.record.get("heartbeat_unix", 0))
        text += f", {age:.0f} s ago by this host's clock"
        if age > float(current.record.get("stale_after_s", 0)) + CLOCK_SLACK_S:
            text += " (looks stale: the next run will take it over)"
    return text


# -- local disks: flock -----------------------------------------------------------------------------


class _Flock:
    def __init__(self, experiment_url: str, clock: Clock = SYSTEM_CLOCK):
        self.folder = local_path(experiment_url)
        self.clock = clock
        self.path = os.path.join(self.folder, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _flock_holder(fd)
            os.close(fd)
            raise ExperimentLockedError(
                f"experiment folder {self.folder} is in use by another run ({holder}); "
                "wait for it to end or choose another runner.experiment_name"
            ) from None
        os.ftruncate(fd, 0)
        os.write(
            fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since_unix": self.clock.now()}).encode()
        )
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def lost(self) -> None:
        return None  # the kernel holds it for as long as we live

    def holder(self) -> str | None:
        """A shared flock succeeds only when no one holds the exclusive one (held for microseconds, then dropped)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _flock_holder(fd)
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)


def _flock_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']}, since {clock(info['since_unix'])}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"
