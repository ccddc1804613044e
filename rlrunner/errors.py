"""User-facing errors: each carries a one-line message and the process exit code it maps to.

`EXIT_CODES` is the one table of the driver's exit codes: `--help` prints it, and a test checks the
README and the launch script (which relaunches the driver after 1 and after a crash) against it.
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass
from typing import Iterator

FINISHED, FAILED, CONFIG_ERROR, STOPPED, FAILED_FOR_GOOD = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class ExitCode:
    code: str  # "0".."4", or "128+N" for a second signal
    meaning: str  # what a user reads (README, --help)
    script_says: str | None  # the launch script's closing line for it; None: the script relaunches the driver


EXIT_CODES = (
    ExitCode("0", "finished", "the run finished"),
    ExitCode(
        "1",
        "failed in a way a relaunch may mend: Ray did not start or the cluster to join does not answer, the cluster "
        "cannot place the workers, the head node of a joined cluster is gone, in-job restarts used up on varied "
        "errors, a save failed for another reason than space or permission. The launch script relaunches it",
        None,
    ),
    ExitCode(
        "2",
        "configuration error: a bad key or value, a missing model or data file, an unusable `runner.resume_dir`, an "
        "experiment folder in use, storage not shared between nodes. Retrying will not help",
        "configuration error (exit code 2): not restarting",
    ),
    ExitCode(
        "3",
        "stopped on request (SIGTERM, SIGINT / Ctrl-C, `runner.max_wall_time_s`) after an emergency checkpoint: resume "
        "with `runner.resume_dir=auto`",
        "stopped on request after an emergency checkpoint (exit code 3): resume with runner.resume_dir=auto",
    ),
    ExitCode(
        "4",
        "failed for good: an exception raised by worker code (a bug, an out-of-memory on one batch, a reward function "
        "that raises), a save that failed for lack of space or permission, in-job restarts used up on the same error "
        "each time. A relaunch would repeat it: the launch script does not",
        "failed in a way a relaunch cannot mend (exit code 4): not restarting",
    ),
    ExitCode(
        "128+N",
        "a second signal N ended the run at once (130: SIGINT, 143: SIGTERM); the last committed checkpoint is intact",
        None,
    ),
)


def exit_codes_text(width: int = 100) -> str:
    """The exit-code table as plain text (for `--help`)."""
    import textwrap

    lines = ["exit codes:"]
    for entry in EXIT_CODES:
        wrapped = textwrap.wrap(entry.meaning.replace("`", ""), width - 10)
        lines.append(f"  {entry.code:<6}  {wrapped[0]}")
        lines += [f"  {'':<6}  {line}" for line in wrapped[1:]]
    return "\n".join(lines)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def first_line(text: object) -> str:
    """The first non-blank line of `text` (an exception, a message), stripped, terminal colour codes removed; ''
    if none.

    An OSError with a `strerror` is described by it (its str() adds the errno and file name)."""
    if isinstance(text, OSError) and text.strerror:
        text = text.strerror
    for line in _ANSI.sub("", str(text)).splitlines():
        if line.strip():
            return line.strip()
    return ""


def describe(err: BaseException) -> str:
    """`Type: first line` of an error (for a Ray task error: of the exception the worker raised)."""
    inner = getattr(err, "cause", None)
    if isinstance(inner, BaseException) and inner is not err:
        err = inner
    line = first_line(str(err))
    return f"{type(err).__name__}: {line}" if line else type(err).__name__


class RLRunnerError(Exception):
    """A problem the user can fix; reported as one line, without a traceback."""

    exit_code = FAILED
    label = "error"  # the word after "rlrunner:" in the one-line report


class ConfigError(RLRunnerError):
    """The configuration or its inputs (model path, data files) cannot work. Retrying will not help."""

    exit_code = CONFIG_ERROR


class ResourceError(RLRunnerError):
    """The cluster cannot place the requested workers within the allowed wait."""

    exit_code = FAILED


class RayStartError(RLRunnerError):
    """Ray did not start, or the cluster to join does not answer: a relaunch (or the cluster coming up) may mend it."""

    exit_code = FAILED


class CheckpointError(RLRunnerError):
    """`runner.resume_dir` cannot be used: missing, incomplete, corrupt, or saved with another model/optimizer
    config."""

    exit_code = CONFIG_ERROR


class CheckpointSaveError(RLRunnerError):
    """A checkpoint could not be written; the previous checkpoints are intact.

    `permanent` when a relaunch cannot mend it (no space, no permission): exit code 4 instead of 1.
    """

    def __init__(self, message: str, permanent: bool = False):
        super().__init__(message)
        self.permanent = permanent

    @property
    def exit_code(self) -> int:  # type: ignore[override]
        return FAILED_FOR_GOOD if self.permanent else FAILED


class ExperimentLockedError(RLRunnerError):
    """Another run is using the same experiment folder."""

    exit_code = CONFIG_ERROR


class RecoveryExhaustedError(RLRunnerError):
    """Workers kept failing: `runner.recovery.max_restarts` in-job restarts were used up.

    On the same error every time, a relaunch would only repeat it: exit code 4; on varied errors, 1.
    """

    def __init__(self, message: str, same_error: bool = False):
        super().__init__(message)
        self.same_error = same_error

    @property
    def exit_code(self) -> int:  # type: ignore[override]
        return FAILED_FOR_GOOD if self.same_error else FAILED


class WorkerError(RLRunnerError):
    """Worker code raised an exception (a bug, an out-of-memory on one batch, a reward function that raises).

    Deterministic as far as rlrunner can tell: neither repaired in-job nor relaunched.
    """

    exit_code = FAILED_FOR_GOOD


class RewardFunctionError(RLRunnerError):
    """The reward function raised, hung past `reward.timeout_s` or returned no score (with `reward.on_error=raise`).

    The same samples would fail again: neither repaired in-job nor relaunched. The trainer writes the emergency
    checkpoint of the last completed step before the run ends.
    """

    exit_code = FAILED_FOR_GOOD


class ClusterLostError(RLRunnerError):
    """The Ray cluster itself is gone: the embedded one's node died, or the head of a joined cluster.

    For a joined cluster this is a driver failure (exit 1): the launch script relaunches the driver.
    """

    exit_code = FAILED


class StoppedEarly(RLRunnerError):
    """A stop was asked for (SIGTERM, SIGINT, runner.max_wall_time_s): an emergency checkpoint was written."""

    exit_code = STOPPED
    label = "stopped"


class StorageNotSharedError(RLRunnerError):
    """The checkpoint folder is not the same folder on every node that hosts a worker."""

    exit_code = CONFIG_ERROR


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and everything it wraps: __cause__/__context__, Ray's task-error cause, DCP's per-rank failures."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        stack.extend([err.__cause__, err.__context__, getattr(err, "cause", None)])
        failures = getattr(err, "failures", None)
        if isinstance(failures, dict):
            stack.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())


# OS errors that a relaunch on the same storage cannot mend.
_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG}


def is_storage_full_or_forbidden(exc: BaseException) -> bool:
    """Whether `exc` (or anything it wraps) is an OS error for lack of space or permission."""
    return any(isinstance(err, OSError) and err.errno in _PERMANENT_ERRNOS for err in exception_chain(exc))


def user_error(exc: BaseException) -> RLRunnerError | None:
    """The RLRunnerError behind `exc`, also when a Ray worker raised it (first found, outermost first)."""
    if isinstance(exc, RLRunnerError):
        return exc
    return next((err for err in exception_chain(exc) if isinstance(err, RLRunnerError)), None)
