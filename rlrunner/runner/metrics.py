"""Per-step metrics: `metrics.jsonl` (one JSON object per step) and the trackers, a progress display, and the pure
functions that make a step's metrics from its samples and the actor ranks' sums."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlrunner.algorithms.objective import PolicyObjective
    from rlrunner.trackers.session import Trackers
from rlrunner.agents.metrics import agent_metrics
from rlrunner.storage import is_url
from rlrunner.storage.local import local_path

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def local_folder(log_path: str | os.PathLike) -> Path:
    """`log_path` (a path or file:// URL) as an absolute local Path; ValueError for a store URL, whose logs are
    written in `ExperimentLogs.local_dir` and uploaded."""
    text = os.fspath(log_path)
    if is_url(text):
        raise ValueError(
            f"{text} is not a local folder: write the logs in ExperimentLogs(...).local_dir and upload them"
        )
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
    """The run's metrics: `metrics.jsonl` (always; the truth) and the trackers (`runner.logger.backends`), for the whole
    driver. Every attempt `begin`s at the step it starts from: the lines of later steps a previous attempt or run logged
    are dropped (they are redone), and the trackers are told where the run stands (`rlrunner.trackers.session`)."""

    def __init__(self, log_path: str | os.PathLike, trackers: "Trackers | None" = None):
        log_path = local_folder(log_path)
        log_path.mkdir(parents=True, exist_ok=True)
        self.path = log_path / METRICS_FILE
        self.trackers = trackers
        self._file = None

    def begin(self, start_step: int) -> None:
        """An attempt starts after `start_step` (0: from the start, whose step-0 validation is logged again)."""
        truncate_metrics(self.path, start_step if start_step > 0 else -1)
        if self.trackers is not None:
            self.trackers.begin(start_step, read_records(self.path))
        self._file = self.path.open("a")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.trackers is not None:
            self.trackers.log(step, metrics)

    def end_attempt(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.trackers is not None:
            self.trackers.end_attempt()

    def close(self, status: str) -> None:
        """The run ends: "finished", "stopped" (on request, to be resumed) or "failed"."""
        self.end_attempt()
        if self.trackers is not None:
            self.trackers.close(status)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl ([] when there is none), up to a line cut short."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


class Progress:
    """A tqdm bar on a terminal; otherwise a log line every ~5% of the run."""

    _SHOWN = (
        ("reward", "rollout/reward_mean"),
        ("acc", "rollout/accuracy"),
        ("loss", "actor/loss"),
        ("val_acc", "val/accuracy"),
        ("s/step", "time/step_s"),
    )

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


def rollout_metrics(samples: list[dict[str, Any]], count_errors: bool = False) -> dict[str, float]:
    """The step's rollout: reward statistics, exact answers (reward 1.0), lengths; `reward/<key>`, the mean of each
    other numeric key a reward function returned in a dict; `reward/errors` (`count_errors`), the calls that failed
    and were scored 0."""
    import torch

    rewards = torch.tensor([s["reward"] for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s["response_ids"]) for s in samples], dtype=torch.float64)
    metrics = {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item(),
        "rollout/reward_max": rewards.max().item(),
        "rollout/reward_min": rewards.min().item(),
        "rollout/accuracy": (rewards == 1.0).double().mean().item(),
        "rollout/response_length_mean": lengths.mean().item(),
        "rollout/eos_frac": sum(s["finished"] for s in samples) / len(samples),
        **reward_extras(samples, "reward/"),
        **agent_metrics(samples),
    }
    if count_errors:
        metrics["reward/errors"] = float(sum(s["reward_error"] for s in samples))
    return metrics


def reward_extras(samples: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    """`<prefix><key>`: the mean of each extra key over the samples whose reward function returned it."""
    values: dict[str, list[float]] = {}
    for sample in samples:
        for key, value in sample.get("reward_extras", {}).items():
            values.setdefault(key, []).append(value)
    return {f"{prefix}{key}": math.fsum(vals) / len(vals) for key, vals in sorted(values.items())}


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def source_key(data_source: str) -> str:
    """A data source as a metric-name part: characters other than letters, digits, `_ . -` become `_`."""
    return _UNSAFE.sub("_", data_source) or "_"


def validation_metrics(samples: list[dict[str, Any]]) -> dict[str, float]:
    """`val/reward_mean`, `val/accuracy` (reward 1.0), the same per data source (`val/<source>/...`), and
    `val/reward/<key>` for a reward function's other numeric keys."""

    def summary(group: list[dict[str, Any]], prefix: str) -> dict[str, float]:
        rewards = [s["reward"] for s in group]
        return {
            f"{prefix}reward_mean": math.fsum(rewards) / len(rewards),
            f"{prefix}accuracy": sum(r == 1.0 for r in rewards) / len(rewards),
        }

    metrics = summary(samples, "val/")
    sources: dict[str, list[dict[str, Any]]] = {}
    for sample in samples:
        sources.setdefault(source_key(sample["data_source"]), []).append(sample)
    for name, group in sorted(sources.items()):
        metrics.update(summary(group, f"val/{name}/"))
    metrics.update(reward_extras(samples, "val/reward/"))
    metrics.update(agent_metrics(samples, prefix="val/agent/"))
    metrics["val/response_length_mean"] = sum(len(s["response_ids"]) for s in samples) / len(samples)
    return metrics


def actor_metrics(per_rank: list[dict[str, float]], objective: "PolicyObjective") -> dict[str, float]:
    """Token means over all data-parallel ranks (sums added in rank order, so the result is reproducible). A
    layout-invariant update's ranks send each pass's sums (`leaf_sums`, in the order of their passes): added in the
    order of the logical micro-batches, mini-batch after mini-batch, the same whatever the number of ranks."""
    if "leaf_sums" in per_rank[0]:
        total = dict.fromkeys(objective.new_sums(), 0.0)
        for step in range(len(per_rank[0]["leaf_sums"])):  # optimizer steps; each rank's passes are its block
            for stats in per_rank:
                for leaf in stats["leaf_sums"][step]:
                    for key in total:
                        total[key] += leaf[key]
        total["pass_tokens"] = sum(stats["pass_tokens"] for stats in per_rank)
    else:
        total = {key: sum(stats[key] for stats in per_rank) for key in per_rank[0]}
    return {
        **objective.metrics(total),
        "actor/grad_norm": per_rank[0]["grad_norm"],
        "actor/lr": per_rank[0]["lr"],
        "actor/skipped_steps": per_rank[0]["skipped_steps"],
        "actor/pass_tokens": total["pass_tokens"],
    }
