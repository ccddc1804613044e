"""MLflow: one MLflow run per experiment, continued by run id after a resume, through an `MlflowClient` of its own.

Store: `runner.logger.mlflow.tracking_uri`, or (null) a sqlite file in the log folder. The newest step the run
holds is the largest step of its metric histories. Params (the run's config, flattened) are written once, when
the run is created: MLflow params cannot change.
"""

from __future__ import annotations

import logging
import posixpath
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

from rlrunner.trackers.base import Tracker, redact_uri

logger = logging.getLogger(__name__)

# MLflow's limits (mlflow.utils.validation) and its rule for metric and param names (not on Windows)
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_VAL_LENGTH = 6000
MAX_KEY_LENGTH = 250
_NAME = re.compile(r"[/\w.\- :]*")

STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


def valid_name(name: str) -> bool:
    """Whether MLflow takes `name` as a metric or param name (letters, digits, _ - . space : /, a normal path)."""
    norm = posixpath.normpath(name)
    return (
        0 < len(name) <= MAX_KEY_LENGTH
        and _NAME.fullmatch(name) is not None
        and norm == name
        and norm != "."
        and not norm.startswith(("..", "/"))
    )


def flatten(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, leaf value) pairs of a nested dict; lists are leaves."""
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from flatten(value, f"{name}.")
        else:
            yield name, value


def batches(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.client: Any = None
        self.run_id: str | None = None
        self._sent = -1
        self._skipped: set[str] = set()
        configured = self.cfg.get("tracking_uri")
        self.log_dir = self.log_dir.absolute()
        self.tracking_uri = configured or f"sqlite:///{self.log_dir / 'mlflow.db'}"
        self.shown_uri = redact_uri(configured) if configured else None  # None: the default store

    def open(self, continue_state: dict[str, Any] | None) -> dict[str, Any]:
        from mlflow.tracking import MlflowClient

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.run_id = self._continued(continue_state) if continue_state else None
        if self.run_id is None:
            self.run_id = self._create()
        return {"run_id": self.run_id, "tracking_uri": self.shown_uri}

    def _continued(self, state: dict[str, Any]) -> str | None:
        """The run of `state` set back to RUNNING, or None (with a warning) when it is not in the configured store."""
        from mlflow.exceptions import MlflowException

        run_id = state.get("run_id")
        where = redact_uri(self.tracking_uri)
        if not run_id:
            return None
        if state.get("tracking_uri") != self.shown_uri:
            logger.warning(
                "MLflow: run %s was in store %s, the tracking URI is now %s: starting a new run",
                run_id,
                state.get("tracking_uri") or "(the default sqlite store)",
                where,
            )
            return None
        try:
            run = self.client.get_run(run_id)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            logger.warning("MLflow: run %s is not in store %s: starting a new run", run_id, where)
            return None
        if run.info.lifecycle_stage == "deleted":
            logger.warning("MLflow: run %s was deleted from store %s: starting a new run", run_id, where)
            return None
        self.client.update_run(run_id, status="RUNNING")
        logger.info("MLflow run %s continued (store %s)", run_id, where)
        return run_id

    def _create(self) -> str:
        from mlflow.exceptions import MlflowException

        name = self.cfg.get("experiment") or "rlrunner"
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            # the default store keeps its (unused) artifact folder in the log folder too, not in the working dir
            location = None if self.shown_uri else (self.log_dir / "mlartifacts").as_uri()
            try:
                experiment_id = self.client.create_experiment(name, artifact_location=location)
            except MlflowException as exc:  # another process created it meanwhile
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                experiment_id = self.client.get_experiment_by_name(name).experiment_id
        run_id = self.client.create_run(experiment_id, start_time=_now_ms(), run_name=self.run_name).info.run_id
        self._log_params(run_id)
        logger.info("MLflow run %s created in experiment %r (store %s)", run_id, name, redact_uri(self.tracking_uri))
        return run_id

    def _log_params(self, run_id: str) -> None:
        from mlflow.entities import Param

        params = []
        for key, value in flatten(self.config):
            if not valid_name(key):
                logger.debug("MLflow: config key %r is not a valid param name; not recorded", key)
                continue
            params.append(Param(key, str(value)[:MAX_PARAM_VAL_LENGTH]))
        for batch in batches(params, MAX_PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=batch)

    def last_step(self) -> int:
        run = self.client.get_run(self.run_id)
        held = -1
        for key in run.data.metrics:
            held = max([held, *(metric.step for metric in self.client.get_metric_history(self.run_id, key))])
        return max(held, self._sent)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        timestamp = _now_ms()
        entries = []
        for key, value in metrics.items():
            if valid_name(key):
                entries.append(Metric(key, float(value), timestamp, step))
            elif key not in self._skipped:
                self._skipped.add(key)
                logger.warning(
                    "MLflow: %r is not a valid metric name (MLflow takes letters, digits, _ - . space : /); "
                    "not recorded",
                    key,
                )
        for batch in batches(entries, MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch)
        self._sent = max(self._sent, step)

    def close(self, status: str) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, STATUS[status], end_time=_now_ms())
            self.client = None


def _now_ms() -> int:
    return int(time.time() * 1000)
