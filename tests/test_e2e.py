"""End to end on real Ray: a few GRPO steps with 2 actor (FSDP2, gloo) workers and 1-2 rollout workers."""

from __future__ import annotations

import ray
import torch

from conftest import read_metrics, run_config, without_time
from rlrunner.runner.grpo_runner import GRPORunner

REQUIRED_METRICS = {
    "step",
    "rollout/reward_mean",
    "actor/loss",
    "actor/entropy",
    "actor/grad_norm",
    "time/step_s",
    "time/rollout_s",
    "time/update_s",
    "time/weight_sync_s",
}


def rollout_weights(runner: GRPORunner) -> dict[str, torch.Tensor]:
    worker = runner.rollout_group.workers[0]
    return ray.get(worker.__ray_call__.remote(lambda self: {k: v.clone() for k, v in self.model.state_dict().items()}))


def test_training_changes_weights_syncs_rollout_and_logs_every_metric(ray_session, tmp_path):
    # Two new tokens: a random policy often emits a digit (a well-formed answer), so rewards vary from step 1.
    cfg = run_config(tmp_path, "actor.num_workers=2", "rollout.num_workers=1", "rollout.max_new_tokens=2")
    with GRPORunner(cfg) as runner:
        before = runner.policy_weights()
        assert set(before) == set(rollout_weights(runner))
        runner.train()
        after = runner.policy_weights()
        synced = rollout_weights(runner)
    changed = [key for key in before if not torch.equal(before[key], after[key])]
    assert len(changed) == len(before), f"unchanged: {sorted(set(before) - set(changed))}"
    assert all(torch.equal(after[key], synced[key]) for key in after), "rollout weights differ from the actor's"

    log_dir = tmp_path / "test"
    records = read_metrics(log_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert REQUIRED_METRICS <= set(record), REQUIRED_METRICS - set(record)
        assert record["actor/entropy"] > 0 and record["time/step_s"] > 0
    assert any(r["rollout/reward_std"] > 0 and r["actor/grad_norm"] > 0 for r in records)
    assert list(log_dir.glob("events.out.tfevents.*")), "no TensorBoard event file"


def test_metrics_are_bitwise_identical_with_one_or_two_rollout_workers(ray_session, tmp_path):
    runs = []
    for workers in (1, 2):
        cfg = run_config(
            tmp_path / f"r{workers}", f"rollout.num_workers={workers}", "rollout.generation_batch_size=1", "rollout.max_new_tokens=2"
        )
        GRPORunner(cfg).run()
        runs.append(without_time(read_metrics(tmp_path / f"r{workers}" / "test" / "metrics.jsonl")))
    assert len(runs[0]) == 4
    assert runs[0] == runs[1]
