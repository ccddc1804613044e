"""Calls into a user's code in processes of their own: a slow call runs beside others, a hung one is stopped, a crash
costs its call only. What reward scoring (`rlrunner.rewards.scorer`) and tool calls (`rlrunner.agents.tool_pool`)
run on.

    pool = ProcessPool("rlrunner.rewards.scoring_process", load_payload, PoolLabels(...), num_workers=4, timeout_s=60)
    batch = pool.submit_items(items)      # returns at once: the calls run while the caller goes on
    results = pool.wait_batch(batch)      # one Result per item, in order
    pool.close()

One thread feeds the processes and reads their results, so that submitting never blocks on a pipe. Items are queued
in order and handed out in small chunks to whichever process is idle (chunks shrink as the queue empties, so that the
processes finish together); an item may instead be pinned to one process slot (`pins`: what holds state of its own,
such as an environment instance, is always called in the same process), where it runs in the order submitted. Each
process answers call by call. A call that runs past `timeout_s` (counted from the process's previous answer) has its
process killed and replaced; it is an error, and the rest of its chunk goes back to the front of the queue, or, for
items pinned to the replaced process, is answered `lost` (the state they needed went with it). A process that dies
makes its current call an error the same way. Which process answers an unpinned item never changes its result: results
are kept by position.

A child is a module whose `main` calls `serve(load)`: `load(payload)` imports what it calls and returns
`(handler, info)` (`info` comes back from `ready()`), or raises `CodeLoadError`; `handler(item)` returns the item's
value or raises (its error, one line). Messages are pickled tuples over two pipes (`multiprocessing.connection`):
    parent -> child: ("load", payload) first, then ("work", [item, ...]) any number of times, ("exit",) at the end
    child -> parent: ("ready", info) or ("load_error", line); then per item, in order, ("result", value, error, seconds)
A child ends with its parent (PR_SET_PDEATHSIG on Linux) even when a call never returns. This module imports no
torch, so a child that imports it starts in a fraction of a second.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from rlrunner.utils.user_code import CodeLoadError

logger = logging.getLogger(__name__)

MAX_CHUNK = 32  # items handed to a process at once (fewer as the queue empties)
MIN_LOAD_TIMEOUT_S = 60.0  # importing a user's libraries can take a while; a hung import still ends


@dataclass(frozen=True)
class PoolLabels:
    """How a pool's messages name things: its code's key and text (`CodeSpec.key`, `.text`), what one process is
    ("scoring process") and the key of its time bound ("reward.timeout_s")."""

    key: str
    text: str
    process: str
    timeout_key: str


@dataclass(frozen=True)
class Result:
    value: Any  # None when the call failed
    error: str | None = None  # "Type: first line" of what the call raised, or why it has no result
    seconds: float = 0.0  # how long the call ran in its process
    lost: bool = False  # never run: it was pinned to a process that was replaced before its turn


class Batch:
    """Items submitted together; complete once every one has a Result, settled already once the first error in
    order is known (every item before it answered). `on_result(index, result)` is called for each item as its
    result arrives (from the feeding thread), before anyone waiting for it is woken."""

    def __init__(self, size: int, on_result: Callable[[int, Result], None] | None = None):
        self.results: list[Result | None] = [None] * size
        self.left = size
        self.in_order = 0  # how many leading items have their Result
        self.done = threading.Event()
        self.settled = threading.Event()  # done, or the results up to the first error are in
        self.discarded = False  # its caller stopped waiting: what is left of it is not run
        self.on_result = on_result
        if size == 0:
            self.done.set()
            self.settled.set()

    def put(self, index: int, result: Result) -> bool:
        """Record `result`; whether it was new (a late answer to an item already answered is dropped). The waiters are
        woken by `wake`, once its callback has run."""
        if self.results[index] is not None:
            return False
        self.results[index] = result
        self.left -= 1
        return True

    def wake(self) -> None:
        """Wake whoever waits for what the results so far complete."""
        while self.in_order < len(self.results) and self.results[self.in_order] is not None:
            if self.results[self.in_order].error is not None:  # type: ignore[union-attr]
                self.settled.set()
            self.in_order += 1
        if self.left == 0:
            self.done.set()
            self.settled.set()

    def until_first_error(self) -> list[Result]:
        """The leading results up to the first error, that error included (all of them when none failed)."""
        results: list[Result] = []
        for result in self.results[: self.in_order]:
            results.append(result)  # type: ignore[arg-type]
            if result.error is not None:  # type: ignore[union-attr]
                break
        return results


Work = tuple[Batch, int, Any]  # (its batch, its position there, the item)


class _Process:
    """One child process and the chunk it is working on."""

    def __init__(self, module: str, payload: Any, load_timeout_s: float):
        parent_in, child_out = os.pipe()
        child_in, parent_out = os.pipe()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", module, str(child_in), str(child_out), str(os.getpid())],
            pass_fds=(child_in, child_out),
            close_fds=True,
        )
        os.close(child_in)
        os.close(child_out)
        self.inbox = Connection(parent_in, writable=False)
        self.outbox = Connection(parent_out, readable=False)
        self.outbox.send(("load", payload))
        self.ready = False
        self.info: Any = None
        self.work: list[Work] = []  # the current chunk's items not answered yet, in order
        self.pinned = False  # the current chunk is of items pinned to this process's slot
        self.deadline = time.monotonic() + load_timeout_s

    def send(self, chunk: list[Work], timeout_s: float, pinned: bool) -> None:
        self.work, self.pinned = list(chunk), pinned
        self.deadline = time.monotonic() + timeout_s
        self.outbox.send(("work", [item for _, _, item in chunk]))

    def kill(self) -> int | None:
        if self.popen.poll() is None:
            self.popen.kill()
        for connection in (self.inbox, self.outbox):
            connection.close()
        try:
            return self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None


class ProcessPool:
    def __init__(self, module: str, payload: Any, labels: PoolLabels, num_workers: int, timeout_s: float):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.module, self.payload, self.labels, self.timeout_s = module, payload, labels, timeout_s
        self.load_timeout_s = max(MIN_LOAD_TIMEOUT_S, timeout_s)
        self._lock = threading.Lock()
        self._queue: deque[Work] = deque()
        self._pinned: list[deque[Work]] = [deque() for _ in range(num_workers)]  # per slot, in order
        self._broken: str | None = None  # why no item can be run (a load error): raised by the waits
        self._closed = False
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)  # a full wake-up pipe already wakes the thread
        self._processes = [self._start() for _ in range(num_workers)]
        self.generations = [0] * num_workers  # per slot: how many times its process was replaced
        self._thread = threading.Thread(target=self._run, name=f"{labels.process}-pool", daemon=True)
        self._thread.start()

    @property
    def num_workers(self) -> int:
        return len(self._pinned)

    # -- the caller's side ---------------------------------------------------------------------------

    def submit_items(
        self,
        items: list[Any],
        pins: list[int | None] | None = None,
        on_result: Callable[[int, Result], None] | None = None,
    ) -> Batch:
        """Queue `items`; `pins[i]`: the slot whose process must run item i (None: any)."""
        batch = Batch(len(items), on_result)
        with self._lock:
            for index, item in enumerate(items):
                slot = None if pins is None else pins[index]
                (self._queue if slot is None else self._pinned[slot]).append((batch, index, item))
        self._wake()
        return batch

    def wait_batch(self, batch: Batch, until_error: bool = False, timeout_s: float | None = None) -> list[Result]:
        """The batch's results, in order; CodeLoadError when the code could not be loaded. With `until_error`, only
        those up to its first error (included), as soon as every item before that one is answered: a caller that fails
        on an error does not wait for the rest (with a hung function, one timeout per item). TimeoutError after
        `timeout_s`."""
        event = batch.settled if until_error else batch.done
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not event.wait(timeout=0.5):
            self._raise_if_broken()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.labels.process}es did not answer within {timeout_s:g} s")
        self._raise_if_broken()
        return batch.until_first_error() if until_error else list(batch.results)  # type: ignore[arg-type]

    def discard(self, batches: list[Batch]) -> None:
        """Drop the queued items of `batches` (their caller stopped waiting); calls already running finish."""
        with self._lock:
            for batch in batches:
                batch.discarded = True
            self._queue = deque(work for work in self._queue if not work[0].discarded)
            self._pinned = [deque(work for work in queue if not work[0].discarded) for queue in self._pinned]

    def ready(self) -> Any:
        """Wait until every process has loaded the code; the first one's `info`. CodeLoadError (one line) when it
        cannot be loaded."""
        while True:
            with self._lock:  # where the feeding thread records a load error and drops the process that had it
                self._raise_if_broken()
                if self._processes and all(process.ready for process in self._processes):
                    return self._processes[0].info
            time.sleep(0.02)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join(timeout=30)
        for process in self._processes:
            try:
                process.outbox.send(("exit",))
            except OSError:
                pass
            try:
                process.popen.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
            process.kill()
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise CodeLoadError(self._broken)

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"x")
        except OSError:
            pass

    # -- the feeding thread ----------------------------------------------------------------------------

    def _start(self) -> _Process:
        return _Process(self.module, self.payload, self.load_timeout_s)

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    self._hand_out()
                    waiting = [p for p in self._processes if not p.ready or p.work]
                timeout = min((p.deadline for p in waiting), default=None)
                if timeout is not None:
                    timeout = max(0.0, timeout - time.monotonic())
                ready = wait([p.inbox for p in self._processes] + [self._wake_read], timeout)
                if self._wake_read in ready:
                    os.read(self._wake_read, 4096)
                answered: list[tuple[Batch, int, Result]] = []
                with self._lock:
                    for process in list(self._processes):
                        if process.inbox in ready:
                            self._receive(process, answered)
                    self._stop_overdue(answered)
                for batch, index, result in answered:  # outside the lock: a callback may take its time
                    if batch.on_result is not None:
                        try:
                            batch.on_result(index, result)
                        except Exception:  # noqa: BLE001 - the caller's callback; its failure must not stop the pool
                            logger.exception("a %s result's callback failed", self.labels.process)
                for batch in {id(batch): batch for batch, _, _ in answered}.values():  # after its callbacks
                    batch.wake()
        except Exception as exc:  # a bug here must not leave callers waiting forever
            logger.exception("the %s pool's feeding thread failed", self.labels.process)
            self._broken = f"{self.labels.key}: its {self.labels.process}es failed: {type(exc).__name__}: {exc}"

    def _hand_out(self) -> None:
        for slot, process in enumerate(self._processes):
            if not process.ready or process.work:
                continue
            pinned = self._pinned[slot]
            if pinned:
                process.send([pinned.popleft() for _ in range(min(MAX_CHUNK, len(pinned)))], self.timeout_s, True)
            elif self._queue:
                size = max(1, min(MAX_CHUNK, -(-len(self._queue) // (2 * len(self._processes)))))
                chunk = [self._queue.popleft() for _ in range(min(size, len(self._queue)))]
                process.send(chunk, self.timeout_s, False)

    def _answer(self, work: Work, result: Result, answered: list) -> None:
        batch, index, _ = work
        if batch.put(index, result):
            answered.append((batch, index, result))

    def _receive(self, process: _Process, answered: list) -> None:
        while process.inbox.poll():
            try:
                message = process.inbox.recv()
            except (EOFError, OSError):
                self._replace(process, f"the {self.labels.process} died (exit code {process.kill()})", answered)
                return
            kind = message[0]
            if kind == "ready":
                process.ready, process.info = True, message[1]
            elif kind == "load_error":
                self._broken = message[1]
                process.kill()
                self._processes.remove(process)
                return
            elif kind == "result":
                _, value, error, seconds = message
                # results come back in order, one per call: the first unanswered item is the one answered
                self._answer(process.work.pop(0), Result(value, error, seconds), answered)
                process.deadline = time.monotonic() + self.timeout_s

    def _stop_overdue(self, answered: list) -> None:
        now = time.monotonic()
        for process in list(self._processes):
            if now < process.deadline:
                continue
            if not process.ready:
                self._broken = (
                    f"{self.labels.key}: loading {self.labels.text} took more than {self.load_timeout_s:g} s "
                    "(its import hangs?)"
                )
                process.kill()
                self._processes.remove(process)
            elif process.work:
                why = f"timed out after {self.timeout_s:g} s ({self.labels.timeout_key})"
                self._replace(process, why, answered, seconds=self.timeout_s)

    def _replace(self, process: _Process, why: str, answered: list, seconds: float = 0.0) -> None:
        """Kill `process`; its current call fails with `why`; the rest of its chunk goes back to the queue's front,
        or, pinned to it, is answered lost, with what else waits for its slot."""
        exit_code = process.kill()
        if not process.ready:
            self._broken = (
                f"{self.labels.key}: the {self.labels.process} for {self.labels.text} exited while loading it "
                f"(exit code {exit_code})"
            )
            self._processes.remove(process)
            return
        slot = self._processes.index(process)
        self.generations[slot] += 1  # before any answer: a caller woken by one must see the slot's state gone
        lost = list(self._pinned[slot])  # waiting for the state that goes with this process
        self._pinned[slot].clear()
        if process.work:
            self._answer(process.work.pop(0), Result(None, why, seconds), answered)
            rest = [work for work in process.work if not work[0].discarded]
            if process.pinned:
                lost = rest + lost
            else:
                self._queue.extendleft(reversed(rest))
        for work in lost:
            self._answer(work, Result(None, f"lost: {why}, before its turn", lost=True), answered)
        self._processes[slot] = self._start()
        logger.warning("%s: %s; a new %s replaces it", self.labels.key, why, self.labels.process)


# -- the child's side ------------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the closed pipe still ends an idle process
        pass
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def serve(load: Callable[[Any], tuple[Callable[[Any], Any], Any]]) -> None:
    """A child's main loop (its arguments: the two pipe fds and the parent's pid, `sys.argv[1:4]`): load, then answer
    every item in order, each as soon as its call returns (so the parent can tell how long the current call has
    run)."""
    from rlrunner.errors import describe

    fd_in, fd_out, parent = (int(arg) for arg in sys.argv[1:4])
    _die_with_parent(parent)
    inbox, outbox = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    kind, payload = inbox.recv()
    assert kind == "load", kind
    try:
        handler, info = load(payload)
    except CodeLoadError as exc:
        outbox.send(("load_error", str(exc)))
        return
    outbox.send(("ready", info))
    while True:
        try:
            message = inbox.recv()
        except EOFError:  # the parent closed its end: nothing more to do
            return
        if message[0] == "exit":
            return
        for item in message[1]:
            started = time.perf_counter()
            try:
                value, error = handler(item), None
            except Exception as exc:  # noqa: BLE001 - the user's code may raise anything; it is reported, not fatal
                value, error = None, describe(exc)
            outbox.send(("result", value, error, time.perf_counter() - started))
