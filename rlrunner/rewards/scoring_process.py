"""A scoring process: loads the reward function itself, then scores what its parent sends, one result per call.

    python -m rlrunner.rewards.scoring_process FD_IN FD_OUT

Messages are pickled tuples over two pipes (`multiprocessing.connection.Connection`):
    parent -> child: ("load", spec, kwargs) first, then ("score", [(data_source, solution_str, ground_truth,
                     extra_info), ...]) any number of times, ("exit",) at the end
    child -> parent: ("ready",) or ("load_error", line); then per call, in order, ("result", score, extras, error)
A result is sent as soon as its call returns, so that the parent can tell how long the current call has run. The
process ends with its parent (PR_SET_PDEATHSIG on Linux) even when a call never returns. It imports neither torch
nor the rest of rlrunner, only what the reward function needs.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from multiprocessing.connection import Connection

from rlrunner.rewards.function import RewardLoadError, load_function, read_result

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the closed pipe still ends an idle process
        pass
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def _call(function, kwargs: dict, item: tuple) -> tuple:
    data_source, solution_str, ground_truth, extra_info = item
    try:
        value = function(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
            **kwargs,
        )
        score, extras = read_result(value)
        return ("result", score, extras, None)
    except Exception as exc:  # noqa: BLE001 - the user's function may raise anything; it is reported, not fatal
        line = next((part.strip() for part in str(exc).splitlines() if part.strip()), "")
        return ("result", None, None, f"{type(exc).__name__}: {line}" if line else type(exc).__name__)


def main(fd_in: int, fd_out: int, parent: int) -> None:
    _die_with_parent(parent)
    inbox, outbox = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    kind, spec, kwargs = inbox.recv()
    assert kind == "load", kind
    try:
        function = load_function(spec)
    except RewardLoadError as exc:
        outbox.send(("load_error", str(exc)))
        return
    outbox.send(("ready",))
    while True:
        try:
            message = inbox.recv()
        except EOFError:  # the parent closed its end: nothing more to do
            return
        if message[0] == "exit":
            return
        for item in message[1]:
            outbox.send(_call(function, kwargs, item))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
