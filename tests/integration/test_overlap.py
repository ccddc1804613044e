"""Overlapped runs (`algorithm.policy_lag=1`: step t trains on samples generated with the weights after step t-2,
generated while step t-1's update ran) on the recovery tests' multi-node cluster (recovery_helpers.py), both
backends: the same metrics and weights, bit for bit, for any number of rollout workers, through a rollout worker lost
in a generation ahead, an actor rank lost mid-update and a stop and resume; a checkpoint resumed with another lag.
"""

from __future__ import annotations

import pytest
import torch
from recovery_helpers import (
    RUN,
    assert_matches_reference,
    assert_restored_from_memory,
    dying,
    kill_in_next_update,
    patch_worker_module,
    recovery_events,
)
from reference_runs import BACKEND_OVERRIDES, LAG1, Reference, reference_run

from rlrunner.errors import StoppedEarly
from rlrunner.runner.supervisor import Supervisor

from conftest import Inspect, metrics_lines, once, read_metrics, run_config, without_time

pytestmark = [pytest.mark.slow, pytest.mark.multinode]

LAG = "rollout/policy_lag"
# lag 1 with a save at the last step only: every update after the first may be asked for ahead of its step
SAVED_AT_THE_END = [*RUN, *LAG1, "runner.save_interval=100"]


@pytest.fixture(scope="module")
def references(cluster, tmp_path_factory) -> dict[str, Reference]:
    """The session's reference runs: lag 0 and lag 1, each backend (trained on this module's cluster if no module
    before trained them)."""
    return {name: reference_run(name, tmp_path_factory) for name in ("fsdp", "fsdp_lag1")}


def _rollout(metrics: dict) -> dict:
    """A step's metrics of its samples alone (the same samples give the same values, whatever the loss)."""
    return {k: v for k, v in metrics.items() if k.startswith("rollout/") and k != LAG}


def test_the_lag_1_reference_trains_on_samples_one_update_old(references):
    lag0, lag1 = references["fsdp"].metrics, references["fsdp_lag1"].metrics
    assert [m[LAG] for m in lag1] == [0] + [1] * (len(lag1) - 1)  # the first step has no older weights
    assert LAG not in lag0[0]
    # step 1's samples are the lag-0 run's (the initial weights in both); the tiny policy first learns at step 5 (the
    # first reward), so the samples first differ at step 6: the lag-0 run's come from the weights after step 5, the
    # lag-1 run's from those after step 4
    assert _rollout(lag1[0]) == _rollout(lag0[0])
    assert [step for step, (a, b) in enumerate(zip(lag0, lag1), 1) if _rollout(a) != _rollout(b)][:1] == [6]
    assert all(m["actor/tis_weight_mean"] > 0 for m in lag1)
    after_lag0, after_lag1 = references["fsdp"].weights(), references["fsdp_lag1"].weights()
    assert not all(torch.equal(after_lag0[name], after_lag1[name]) for name in after_lag0)


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_lag_1_is_the_same_for_two_rollout_workers_through_losses_and_a_stop(backend, cluster, tmp_path, request):
    """Two rollout workers (the reference has one). Rollout worker 0 dies in the generation it is asked for after
    step 5 (a generation ahead, started before an update: the repair pushes the weights the actor ranks kept from the
    sync before it, which differ from the updated ones from step 5 on, the first that learns); actor rank 1 dies in
    the update after step 7 (restored from the snapshot; the generation beside it goes on, and the redone step keeps
    it); a stop (the path of SIGTERM) after step 8; the run resumed to the end. Every step bit-identical to the
    uninterrupted one-worker run, no step lost."""
    reference = reference_run(f"{backend}_lag1", request.getfixturevalue("tmp_path_factory"))
    run = [*RUN, *BACKEND_OVERRIDES[f"{backend}_lag1"], "rollout.num_workers=2", "cluster.cpus_per_rollout_worker=0.5"]
    runner = Supervisor(run_config(tmp_path, *run))
    once(
        lambda: metrics_lines(tmp_path) >= 5,
        lambda: patch_worker_module(runner.trainer.rollout_group, 0, "rlrunner.rollout.worker", "derive_seed", dying),
    )
    kill_in_next_update(runner, 1, 7)
    once(lambda: metrics_lines(tmp_path) >= 8, lambda: runner.stop.request("SIGTERM received"))
    with pytest.raises(StoppedEarly, match=r"SIGTERM received at step \d+; (saved global_step_|global_step_\d+ is)"):
        runner.run()
    stopped_at = metrics_lines(tmp_path)
    in_flight = tmp_path / "test" / "checkpoints" / f"global_step_{stopped_at}" / "data" / "in_flight.pt"
    assert in_flight.is_file()  # the batch generated for the next step is saved with the step

    [repair] = recovery_events(tmp_path, "rollout_repaired")
    assert repair["phase"] == "generation ahead" and repair["lost_steps"] == 0 and repair["step"] >= 6, repair
    failure = assert_restored_from_memory(tmp_path)
    assert failure["replaced"] == "actor ranks 1" and failure["step"] >= 7, failure
    # the same Trainer went on, and the redone step kept the generation that had been running beside the lost update
    assert runner.trainer.generations_kept == 1

    Supervisor(run_config(tmp_path, *run, "runner.resume_dir=auto")).run()
    assert_matches_reference(tmp_path, reference)
    assert not (tmp_path / "test" / "checkpoints" / "global_step_10" / "data" / "in_flight.pt").exists()


def test_updates_asked_ahead_of_their_step_survive_a_lost_sync_a_lost_rank_and_a_stop(references, cluster, tmp_path):
    """With no save before the last step, each update is asked for behind the weight sync of the step before it
    (`Trainer._may_update_ahead`), so it may run before that step completes. Rollout worker 0 dies in a weight sync
    after step 4: the repair pushes the copy that sync kept, not the live weights, which the update asked for ahead
    has changed by then. Actor rank 1 dies in an update after step 6, possibly one asked for ahead. A stop after
    step 8 still runs the update already asked for. Resumed, the run is the reference's, bit for bit, no step lost."""
    run = SAVED_AT_THE_END
    runner = Supervisor(run_config(tmp_path, *run))
    asked_ahead: list[int] = []  # the updates asked for before the step before them completed

    def record_updates(trainer) -> None:
        submit = trainer.submit_update

        def recorded(step: int, samples: list) -> object:
            if step > trainer.global_step + 1:
                asked_ahead.append(step)
            return submit(step, samples)

        trainer.submit_update = recorded

    runner.callbacks.append(Inspect(on_start=record_updates))
    once(
        lambda: metrics_lines(tmp_path) >= 4,
        lambda: patch_worker_module(
            runner.trainer.rollout_group, 0, "rlrunner.weight_sync.transport", "Assembler", dying
        ),
    )
    once(
        lambda: metrics_lines(tmp_path) >= 6,
        lambda: patch_worker_module(runner.trainer.actor_group, 1, "rlrunner.backends.actor", "token_log_probs", dying),
    )
    once(lambda: metrics_lines(tmp_path) >= 8, lambda: runner.stop.request("SIGTERM received"))
    with pytest.raises(StoppedEarly, match=r"SIGTERM received at step \d+"):
        runner.run()

    assert set(asked_ahead) >= {2, 3, 4}  # at least up to the lost sync
    [repair] = recovery_events(tmp_path, "rollout_repaired")
    assert repair["phase"] == "weight sync" and repair["lost_steps"] == 0 and repair["step"] >= 5, repair
    failure = assert_restored_from_memory(tmp_path)
    assert failure["replaced"] == "actor ranks 1" and failure["step"] >= 7, failure

    Supervisor(run_config(tmp_path, *run, "runner.resume_dir=auto")).run()
    assert_matches_reference(tmp_path, references["fsdp_lag1"])


def test_a_stop_during_the_repair_of_a_generation_ahead_ends_after_its_step(references, cluster, tmp_path):
    """A stop request that comes while the rollout group is repaired for a generation ahead (the step's update is done)
    does not abandon the repair: the step completes, its emergency checkpoint holds the repaired generation's batch,
    and the resumed run is the reference's. Abandoned, the step would be undone while the actor kept its update, and
    the emergency checkpoint of the step before would hold the weights after it."""
    run = SAVED_AT_THE_END
    runner = Supervisor(run_config(tmp_path, *run))
    repaired: list[int] = []

    def stop_in_repairs(trainer) -> None:
        repair = trainer.repair_rollout

        def stopping(exc, step, phase, **kwargs) -> None:
            runner.stop.request("SIGTERM received")
            repaired.append(step)
            repair(exc, step, phase, **kwargs)

        trainer.repair_rollout = stopping

    runner.callbacks.append(Inspect(on_start=stop_in_repairs))
    once(
        lambda: metrics_lines(tmp_path) >= 4,
        lambda: patch_worker_module(runner.trainer.rollout_group, 0, "rlrunner.rollout.worker", "derive_seed", dying),
    )
    with pytest.raises(StoppedEarly, match=r"SIGTERM received at step (\d+); saved global_step_\1"):
        runner.run()
    [generated_for] = repaired  # the step whose batch it was, generated during the step before (lag 1)
    assert metrics_lines(tmp_path) == generated_for - 1  # that step completed, and the run ended after it
    in_flight = tmp_path / "test" / "checkpoints" / f"global_step_{generated_for - 1}" / "data" / "in_flight.pt"
    assert in_flight.is_file()
    [repair] = recovery_events(tmp_path, "rollout_repaired")
    assert repair["phase"] == "generation ahead" and repair["lost_steps"] == 0, repair

    Supervisor(run_config(tmp_path, *run, "runner.resume_dir=auto")).run()
    assert_matches_reference(tmp_path, references["fsdp_lag1"])


def test_a_lag_0_checkpoint_resumes_with_lag_1_and_back(references, cluster, tmp_path):
    """Resumed with another lag, a run first trains on what its checkpoint has: the lag-0 checkpoint of step 6 has no
    batch in flight, so with lag 1 step 7 is generated at its start (lag 0, the lag-0 run's step 7 exactly) and step 8
    during step 7 (lag 1). The lag-1 checkpoint of step 6 holds step 7's batch, so with lag 0 step 7 trains on it (the
    lag-1 run's step 7 exactly) and step 8 is generated at its start."""
    lag0, lag1 = references["fsdp"], references["fsdp_lag1"]
    to_lag1, to_lag0 = tmp_path / "to_lag1", tmp_path / "to_lag0"
    # back to lag 0 with the lag-1 run's correction, so that its step 7 is the lag-1 run's exactly
    back = ["algorithm.rollout_correction.tis_cap=2.0"]
    for output_dir, reference, lag in ((to_lag1, lag0, BACKEND_OVERRIDES["fsdp_lag1"]), (to_lag0, lag1, back)):
        resume = f"runner.resume_dir={reference.checkpoint(6)}"
        Supervisor(run_config(output_dir, *RUN, *lag, "runner.max_steps=8", resume)).run()

    switched_up = read_metrics(to_lag1 / "test" / "metrics.jsonl")
    assert [m["step"] for m in switched_up] == [7, 8]
    assert [m[LAG] for m in switched_up] == [0, 1]
    assert _rollout(switched_up[0]) == _rollout(lag0.metrics[6])  # the lag-0 run's samples of step 7
    assert _rollout(switched_up[1]) != _rollout(lag0.metrics[7])  # step 8's from the weights after step 6

    switched_down = read_metrics(to_lag0 / "test" / "metrics.jsonl")
    assert [m["step"] for m in switched_down] == [7, 8]
    assert without_time(switched_down[:1]) == without_time(lag1.metrics[6:7])  # its lag, 1, included
    assert LAG not in switched_down[1]
