"""Per-step metrics: `metrics.jsonl` (one JSON object per step), TensorBoard events, and a progress display."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from rlrunner.errors import ConfigError
from rlrunner.storage import is_url
from rlrunner.storage.local import local_path

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def require_tensorboard() -> None:
    """ConfigError when TensorBoard logging is asked for and the package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError(
            "runner.logger.tensorboard=true needs the tensorboard package: pip install tensorboard "
            "(or pip install 'rlrunner[tensorboard]'), or set runner.logger.tensorboard=false"
        ) from None


def local_folder(log_path: str | os.PathLike) -> Path:
    """`log_path` (a path or file:// URL) as an absolute local Path; ValueError for a store URL, whose logs are
    written in `ExperimentLogs.local_dir` and uploaded."""
    text = os.fspath(log_path)
    if is_url(text):
        raise ValueError(f"{text} is not a local folder: write the logs in ExperimentLogs(...).local_dir and upload them")
    return Path(local_path(text))


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep only the lines of steps <= `last_step` (a resumed run rewrites what came after); returns lines kept."""
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break  # a line cut short by a crash ends the usable log
        if record.get("step", 0) > last_step:
            break
        kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return len(kept)


class MetricsLogger:
    """Appends each step's metrics; on (re)start, drops whatever a previous run logged after `start_step`."""

    def __init__(self, log_path: str | os.PathLike, start_step: int, tensorboard: bool):
        log_path = local_folder(log_path)
        log_path.mkdir(parents=True, exist_ok=True)
        self.path = log_path / METRICS_FILE
        truncate_metrics(self.path, start_step)
        self._file = self.path.open("a")
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events of steps >= start_step + 1 left by an earlier run, so curves have no duplicates.
            self._writer = SummaryWriter(log_dir=str(log_path), purge_step=start_step + 1)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()

    def close(self) -> None:
        self._file.close()
        if self._writer is not None:
            self._writer.close()


class Progress:
    """A tqdm bar on a terminal; otherwise a log line every ~5% of the run."""

    _SHOWN = (("reward", "rollout/reward_mean"), ("acc", "rollout/accuracy"), ("loss", "actor/loss"), ("s/step", "time/step_s"))

    def __init__(self, total_steps: int, start_step: int, enabled: bool):
        self.total_steps = total_steps
        self.bar = None
        self.every = max(1, total_steps // 20)
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="global step", dynamic_ncols=True)

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        shown = {name: metrics[key] for name, key in self._SHOWN if key in metrics}
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.3f}" for k, v in shown.items()}, refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == self.total_steps:
            logger.info("step %d/%d %s", step, self.total_steps, " ".join(f"{k}={v:.3f}" for k, v in shown.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
