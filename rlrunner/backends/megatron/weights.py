"""The Megatron backend's weights out in a weight sync: each tensor-parallel rank sends its own slices, in HF layout.

Nothing is gathered: a column-parallel weight gives dim-0 blocks of the HF tensors (q, k, v per query group, gate
and up), a row-parallel one dim-1 blocks (o_proj, down_proj), a vocabulary-parallel one its rows below the
vocabulary size; the replicated norms come from tensor-parallel rank 0. Only data-parallel rank 0's group sends.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from rlrunner.backends.megatron.layout import Qwen2Dims, layer_keys, check_splittable
from rlrunner.weight_sync.endpoints import Block, WeightSource


def hf_blocks(shard: Mapping[str, torch.Tensor], config: Any, tp: int, rank: int) -> list[tuple[str, tuple[int, ...], int, int, int, torch.Tensor]]:
    """What tensor-parallel rank `rank`'s megatron-core dict holds of each HF tensor, without gathering anything:
    (HF key, full HF shape, dim, start, stop, block) with the block = rows [start, stop) of the HF tensor along
    `dim`. Column-parallel weights give dim-0 blocks (q, k, v, gate, up: per query group or per chunk), row-parallel
    ones dim-1 blocks (o_proj, down_proj), vocabulary-parallel ones their rows below the vocabulary size (none for a
    rank holding only padding); replicated norms come from rank 0 only. Assembling every rank's blocks gives
    `megatron_to_hf` of the shards, exactly."""
    dims = Qwen2Dims.from_config(config)
    check_splittable(dims, tp)
    hidden, head_dim = dims.hidden_size, dims.head_dim
    out: list[tuple[str, tuple[int, ...], int, int, int, torch.Tensor]] = []

    def vocab(name: str, key: str) -> None:
        weight = shard[key]
        rows = weight.shape[0]
        first = rank * rows
        count = max(0, min(rows, dims.vocab_size - first))
        if count:
            out.append((name, (dims.vocab_size, hidden), 0, first, first + count, weight[:count]))

    def split(name: str, full: tuple[int, ...], dim: int, block: torch.Tensor) -> None:
        size = block.shape[dim]
        out.append((name, full, dim, rank * size, (rank + 1) * size, block))

    vocab("model.embed_tokens.weight", "embedding.word_embeddings.weight")
    groups = dims.num_kv_heads // tp
    q_rows = dims.heads_per_group * head_dim
    for layer in range(dims.num_layers):
        k = layer_keys(layer)
        attn, mlp = k["hf"] + "self_attn.", k["hf"] + "mlp."
        for suffix in ("weight", "bias") if dims.qkv_bias else ("weight",):
            fused = shard[k["qkv"] + suffix]
            tail = tuple(fused.shape[1:])
            grouped = fused.reshape(groups, q_rows + 2 * head_dim, *tail)
            split(attn + f"q_proj.{suffix}", (dims.num_heads * head_dim, *tail), 0, grouped[:, :q_rows].reshape(-1, *tail))
            split(attn + f"k_proj.{suffix}", (dims.num_kv_heads * head_dim, *tail), 0,
                  grouped[:, q_rows : q_rows + head_dim].reshape(-1, *tail))
            split(attn + f"v_proj.{suffix}", (dims.num_kv_heads * head_dim, *tail), 0,
                  grouped[:, q_rows + head_dim :].reshape(-1, *tail))
        split(attn + "o_proj.weight", (hidden, dims.num_heads * head_dim), 1, shard[k["proj"] + "weight"])
        gate, up = shard[k["fc1"] + "weight"].chunk(2, dim=0)
        split(mlp + "gate_proj.weight", (dims.intermediate_size, hidden), 0, gate)
        split(mlp + "up_proj.weight", (dims.intermediate_size, hidden), 0, up)
        split(mlp + "down_proj.weight", (hidden, dims.intermediate_size), 1, shard[k["fc2"] + "weight"])
        if rank == 0:
            out.append((k["hf"] + "input_layernorm.weight", (hidden,), 0, 0, hidden, shard[k["input_norm"]]))
            out.append((k["hf"] + "post_attention_layernorm.weight", (hidden,), 0, 0, hidden, shard[k["mlp_norm"]]))
    if rank == 0:
        out.append(("model.norm.weight", (hidden,), 0, 0, hidden, shard["decoder.final_layernorm.weight"]))
    if not dims.tie_word_embeddings:
        vocab("lm_head.weight", "output_layer.weight")
    return out


class MegatronWeightSource(WeightSource):
    """Data-parallel rank 0's tensor-parallel ranks each send their own slices, in HF layout; the other data-parallel
    replicas hold the same weights and send nothing."""

    def __init__(self, worker: Any):  # a MegatronActorWorker
        self.worker = worker

    def blocks(self) -> list[Block]:
        worker = self.worker
        if worker.dp_rank != 0:
            return []
        shard = {k: v.detach() for k, v in worker.model.state_dict().items()}
        return [Block(*block) for block in hf_blocks(shard, worker.hf_config, worker.tp, worker.tp_rank)]
