"""One run per experiment folder: an exclusive flock that the kernel releases when its holder dies.

A crashed or killed run therefore never leaves the lock stuck. (flock is per host on some network
filesystems; on NFS v4 and Lustre it is enforced across nodes.)
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from rlrunner.errors import ExperimentLockedError

LOCK_FILE = ".rlrunner.lock"


class ExperimentLock:
    def __init__(self, experiment: Path):
        self.path = experiment / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ExperimentLockedError(
                f"experiment folder {self.path.parent} is in use by another run ({holder}); "
                "wait for it to end or choose another runner.experiment_name"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since_unix": time.time()}).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "ExperimentLock":
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since_unix"]))
        return f"pid {info['pid']} on {info['host']}, since {started}"
    except (OSError, ValueError, KeyError):
        return "holder unknown"
