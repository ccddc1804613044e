"""A step's agent metrics, from its trajectories' summaries (`sample["agent"]`, `rlrunner.rollout.multi_turn`). Pure.

agent/turns_mean, agent/turns_max              assistant turns per trajectory
agent/tool_calls_mean                          tool calls made per trajectory
agent/tool_errors, agent/tool_timeouts         calls that failed (raised, malformed, unknown tool, timed out) and
                                               those that timed out, over the step
agent/ended_max_turns, agent/ended_max_response_tokens   the share of trajectories those bounds ended
agent/env_reward_mean                          the mean of an environment's own rewards, where it gave any
time/tools_s                                   the seconds the step's tool calls ran (a timing: not reproducible)
"""

from __future__ import annotations

import math
from typing import Any


def agent_metrics(samples: list[dict[str, Any]], prefix: str = "agent/") -> dict[str, float]:
    """The metrics of the samples that are trajectories ({} when none is)."""
    runs = [sample["agent"] for sample in samples if "agent" in sample]
    if not runs:
        return {}
    count = len(runs)
    metrics = {
        f"{prefix}turns_mean": sum(run["turns"] for run in runs) / count,
        f"{prefix}turns_max": float(max(run["turns"] for run in runs)),
        f"{prefix}model_tokens_mean": sum(run["model_tokens"] for run in runs) / count,
        f"{prefix}tool_calls_mean": sum(run["tool_calls"] for run in runs) / count,
        f"{prefix}tool_errors": float(sum(run["tool_errors"] for run in runs)),
        f"{prefix}tool_timeouts": float(sum(run["tool_timeouts"] for run in runs)),
        f"{prefix}ended_max_turns": sum(run["ended"] == "max_turns" for run in runs) / count,
        f"{prefix}ended_max_response_tokens": sum(run["ended"] == "max_response_tokens" for run in runs) / count,
    }
    rewards = [run["env_reward"] for run in runs if run.get("env_reward") is not None]
    if rewards:
        metrics[f"{prefix}env_reward_mean"] = math.fsum(rewards) / len(rewards)
    if prefix == "agent/":
        metrics["time/tools_s"] = math.fsum(run["tool_s"] for run in runs)
    return metrics


def model_tokens(sample: dict[str, Any]) -> int:
    """How many of a sample's response tokens the model sampled (all of them, for a single-turn sample)."""
    mask = sample.get("response_mask")
    return len(sample["response_ids"]) if mask is None else int(sum(mask))
