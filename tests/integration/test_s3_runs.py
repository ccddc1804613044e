"""Whole runs with `runner.output_dir=s3://...` against a real S3 API (moto's server, the s3fs client).

Each ends bit-identical to the same run on a local disk (the session's reference run,
tests/reference_runs.py): saves every 2 steps straight to the store, a
resume with `auto` on a machine with no local state (a fresh log cache), retention across restarts,
a save killed halfway (no manifest: `auto` skips it), a worker SIGKILLed mid-run (in-job recovery
from the store), and a checkpoint written by 2 actor ranks resumed by 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from reference_runs import NUMERICS, Reference, reference_run

from rlrunner.checkpoint.status import COMPLETE, scan_checkpoints
from rlrunner.runner.supervisor import Supervisor
from rlrunner.storage import open_storage
from rlrunner.tools.convert import load_model_weights

from conftest import TEST_LAYOUT, TINY_MODEL, Inspect, assert_bit_equal, run_config, without_time

pytestmark = pytest.mark.slow

STEPS = 6
RUN = [*NUMERICS, f"runner.max_steps={STEPS}", "runner.save_interval=2"]


def s3_overrides(url: str, options: dict, cache: Path) -> list[str]:
    """The run's output on the store; credentials and endpoint as runner.storage_options (Ray workers get them too)."""
    endpoint = options["client_kwargs"]["endpoint_url"]
    return [
        f"runner.output_dir={url}",
        f"runner.local_cache_dir={cache}",
        f"+runner.storage_options.key={options['key']}",
        f"+runner.storage_options.secret={options['secret']}",
        f"+runner.storage_options.client_kwargs.endpoint_url='{endpoint}'",
        "+runner.storage_options.client_kwargs.region_name=us-east-1",
    ]


def remote_metrics(storage, url: str) -> list[dict]:
    return [json.loads(line) for line in storage.read_bytes(f"{url}/test/metrics.jsonl").decode().splitlines()]


def complete_steps(storage, url: str) -> list[int]:
    return [
        s.step for s in scan_checkpoints(storage, f"{url}/test/checkpoints", checksums=True) if s.status == COMPLETE
    ]


@pytest.fixture(scope="module")
def local_reference(ray_session, tmp_path_factory) -> Reference:
    """The session's FSDP reference run, on a local disk (trained in this module's Ray if no module before trained
    it)."""
    return reference_run("fsdp", tmp_path_factory)


def kill_an_actor_rank_after_step_3(runner: Supervisor) -> list[int]:
    """In a thread: SIGKILL actor rank 1 once step 3 is logged (global_step_2 is on the store); the pid killed."""
    killed: list[int] = []

    def kill() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            trainer = runner.trainer
            log = Path(runner.ctx.log_path) / "metrics.jsonl" if runner.ctx is not None else None
            if (
                log is not None
                and log.exists()
                and len(log.read_text().splitlines()) >= 3
                and trainer is not None
                and trainer.actor_group is not None
            ):
                killed.append(trainer.actor_group.hosts[1]["pid"])
                os.kill(killed[0], signal.SIGKILL)
                return
            time.sleep(0.005)

    threading.Thread(target=kill, daemon=True).start()
    return killed


def test_a_run_on_s3_recovers_saves_reshards_resumes_from_a_fresh_machine_and_keeps_retention(
    ray_session, local_reference, s3_store, tmp_path
):
    """One experiment on the store, in four runs' worth of checks (one test: fewer run start-ups for the suite):
    an actor rank killed mid-run and recovered; retention; the checkpoint of two ranks started with one; another
    machine resuming with `auto`."""
    url, options = s3_store
    storage = open_storage(url, options)
    runner = Supervisor(
        run_config(
            tmp_path,
            *RUN,
            *s3_overrides(url, options, tmp_path / "cache-a"),
            "runner.max_ckpt_to_keep=2",
            "runner.recovery.step_timeout_s=30",
            "runner.recovery.wait_timeout_s=60",
        )
    )
    killed = kill_an_actor_rank_after_step_3(runner)
    runner.run()
    assert killed, "no worker was killed"
    events = [json.loads(line) for line in storage.read_bytes(f"{url}/test/recovery.jsonl").decode().splitlines()]
    assert [e["event"] for e in events if e["event"] in ("failure", "resumed")] == ["failure", "resumed"]
    assert not (tmp_path / "test").exists()  # nothing of the experiment on the local disk but the log cache
    assert complete_steps(storage, url) == [6, 4]
    metrics = remote_metrics(storage, url)
    assert without_time(metrics) == without_time(local_reference.metrics[:STEPS])
    assert_bit_equal(
        load_model_weights(f"{url}/test/checkpoints/global_step_6", storage_options=options), local_reference.weights(6)
    )

    # The checkpoint of two actor ranks, started with one (runner.max_steps=6: nothing left to train, the run ends once
    # started, and saves nothing).
    seen = {}

    def start(trainer) -> None:
        seen["step"], seen["weights"] = trainer.global_step, trainer.policy_weights()

    Supervisor(
        run_config(
            tmp_path,
            *RUN,
            *s3_overrides(url, options, tmp_path / "cache-one"),
            "actor.num_workers=1",
            "runner.max_ckpt_to_keep=2",
            "runner.resume_dir=auto",
        ),
        callbacks=[Inspect(start)],
    ).run()
    assert seen["step"] == 6
    assert_bit_equal(seen["weights"], local_reference.weights(6))
    assert complete_steps(storage, url) == [6, 4]

    # Another machine (an empty log cache) resumes from the store with `auto` and runs on to step 8.
    Supervisor(
        run_config(
            tmp_path,
            *RUN,
            *s3_overrides(url, options, tmp_path / "cache-b"),
            "runner.max_ckpt_to_keep=2",
            "runner.max_steps=8",
            "runner.resume_dir=auto",
        )
    ).run()
    assert complete_steps(storage, url) == [8, 6]  # retention counted the first run's checkpoints too
    metrics = remote_metrics(storage, url)
    assert [m["step"] for m in metrics] == list(range(1, 9))  # the log came back from the store, then grew
    assert without_time(metrics) == without_time(local_reference.metrics[:8])
    assert_bit_equal(
        load_model_weights(f"{url}/test/checkpoints/global_step_8", storage_options=options), local_reference.weights(8)
    )


def test_a_save_killed_halfway_on_s3_is_skipped_by_auto(
    ray_session, local_reference, s3_store, tmp_path, subprocess_env
):
    """SIGKILL the driver while a checkpoint folder has objects but no manifest yet; `auto` resumes from the one
    before."""
    url, options = s3_store
    storage = open_storage(url, options)
    overrides = [
        *RUN,
        *s3_overrides(url, options, tmp_path / "cache"),
        "runner.save_interval=1",
        "runner.async_save=false",
        "runner.logger.progress_bar=false",
        "runner.experiment_name=test",
        "data.batch_size=4",
        "algorithm.group_size=4",
        "actor.micro_batch_size=4",
        f"cluster.ray_address={ray_session.get_runtime_context().gcs_address}",
        *TINY_MODEL,
        *TEST_LAYOUT,
        "data.synthetic.val_size=0",
    ]
    driver = subprocess.Popen(
        [sys.executable, "-m", "rlrunner.main_grpo", *overrides],
        env=subprocess_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    root = f"{url}/test/checkpoints"
    unfinished = None
    deadline = time.monotonic() + 180
    try:
        while unfinished is None and driver.poll() is None and time.monotonic() < deadline:
            for folder in storage.list(root, dirs_only=True):
                files = storage.list(f"{root}/{folder}")
                if (
                    files
                    and "manifest.json" not in files
                    and folder.startswith("global_step_")
                    and folder != "global_step_1"
                ):
                    unfinished = folder
                    break
            else:  # a listing is two requests to moto in this process: not more often than a save's objects go up
                time.sleep(0.02)
        assert unfinished is not None, "never saw a save in progress"
        os.killpg(driver.pid, signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait()
    killed_step = int(unfinished.rsplit("_", 1)[1])
    assert "manifest.json" not in storage.list(f"{root}/{unfinished}")
    assert complete_steps(storage, url)[0] == killed_step - 1

    Supervisor(
        run_config(
            tmp_path,
            *RUN,
            *s3_overrides(url, options, tmp_path / "cache"),
            "runner.save_interval=1",
            "runner.resume_dir=auto",
        )
    ).run()
    assert complete_steps(storage, url) == list(range(STEPS, 0, -1))
    assert without_time(remote_metrics(storage, url)) == without_time(local_reference.metrics[:STEPS])
    assert_bit_equal(load_model_weights(f"{root}/global_step_6", storage_options=options), local_reference.weights(6))
