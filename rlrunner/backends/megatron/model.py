"""A tensor-parallel Qwen2 or Llama causal LM in plain PyTorch (gloo on CPU, NCCL on GPU), split Megatron's way.

Each rank's parameters are exactly its megatron-core shard (`megatron_layout.hf_to_megatron_rank`), under the
same names, so `model.state_dict()` is what a `model_optim_rng.pt` holds (less the weightless `_extra_state`).

The collectives are Megatron's conjugate operators, written as autograd functions:
    f  (`_copy_to_tp`)      identity forward, all-reduce backward   -- input of a column-parallel layer
    g  (`_reduce_from_tp`)  all-reduce forward, identity backward   -- output of a row-parallel layer / embedding
    gather (`_gather_last`) all-gather forward, own slice backward  -- output of the vocab-parallel output layer
Every rank computes the same (replicated) loss, so the gradients of replicated tensors (norms, residual stream)
are already whole on every rank and the shard gradients are the HF gradients split by the layout.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from transformers import AutoConfig
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, Qwen2RotaryEmbedding, apply_rotary_pos_emb

from rlrunner.backends.megatron.layout import (
    DEFAULT_VOCAB_DIVISIBLE_BY,
    EXTRA_STATE,
    DecoderDims,
    check_splittable,
    padded_vocab_size,
)

# --- Megatron's f / g operators ---------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous()  # all_reduce works in place: never on a view of something autograd saved
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.width = group, x.shape[-1]
        pieces = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # every rank holds the whole (replicated) gradient: each keeps the columns its shard produced
        rank = dist.get_rank(ctx.group)
        return grad[..., rank * ctx.width : (rank + 1) * ctx.width].contiguous(), None


def _tp_size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def _copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if _tp_size(group) == 1 else _CopyToTP.apply(x, group)


def _reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if _tp_size(group) == 1 else _ReduceFromTP.apply(x, group)


def _gather_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if _tp_size(group) == 1 else _GatherLast.apply(x, group)


# --- weights gathered unit by unit (ZeRO-3) ---------------------------------------------------------------


class _AroundUnit(torch.autograd.Function):
    """Identity on `x`; calls `now(unit)` in forward and `later(unit)` in backward, which autograd runs once the
    backward has come back through this point (after the unit's own backward, for a point before the unit)."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, now: Callable[[int], None], later: Callable[[int], None], unit: int
    ) -> torch.Tensor:
        ctx.later, ctx.unit = later, unit
        now(unit)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.later(ctx.unit)
        return grad, None, None, None


def _around(x: torch.Tensor, now: Callable[[int], None], later: Callable[[int], None], unit: int) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _AroundUnit.apply(x, now, later, unit)
    now(unit)  # no backward will come
    return x


def _enter(x: torch.Tensor, units: Any, unit: int) -> torch.Tensor:
    """Before weight unit `unit` is used: gathered now, released once its backward is done."""
    return x if units is None else _around(x, units.gather, units.release, unit)


def _exit(x: torch.Tensor, units: Any, unit: int) -> torch.Tensor:
    """After weight unit `unit` is used: released now, gathered again before its backward (and its recomputation)."""
    return x if units is None else _around(x, units.release, units.gather, unit)


# --- parallel layers (parameter names as megatron-core's) --------------------------------------------


class ColumnParallelLinear(nn.Module):
    """y_r = x A_r^T (+ b_r): the output features split over ranks; the output stays split."""

    def __init__(self, in_features: int, out_local: int, bias: bool, group: dist.ProcessGroup, **factory: Any):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.zeros(out_local, in_features, **factory))
        self.bias = nn.Parameter(torch.zeros(out_local, **factory)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r A_r^T: the input features split over ranks (the input is already split), the output summed."""

    def __init__(self, in_local: int, out_features: int, group: dist.ProcessGroup, **factory: Any):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.zeros(out_features, in_local, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _reduce_from_tp(F.linear(x, self.weight), self.group)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous run of (padded) vocabulary rows, looks up the ids inside it, zero elsewhere;
    the all-reduce sums the one non-zero contribution of each token.

    The padding token's row gets no gradient, as in HF's `nn.Embedding(..., padding_idx=pad_token_id)`."""

    def __init__(
        self, rows_local: int, hidden: int, group: dist.ProcessGroup, padding_idx: int | None = None, **factory: Any
    ):
        super().__init__()
        self.group = group
        self.padding_idx = padding_idx
        self.weight = nn.Parameter(torch.zeros(rows_local, hidden, **factory))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        first = dist.get_rank(self.group) * rows
        local = ids - first
        outside = (local < 0) | (local >= rows)
        padding = None
        if self.padding_idx is not None and first <= self.padding_idx < first + rows:
            padding = self.padding_idx - first
        out = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=padding)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return _reduce_from_tp(out, self.group)


# --- the transformer ---------------------------------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, dims: DecoderDims, tp: int, group: dist.ProcessGroup, **factory: Any):
        super().__init__()
        self.groups_local = dims.num_kv_heads // tp
        self.heads_per_group, self.head_dim = dims.heads_per_group, dims.head_dim
        qkv_rows = self.groups_local * (self.heads_per_group + 2) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(dims.hidden_size, qkv_rows, dims.qkv_bias, group, **factory)
        heads_local = self.groups_local * self.heads_per_group
        self.linear_proj = RowParallelLinear(heads_local * self.head_dim, dims.hidden_size, group, **factory)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        d, hpg = self.head_dim, self.heads_per_group
        # fused rows, group after group: the group's query heads, its key head, its value head
        qkv = self.linear_qkv(x).view(batch, seq, self.groups_local, (hpg + 2) * d)
        q, k, v = qkv.split([hpg * d, d, d], dim=-1)
        q = q.reshape(batch, seq, self.groups_local * hpg, d).transpose(1, 2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [batch, local groups, seq, d]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.repeat_interleave(hpg, dim=1), v.repeat_interleave(hpg, dim=1)  # HF's repeat_kv
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.linear_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class _MLP(nn.Module):
    def __init__(self, dims: DecoderDims, tp: int, group: dist.ProcessGroup, **factory: Any):
        super().__init__()
        ffn_local = dims.intermediate_size // tp
        self.linear_fc1 = ColumnParallelLinear(dims.hidden_size, 2 * ffn_local, False, group, **factory)
        self.linear_fc2 = RowParallelLinear(ffn_local, dims.hidden_size, group, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)  # [gate_r; up_r]
        return self.linear_fc2(F.silu(gate) * up)


class _Layer(nn.Module):
    def __init__(self, dims: DecoderDims, eps: float, tp: int, group: dist.ProcessGroup, **factory: Any):
        super().__init__()
        self.input_layernorm = Qwen2RMSNorm(dims.hidden_size, eps).to(**factory)
        self.self_attention = _Attention(dims, tp, group, **factory)
        self.pre_mlp_layernorm = Qwen2RMSNorm(dims.hidden_size, eps).to(**factory)
        self.mlp = _MLP(dims, tp, group, **factory)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class _Decoder(nn.Module):
    def __init__(self, dims: DecoderDims, eps: float, tp: int, group: dist.ProcessGroup, **factory: Any):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(dims, eps, tp, group, **factory) for _ in range(dims.num_layers))
        self.final_layernorm = Qwen2RMSNorm(dims.hidden_size, eps).to(**factory)


class _Embedding(nn.Module):
    def __init__(self, rows_local: int, hidden: int, group: dist.ProcessGroup, padding_idx: int | None, **factory: Any):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(rows_local, hidden, group, padding_idx, **factory)


def _hf_config(config: Any) -> Any:
    """A transformers config object of its family (`model_type`: qwen2 or llama) from a config or its dict."""
    if not isinstance(config, Mapping):
        return config
    settings = dict(config)
    return AutoConfig.for_model(settings.pop("model_type", "qwen2"), **settings)


def _padding_mask(attention_mask: torch.Tensor, seq: int) -> torch.Tensor:
    """Boolean [batch, 1, seq, seq] (True = may attend): causal and not a padding key, as HF's sdpa mask; a boolean
    [batch, 1, seq, seq] mask as it is (as HF takes a 4D mask)."""
    if attention_mask.dim() == 4 and attention_mask.dtype == torch.bool and attention_mask.shape[-2:] == (seq, seq):
        return attention_mask
    if attention_mask.dim() != 2 or attention_mask.shape[1] != seq:
        raise ValueError(
            f"attention_mask must be [batch, {seq}] or a boolean [batch, 1, {seq}, {seq}], "
            f"got shape {tuple(attention_mask.shape)}"
        )
    causal = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).tril()
    return causal[None, None] & attention_mask.bool()[:, None, None, :]


class TPCausalLM(nn.Module):
    """One tensor-parallel rank of a Qwen2 or Llama causal LM; its parameters are this rank's megatron-core shard.

    Build it on every rank of `tp_group` with the same config, then `load_megatron_shard` the dict
    `hf_to_megatron_rank(hf_state, config, tp, rank)` gives (or the `model` of this rank's `model_optim_rng.pt`).
    `forward` must be called on every rank of the group with the same inputs."""

    def __init__(
        self,
        config: Any,
        tp_group: dist.ProcessGroup,
        divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        config = _hf_config(config)
        self.dims = dims = DecoderDims.from_config(config)
        self.tp_group, self.tp = tp_group, dist.get_world_size(tp_group)
        check_splittable(dims, self.tp)
        self.padded_vocab_size = padded_vocab_size(dims.vocab_size, self.tp, divisible_by)
        factory = {"dtype": dtype, "device": device}
        rows_local = self.padded_vocab_size // self.tp
        eps = float(config.rms_norm_eps)
        self.embedding = _Embedding(rows_local, dims.hidden_size, tp_group, config.pad_token_id, **factory)
        self.decoder = _Decoder(dims, eps, self.tp, tp_group, **factory)
        if not dims.tie_word_embeddings:
            self.output_layer = ColumnParallelLinear(dims.hidden_size, rows_local, False, tp_group, **factory)
        # HF's rotary table (rope_theta, scaling types), not a parameter: kept out of the state dict, and computed
        # on the CPU for a meta-device build (whose parameters get their storage from `bind_to_buffer`)
        self.rotary = Qwen2RotaryEmbedding(config).to(None if torch.device(device or "cpu").type == "meta" else device)
        self.gradient_checkpointing = False  # in training, keep each layer's input only and recompute it in backward
        # ZeRO-3: an object with gather(unit) / release(unit) (DistributedAdamW with shard_weights) that gives the
        # units of `weight_unit_names` their values around each use; None: every parameter holds its values
        self.weight_units: Any = None

    def weight_unit_names(self) -> list[list[str]]:
        """The parameter names of each unit gathered at once, in `named_parameters` order: the embedding, each layer,
        then the final norm with the output layer."""
        names = [name for name, _ in self.named_parameters()]
        embedding = [n for n in names if n.startswith("embedding.")]
        layers = [[n for n in names if n.startswith(f"decoder.layers.{i}.")] for i in range(self.dims.num_layers)]
        head = [n for n in names if n.startswith("decoder.final_layernorm.") or n.startswith("output_layer.")]
        return [embedding, *layers, head]

    def load_megatron_shard(
        self,
        shard: Mapping[str, Any] | Iterable[tuple[str, Any]],
        into: Callable[[str, torch.Tensor], None] | None = None,
    ) -> None:
        """Copy this rank's megatron-core dict (or its entries, one at a time) into the parameters (`_extra_state`
        entries ignored); ValueError naming the first missing, unexpected or misshapen key. A dict is checked whole
        before anything is copied. `into(key, tensor)` does the copy instead (sharded weights: the owned part only)."""
        own = self.state_dict()
        if isinstance(shard, Mapping):
            given = {k: v for k, v in shard.items() if not k.endswith(EXTRA_STATE)}
            missing, unexpected = sorted(set(own) - set(given)), sorted(set(given) - set(own))
            if missing:
                raise ValueError(
                    f"the shard lacks {len(missing)} key(s) of this tp={self.tp} model, e.g. {missing[:3]}"
                )
            if unexpected:
                raise ValueError(
                    f"the shard has {len(unexpected)} key(s) this model does not have, e.g. {unexpected[:3]}"
                )
            shard = given.items()
        loaded = set()
        with torch.no_grad():
            for key, tensor in shard:
                if key.endswith(EXTRA_STATE):
                    continue
                if key not in own:
                    raise ValueError(f"the shard has the key {key!r} this model does not have")
                if tuple(tensor.shape) != tuple(own[key].shape):
                    raise ValueError(
                        f"{key} has shape {tuple(tensor.shape)} in the shard, expected "
                        f"{tuple(own[key].shape)} for tensor-parallel size {self.tp}"
                    )
                if into is not None:
                    into(key, tensor)
                else:
                    own[key].copy_(tensor)
                loaded.add(key)
        missing = sorted(set(own) - loaded)
        if missing:
            raise ValueError(f"the shard lacks {len(missing)} key(s) of this tp={self.tp} model, e.g. {missing[:3]}")

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [batch, seq, vocab_size] over the real vocabulary (the padding columns are dropped after the
        gather, so they never reach a loss or a sampler). Positions default to 0..seq-1, as HF's."""
        seq = input_ids.shape[1]
        units = self.weight_units
        head = self.dims.num_layers + 1
        if units is not None:  # the lookup's backward needs no weights: the embedding is gathered for the forward only
            units.gather(0)
        try:
            hidden = self.embedding.word_embeddings(input_ids)
        finally:
            if units is not None:
                units.release(0)
        if position_ids is None:
            position_ids = torch.arange(seq, device=input_ids.device)[None]
        cos, sin = self.rotary(hidden, position_ids)
        mask = None if attention_mask is None else _padding_mask(attention_mask, seq)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for index, layer in enumerate(self.decoder.layers, start=1):
            hidden = _enter(hidden, units, index)  # outside the checkpoint: its recomputation finds the unit gathered
            if recompute:  # non-reentrant: the autocast state and the TP collectives are replayed as they ran
                hidden = torch.utils.checkpoint.checkpoint(layer, hidden, cos, sin, mask, use_reentrant=False)
            else:
                hidden = layer(hidden, cos, sin, mask)
            hidden = _exit(hidden, units, index)
        hidden = _enter(hidden, units, head)
        if self.dims.tie_word_embeddings:
            hidden = _enter(hidden, units, 0)
        hidden = self.decoder.final_layernorm(hidden)
        weight = self.embedding.word_embeddings.weight if self.dims.tie_word_embeddings else self.output_layer.weight
        logits = F.linear(_copy_to_tp(hidden, self.tp_group), weight)
        if self.dims.tie_word_embeddings:
            logits = _exit(logits, units, 0)
        logits = _exit(logits, units, head)
        return _gather_last(logits, self.tp_group)[..., : self.dims.vocab_size]
