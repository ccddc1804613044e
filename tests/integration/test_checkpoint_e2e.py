"""Checkpoints end to end on real Ray with FSDP2 + DCP: layout, bitwise resume, RNG, resharding, continuity, converters.

The session's FSDP reference run (tests/reference_runs.py: 10 steps, saves at 3, 6, 9 and 10) is what
the runs here are compared with, and resumed from; they train 8 steps and save every 3 (RUN), with the
same data: 26 problems in batches of 4, 6 steps per epoch, so step 3 is mid-epoch and step 6 the end
of epoch 0 (its 2 leftover prompts are dropped).
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
from reference_runs import NUMERICS, REFERENCE_STEPS, Reference, actor_rng_states, assert_resumed_bitwise, reference_run

from rlrunner.backends.registry import check_model_path
from rlrunner.checkpoint import layout
from rlrunner.checkpoint.manifest import read_manifest
from rlrunner.checkpoint.status import COMPLETE, scan_checkpoints
from rlrunner.errors import CheckpointError, CheckpointSaveError
from rlrunner.main_grpo import main
from rlrunner.runner.supervisor import Supervisor
from rlrunner.storage import basename
from rlrunner.tools.convert import load_model_weights

from conftest import (
    LOCAL,
    TEST_LAYOUT,
    TINY_MODEL,
    Inspect,
    assert_bit_equal,
    read_metrics,
    run_config,
    run_toolkit,
    without_time,
)

pytestmark = pytest.mark.slow

RUN = [*NUMERICS, "runner.max_steps=8", "runner.save_interval=3"]


@pytest.fixture(scope="module")
def reference(ray_session, tmp_path_factory) -> Reference:
    """The session's FSDP reference run (trained in this module's Ray if no module before trained it)."""
    return reference_run("fsdp", tmp_path_factory)


def resume_run(tmp_path: Path, resume_dir: str | Path, *overrides: str, callbacks=()) -> tuple[Path, Supervisor]:
    runner = Supervisor(
        run_config(tmp_path, *RUN, f"runner.resume_dir={resume_dir}", *overrides), callbacks=list(callbacks)
    )
    runner.run()
    return tmp_path / "test", runner


def test_saves_at_the_interval_and_the_last_step_in_the_layout(reference):
    root = reference.experiment / "checkpoints"
    assert REFERENCE_STEPS == 10  # saves every 3 steps, and at the last
    assert sorted(p.name for p in root.iterdir()) == [
        "global_step_10",
        "global_step_3",
        "global_step_6",
        "global_step_9",
    ]
    for step, epoch in ((3, 0), (6, 0), (9, 1), (10, 1)):
        path = reference.checkpoint(step)
        actor = sorted(p.name for p in (path / "actor").iterdir())
        assert actor == [".metadata", "__0_0.distcp", "__1_0.distcp", "huggingface"]
        manifest = read_manifest(LOCAL, str(path))
        assert manifest["step"] == step and manifest["world_size"] == 2 and manifest["backend"] == "fsdp2-dcp"
        assert {"actor/.metadata", "actor/__0_0.distcp", "actor/__1_0.distcp", "data/data.pt"} <= set(manifest["files"])
        data = torch.load(path / "data" / "data.pt", weights_only=True)
        assert data["runner"]["global_step"] == step and data["runner"]["epoch"] == epoch
    assert [s.status for s in scan_checkpoints(LOCAL, str(root), checksums=True)] == [COMPLETE] * 4
    # the time saves block the loop is logged on the steps that save, and on the steps that commit a background save
    blocked = {r["step"]: r["time/save_s"] for r in reference.metrics if "time/save_s" in r}
    assert {3, 6, 9, 10} <= set(blocked) and all(step in (3, 6, 9, 10) or step > 3 for step in blocked)
    assert all(seconds > 0 for seconds in blocked.values())


@pytest.mark.parametrize("resume_step", [3, 6], ids=["mid_epoch", "epoch_boundary"])
def test_resume_is_bitwise_identical_to_the_uninterrupted_run(reference, tmp_path, resume_step):
    """Also every rank's own RNG state comes back: the reference seeded each rank differently, so a restore of "rank 0's
    copy everywhere" (or none) would end with other states than the reference's."""
    assert not torch.equal(reference.rng(8)[0], reference.rng(8)[1])
    seen = {}
    end = Inspect(on_end=lambda trainer: seen.update(rng=actor_rng_states(trainer)))
    experiment, _ = resume_run(tmp_path, reference.checkpoint(resume_step), callbacks=[end])
    assert_resumed_bitwise(experiment, reference, resume_step, 8)
    assert all(torch.equal(a, b) for a, b in zip(seen["rng"], reference.rng(8), strict=True))
    # counting continues: from step 3 with save_interval=3 the next saves are 6 and 8
    expected = ["global_step_6", "global_step_8"] if resume_step == 3 else ["global_step_8"]
    assert sorted(p.name for p in (experiment / "checkpoints").iterdir()) == expected


def test_a_resume_with_linear_units_and_recomputation_ends_bitwise_identical(reference, tmp_path):
    """actor.fsdp.unit=linear (each projection its own FSDP unit), with activation recomputation, loads the default
    run's checkpoint (the tiny model: one unit, no recomputation) and trains on exactly as it did."""
    experiment, _ = resume_run(
        tmp_path, reference.checkpoint(6), "actor.fsdp.unit=linear", "actor.gradient_checkpointing=true"
    )
    assert_resumed_bitwise(experiment, reference, 6, 8)


@pytest.mark.parametrize("workers", [1, 4])
def test_resharding_two_ranks_to_another_count(reference, tmp_path, caplog, workers):
    with caplog.at_level(logging.WARNING, logger="rlrunner.checkpoint"):
        experiment, _ = resume_run(tmp_path, reference.checkpoint(6), f"actor.num_workers={workers}")
    assert f"resharding global_step_6 from 2 to {workers} actor ranks" in caplog.text
    resumed = read_metrics(experiment / "metrics.jsonl")
    expected = reference.metrics[6:8]
    assert [r["step"] for r in resumed] == [7, 8]
    # step 7 generates with the restored weights: its rollout is exactly the reference's
    for key in ("rollout/reward_mean", "rollout/response_length_mean", "rollout/eos_frac"):
        assert resumed[0][key] == expected[0][key]
    for got, want in zip(resumed, expected):  # the update reduces in another order: close, not bitwise
        assert got["actor/entropy"] == pytest.approx(want["actor/entropy"], rel=1e-4)
        assert got["actor/loss"] == pytest.approx(want["actor/loss"], abs=1e-4)
    final, want = load_model_weights(experiment / "checkpoints" / "global_step_8"), reference.weights(8)
    assert final.keys() == want.keys() and all(torch.allclose(final[k], want[k], atol=1e-4) for k in final)


def test_auto_skips_a_corrupt_newest_checkpoint_and_rewrites_metrics_in_place(reference, tmp_path, caplog):
    """The run died in its last save: step 10 is logged but its checkpoint has half a shard. `auto` skips it, resumes in
    place from step 9, logs step 10 again without duplicates (metrics.jsonl and tensorboard), and ends with the
    reference's weights."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    copy = tmp_path / "test"
    shutil.copytree(reference.experiment, copy)
    shard = copy / "checkpoints" / "global_step_10" / "actor" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with caplog.at_level(logging.INFO, logger="rlrunner.checkpoint"):
        experiment, _ = resume_run(tmp_path, "auto", "runner.max_steps=10")
    assert "skipping global_step_10: corrupt (actor/__1_0.distcp:" in caplog.text
    assert "global_step_9 (step 9), the newest complete checkpoint" in caplog.text
    records = read_metrics(experiment / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 11))
    assert without_time(records) == without_time(reference.metrics)
    events = EventAccumulator(str(experiment))
    events.Reload()
    steps = [event.step for event in events.Scalars("rollout/reward_mean")]
    assert steps == list(range(1, 11))
    assert_bit_equal(
        load_model_weights(experiment / "checkpoints" / "global_step_10"), load_model_weights(reference.checkpoint(10))
    )


@pytest.mark.parametrize(
    "breakage, expected",
    [
        (lambda p: (p / "actor" / ".metadata").unlink(), "actor/.metadata: missing"),
        (lambda p: (p / "actor" / "__1_0.distcp").unlink(), "actor/__1_0.distcp: missing"),
        (lambda p: (p / "data" / "data.pt").unlink(), "data/data.pt: missing"),
        (lambda p: os.truncate(p / "actor" / "__0_0.distcp", 100), "actor/__0_0.distcp: 100 bytes, the manifest says"),
    ],
    ids=["missing_metadata", "missing_shard", "missing_data_pt", "truncated_shard"],
)
def test_a_broken_fsdp_checkpoint_is_refused_in_one_line(reference, tmp_path, capsys, breakage, expected):
    broken = tmp_path / "global_step_3"
    shutil.copytree(reference.checkpoint(3), broken)
    breakage(broken)
    code = main(
        [
            f"runner.output_dir={tmp_path / 'out'}",
            "runner.experiment_name=test",
            *RUN,
            f"runner.resume_dir={broken}",
            "data.batch_size=4",
            "algorithm.group_size=4",
            "actor.micro_batch_size=4",
            "runner.logger.progress_bar=false",
            *TINY_MODEL,
            *TEST_LAYOUT,
            "data.synthetic.val_size=0",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"rlrunner: error: runner.resume_dir {broken} fails verification: {expected}" in err


def test_a_checkpoint_of_another_model_is_refused_naming_the_keys(reference, tmp_path):
    with pytest.raises(CheckpointError) as error:
        resume_run(
            tmp_path, reference.checkpoint(6), "++model.override_config.intermediate_size=48", "actor.optim.lr=0.01"
        )
    assert "model.config.intermediate_size (checkpoint 64, run 48)" in str(error.value)
    assert "actor.optim.lr (checkpoint 0.0003, run 0.01)" in str(error.value)
    assert not (tmp_path / "test" / "checkpoints").exists()


def test_a_run_starts_from_a_checkpoint_given_as_model_path(reference, tmp_path):
    """model.path may be a global_step_N folder (of any backend): the backend that wrote it reads its weights, and the
    run starts from them exactly (its HF config and tokenizer come from the checkpoint's actor/huggingface)."""
    check_model_path(str(reference.checkpoint(10)))  # what the driver checks before Ray starts: accepted
    seen = {}
    cfg = run_config(tmp_path, *RUN, f"model.path={reference.checkpoint(10)}", "runner.max_steps=1")
    Supervisor(cfg, callbacks=[Inspect(lambda trainer: seen.update(weights=trainer.policy_weights()))]).run()
    assert_bit_equal(seen["weights"], reference.weights(10))


def test_converters_give_the_live_policy(reference, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "weights.pt"
    actor = reference.checkpoint(10) / "actor"
    run_toolkit("convert_dcp_to_state_dict", "--dcp_path", str(actor), "--output_path", str(out))
    assert_bit_equal(torch.load(out, weights_only=True), reference.weights(10))

    hf_dir = tmp_path / "hf"
    run_toolkit("convert_dcp_to_hf", "--ckpt_path", str(reference.checkpoint(10)), "--output_path", str(hf_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in hf_dir.iterdir()}
    exported = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    live = AutoModelForCausalLM.from_config(exported.config).eval()
    live.load_state_dict(reference.weights(10))
    tokens = torch.tensor([[5, 17, 22, 11, 30, 1, 40, 9]])
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, live(tokens).logits)


def test_inspector_lists_and_verifies(reference, tmp_path, repo_root, subprocess_env):
    copy = tmp_path / "test"
    shutil.copytree(reference.experiment, copy)
    (copy / "checkpoints" / "global_step_6" / "manifest.json").unlink()
    listing = subprocess.run(
        [sys.executable, "-m", "rlrunner.checkpoint", "list", str(copy)],
        env=subprocess_env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line.split() for line in listing.splitlines()[1:] if line.strip() and line.split()[0].isdigit()]
    assert [(r[0], r[2]) for r in rows] == [
        ("10", "complete"),
        ("9", "complete"),
        ("6", "incomplete"),
        ("3", "complete"),
    ]
    good = subprocess.run(
        [sys.executable, "-m", "rlrunner.checkpoint", "verify", str(copy / "checkpoints" / "global_step_10")],
        env=subprocess_env,
        capture_output=True,
        text=True,
    )
    assert good.returncode == 0 and "complete, step 10, world size 2" in good.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "rlrunner.checkpoint", "verify", str(copy / "checkpoints" / "global_step_6")],
        env=subprocess_env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and "incomplete: no manifest.json" in bad.stdout


@pytest.mark.parametrize("async_save", [True, False], ids=["background", "synchronous"])
def test_a_failing_shard_write_commits_nothing(ray_session, tmp_path, async_save):
    """A shard write that the OS refuses (a file-size limit in the actor processes: EFBIG, as a full disk gives
    ENOSPC)."""
    limit = lambda self: resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, resource.RLIM_INFINITY))  # noqa: E731
    runner = Supervisor(
        run_config(tmp_path, *RUN, "runner.save_interval=2", "runner.max_steps=4", f"runner.async_save={async_save}"),
        callbacks=[
            Inspect(lambda trainer: ray.get([w.__ray_call__.remote(limit) for w in trainer.actor_group.workers]))
        ],
    )
    with pytest.raises(CheckpointSaveError) as error:
        runner.run()
    assert runner.trainer.last_saved_step is None  # a save that never committed does not count
    message = str(error.value)
    assert message.startswith("saving global_step_2 failed: rank ") and "OSError: [Errno 27] File too large" in message
    assert message.endswith("there is no complete checkpoint yet") and "\n" not in message
    assert error.value.exit_code == 4  # a file too large for its disk: a relaunch would fail the same way
    root = tmp_path / "test" / "checkpoints"
    assert list(root.iterdir()) == []
    steps = [r["step"] for r in read_metrics(tmp_path / "test" / "metrics.jsonl")]
    # written in the background, the failure is found when the writes are polled after a later step
    assert steps == [1, 2] if not async_save else (steps[:2] == [1, 2] and len(steps) <= 4)


def test_a_save_killed_halfway_is_skipped_by_auto(ray_session, tmp_path, subprocess_env, caplog):
    """SIGKILL the driver while a save is staged; the next run removes the leftover and resumes from the newest
    complete."""
    overrides = [*RUN, "runner.save_interval=1", "runner.max_steps=8"]
    base = [
        f"runner.output_dir={tmp_path}",
        "runner.experiment_name=test",
        "runner.logger.progress_bar=false",
        "data.batch_size=4",
        "algorithm.group_size=4",
        "actor.micro_batch_size=4",
        f"cluster.ray_address={ray_session.get_runtime_context().gcs_address}",
        *TINY_MODEL,
        *TEST_LAYOUT,
        "data.synthetic.val_size=0",
    ]
    driver = subprocess.Popen(
        [sys.executable, "-m", "rlrunner.main_grpo", *base, *overrides],
        env=subprocess_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    root = tmp_path / "test" / "checkpoints"
    staged = None
    deadline = time.monotonic() + 120
    try:
        while staged is None and driver.poll() is None and time.monotonic() < deadline:
            if root.is_dir():
                staged = next((p for p in root.iterdir() if p.name.startswith(layout.STAGING_PREFIX)), None)
            if staged is None:
                time.sleep(0.005)
        assert staged is not None, "never saw a save in progress"
        os.killpg(driver.pid, signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait()
    killed_step = int(staged.name.split("global_step_")[1].split("-")[0])
    assert staged.exists() and not (staged / "manifest.json").exists()
    assert not (root / f"global_step_{killed_step}").exists()
    complete = [s.step for s in scan_checkpoints(LOCAL, str(root)) if s.status == COMPLETE]
    assert complete == list(range(killed_step - 1, 0, -1))

    with caplog.at_level(logging.INFO, logger="rlrunner.checkpoint"):
        cfg = run_config(tmp_path, *overrides, "runner.resume_dir=auto")
        Supervisor(cfg).run()
    assert f"removing {staged.name}, left by a save or deletion that did not finish" in caplog.text
    if killed_step > 1:
        assert f"global_step_{killed_step - 1} (step {killed_step - 1}), the newest complete checkpoint" in caplog.text
    records = read_metrics(tmp_path / "test" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [s.step for s in scan_checkpoints(LOCAL, str(root)) if s.status == COMPLETE] == list(range(8, 0, -1))
    assert not any(p.name.startswith(layout.STAGING_PREFIX) for p in root.iterdir())


def test_rolling_back_starts_a_branch_that_retention_and_auto_keep(reference, tmp_path):
    """Resume on purpose from global_step_6 while 9 and 10 exist, keeping 1: the new branch survives, the old is moved
    aside."""
    copy = tmp_path / "test"
    shutil.copytree(reference.experiment, copy)
    root = copy / "checkpoints"
    steps = f"runner.max_steps={REFERENCE_STEPS}"  # the reference's run
    experiment, _ = resume_run(tmp_path, root / "global_step_6", steps, "runner.max_ckpt_to_keep=1")
    [abandoned] = list((root / layout.ABANDONED_DIR).iterdir())
    assert sorted(p.name for p in abandoned.iterdir()) == ["global_step_10", "global_step_9"]
    assert sorted(basename(u) for u in layout.step_dirs(LOCAL, str(root))) == [
        "global_step_10"
    ]  # the new branch's, kept by retention
    new_created = read_manifest(LOCAL, str(root / "global_step_10"))["created_unix"]
    assert new_created > read_manifest(LOCAL, str(abandoned / "global_step_10"))["created_unix"]
    # the same config and seed: the new branch is the same run, bit for bit, and metrics have each step once
    assert_bit_equal(load_model_weights(root / "global_step_10"), load_model_weights(reference.checkpoint(10)))
    records = read_metrics(experiment / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 11))
    # a later `auto` (a relaunch) resumes from the live branch, not the abandoned one
    _, runner = resume_run(tmp_path, "auto", steps, "runner.max_ckpt_to_keep=1")
    assert (
        runner.trainer.global_step == 10
        and read_manifest(LOCAL, str(root / "global_step_10"))["created_unix"] == new_created
    )


def test_a_resumed_run_follows_its_own_lr_schedule(ray_session, tmp_path):
    """A cosine run of 4 steps, resumed at step 2 with runner.max_steps=8: the LR follows the 8-step schedule."""
    from rlrunner.backends.optim import LRSchedule

    cosine = [*RUN, "actor.optim.lr_schedule=cosine", "runner.save_interval=2"]
    Supervisor(run_config(tmp_path, *cosine, "runner.max_steps=4")).run()
    checkpoint = tmp_path / "test" / "checkpoints" / "global_step_2"
    Supervisor(run_config(tmp_path / "longer", *cosine, "runner.max_steps=8", f"runner.resume_dir={checkpoint}")).run()
    lrs = {r["step"]: r["actor/lr"] for r in read_metrics(tmp_path / "longer" / "test" / "metrics.jsonl")}
    schedule = LRSchedule(0, 8, "cosine")  # one optimizer step per GRPO step here; actor/lr is the LR after the step
    assert list(lrs) == [3, 4, 5, 6, 7, 8]
    for step, lr in lrs.items():
        assert lr == pytest.approx(3e-4 * schedule(step), rel=1e-12)


def test_synchronous_saves_give_the_same_run_and_checkpoints(reference, tmp_path):
    """runner.async_save=false (the loop waits for each save) and the background default are the same run, bit for
    bit."""
    Supervisor(run_config(tmp_path, *RUN, f"runner.max_steps={REFERENCE_STEPS}", "runner.async_save=false")).run()
    experiment = tmp_path / "test"
    assert without_time(read_metrics(experiment / "metrics.jsonl")) == without_time(reference.metrics)
    for step in (3, 6, 9, 10):
        saved = load_model_weights(experiment / "checkpoints" / f"global_step_{step}")
        assert_bit_equal(saved, load_model_weights(reference.checkpoint(step)))
        sync_files = read_manifest(LOCAL, str(experiment / "checkpoints" / f"global_step_{step}"))["files"]
        async_files = read_manifest(LOCAL, str(reference.checkpoint(step)))["files"]
        assert sync_files["data/data.pt"] == async_files["data/data.pt"]
        assert sync_files.keys() == async_files.keys()
