"""Scoring in processes of their own (`rlrunner.utils.process_pool`): a slow reward runs in parallel, a hung call is
stopped, a crash is contained.

    scorer = RewardScorer(spec, kwargs, num_workers=4, timeout_s=60)
    batch = scorer.submit(requests)   # returns at once: scoring goes on while the caller generates the next chunk
    scores = scorer.wait(batch)       # one Score per request, in order
    scorer.close()

A call that runs past `timeout_s` (counted from its process's previous answer) has its process killed and replaced and
is an error; a process that dies makes its current call an error the same way; the rest of its chunk is scored by the
others. Which process scores a request never changes its result: results are kept by position.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rlrunner.rewards import BUILTIN_VERIFIERS
from rlrunner.rewards.function import builtin_spec
from rlrunner.utils.process_pool import Batch, PoolLabels, ProcessPool, Result
from rlrunner.utils.user_code import CodeSpec


@dataclass(frozen=True)
class RewardSettings:
    """What scores a run's responses and how (`reward.*`, resolved by the driver): plain values, sent to the rollout
    workers, whose scoring processes import the function themselves."""

    spec: CodeSpec
    kwargs: dict = field(default_factory=dict)
    num_workers: int = 1
    timeout_s: float = 60.0
    on_error: str = "raise"  # raise | zero

    @classmethod
    def builtin(cls, verifier: str, **options: Any) -> "RewardSettings":
        return cls(builtin_spec(BUILTIN_VERIFIERS[verifier], f"the {verifier} verifier"), **options)

    def scorer(self) -> "RewardScorer":
        return RewardScorer(self.spec, self.kwargs, self.num_workers, self.timeout_s)


def check_reward_function(settings: RewardSettings) -> None:
    """Load the function once in a scoring process of its own: CodeLoadError (one line naming it) when its file is
    missing, does not import, or lacks the name. The driver calls it before any worker starts."""
    scorer = dataclasses.replace(settings, num_workers=1).scorer()
    try:
        scorer.ready()
    finally:
        scorer.close()


@dataclass(frozen=True)
class ScoreRequest:
    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict


@dataclass
class Score:
    value: float | None  # None when the call failed
    extras: dict[str, float] = field(default_factory=dict)  # the other numeric keys of a dict result
    error: str | None = None  # "Type: first line" of what the call raised, or why it has no result

    @classmethod
    def of(cls, result: Result) -> "Score":
        if result.error is not None:
            return cls(None, {}, result.error)
        value, extras = result.value
        return cls(value, extras or {}, None)


class RewardScorer(ProcessPool):
    def __init__(self, spec: CodeSpec, kwargs: dict | None, num_workers: int, timeout_s: float):
        labels = PoolLabels(spec.key, spec.text, "scoring process", "reward.timeout_s")
        super().__init__("rlrunner.rewards.scoring_process", (spec, dict(kwargs or {})), labels, num_workers, timeout_s)
        self.spec = spec

    def submit(self, requests: list[ScoreRequest]) -> Batch:
        return self.submit_items([(r.data_source, r.solution_str, r.ground_truth, r.extra_info) for r in requests])

    def wait(self, batch: Batch, until_error: bool = False) -> list[Score]:
        """The batch's scores, in order; CodeLoadError when the function could not be loaded. With `until_error`, only
        those up to its first error (included), as soon as every request before that one is scored: a caller that fails
        on an error does not wait for the rest (with a hung function, one timeout per request)."""
        return [Score.of(result) for result in self.wait_batch(batch, until_error)]

    def score(self, requests: list[ScoreRequest]) -> list[Score]:
        return self.wait(self.submit(requests))
