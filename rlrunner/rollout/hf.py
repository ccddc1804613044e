"""The `hf` rollout engine: a Hugging Face model in the worker's own process, sampled with a KV cache.

Each chunk of prompts is one left-padded batch whose distinct prompts are read once (a group's samples share
the prompt's KV cache); every sample draws from its own seeded generator
(`rlrunner.rollout.sampling`), so what it gets depends on its seed, its chunk and the weights alone.
The weight sink writes the synced tensors straight into the model's own parameters and buffers.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import torch

from rlrunner.models.loading import TokenIds, build_hf_config, random_model, torch_dtype
from rlrunner.rollout.base import Completion, RolloutEngine, SampleRequest, Sampling
from rlrunner.rollout.sampling import generate
from rlrunner.weight_sync.endpoints import WeightSink, distinct_state_tensors, specs_of
from rlrunner.weight_sync.plan import TensorSpec


class ModuleSink(WeightSink):
    """Loads the synced tensors in place into a torch module's state-dict tensors (a tied weight once, under its first
    name): no copy beyond the one from the wire."""

    def __init__(self, module: torch.nn.Module):
        self.tensors = distinct_state_tensors(module)

    def layout(self) -> list[TensorSpec]:
        return specs_of(self.tensors)

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def target(self, spec: TensorSpec) -> torch.Tensor:
        return self.tensors[spec.name]

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Nothing left to do: the tensor was assembled in place."""


class HFEngine(RolloutEngine):
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
        super().__init__(model_cfg, rollout_cfg, tokenizer, token_ids, seed, device, max_prompt_length)
        config = build_hf_config(model_cfg, tokenizer)
        self.model = random_model(config, seed, model_cfg["attn_implementation"], torch_dtype(model_cfg["dtype"]))
        self.model = self.model.to(device).eval()
        self.sink = ModuleSink(self.model)

    def generate(self, chunks: Sequence[Sequence[SampleRequest]], sampling: Sampling) -> list[list[Completion]]:
        return list(self.iter_generate(chunks, sampling))

    def iter_generate(
        self, chunks: Sequence[Sequence[SampleRequest]], sampling: Sampling
    ) -> Iterator[list[Completion]]:
        for chunk in chunks:
            limited = any(request.max_new_tokens is not None for request in chunk)
            longest = max(request.limit(sampling) for request in chunk) if limited else sampling.max_new_tokens
            yield generate(
                self.model,
                prompts=[request.prompt_ids for request in chunk],
                seeds=[request.seed for request in chunk],
                max_new_tokens=longest,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                pad_id=self.token_ids.pad,
                eos_ids=self.token_ids.eos,
                row_limits=[request.limit(sampling) for request in chunk] if limited else None,
            )

    def weight_sink(self) -> WeightSink:
        return self.sink
