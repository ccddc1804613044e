"""Logs of an experiment on a store: written in a local cache, uploaded, restored on another machine (real S3 API)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid

import boto3
import pytest

from rlrunner.runner.experiment_logs import ExperimentLogs
from rlrunner.runner.metrics import MetricsLogger
from rlrunner.runner.recovery import RecoveryLog
from rlrunner.storage import join, open_storage
from rlrunner.trackers.session import Trackers


def log_steps(folder: str, start_step: int, steps: range, scale: float) -> None:
    metrics = MetricsLogger(folder, Trackers(["tensorboard"], {}, folder, "exp", {}, continue_runs=True))
    metrics.begin(start_step)
    for step in steps:
        metrics.log(step, {"loss": step * scale, "note": "text is not a scalar"})
    metrics.close("finished")


def tensorboard_scalars(folder: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder)  # purge_orphaned_data: a writer's purge_step hides the older events
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def steps_and_losses(folder: str) -> list[tuple[int, float]]:
    with open(os.path.join(folder, "metrics.jsonl")) as handle:
        return [(record["step"], record["loss"]) for record in map(json.loads, handle)]


def test_logs_survive_a_move_to_another_machine(s3_store, tmp_path):
    url, options = s3_store
    cache = tmp_path / "cache"
    logs = ExperimentLogs(url, options, str(cache), "exp/1")
    assert os.path.dirname(logs.local_dir) == str(cache) and os.path.basename(logs.local_dir).startswith("exp_1-")
    assert logs.restore() == []  # a fresh experiment: nothing on the store yet
    log_steps(logs.local_dir, 0, range(1, 7), 1.0)
    RecoveryLog(logs.local_dir).write("failure", restart=1, step=3)
    uploaded = logs.upload()
    assert uploaded[-2:] == ["metrics.jsonl", "recovery.jsonl"] and uploaded[0].startswith("events.out.tfevents.")
    assert logs.upload() == []  # nothing changed since

    shutil.rmtree(cache)  # the driver comes back on another machine, with an empty cache
    moved = ExperimentLogs(url, options, str(cache), "exp/1")
    assert moved.local_dir == logs.local_dir
    assert sorted(moved.restore()) == sorted(uploaded)
    log_steps(moved.local_dir, 4, range(5, 7), 10.0)  # resumed at step 4: steps 5 and 6 are redone
    expected = [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0), (6, 60.0)]
    assert steps_and_losses(moved.local_dir) == expected
    assert tensorboard_scalars(moved.local_dir, "loss") == expected
    with open(os.path.join(moved.local_dir, "recovery.jsonl")) as handle:
        assert [json.loads(line)["event"] for line in handle] == ["failure"]

    # only what changed goes up again: the truncated metrics and the new writer's events
    again = moved.upload()
    assert "metrics.jsonl" in again and "recovery.jsonl" not in again and len(again) == 2
    store = open_storage(url, options)
    with open(os.path.join(moved.local_dir, "metrics.jsonl"), "rb") as handle:
        assert store.read_bytes(join(url, "metrics.jsonl")) == handle.read()
    assert sorted(store.list(url)) == sorted(os.listdir(moved.local_dir))


def test_restore_replaces_a_stale_cache(s3_store, tmp_path):
    url, options = s3_store
    logs = ExperimentLogs(url, options, str(tmp_path / "cache"), "exp")
    log_steps(logs.local_dir, 0, range(1, 4), 1.0)
    logs.upload()
    # what an earlier run on this machine left behind and never uploaded
    stale = os.path.join(logs.local_dir, "events.out.tfevents.1.stale.1.0")
    with open(stale, "wb") as handle:
        handle.write(b"junk")
    with open(os.path.join(logs.local_dir, "metrics.jsonl"), "a") as handle:
        handle.write(json.dumps({"step": 99, "loss": 0.0}) + "\n")
    with open(os.path.join(logs.local_dir, "notes.txt"), "w") as handle:
        handle.write("not a log: left alone")

    ExperimentLogs(url, options, str(tmp_path / "cache"), "exp").restore()
    assert not os.path.exists(stale)
    assert steps_and_losses(logs.local_dir) == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert os.path.exists(os.path.join(logs.local_dir, "notes.txt"))


def test_a_failed_upload_is_a_warning_and_is_retried(s3_store, moto_endpoint, tmp_path, caplog):
    _, options = s3_store
    bucket = f"rlrunner-missing-{uuid.uuid4().hex[:8]}"
    logs = ExperimentLogs(f"s3://{bucket}/runs/exp", options, str(tmp_path / "cache"), "exp")
    log_steps(logs.local_dir, 0, range(1, 3), 1.0)
    with caplog.at_level(logging.WARNING, logger="rlrunner.runner.experiment_logs"):
        assert logs.upload() == []
    warning = caplog.records[-1].getMessage()
    assert (
        f"to s3://{bucket}/runs/exp (The specified bucket does not exist), nor 1 more log files; will retry" in warning
    )

    boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=bucket)
    assert sorted(logs.upload())[-1] == "metrics.jsonl"  # the next call uploads what failed
    assert open_storage(logs.url, options).exists(join(logs.url, "metrics.jsonl"))


def test_a_local_log_folder_is_used_as_it_is(tmp_path):
    folder = tmp_path / "runs" / "exp"
    logs = ExperimentLogs(str(folder), {}, str(tmp_path / "cache"), "exp")
    assert logs.local_dir == str(folder)
    log_steps(logs.local_dir, 0, range(1, 3), 1.0)
    assert logs.restore() == [] and logs.upload() == []
    assert not (tmp_path / "cache").exists()
    assert steps_and_losses(str(folder)) == [(1, 1.0), (2, 2.0)]


def test_the_loggers_refuse_a_store_url(tmp_path):
    with pytest.raises(ValueError, match=r"^s3://bucket/run is not a local folder: write the logs in ExperimentLogs"):
        MetricsLogger("s3://bucket/run")
    with pytest.raises(ValueError, match=r"^s3://bucket/run is not a local folder"):
        RecoveryLog("s3://bucket/run")
