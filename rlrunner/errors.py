"""User-facing errors: each carries a one-line message and the process exit code it maps to."""

from __future__ import annotations


class RLRunnerError(Exception):
    """A problem the user can fix; reported as one line, without a traceback."""

    exit_code = 1
    label = "error"  # the word after "rlrunner:" in the one-line report


class ConfigError(RLRunnerError):
    """The configuration or its inputs (model path, data files) cannot work. Retrying will not help."""

    exit_code = 2


class ResourceError(RLRunnerError):
    """The cluster cannot place the requested workers within the allowed wait."""

    exit_code = 1


class CheckpointError(RLRunnerError):
    """`runner.resume_dir` cannot be used: missing, incomplete, corrupt, or saved with another model/optimizer config."""

    exit_code = 2


class CheckpointSaveError(RLRunnerError):
    """A checkpoint could not be written (e.g. the disk is full); the previous checkpoints are intact."""

    exit_code = 1


class ExperimentLockedError(RLRunnerError):
    """Another run is using the same experiment folder."""

    exit_code = 2


class RecoveryExhaustedError(RLRunnerError):
    """Workers kept failing: `runner.recovery.max_restarts` in-job restarts were used up."""

    exit_code = 1


class StoppedEarly(RLRunnerError):
    """A stop was asked for (SIGTERM, SIGINT, runner.max_wall_time_s): an emergency checkpoint was written."""

    exit_code = 3
    label = "stopped"


class StorageNotSharedError(RLRunnerError):
    """The checkpoint folder is not the same folder on every node that hosts a worker."""

    exit_code = 2
