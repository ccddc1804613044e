"""A user's own job on real Ray: their reward function (verl's signature), a validation set, the algorithm variants.

One reference run with all of them on (a verl-style reward returning dicts and raising on some samples, scored as 0,
in two scoring processes; validation every 2 steps; RLOO advantages, the GSPO loss, Dr. GRPO's aggregation and
truncated importance sampling) is compared with the same job without validation in one scoring process (training is
bit for bit the same), and with the same job stopped after step 2 and resumed (every step, validation included, logged
the same). Then a reward function that raises, or hangs, ends the run with one line and its emergency checkpoint.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from rlrunner.errors import RewardFunctionError
from rlrunner.runner.supervisor import Supervisor

from conftest import metrics_lines, once, read_metrics, run_config, without_time

pytestmark = pytest.mark.slow

REWARD = '''
"""A verl-style reward file: one function, dispatching on the data source."""
import os
import time

TRIGGER = os.path.join(os.path.dirname(__file__), "{trigger}")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if os.path.exists(TRIGGER):
        {when_triggered}
    if {picky} and not any(c.isdigit() for c in solution_str):
        raise ValueError("no digit in the response")
    exact = solution_str.strip() == str(ground_truth)
    return {{"score": 1.0 if exact else 0.1 * solution_str.strip().isdigit(), "acc": exact,
            "digits": sum(c.isdigit() for c in solution_str)}}
'''

ALGORITHM = [
    "algorithm.adv_estimator=rloo",
    "algorithm.policy_loss=gspo",
    "algorithm.clip_ratio=0.0003",
    "algorithm.clip_ratio_high=0.0004",
    "algorithm.loss_agg_mode=seq-mean-token-sum-norm",
    "algorithm.rollout_correction.tis_cap=2.0",
]
JOB = [
    *ALGORITHM,
    "rollout.max_new_tokens=2",
    "rollout.generation_batch_size=2",
    "runner.save_interval=2",
    "actor.optim.lr=0.01",
]
SCORED_ZERO = ["reward.on_error=zero"]  # a response without a digit raises: scored 0 and counted
VALIDATION = ["data.synthetic.val_size=6", "runner.val_interval=2", "rollout.val.max_new_tokens=3"]


def reward_file(folder: Path, when_triggered: str = "pass", trigger: str = "never", picky: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "my_reward.py"
    path.write_text(textwrap.dedent(REWARD.format(trigger=trigger, when_triggered=when_triggered, picky=picky)))
    return path


def training(records: list[dict]) -> list[dict]:
    """The training metrics of each step (no validation, no timings)."""
    return [{k: v for k, v in r.items() if not k.startswith("val/")} for r in without_time(records) if r["step"] > 0]


@pytest.fixture(scope="module")
def reference(ray_session, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    reward = reward_file(out / "user")
    Supervisor(
        run_config(out, *JOB, *SCORED_ZERO, *VALIDATION, f"reward.function={reward}", "reward.num_workers=2")
    ).run()
    return out / "test"


def test_the_users_job_logs_its_reward_keys_errors_validation_and_variants(reference):
    records = read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    validated = [r for r in records if "val/reward_mean" in r]
    assert [r["step"] for r in validated] == [0, 2, 4]  # before training, every 2 steps and the last
    for record in validated:
        assert record["val/arithmetic/reward_mean"] == record["val/reward_mean"]  # one source: the same
        assert 0 <= record["val/accuracy"] <= 1 and record["val/reward/acc"] == record["val/accuracy"]
        assert record["val/response_length_mean"] <= 3  # rollout.val.max_new_tokens
    steps = records[1:]
    for record in steps:
        assert record["rollout/response_length_mean"] <= 2  # rollout.max_new_tokens
        assert {"reward/errors", "actor/tis_weight_mean", "actor/tis_capped_frac"} <= set(record)
    # the dict's other keys: means over the calls that returned (not over those that raised and were scored 0)
    scored = [r for r in steps if "reward/digits" in r]
    assert scored and all(r["reward/digits"] >= 1 and 0 <= r["reward/acc"] <= 1 for r in scored)
    assert sum(r["reward/errors"] for r in steps) > 0, "no call raised: on_error=zero went unchecked"
    assert any(r["rollout/reward_std"] > 0 and r["actor/grad_norm"] > 0 for r in steps)


def test_validation_and_the_number_of_scoring_processes_change_no_training_bit(reference, tmp_path):
    reward = reward_file(tmp_path / "user")
    Supervisor(run_config(tmp_path, *JOB, *SCORED_ZERO, f"reward.function={reward}", "reward.num_workers=1")).run()
    plain = read_metrics(tmp_path / "test" / "metrics.jsonl")
    assert not any("val/reward_mean" in r for r in plain)
    assert training(plain) == training(read_metrics(reference / "metrics.jsonl"))


def test_a_resumed_run_logs_the_same_steps_and_validations(reference, tmp_path):
    reward = reward_file(tmp_path / "user")
    job = [*JOB, *SCORED_ZERO, *VALIDATION, f"reward.function={reward}", "reward.num_workers=2"]
    Supervisor(run_config(tmp_path, *job, "runner.max_steps=2")).run()  # its last step, 2, is validated anyway
    Supervisor(run_config(tmp_path, *job, "runner.resume_dir=auto")).run()
    assert without_time(read_metrics(tmp_path / "test" / "metrics.jsonl")) == without_time(
        read_metrics(reference / "metrics.jsonl")
    )


@pytest.mark.parametrize(
    ("when_triggered", "options", "error"),
    [
        ("raise KeyError('ground_truth')", [], "KeyError: 'ground_truth'"),
        ("time.sleep(3600)", ["reward.timeout_s=1"], r"timed out after 1 s \(reward.timeout_s\)"),
    ],
    ids=["raises", "hangs"],
)
def test_a_reward_function_that_fails_ends_the_run_in_one_line_after_its_emergency_checkpoint(
    ray_session, tmp_path, when_triggered, options, error
):
    """Armed once step 2 is logged: a later step's scoring fails. The run ends with one line naming the function, the
    step, the sample and the error; the steps before it are kept, the last one saved (the emergency checkpoint)."""
    user = tmp_path / "user"
    reward = reward_file(user, when_triggered, trigger="armed", picky=False)
    cfg = run_config(tmp_path, *JOB, f"reward.function={reward}", "runner.max_steps=8", *options)
    once(lambda: metrics_lines(tmp_path) >= 2, lambda: (user / "armed").write_text(""))
    with pytest.raises(RewardFunctionError) as info:
        Supervisor(cfg).run()
    message = str(info.value)
    pattern = (
        rf"reward function {re.escape(str(reward))} failed at step (\d+), sample (\d+) \(prompt \d+, response "
        rf"\d+\): {error}; (saved global_step_(\d+)|global_step_(\d+) is already saved); fix the reward function"
    )
    match = re.match(pattern, message)
    assert match and "\n" not in message and info.value.exit_code == 4, message
    failed = int(match.group(1))
    assert failed >= 3 and int(match.group(4) or match.group(5)) == failed - 1, message
    assert [r["step"] for r in read_metrics(tmp_path / "test" / "metrics.jsonl")] == list(range(1, failed))
    manifest = json.loads(
        (tmp_path / "test" / "checkpoints" / f"global_step_{failed - 1}" / "manifest.json").read_text()
    )
    assert manifest["step"] == failed - 1
