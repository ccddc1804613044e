"""Trackers with the real wandb (offline) and MLflow (sqlite) libraries: a resumed run continues each tracker's run
and every step is in each store exactly once, whether the store already held redone steps or lost some."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from rlrunner.errors import ConfigError
from rlrunner.schema import LoggerConfig
from rlrunner.trackers.base import REDACTED, redact
from rlrunner.trackers.registry import check_backends, missing_package
from rlrunner.trackers.session import Trackers
from rlrunner.trackers.state import TRACKERS_FILE
from rlrunner.trackers.wandb_offline import (
    history_records,
    offline_config,
    offline_history,
    offline_last_step,
    run_folders,
    run_records,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def quiet_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # no usage reports from tests


def logger_cfg(**mlflow):
    return {
        "backends": ["wandb", "mlflow"],
        "wandb": {"project": "rlrunner-test", "entity": None, "mode": "offline", "name": None},
        "mlflow": {"tracking_uri": None, "experiment": "rlrunner", **mlflow},
    }


def trackers(log_dir, continue_runs, backends=("wandb", "mlflow"), config=None, **mlflow) -> Trackers:
    return Trackers(list(backends), logger_cfg(**mlflow), log_dir, "exp", config or {"seed": 1}, continue_runs)


def metrics(step: int, attempt: int) -> dict:
    """Deterministic values; time/* differs between attempts (as a redone step's would)."""
    return {
        "actor/loss": 0.5 * step,
        "val/gsm8k/reward_mean": step / 8,
        "rollout/eos_frac": step % 2 == 0,
        "time/step_s": float(attempt),
        "note": "not a number: left out",
    }


def records(steps, attempt: int = 1) -> list[dict]:
    return [{"step": step, **metrics(step, attempt)} for step in steps]


def run_ids(log_dir: Path) -> dict:
    state = json.loads((log_dir / TRACKERS_FILE).read_text())
    return {name: entry["run_id"] for name, entry in state.items()}


def mlflow_history(log_dir: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    client = MlflowClient(f"sqlite:///{log_dir}/mlflow.db")
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def finished_history(wandb_dir: Path, run_id: str) -> list[tuple[str, list[tuple[int, dict]]]]:
    """`offline_history` of a run last finished in this process, read once its newest folder holds W&B's exit record
    (up to 30 s): `run.finish()` can return before W&B's service has written the file (seen once, on a loaded machine:
    no history in it yet)."""

    def exited() -> bool:
        folders = run_folders(wandb_dir, run_id)
        return bool(folders) and any(kind == "exit" for kind, _ in run_records(folders[-1] / f"run-{run_id}.wandb"))

    deadline = time.monotonic() + 30
    while not exited() and time.monotonic() < deadline:
        time.sleep(0.05)
    return offline_history(wandb_dir, run_id)


def wandb_history(log_dir: Path, run_id: str, finished: bool = True) -> list[tuple[int, dict]]:
    """The run's history over its offline folders (`finished`: its last launch was finished in this process)."""
    folders = finished_history(log_dir / "wandb", run_id) if finished else offline_history(log_dir / "wandb", run_id)
    return [record for _, history in folders for record in history]


def assert_each_step_once(log_dir: Path, steps: range, time_of_step) -> None:
    """Every store holds each of `steps` once, with its values (time/step_s: the attempt that first sent it)."""
    ids = run_ids(log_dir)
    loss = mlflow_history(log_dir, ids["mlflow"], "actor/loss")
    assert loss == [(step, 0.5 * step) for step in steps]
    assert mlflow_history(log_dir, ids["mlflow"], "val/gsm8k/reward_mean") == [(step, step / 8) for step in steps]
    assert mlflow_history(log_dir, ids["mlflow"], "time/step_s") == [(step, time_of_step(step)) for step in steps]
    history = wandb_history(log_dir, ids["wandb"])
    assert [step for step, _ in history] == list(steps)
    for step, logged in history:
        assert logged == {
            "actor/loss": 0.5 * step,
            "val/gsm8k/reward_mean": step / 8,
            "rollout/eos_frac": float(step % 2 == 0),
            "time/step_s": time_of_step(step),
        }


def test_a_resumed_run_continues_each_tracker_and_holds_every_step_once(tmp_path):
    first = trackers(tmp_path, continue_runs=False)
    first.begin(0, [])
    for step in range(6):
        first.log(step, metrics(step, attempt=1))
    first.end_attempt()
    first.close("stopped")
    ids = run_ids(tmp_path)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert client.get_run(ids["mlflow"]).info.status == "KILLED"

    # relaunched from the checkpoint of step 3: metrics.jsonl cut to steps 0..3, steps 4..8 (re)done
    second = trackers(tmp_path, continue_runs=True)
    second.begin(3, records(range(4)))
    assert client.get_run(ids["mlflow"]).info.status == "RUNNING"
    for step in range(4, 9):
        second.log(step, metrics(step, attempt=2))
    second.end_attempt()
    second.close("finished")

    assert run_ids(tmp_path) == ids
    assert client.get_run(ids["mlflow"]).info.status == "FINISHED"
    assert len(client.search_runs([client.get_experiment_by_name("rlrunner").experiment_id])) == 1
    # steps 4 and 5 were in the stores already: not sent again (their time/step_s is the first attempt's)
    assert_each_step_once(tmp_path, range(9), lambda step: 1.0 if step <= 5 else 2.0)
    assert len(finished_history(tmp_path / "wandb", ids["wandb"])) == 2  # one offline folder per launch


def test_steps_a_tracker_lost_are_sent_again_from_the_metrics_log(tmp_path):
    # the stores got steps 0..2 only, while metrics.jsonl has 0..5 (records lost with a killed process)
    first = trackers(tmp_path, continue_runs=False)
    first.begin(0, [])
    for step in range(3):
        first.log(step, metrics(step, attempt=1))
    first.close("failed")
    ids = run_ids(tmp_path)

    second = trackers(tmp_path, continue_runs=True)
    second.begin(5, records(range(6), attempt=1))
    for step in range(4, 8):  # a redone step at or before the resume point is not sent twice either
        second.log(step, metrics(step, attempt=2))
    second.close("finished")

    assert run_ids(tmp_path) == ids
    assert_each_step_once(tmp_path, range(8), lambda step: 1.0 if step <= 5 else 2.0)
    assert [[step for step, _ in history] for _, history in finished_history(tmp_path / "wandb", ids["wandb"])] == [
        [0, 1, 2],
        [3, 4, 5, 6, 7],
    ]


CHILD = """
import sys, time
from rlrunner.trackers.session import Trackers
cfg = {"wandb": {"project": "rlrunner-test", "mode": "offline"}, "mlflow": {"experiment": "rlrunner"}}
trackers = Trackers(["wandb", "mlflow"], cfg, sys.argv[1], "exp", {"seed": 1}, continue_runs=False)
trackers.begin(0, [])
for step in range(6):
    trackers.log(step, {"actor/loss": 0.5 * step, "val/gsm8k/reward_mean": step / 8,
                        "rollout/eos_frac": step % 2 == 0, "time/step_s": 1.0})
print("logged", flush=True)
time.sleep(60)
"""


def test_a_sigkilled_driver_is_continued_without_gaps_or_repeats(tmp_path):
    env = dict(os.environ, WANDB_SILENT="true", PYTHONPATH=str(ROOT))
    env.pop("WANDB_SERVICE", None)  # set by an earlier wandb.init in this process: the child would share its service
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout.readline().strip() == "logged"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    ids = run_ids(tmp_path)
    lost = 6 - len(wandb_history(tmp_path, ids["wandb"], finished=False))  # unflushed W&B records die with the process

    second = trackers(tmp_path, continue_runs=True)
    second.begin(5, records(range(6)))  # the child's metrics.jsonl (written and flushed line by line)
    for step in range(6, 8):
        second.log(step, metrics(step, attempt=2))
    second.close("finished")

    assert lost > 0  # what this test is about (wandb 0.31 flushes its transaction log every 15 s)
    assert_each_step_once(tmp_path, range(8), lambda step: 1.0 if step <= 5 else 2.0)


def test_new_runs_unless_continuing(tmp_path, caplog):
    # the driver passes the runner.logger node of its config
    node = OmegaConf.structured(LoggerConfig(backends=["wandb", "mlflow"]))
    node.wandb.mode = "offline"
    first = Trackers(list(node.backends), node, tmp_path, "exp", {"seed": 1}, continue_runs=False)
    first.begin(0, [])
    first.log(0, metrics(0, attempt=1))
    first.close("finished")
    old = run_ids(tmp_path)

    second = trackers(tmp_path, continue_runs=False)
    second.begin(0, [])
    second.log(0, metrics(0, attempt=2))
    second.close("finished")
    new = run_ids(tmp_path)
    assert set(new) == {"wandb", "mlflow"} and new["wandb"] != old["wandb"] and new["mlflow"] != old["mlflow"]
    assert mlflow_history(tmp_path, new["mlflow"], "time/step_s") == [(0, 2.0)]
    assert [step for step, _ in wandb_history(tmp_path, new["wandb"])] == [0]

    # an MLflow run is continued only in the store it is in: another tracking URI gives a new run, with a warning
    other = f"sqlite:///{tmp_path}/other.db"
    with caplog.at_level(logging.WARNING, logger="rlrunner.trackers"):
        third = trackers(tmp_path, continue_runs=True, backends=["mlflow"], tracking_uri=other)
        third.begin(0, records([0]))
        third.close("finished")
    moved = json.loads((tmp_path / TRACKERS_FILE).read_text())
    assert moved["mlflow"]["run_id"] != new["mlflow"] and moved["mlflow"]["tracking_uri"] == other
    assert moved["wandb"]["run_id"] == new["wandb"]  # a tracker not used this time keeps its entry
    assert f"the tracking URI is now {other}: starting a new run" in caplog.text
    moved_loss = MlflowClient(other).get_metric_history(moved["mlflow"]["run_id"], "actor/loss")
    assert [(m.step, m.value) for m in moved_loss] == [(0, 0.0)]


SECRETS = ("AKIAEXAMPLE", "s3cr3t-value", "sk-live-123", "hf_tokenvalue", "hunter2", "pw-in-uri")


def test_secrets_are_redacted_from_the_recorded_config(tmp_path):
    config = {
        "runner": {
            "experiment_name": "exp",
            "storage_options": {"key": SECRETS[0], "client_kwargs": {"region_name": "eu-west-1"}},
            "logger": {"mlflow": {"tracking_uri": f"http://alice:{SECRETS[5]}@mlflow.example:5000"}},
        },
        "reward": {"aws_secret_access_key": SECRETS[1], "api_key": SECRETS[2], "hfToken": SECRETS[3]},
        "db": {"password": SECRETS[4], "host": "db.example"},
        "rollout": {"max_new_tokens": 16, "tokenizer": "same"},
    }
    session = trackers(tmp_path, continue_runs=False, config=config)
    session.begin(0, [])
    session.log(0, metrics(0, attempt=1))
    session.close("finished")
    ids = run_ids(tmp_path)

    params = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(ids["mlflow"]).data.params
    assert params["runner.storage_options"] == REDACTED
    assert params["reward.aws_secret_access_key"] == params["reward.api_key"] == params["reward.hfToken"] == REDACTED
    assert params["db.password"] == REDACTED and params["db.host"] == "db.example"
    assert params["runner.logger.mlflow.tracking_uri"] == f"http://{REDACTED}@mlflow.example:5000"
    assert params["rollout.max_new_tokens"] == "16" and params["rollout.tokenizer"] == "same"
    assert offline_config(tmp_path / "wandb", ids["wandb"]) == redact(config)
    assert offline_config(tmp_path / "wandb", ids["wandb"])["reward"]["api_key"] == REDACTED
    for path in tmp_path.rglob("*"):  # nowhere on disk: W&B files and logs, the MLflow store, trackers.json
        if path.is_file():
            data = path.read_bytes()
            assert not [secret for secret in SECRETS if secret.encode() in data], path


def test_redact_rules():
    assert redact({"a": {"storage_options": {}}, "prompt_key": "prompt", "max_new_tokens": 4, "keys": [1]}) == {
        "a": {"storage_options": REDACTED},
        "prompt_key": REDACTED,  # a word ending in "key" is taken as secret, harmless names too
        "max_new_tokens": 4,
        "keys": [1],
    }
    assert redact({"list": [{"secretKey": "x"}, "s3://u:p@host/b"]}) == {
        "list": [{"secretKey": REDACTED}, f"s3://{REDACTED}@host/b"]
    }


def test_check_backends():
    check_backends(["tensorboard", "wandb", "mlflow"])  # all installed here
    with pytest.raises(ConfigError) as error:
        check_backends(["tensorboard", "neptune"])
    assert str(error.value) == (
        "runner.logger.backends: unknown tracker 'neptune' (choose from tensorboard, wandb, mlflow)"
    )
    with pytest.raises(ConfigError, match="^runner.logger.backends: 'wandb' is listed twice$"):
        check_backends(["wandb", "wandb"])
    assert missing_package("wandb") is None
    absent = {"wandb": "rlrunner_test_no_such_package"}
    assert missing_package("wandb", absent) == "rlrunner_test_no_such_package"
    with pytest.raises(ConfigError) as error:
        check_backends(["tensorboard", "wandb"], packages=absent)
    assert str(error.value) == (
        "runner.logger.backends has wandb, which needs the rlrunner_test_no_such_package package: "
        "pip install 'rlrunner[wandb]'"
    )
    # the check imports none of the trackers' packages
    probe = (
        "import sys, rlrunner.trackers.registry as r, rlrunner.trackers.session; r.check_backends(['wandb', 'mlflow']);"
        "print(sorted(m for m in ('torch', 'wandb', 'mlflow', 'tensorboard') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"


def tensorboard_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))  # purge_orphaned_data: a writer's purge_step hides the older events
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def test_tensorboard_rewrites_the_steps_after_the_resume_point(tmp_path):
    session = trackers(tmp_path, continue_runs=False, backends=["tensorboard"])
    session.begin(0, [])
    for step in range(5):
        session.log(step, {"loss": float(step), "note": "text"})
    session.end_attempt()
    session.begin(2, records(range(3)))  # an in-job repair back to step 2: steps 3 and 4 are redone
    for step in (3, 4):
        session.log(step, {"loss": 10.0 + step})
    session.end_attempt()
    session.close("finished")
    assert tensorboard_scalars(tmp_path, "loss") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    assert not (tmp_path / TRACKERS_FILE).exists()  # nothing to continue


def test_in_job_repair_keeps_the_runs_open_and_sends_nothing_twice(tmp_path, caplog):
    session = trackers(tmp_path, continue_runs=False, backends=["tensorboard", "wandb", "mlflow"])
    session.begin(0, [])
    for step in range(6):
        session.log(step, metrics(step, attempt=1))
    session.end_attempt()
    with caplog.at_level(logging.INFO, logger="rlrunner.trackers"):
        session.begin(3, records(range(4)))  # same driver: W&B has not flushed steps 0..5 to disk yet
    assert "sent steps" not in caplog.text  # nothing re-sent (W&B would drop it, with a warning)
    for step in range(4, 8):
        session.log(step, metrics(step, attempt=2))
    session.end_attempt()
    session.close("finished")
    assert len(finished_history(tmp_path / "wandb", run_ids(tmp_path)["wandb"])) == 1  # one W&B run, one folder
    assert_each_step_once(tmp_path, range(8), lambda step: 1.0 if step <= 5 else 2.0)
    assert tensorboard_scalars(tmp_path, "time/step_s") == [(s, 1.0 if s <= 3 else 2.0) for s in range(8)]


def test_a_failing_tracker_does_not_stop_the_run(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="rlrunner.trackers"):
        broken = trackers(tmp_path, continue_runs=False, tracking_uri="nosuchscheme://alice:pw-in-uri@host/")
        broken.begin(0, [])  # MLflow cannot open its store: W&B goes on alone
        session_ids = run_ids(tmp_path)
        assert set(session_ids) == {"wandb"}
        broken.log(0, metrics(0, attempt=1))
        broken.close("finished")
        assert "tracker mlflow failed opening its run" in caplog.text
        assert "nosuchscheme://<redacted>@host/" in caplog.text and "pw-in-uri" not in caplog.text

        session = trackers(tmp_path, continue_runs=False)
        session.begin(0, [])
        session.log(0, metrics(0, attempt=1))
        ids = run_ids(tmp_path)
        MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").delete_run(ids["mlflow"])  # logging to it fails from now
        caplog.clear()
        for step in range(1, 4):
            session.log(step, metrics(step, attempt=1))
        session.close("finished")
    assert caplog.text.count("tracker mlflow failed logging step 1") == 1
    assert "failed logging step 2" not in caplog.text  # once per tracker, then counted
    assert "tracker mlflow: 4 failures in all" in caplog.text  # 3 steps and the close
    assert [step for step, _ in wandb_history(tmp_path, ids["wandb"])] == [0, 1, 2, 3]


def test_the_offline_reader_stops_at_a_cut_or_damaged_record(tmp_path, caplog):
    (tmp_path / TRACKERS_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="rlrunner.trackers"):
        session = trackers(tmp_path, continue_runs=True, backends=["wandb"])  # a corrupt file: a new run
        session.begin(0, [])
    assert "ignoring" in caplog.text and TRACKERS_FILE in caplog.text
    big = {f"k/{i}": float(i) for i in range(300)}  # records longer than a 32 KiB block's rest: split records
    for step in range(40):
        session.log(step, {"step_value": float(step), **big})
    session.close("finished")
    run_id = run_ids(tmp_path)["wandb"]
    ((folder, full),) = finished_history(tmp_path / "wandb", run_id)
    assert [step for step, _ in full] == list(range(40)) and full[7][1] == {"step_value": 7.0, **big}
    assert offline_last_step(tmp_path / "wandb", run_id) == 39
    data = (Path(folder) / f"run-{run_id}.wandb").read_bytes()
    assert len(data) > 3 * 32 * 1024
    cut = tmp_path / "cut.wandb"
    for size in [0, 5, 7, 100, 32 * 1024 - 3, 32 * 1024 + 11, 70_000, len(data) // 2, len(data) - 1]:
        cut.write_bytes(data[:size])
        records = history_records(cut)  # never raises on a file a killed writer left
        assert records == full[: len(records)], size
    cut.write_bytes(data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1 :])
    damaged = history_records(cut)
    assert damaged == full[: len(damaged)] and len(damaged) < len(full)  # reading stops at the damaged record


def test_disabled_wandb_logs_nothing_and_does_not_fail(tmp_path):
    cfg = logger_cfg()
    cfg["wandb"]["mode"] = "disabled"
    session = Trackers(["wandb"], cfg, tmp_path, "exp", {"seed": 1}, continue_runs=True)
    session.begin(2, records(range(3)))
    session.log(3, metrics(3, attempt=1))
    session.end_attempt()
    session.close("failed")
    assert offline_history(tmp_path / "wandb", run_ids(tmp_path)["wandb"]) == []
