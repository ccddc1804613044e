"""Qwen2 and Llama weights in Hugging Face layout <-> megatron-core's tensor-parallel layout (one state dict per TP
rank). The two families share their HF key names and layer structure; Llama has no QKV bias (Llama 3.x; a Llama with
`attention_bias` or `mlp_bias` is refused), so its rank dicts have no `linear_qkv.bias`.

Pure tensor functions: no files, no process groups. The names and the splits are megatron-core's
`GPTModel` with the *local* layer spec (`get_gpt_layer_local_spec`), so each rank's dict loads into
that model with `load_state_dict(strict=True)`:

    embedding.word_embeddings.weight                      vocab-parallel rows (padded vocabulary, pad rows zero)
    decoder.layers.N.input_layernorm.weight               replicated
    decoder.layers.N.self_attention.linear_qkv.weight|bias  column-parallel, fused QKV by query group
    decoder.layers.N.self_attention.linear_proj.weight    row-parallel (input columns split)
    decoder.layers.N.pre_mlp_layernorm.weight             replicated
    decoder.layers.N.mlp.linear_fc1.weight                column-parallel, [gate_r; up_r] on rank r
    decoder.layers.N.mlp.linear_fc2.weight                row-parallel
    decoder.final_layernorm.weight                        replicated
    output_layer.weight                                   vocab-parallel rows, absent when embeddings are tied
    <every linear>._extra_state                           None, as in megatron-core's own state dicts (the
                                                          output layer's too when tied): its linears declare
                                                          extra state; this reader accepts them missing

Fused QKV: the KV heads are megatron's query groups. The rows of `linear_qkv` are, group after group,
the group's query heads, then its key head, then its value head (megatron-core's
`SelfAttention.get_query_key_value_tensors` views them as [groups, (heads/groups + 2) * head_dim]).
Tensor parallelism gives each rank a contiguous run of whole groups, so rank r's QKV rows are the
fused layout of its own groups. Rotary embeddings need no permutation: both sides rotate halves.
(The Transformer Engine spec would instead fold the norms into `linear_qkv.layer_norm_weight` and
`linear_fc1.layer_norm_weight`; this module does not write that spec.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from rlrunner.models.hf_tensors import HFTensors, StateDict

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")  # the same keys and layers; Llama has no QKV bias
DEFAULT_VOCAB_DIVISIBLE_BY = 128  # megatron's --make-vocab-size-divisible-by default
EXTRA_STATE = "_extra_state"

# HF keys that carry no weights of their own (buffers some older checkpoints saved).
_IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class DecoderDims:
    """The dimensions the split depends on, read from an HF Qwen2 or Llama config."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = True  # Qwen2 always has biases on q, k and v (and none elsewhere); Llama none at all

    @classmethod
    def from_config(cls, config: Any) -> "DecoderDims":
        """From a transformers config object or its dict; ValueError for a model family this layout does not cover."""
        get = (
            (lambda key, default=None: config.get(key, default))
            if isinstance(config, Mapping)
            else (lambda key, default=None: getattr(config, key, default))
        )
        model_type = get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"the Megatron layout covers model types {SUPPORTED_MODEL_TYPES}, not {model_type!r}")
        if model_type == "llama" and (get("attention_bias") or get("mlp_bias")):
            which = "attention_bias" if get("attention_bias") else "mlp_bias"
            raise ValueError(f"a Llama model with {which}=true has biases the Megatron layout does not map")
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        head_dim = get("head_dim") or hidden // heads
        return cls(
            num_layers=int(get("num_hidden_layers")),
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size")),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            vocab_size=int(get("vocab_size")),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
        )

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY) -> int:
    """Megatron's padded vocabulary: the smallest multiple of `divisible_by * tp` that holds `vocab_size`."""
    if vocab_size < 1 or tp < 1 or divisible_by < 1:
        raise ValueError(f"vocab_size, tp and divisible_by must be positive, got {vocab_size}, {tp}, {divisible_by}")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def check_splittable(dims: DecoderDims, tp: int) -> None:
    """ValueError (one line, with the numbers) unless every split of this model by `tp` is whole."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_model_parallel_size must be a positive integer, got {tp!r}")
    if dims.num_heads % dims.num_kv_heads:
        raise ValueError(
            f"num_attention_heads={dims.num_heads} is not a multiple of num_key_value_heads={dims.num_kv_heads}"
        )
    for name, value in (
        ("num_attention_heads", dims.num_heads),
        ("num_key_value_heads (query groups)", dims.num_kv_heads),
        ("intermediate_size", dims.intermediate_size),
    ):
        if value % tp:
            raise ValueError(f"cannot split {name}={value} over tensor_model_parallel_size={tp}: not divisible")


def layer_keys(layer: int) -> dict[str, str]:
    hf, mc = f"model.layers.{layer}.", f"decoder.layers.{layer}."
    return {
        "hf": hf,
        "mc": mc,
        "input_norm": mc + "input_layernorm.weight",
        "qkv": mc + "self_attention.linear_qkv.",
        "proj": mc + "self_attention.linear_proj.",
        "mlp_norm": mc + "pre_mlp_layernorm.weight",
        "fc1": mc + "mlp.linear_fc1.",
        "fc2": mc + "mlp.linear_fc2.",
    }


def expected_hf_keys(dims: DecoderDims) -> list[str]:
    """Every HF key the model has (lm_head.weight only when untied)."""
    keys = ["model.embed_tokens.weight"]
    for layer in range(dims.num_layers):
        p = f"model.layers.{layer}."
        keys += [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
        if dims.qkv_bias:
            keys += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
        keys += [p + "self_attn.o_proj.weight"]
        keys += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    keys.append("model.norm.weight")
    if not dims.tie_word_embeddings:
        keys.append("lm_head.weight")
    return keys


def expected_megatron_keys(dims: DecoderDims) -> list[str]:
    """Every key of one rank's dict, `_extra_state` entries included, in megatron-core's state_dict order."""
    keys = ["embedding.word_embeddings.weight"]
    for layer in range(dims.num_layers):
        k = layer_keys(layer)
        keys += [k["input_norm"], k["proj"] + "weight", k["proj"] + EXTRA_STATE, k["qkv"] + "weight"]
        if dims.qkv_bias:
            keys.append(k["qkv"] + "bias")
        keys += [k["qkv"] + EXTRA_STATE, k["mlp_norm"], k["fc1"] + "weight", k["fc1"] + EXTRA_STATE]
        keys += [k["fc2"] + "weight", k["fc2"] + EXTRA_STATE]
    keys.append("decoder.final_layernorm.weight")
    if not dims.tie_word_embeddings:
        keys.append("output_layer.weight")
    keys.append("output_layer." + EXTRA_STATE)  # megatron-core keeps the (weightless) output layer when tied
    return keys


def _check_hf_state(state: Mapping[str, torch.Tensor], dims: DecoderDims) -> None:
    expected = set(expected_hf_keys(dims))
    present = {k for k in state if not k.endswith(_IGNORED_HF_SUFFIXES)}
    if dims.tie_word_embeddings:
        present.discard("lm_head.weight")  # a tied model's state dict lists the shared tensor twice
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing:
        family = "Qwen2" if dims.qkv_bias else "Llama"
        raise ValueError(f"the HF state dict lacks {len(missing)} key(s) of a {family} model, e.g. {missing[:3]}")
    if unexpected:
        raise ValueError(
            f"the HF state dict has {len(unexpected)} key(s) this layout does not map, e.g. {unexpected[:3]}"
        )
    vocab_rows = state["model.embed_tokens.weight"].shape[0]
    if vocab_rows != dims.vocab_size:
        raise ValueError(
            f"model.embed_tokens.weight has {vocab_rows} rows but the config's vocab_size is {dims.vocab_size}"
        )


def _vocab_piece(tensors: HFTensors, name: str, vocab_size: int, padded: int, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s run of padded vocabulary rows: the real rows it holds, zeros below them for the padding."""
    rows = padded // tp
    start = min(rank * rows, vocab_size)
    real = tensors.read(name, 0, start, min(rank * rows + rows, vocab_size))  # empty for a rank of padding only
    out = torch.zeros((rows, *real.shape[1:]), dtype=real.dtype)
    out[: real.shape[0]] = real
    return out


def _split(tensors: HFTensors, name: str, dim: int, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/tp of tensor `name` along `dim` (torch.chunk's split; the sizes divide here)."""
    size = tensors.shape(name)[dim] // tp
    return tensors.read(name, dim, rank * size, (rank + 1) * size)


def _fused_qkv(tensors: HFTensors, prefix: str, suffix: str, dims: DecoderDims, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s fused QKV rows (weight [out, in] or bias [out]): per group, its query heads, key head, value
    head."""
    groups = dims.num_kv_heads // tp
    first = rank * groups
    parts = []
    for n, rows in (("q", dims.heads_per_group * dims.head_dim), ("k", dims.head_dim), ("v", dims.head_dim)):
        part = tensors.read(f"{prefix}{n}_proj.{suffix}", 0, first * rows, (first + groups) * rows)
        parts.append(part.reshape(groups, rows, *part.shape[1:]))
    return torch.cat(parts, dim=1).reshape(-1, *parts[0].shape[2:]).contiguous()


def hf_to_megatron_rank(
    state: Mapping[str, torch.Tensor] | HFTensors,
    config: Any,
    tp: int,
    rank: int,
    divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
) -> dict[str, torch.Tensor | None]:
    """Tensor-parallel rank `rank`'s megatron-core model dict from a full HF Qwen2 state dict, or from `HFTensors`
    (then only this rank's rows and columns are read). Every returned tensor has its own storage; the HF tensors
    are only read."""
    return dict(iter_hf_to_megatron_rank(state, config, tp, rank, divisible_by))


def iter_hf_to_megatron_rank(
    state: Mapping[str, torch.Tensor] | HFTensors,
    config: Any,
    tp: int,
    rank: int,
    divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """`hf_to_megatron_rank`'s entries one at a time, each read when it is asked for: what a rank building its shard
    iterates, so that it holds one tensor beyond its own parameters."""
    dims = DecoderDims.from_config(config)
    check_splittable(dims, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"tensor-parallel rank {rank} is outside 0..{tp - 1}")
    if isinstance(state, HFTensors):
        tensors = state
        vocab_rows = tensors.shape("model.embed_tokens.weight")[0]
        if vocab_rows != dims.vocab_size:
            raise ValueError(
                f"model.embed_tokens.weight has {vocab_rows} rows but the config's vocab_size is {dims.vocab_size}"
            )
    else:
        _check_hf_state(state, dims)
        tensors = StateDict(state)
    padded = padded_vocab_size(dims.vocab_size, tp, divisible_by)
    yield (
        "embedding.word_embeddings.weight",
        _vocab_piece(tensors, "model.embed_tokens.weight", dims.vocab_size, padded, rank, tp),
    )
    for layer in range(dims.num_layers):
        k = layer_keys(layer)
        attn, mlp = k["hf"] + "self_attn.", k["hf"] + "mlp."
        yield k["input_norm"], tensors.read(k["hf"] + "input_layernorm.weight")
        yield k["proj"] + "weight", _split(tensors, attn + "o_proj.weight", 1, rank, tp)
        yield k["proj"] + EXTRA_STATE, None
        yield k["qkv"] + "weight", _fused_qkv(tensors, attn, "weight", dims, rank, tp)
        if dims.qkv_bias:
            yield k["qkv"] + "bias", _fused_qkv(tensors, attn, "bias", dims, rank, tp)
        yield k["qkv"] + EXTRA_STATE, None
        yield k["mlp_norm"], tensors.read(k["hf"] + "post_attention_layernorm.weight")
        gate = _split(tensors, mlp + "gate_proj.weight", 0, rank, tp)
        up = _split(tensors, mlp + "up_proj.weight", 0, rank, tp)
        yield k["fc1"] + "weight", torch.cat([gate, up], dim=0)
        del gate, up
        yield k["fc1"] + EXTRA_STATE, None
        yield k["fc2"] + "weight", _split(tensors, mlp + "down_proj.weight", 1, rank, tp)
        yield k["fc2"] + EXTRA_STATE, None
    yield "decoder.final_layernorm.weight", tensors.read("model.norm.weight")
    if not dims.tie_word_embeddings:
        yield "output_layer.weight", _vocab_piece(tensors, "lm_head.weight", dims.vocab_size, padded, rank, tp)
    yield "output_layer." + EXTRA_STATE, None


def hf_to_megatron(
    state: Mapping[str, torch.Tensor], config: Any, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY
) -> list[dict[str, torch.Tensor | None]]:
    """One megatron-core model dict per tensor-parallel rank (see the module docstring for the layout)."""
    return [hf_to_megatron_rank(state, config, tp, rank, divisible_by) for rank in range(tp)]


def rank_shapes(dims: DecoderDims, tp: int) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of one rank's dict, except the vocabulary-parallel ones (their rows depend on
    the padding): {key: shape}."""
    hidden, head_dim = dims.hidden_size, dims.head_dim
    qkv_rows = (dims.num_heads + 2 * dims.num_kv_heads) * head_dim // tp
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in range(dims.num_layers):
        k = layer_keys(layer)
        shapes[k["input_norm"]] = (hidden,)
        shapes[k["proj"] + "weight"] = (hidden, dims.num_heads * head_dim // tp)
        shapes[k["qkv"] + "weight"] = (qkv_rows, hidden)
        if dims.qkv_bias:
            shapes[k["qkv"] + "bias"] = (qkv_rows,)
        shapes[k["mlp_norm"]] = (hidden,)
        shapes[k["fc1"] + "weight"] = (2 * dims.intermediate_size // tp, hidden)
        shapes[k["fc2"] + "weight"] = (hidden, dims.intermediate_size // tp)
    shapes["decoder.final_layernorm.weight"] = (hidden,)
    return shapes
