"""A Qwen2-architecture model of about a chosen size, and the run config of a benchmark's actor group."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int

    def overrides(self) -> list[str]:
        return [f"+model.override_config.{name}={value}" for name, value in vars(self).items()]


def shape_for_hidden(hidden: int, layers: int, tp: int = 1) -> ModelShape | None:
    """A Qwen2-like block: 64-wide heads, 4 query heads per KV head (at most), MLP 4x hidden; None when the
    heads cannot be split `tp` ways. With tp > 1 the KV heads are a multiple of tp (Megatron splits the query
    groups)."""
    heads = hidden // 64
    if heads % tp or (4 * hidden) % tp:
        return None
    limit = max(tp, heads // 4)
    kv_heads = max(d for d in range(tp, limit + 1, tp) if heads % d == 0)  # tp itself divides heads
    return ModelShape(hidden, 4 * hidden, layers, heads, kv_heads)


def approx_params(shape: ModelShape, vocab: int) -> float:
    hidden, layers = shape.hidden_size, shape.num_hidden_layers
    kv = shape.num_key_value_heads * 64
    attention = 2 * hidden * hidden + 2 * hidden * kv + hidden + 2 * kv  # q, o, k, v (+ qkv biases)
    mlp = 3 * hidden * shape.intermediate_size
    return layers * (attention + mlp + 2 * hidden) + 2 * vocab * hidden + hidden  # untied embeddings


def choose_shape(target_params: float, vocab: int, tp: int = 1) -> ModelShape:
    """Hidden size and depth landing near `target_params`, with depth close to hidden/64 (GPT-2-like aspect), and
    heads, KV heads and MLP width divisible by `tp`, so that the FSDP and the Megatron (tp) backends build one model."""
    best: tuple[float, ModelShape] | None = None
    for hidden in range(128, 8192 + 1, 64):
        base = shape_for_hidden(hidden, 0, tp)
        if base is None:
            continue
        per_layer = approx_params(shape_for_hidden(hidden, 1, tp), vocab) - approx_params(base, vocab)
        layers_exact = (target_params - approx_params(base, vocab)) / per_layer
        if layers_exact < 0.5:
            continue
        score = abs(math.log(layers_exact / (hidden / 64)))
        if best is None or score < best[0]:
            best = (score, shape_for_hidden(hidden, max(1, round(layers_exact)), tp))
    if best is None:  # a target below one layer of the smallest splittable width
        return next(shape for h in range(128, 8192 + 1, 64) if (shape := shape_for_hidden(h, 1, tp)) is not None)
    return best[1]


def exact_param_count(model_cfg: dict[str, Any]) -> int:
    """Parameters of the model the actors build, counted on the meta device (no memory, no init)."""
    from transformers import AutoModelForCausalLM

    from rlrunner.models.loading import build_hf_config, build_tokenizer

    config = build_hf_config(model_cfg, build_tokenizer(model_cfg))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def tokenizer_vocab_size() -> int:
    from rlrunner.models.tokenizer import build_char_tokenizer

    return len(build_char_tokenizer())


def build_config(
    shape: ModelShape,
    workers: int,
    cpus_per_worker: float,
    output_dir: Path,
    tp: int = 0,
    batch_size: int | None = None,
    extra: Sequence[str] = (),
):
    """A valid run config (tests/conftest.py style) whose model is `shape` and whose actor has `workers` ranks:
    FSDP ranks, or with `tp` > 0 the Megatron backend's (workers / tp data-parallel x tp tensor-parallel).
    One prompt per rank (two samples each), so that any number of ranks divides the batch."""
    from rlrunner.config import load_config

    backend = ["actor.training_backend=megatron", f"actor.tensor_model_parallel_size={tp}"] if tp else []
    return load_config(
        [
            f"runner.output_dir={output_dir}",
            "runner.experiment_name=bench",
            f"actor.num_workers={workers}",
            f"data.batch_size={batch_size or workers}",
            "algorithm.group_size=2",
            "actor.micro_batch_size=2",
            f"cluster.cpus_per_actor_worker={cpus_per_worker}",
            *backend,
            *shape.overrides(),
            *extra,
        ]
    )


def check_megatron_shape(cfg) -> None:
    """The one-line ConfigError a run raises (RunContext) when the Megatron backend cannot split this model."""
    from rlrunner.backends.registry import get_backend
    from rlrunner.models.loading import build_hf_config, build_tokenizer

    get_backend("megatron").check_model(build_hf_config(cfg.model, build_tokenizer(cfg.model)), cfg.actor)
