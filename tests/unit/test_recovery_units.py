"""Recovery building blocks: failure classification, stop requests, the shared-storage probe."""

from __future__ import annotations

import errno
import signal
import time

import ray

from rlrunner.cluster.actor_calls import CallTimeoutError
from rlrunner.errors import (
    CheckpointSaveError,
    RecoveryExhaustedError,
    WorkerError,
    describe,
    exception_chain,
    is_storage_full_or_forbidden,
)
from rlrunner.runner.recovery import RestartBudget, failure_cause, ranks_to_replace, same_failure
from rlrunner.runner.stopping import DUPLICATE_WINDOW_S, StopRequest


def raised_from(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except BaseException as caught:
        return caught


def test_failure_cause_classifies_what_can_be_repaired():
    assert failure_cause(CallTimeoutError("the actor group did not answer within 5s")).startswith(
        "hang: the actor group"
    )
    assert failure_cause(ray.exceptions.GetTimeoutError()).startswith("hang:")
    assert failure_cause(ray.exceptions.ActorDiedError()).startswith("worker lost: ActorDiedError")
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:5000: Connection reset by peer"
    )
    assert failure_cause(gloo).startswith(
        "collective failed (a peer is gone or stuck): RuntimeError: [../third_party/gloo"
    )
    # a save that failed because a worker died is repairable; one that failed on a full disk is not
    assert failure_cause(
        raised_from(CheckpointSaveError("saving global_step_4 failed"), ray.exceptions.ActorDiedError())
    )
    disk_full = raised_from(CheckpointSaveError("saving global_step_4 failed"), OSError(28, "No space left on device"))
    assert failure_cause(disk_full) is None
    assert failure_cause(ValueError("shapes do not match")) is None


def test_exception_chain_reaches_wrapped_and_per_rank_errors():
    class FakeDCPError(BaseException):  # the shape of torch's CheckpointException: .failures {rank: (exc, tb)}
        def __init__(self, failures):
            self.failures = failures

    inner = OSError("disk")
    wrapped = raised_from(RuntimeError("outer"), FakeDCPError({1: (inner, None)}))
    assert inner in list(exception_chain(wrapped))


def test_describe_strips_ray_colour_codes_and_keeps_the_first_line():
    assert (
        describe(RuntimeError("\x1b[36mray::ActorWorker.update()\x1b[39m (pid=1)\nmore"))
        == "RuntimeError: ray::ActorWorker.update() (pid=1)"
    )


def test_stop_request_from_a_signal_and_its_duplicate():
    stop = StopRequest()
    assert not stop.requested
    stop.on_signal(signal.SIGTERM)
    assert stop.requested and stop.reason == "SIGTERM received"
    stop.on_signal(signal.SIGTERM)  # the same stop delivered twice: ignored (a later one would exit the process)
    assert stop.is_duplicate() and stop.reason == "SIGTERM received"
    time.sleep(DUPLICATE_WINDOW_S + 0.05)
    assert not stop.is_duplicate()


def test_stop_request_from_wall_time():
    stop = StopRequest(max_wall_time_s=0.05)
    assert not stop.requested
    time.sleep(0.1)
    assert stop.requested and stop.reason == "runner.max_wall_time_s=0.05 reached"


def test_restart_budget_counts_restarts_without_progress():
    budget = RestartBudget(max_restarts=2)
    assert budget.spend("global_step_50") and budget.spend("global_step_50")
    assert not budget.spend("global_step_50")  # a third failure before anything new was saved: give up
    budget = RestartBudget(max_restarts=2)
    for newest in ["global_step_50", "global_step_50", "global_step_100", "global_step_100", "global_step_150"]:
        assert budget.spend(newest)  # progress in between starts the count again
    assert budget.total == 5 and budget.count == 1
    assert not RestartBudget(max_restarts=0).spend(None)


def test_same_failure_ignores_pids_ranks_and_ids():
    died = "worker lost: ActorDiedError: The actor 0054c1bc89c1e74bd154de9a01000000 died (pid={}) [dead: actor rank {}]"
    assert same_failure([died.format(101, 0), died.format(202, 1), died.format(303, "0, actor rank 1")])
    assert not same_failure([died.format(101, 0), "hang: the rollout group did not answer within 6s"])
    assert not same_failure([]) and not same_failure([died.format(101, 0)])  # one failure is not a repetition
    budget = RestartBudget(max_restarts=1)
    budget.spend("global_step_2", "a")
    budget.spend("global_step_4", "b")  # progress since the last restart: a new stretch
    assert budget.causes == ["b"]


def test_lack_of_space_or_permission_is_recognised_through_wrapping():
    assert is_storage_full_or_forbidden(
        raised_from(CheckpointSaveError("x"), OSError(errno.ENOSPC, "No space left on device"))
    )
    assert is_storage_full_or_forbidden(PermissionError(errno.EACCES, "Permission denied"))
    assert not is_storage_full_or_forbidden(raised_from(CheckpointSaveError("x"), OSError(errno.EIO, "I/O error")))


def test_exit_codes_tell_the_launch_script_what_a_relaunch_can_mend():
    assert WorkerError("actor rank 1: RuntimeError: boom").exit_code == 4
    assert RecoveryExhaustedError("x", same_error=True).exit_code == 4
    assert RecoveryExhaustedError("x", same_error=False).exit_code == 1
    assert CheckpointSaveError("x", permanent=True).exit_code == 4
    assert CheckpointSaveError("x").exit_code == 1


def test_only_lost_processes_of_the_actor_group_are_replaced_alone():
    nodes = ["a", "a", "b"]  # the node of each actor rank
    assert ranks_to_replace([2, 0], nodes, ["a", "b"], []) == [0, 2]
    assert ranks_to_replace([], nodes, ["a", "b"], []) == []  # nothing lost in the actor group
    assert ranks_to_replace([2], nodes, ["a"], []) == []  # rank 2's node is gone: both groups are replaced
    assert ranks_to_replace([1], nodes, ["a", "b"], [0]) == []  # a rollout worker is lost too
