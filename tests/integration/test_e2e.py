"""End to end on real Ray: a few GRPO steps with 2 actor (FSDP2, gloo) workers and 1-2 rollout workers."""

from __future__ import annotations

import pytest
import ray
import torch

from rlrunner.runner.supervisor import Supervisor
from rlrunner.runner.trainer import Trainer

from conftest import Inspect, assert_bit_equal, read_metrics, run_config, without_time, worker_pids

pytestmark = pytest.mark.slow

REQUIRED_METRICS = {
    "step",
    "rollout/reward_mean",
    "actor/loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/micro_batches",
    "time/step_s",
    "time/rollout_s",
    "time/update_s",
    "time/weight_sync_s",
}


def holder_pids(trainer: Trainer) -> list[int]:
    """The process ids of the run's snapshot holders (one per node)."""
    return ray.get([holder.ping.remote() for holder in trainer.ctx.snapshots.holders.values()])


def rollout_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    worker = trainer.rollout_group.workers[0]
    return ray.get(
        worker.__ray_call__.remote(lambda self: {k: v.clone() for k, v in self.engine.model.state_dict().items()})
    )


def test_training_changes_weights_syncs_rollout_and_logs_every_metric(ray_session, tmp_path):
    """A 4-step run changes every weight, syncs them to the rollout worker and logs every metric; the same run with two
    rollout workers logs the same metrics, bit for bit, and so does the first run again in the worker processes the
    runs before it left (one test: fewer start-ups for the suite)."""
    # Two new tokens: a random policy often emits a digit (a well-formed answer), so rewards vary from step 1.
    one_worker = ["actor.num_workers=2", "rollout.generation_batch_size=1", "rollout.max_new_tokens=2"]
    cfg = run_config(tmp_path, *one_worker, "rollout.num_workers=1")
    seen = {}

    def start(trainer: Trainer) -> None:
        seen["before"] = trainer.policy_weights()
        seen["rollout_names"] = set(rollout_weights(trainer))
        seen["pids"] = worker_pids(trainer)

    def end(trainer: Trainer) -> None:
        seen["after"], seen["synced"] = trainer.policy_weights(), rollout_weights(trainer)

    Supervisor(cfg, callbacks=[Inspect(start, end)]).run()
    before, after, synced = seen["before"], seen["after"], seen["synced"]
    assert set(before) == seen["rollout_names"]
    changed = [key for key in before if not torch.equal(before[key], after[key])]
    assert len(changed) == len(before), f"unchanged: {sorted(set(before) - set(changed))}"
    assert_bit_equal(synced, after)  # the rollout worker holds the actor's weights

    log_dir = tmp_path / "test"
    records = read_metrics(log_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert REQUIRED_METRICS <= set(record), REQUIRED_METRICS - set(record)
        assert record["actor/entropy"] > 0 and record["time/step_s"] > 0
        assert record["actor/micro_batches"] == 2  # a rank's 8 sequences in passes of actor.micro_batch_size 4
    assert any(r["rollout/reward_std"] > 0 and r["actor/grad_norm"] > 0 for r in records)
    assert list(log_dir.glob("events.out.tfevents.*")), "no TensorBoard event file"

    # Micro-batches by a token budget: a few rows each, as many on both ranks as the rank that needs the most (FSDP's
    # collectives run once per pass: a rank with fewer would hang), and rows never packed by prompt (the first run's
    # passes of 4 were: each is one group). The first step trains on the same samples from the same weights, so its
    # loss and gradient are the first run's, up to rounding.
    Supervisor(
        run_config(
            tmp_path / "tokens",
            *one_worker,
            "rollout.num_workers=1",
            "actor.micro_batch_size=null",
            "actor.micro_batch_tokens=15",
            "actor.pack_shared_prompts=false",
        )
    ).run()
    by_tokens = read_metrics(tmp_path / "tokens" / "test" / "metrics.jsonl")
    assert [r["step"] for r in by_tokens] == [1, 2, 3, 4]
    assert all(r["actor/micro_batches"] >= 4 for r in by_tokens), [r["actor/micro_batches"] for r in by_tokens]
    assert by_tokens[0]["rollout/reward_mean"] == records[0]["rollout/reward_mean"]
    # 16 rows of a 4-token prompt and 1-2 new tokens: at least 80 padded; packed, 4 prompts of 3 tokens, then each
    # row's copy of the last and its response
    assert records[0]["actor/pass_tokens"] <= 4 * 3 + 16 * 3 < by_tokens[0]["actor/pass_tokens"]
    for key in ("actor/loss", "actor/grad_norm", "actor/entropy"):
        assert by_tokens[0][key] == pytest.approx(records[0][key], rel=1e-5, abs=1e-7), key

    two = {}
    Supervisor(
        run_config(tmp_path / "two", *one_worker, "rollout.num_workers=2"),
        callbacks=[Inspect(lambda trainer: two.update(pids=worker_pids(trainer), holders=holder_pids(trainer)))],
    ).run()
    assert without_time(read_metrics(tmp_path / "two" / "test" / "metrics.jsonl")) == without_time(records)

    # The first run again, in the processes the last two runs left (cluster.reuse_workers): the same run, bit for bit.
    again = {}
    Supervisor(
        run_config(tmp_path / "again", *one_worker, "rollout.num_workers=1"),
        callbacks=[
            Inspect(
                lambda trainer: again.update(pids=worker_pids(trainer), holders=holder_pids(trainer)),
                lambda t: again.update(after=t.policy_weights()),
            )
        ],
    ).run()
    assert again["pids"] == {"actor": two["pids"]["actor"], "rollout": seen["pids"]["rollout"]}
    assert again["holders"] == two["holders"] and len(two["holders"]) == 1  # the snapshot holder was kept too
    assert without_time(read_metrics(tmp_path / "again" / "test" / "metrics.jsonl")) == without_time(records)
    assert_bit_equal(again["after"], after)
