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


# -- one step's metrics from its samples and the actor ranks' sums (pure) -----------------------------


def rollout_metrics(samples: list[dict[str, Any]]) -> dict[str, float]:
    import torch

    rewards = torch.tensor([s["reward"] for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s["response_ids"]) for s in samples], dtype=torch.float64)
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item(),
        "rollout/reward_max": rewards.max().item(),
        "rollout/reward_min": rewards.min().item(),
        "rollout/accuracy": (rewards == 1.0).double().mean().item(),
        "rollout/response_length_mean": lengths.mean().item(),
        "rollout/eos_frac": sum(s["finished"] for s in samples) / len(samples),
    }


def actor_metrics(per_rank: list[dict[str, float]], use_kl_loss: bool, kl_coef: float, entropy_coef: float) -> dict[str, float]:
    """Token means over all data-parallel ranks (sums added in rank order, so the result is reproducible)."""
    total = {key: sum(stats[key] for stats in per_rank) for key in per_rank[0]}
    tokens = max(total["tokens"], 1.0)
    pg_loss = total["pg_loss"] / tokens
    metrics = {
        "actor/pg_loss": pg_loss,
        "actor/entropy": total["entropy"] / tokens,
        "actor/pg_clipfrac": total["clipped"] / tokens,
        "actor/ppo_kl": total["ppo_kl"] / tokens,
        "actor/grad_norm": per_rank[0]["grad_norm"],
        "actor/lr": per_rank[0]["lr"],
        "actor/skipped_steps": per_rank[0]["skipped_steps"],
        # mean |rollout engine's log-prob - actor's| over the response tokens, under the policy that generated them
        "rollout/logprob_abs_diff": total["logprob_diff"] / tokens,
    }
    loss = pg_loss
    if use_kl_loss:
        metrics["actor/kl"] = total["kl"] / tokens
        loss += kl_coef * metrics["actor/kl"]
    if entropy_coef:
        loss -= entropy_coef * metrics["actor/entropy"]
    return {"actor/loss": loss, **metrics}
