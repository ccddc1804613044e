"""The rollout-engine seam: what a rollout worker needs from the engine that generates for it.

An engine is built from the model config (its weights do not matter: the actor's are pushed before the first
generation), generates response token ids for fixed chunks of prompts with one seed per sample, takes new weights
through its weight sink, and is closed when a run ends as it should (after a failure its worker is killed
without asking: an engine that starts processes of its own must not leave them behind when its own process dies).
A new engine is one module (or package) under `rlrunner/rollout/` and one line in `rlrunner/rollout/registry.py`.
Rewards are not the engine's business: the rollout worker scores every response in one place
(`RolloutWorker._score`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

from rlrunner.models.loading import TokenIds
from rlrunner.weight_sync.endpoints import WeightSink


@dataclass(frozen=True)
class Completion:
    """One generated response: its token ids (ending with the eos id that stopped it, if one did) and the
    log-probability of each under the model's raw distribution (before temperature or top-p), as the actor
    computes it: the two differ only by the numerics of the two engines."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class SampleRequest:
    """One sample to generate: its prompt's token ids and the seed of its own random stream; `max_new_tokens`, when
    set, bounds it below the call's `Sampling.max_new_tokens` (a multi-turn trajectory's turn, what is left of its
    token budget)."""

    prompt_ids: Sequence[int]
    seed: int
    max_new_tokens: int | None = None

    def limit(self, sampling: "Sampling") -> int:
        """The most tokens this request may get under `sampling`."""
        return (
            sampling.max_new_tokens
            if self.max_new_tokens is None
            else min(self.max_new_tokens, sampling.max_new_tokens)
        )


@dataclass(frozen=True)
class Sampling:
    """How one generation call samples: the training settings (`rollout.*`) or the validation ones (`rollout.val.*`)."""

    temperature: float  # 0: greedy
    top_p: float
    max_new_tokens: int

    @classmethod
    def training(cls, rollout_cfg: Mapping[str, Any]) -> "Sampling":
        return cls(rollout_cfg["temperature"], rollout_cfg["top_p"], rollout_cfg["max_new_tokens"])

    @classmethod
    def validation(cls, rollout_cfg: Mapping[str, Any]) -> "Sampling":
        val = rollout_cfg["val"]
        return cls(val["temperature"], val["top_p"], val["max_new_tokens"] or rollout_cfg["max_new_tokens"])


def longest_response(rollout_cfg: Mapping[str, Any]) -> int:
    """The most tokens a sequence may have after its prompt (training or validation): what an engine sizes its
    sequences by. A multi-turn trajectory's whole response (`rollout.multi_turn.max_response_tokens`) is the context
    its later turns are generated after."""
    from rlrunner.agents.settings import is_multi_turn, max_response_tokens

    longest = max(Sampling.training(rollout_cfg).max_new_tokens, Sampling.validation(rollout_cfg).max_new_tokens)
    if "multi_turn" in rollout_cfg and is_multi_turn(rollout_cfg):
        longest = max(longest, max_response_tokens(rollout_cfg))
    return longest


class RolloutEngine(ABC):
    def __init__(
        self,
        model_cfg: Mapping[str, Any],
        rollout_cfg: Mapping[str, Any],
        tokenizer: Any,
        token_ids: TokenIds,
        seed: int,
        device: torch.device,
        max_prompt_length: int,
    ):
        """Build the engine for `model.*` (its dtype is the rollout's) and `rollout.*`; `seed` seeds anything random
        at build time. A response ends with its first id in `token_ids.eos` (kept) or after the call's
        `Sampling.max_new_tokens` (at most `longest_response(rollout_cfg)`); no prompt is longer than
        `max_prompt_length` tokens (`data.max_prompt_length`)."""
        self.max_prompt_length = max_prompt_length
        self.model_cfg = model_cfg
        self.rollout_cfg = rollout_cfg
        self.tokenizer = tokenizer
        self.token_ids = token_ids
        self.device = device

    @classmethod
    def check(cls, cfg: Any, hf_config: Any) -> None:
        """Raise ConfigError (one line) for settings or a model this engine cannot run; called by the driver before
        any worker starts."""

    @abstractmethod
    def generate(self, chunks: Sequence[Sequence[SampleRequest]], sampling: Sampling) -> list[list[Completion]]:
        """The completion of every request, chunk by chunk, in order, sampled as `sampling` says. The chunks are fixed
        by the driver; what a request gets may depend on its chunk (its batch) but never on how chunks are shared
        between workers."""

    def iter_generate(
        self, chunks: Sequence[Sequence[SampleRequest]], sampling: Sampling
    ) -> Iterator[list[Completion]]:
        """`generate`'s chunks one by one, as each is done (so the worker scores a chunk while the next generates). By
        default all at once; an engine that generates chunk by chunk yields each as it finishes."""
        yield from self.generate(chunks, sampling)

    def reset_cache(self) -> None:
        """Drop whatever a generation left behind that could change a later one (a prefix cache): called after each
        validation, so that validating never changes training. Nothing by default."""

    @abstractmethod
    def weight_sink(self) -> WeightSink:
        """Where a weight sync delivers the policy's tensors (HF names), to be loaded the engine's way."""

    def close(self) -> None:
        """Free what the engine holds (processes, device memory): the run is over. Nothing by default."""
