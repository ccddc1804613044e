"""Scoring in processes of their own: a slow reward runs in parallel, a hung call is stopped, a crash is contained.

    scorer = RewardScorer(spec, kwargs, num_workers=4, timeout_s=60)
    batch = scorer.submit(requests)   # returns at once: scoring goes on while the caller generates the next chunk
    scores = scorer.wait(batch)       # one Score per request, in order
    scorer.close()

One thread feeds the processes and reads their results, so that submitting never blocks on a pipe. Requests are
queued in order and handed out in small chunks to whichever process is idle (chunks shrink as the queue empties, so
that the processes finish together); each process answers call by call. A call that runs past `timeout_s` (counted
from the process's previous answer) has its process killed and replaced; it is an error, and the rest of its chunk
goes back to the front of the queue. A process that dies makes its current call an error the same way. Which
process scores a request never changes its result: results are kept by position.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from rlrunner.rewards import BUILTIN_VERIFIERS
from rlrunner.rewards.function import RewardFunctionSpec, RewardLoadError, builtin_spec

logger = logging.getLogger(__name__)

MAX_CHUNK = 32  # requests handed to a process at once (fewer as the queue empties)
MIN_LOAD_TIMEOUT_S = 60.0  # importing a reward's libraries can take a while; a hung import still ends


@dataclass(frozen=True)
class RewardSettings:
    """What scores a run's responses and how (`reward.*`, resolved by the driver): plain values, sent to the rollout
    workers, whose scoring processes import the function themselves."""

    spec: RewardFunctionSpec
    kwargs: dict = field(default_factory=dict)
    num_workers: int = 1
    timeout_s: float = 60.0
    on_error: str = "raise"  # raise | zero

    @classmethod
    def builtin(cls, verifier: str, **options: Any) -> "RewardSettings":
        return cls(builtin_spec(BUILTIN_VERIFIERS[verifier], f"the {verifier} verifier"), **options)

    def scorer(self) -> "RewardScorer":
        return RewardScorer(self.spec, self.kwargs, self.num_workers, self.timeout_s)


def check_reward_function(settings: RewardSettings) -> None:
    """Load the function once in a scoring process of its own: RewardLoadError (one line naming it) when its file is
    missing, does not import, or lacks the name. The driver calls it before any worker starts."""
    scorer = dataclasses.replace(settings, num_workers=1).scorer()
    try:
        scorer.ready()
    finally:
        scorer.close()


@dataclass(frozen=True)
class ScoreRequest:
    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict


@dataclass
class Score:
    value: float | None  # None when the call failed
    extras: dict[str, float] = field(default_factory=dict)  # the other numeric keys of a dict result
    error: str | None = None  # "Type: first line" of what the call raised, or why it has no result


class Batch:
    """Requests submitted together; complete once every one has a Score, settled already once the first error in
    order is known (every request before it scored)."""

    def __init__(self, size: int):
        self.scores: list[Score | None] = [None] * size
        self.left = size
        self.in_order = 0  # how many leading requests have their Score
        self.done = threading.Event()
        self.settled = threading.Event()  # done, or the scores up to the first error are in
        self.discarded = False  # its caller stopped waiting: what is left of it is not scored
        if size == 0:
            self.done.set()
            self.settled.set()

    def put(self, index: int, score: Score) -> None:
        if self.scores[index] is not None:
            return
        self.scores[index] = score
        self.left -= 1
        while self.in_order < len(self.scores) and self.scores[self.in_order] is not None:
            if self.scores[self.in_order].error is not None:  # type: ignore[union-attr]
                self.settled.set()
            self.in_order += 1
        if self.left == 0:
            self.done.set()
            self.settled.set()

    def until_first_error(self) -> list[Score]:
        """The leading scores up to the first error, that error included (all of them when none failed)."""
        scores: list[Score] = []
        for score in self.scores[: self.in_order]:
            scores.append(score)  # type: ignore[arg-type]
            if score.error is not None:  # type: ignore[union-attr]
                break
        return scores


class _Process:
    """One scoring process and the chunk it is working on."""

    def __init__(self, spec: RewardFunctionSpec, kwargs: dict, load_timeout_s: float):
        parent_in, child_out = os.pipe()
        child_in, parent_out = os.pipe()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "rlrunner.rewards.scoring_process", str(child_in), str(child_out), str(os.getpid())],
            pass_fds=(child_in, child_out),
            close_fds=True,
        )
        os.close(child_in)
        os.close(child_out)
        self.inbox = Connection(parent_in, writable=False)
        self.outbox = Connection(parent_out, readable=False)
        self.outbox.send(("load", spec, kwargs))
        self.ready = False
        self.work: list[tuple[Batch, int, ScoreRequest]] = []  # the current chunk's requests not answered yet, in order
        self.deadline = time.monotonic() + load_timeout_s

    def send(self, chunk: list[tuple[Batch, int, ScoreRequest]], timeout_s: float) -> None:
        self.work = list(chunk)
        items = [(r.data_source, r.solution_str, r.ground_truth, r.extra_info) for _, _, r in chunk]
        self.deadline = time.monotonic() + timeout_s
        self.outbox.send(("score", items))

    def kill(self) -> int | None:
        if self.popen.poll() is None:
            self.popen.kill()
        for connection in (self.inbox, self.outbox):
            connection.close()
        try:
            return self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None


class RewardScorer:
    def __init__(self, spec: RewardFunctionSpec, kwargs: dict | None, num_workers: int, timeout_s: float):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.spec, self.kwargs, self.timeout_s = spec, dict(kwargs or {}), timeout_s
        self.load_timeout_s = max(MIN_LOAD_TIMEOUT_S, timeout_s)
        self._lock = threading.Lock()
        self._queue: deque[tuple[Batch, int, ScoreRequest]] = deque()
        self._broken: str | None = None  # why no request can be scored (a load error): raised by wait()
        self._closed = False
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)  # a full wake-up pipe already wakes the thread
        self._processes = [self._start() for _ in range(num_workers)]
        self._thread = threading.Thread(target=self._run, name="reward-scorer", daemon=True)
        self._thread.start()

    # -- the caller's side ---------------------------------------------------------------------------

    def submit(self, requests: list[ScoreRequest]) -> Batch:
        batch = Batch(len(requests))
        with self._lock:
            self._queue.extend((batch, index, request) for index, request in enumerate(requests))
        self._wake()
        return batch

    def wait(self, batch: Batch, until_error: bool = False) -> list[Score]:
        """The batch's scores, in order; RewardLoadError when the function could not be loaded. With `until_error`,
        only those up to its first error (included), as soon as every request before that one is scored: a caller
        that fails on an error does not wait for the rest (with a hung function, one timeout per request)."""
        event = batch.settled if until_error else batch.done
        while not event.wait(timeout=0.5):
            self._raise_if_broken()
        self._raise_if_broken()
        return batch.until_first_error() if until_error else list(batch.scores)  # type: ignore[arg-type]

    def discard(self, batches: list[Batch]) -> None:
        """Drop the queued requests of `batches` (their caller stopped waiting); calls already running finish."""
        with self._lock:
            for batch in batches:
                batch.discarded = True
            self._queue = deque(item for item in self._queue if not item[0].discarded)

    def score(self, requests: list[ScoreRequest]) -> list[Score]:
        return self.wait(self.submit(requests))

    def ready(self) -> None:
        """Wait until every process has loaded the function; RewardLoadError (one line) when it cannot be loaded."""
        while True:
            with self._lock:  # where the feeding thread records a load error and drops the process that had it
                self._raise_if_broken()
                if self._processes and all(process.ready for process in self._processes):
                    return
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
            raise RewardLoadError(self._broken)

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"x")
        except OSError:
            pass

    # -- the feeding thread ----------------------------------------------------------------------------

    def _start(self) -> _Process:
        return _Process(self.spec, self.kwargs, self.load_timeout_s)

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
                with self._lock:
                    for process in list(self._processes):
                        if process.inbox in ready:
                            self._receive(process)
                    self._stop_overdue()
        except Exception as exc:  # a bug here must not leave callers waiting forever
            logger.exception("the reward scorer's feeding thread failed")
            self._broken = f"reward scoring failed: {type(exc).__name__}: {exc}"

    def _hand_out(self) -> None:
        idle = [p for p in self._processes if p.ready and not p.work]
        for process in idle:
            if not self._queue:
                return
            size = max(1, min(MAX_CHUNK, -(-len(self._queue) // (2 * len(self._processes)))))
            chunk = [self._queue.popleft() for _ in range(min(size, len(self._queue)))]
            process.send(chunk, self.timeout_s)

    def _receive(self, process: _Process) -> None:
        while process.inbox.poll():
            try:
                message = process.inbox.recv()
            except (EOFError, OSError):
                self._replace(process, f"the scoring process died (exit code {process.kill()})")
                return
            kind = message[0]
            if kind == "ready":
                process.ready = True
            elif kind == "load_error":
                self._broken = message[1]
                process.kill()
                self._processes.remove(process)
                return
            elif kind == "result":
                _, value, extras, error = message
                # results come back in order, one per call: the first unanswered request is the one answered
                batch, index, _ = process.work.pop(0)
                batch.put(index, Score(value, extras or {}, error))
                process.deadline = time.monotonic() + self.timeout_s

    def _stop_overdue(self) -> None:
        now = time.monotonic()
        for process in list(self._processes):
            if now < process.deadline:
                continue
            if not process.ready:
                self._broken = (
                    f"reward.function: loading {self.spec.text} took more than {self.load_timeout_s:g} s "
                    "(its import hangs?)"
                )
                process.kill()
                self._processes.remove(process)
            elif process.work:
                self._replace(process, f"timed out after {self.timeout_s:g} s (reward.timeout_s)")

    def _replace(self, process: _Process, why: str) -> None:
        """Kill `process`; its current call fails with `why`, the rest of its chunk goes back to the queue's front."""
        exit_code = process.kill()
        if not process.ready:
            self._broken = (
                f"reward.function: the scoring process for {self.spec.text} exited while loading it "
                f"(exit code {exit_code})"
            )
            self._processes.remove(process)
            return
        if process.work:
            batch, index, _ = process.work.pop(0)
            batch.put(index, Score(None, {}, why))
            self._queue.extendleft(reversed([item for item in process.work if not item[0].discarded]))
        self._processes[self._processes.index(process)] = self._start()
        logger.warning("reward scoring: %s; a new scoring process replaces it", why)
