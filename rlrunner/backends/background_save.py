"""One rank's checkpoint save in flight (at most one): started, then finished, waited for or polled.

Every backend's worker keeps one `BackgroundSave`. A save is either a write this object runs itself, in its own
thread or inline (`run`), or a save already under way elsewhere, such as DCP's `async_save` (`track`). Either
way `finish` returns the files the rank wrote, {name: {"size", "crc32"}}, and how long the writing took, or
raises the write's error.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Mapping

Files = Mapping[str, Any]  # file name -> FileRecord or its dict


class BackgroundSave:
    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future | None = None
        self._started = 0.0
        self._write_s: float | None = None

    @property
    def written(self) -> bool:
        """Whether the save in flight is done writing (or failed): `finish` will not wait."""
        if self._future is None:
            raise RuntimeError("no checkpoint save in flight on this rank")
        return self._future.done()

    def _begin(self) -> None:
        if self._future is not None:
            raise RuntimeError("a checkpoint save is already in flight on this rank")
        self._started, self._write_s = time.monotonic(), None

    def _timed(self, write: Callable[[], Files]) -> Files:
        try:
            return write()
        finally:
            self._write_s = time.monotonic() - self._started

    def run(self, write: Callable[[], Files], background: bool) -> None:
        """Run `write` (which returns the files it wrote) in this saver's thread with `background`, else now."""
        self._begin()
        if background:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlrunner-ckpt")
            self._future = self._pool.submit(self._timed, write)
            return
        future: Future = Future()
        try:
            future.set_result(self._timed(write))
        except BaseException as exc:  # DCP raises CheckpointException, a BaseException: finish() raises it
            future.set_exception(exc)
        self._future = future

    def track(self, start: Callable[[], Future], files: Callable[[], Files]) -> None:
        """Start a save that runs on its own (`start()` returns a future that completes when its writes have) and
        follow it; `files()` lists what it wrote, afterwards."""
        self._begin()
        save = start()
        done: Future = Future()

        def finished(_: Future) -> None:
            self._write_s = time.monotonic() - self._started
            try:
                save.result()
                done.set_result(files())
            except BaseException as exc:
                done.set_exception(exc)

        save.add_done_callback(finished)
        self._future = done

    def finish(self) -> dict[str, Any]:
        """Wait for the save in flight: {"files": {name: {size, crc32}}, "write_s": seconds}, or its error."""
        if self._future is None:
            raise RuntimeError("no checkpoint save in flight on this rank")
        future, self._future = self._future, None
        records = future.result()
        files = {
            name: record.as_dict() if hasattr(record, "as_dict") else dict(record) for name, record in records.items()
        }
        return {"files": dict(sorted(files.items())), "write_s": self._write_s}

    def abandon(self, timeout_s: float) -> None:
        """Forget the save in flight, if any (its group lost a rank, so it is never committed), once its writes have
        stopped or after `timeout_s`: a write in a collective with the lost rank fails when the peer is gone."""
        future, self._future = self._future, None
        if future is not None:
            wait([future], timeout=timeout_s)
