"""Megatron-core's tensor-parallel shards read as Hugging Face Qwen2 tensors (`layout.py`'s inverse), without
gathering them.

Each tensor-parallel rank's dict holds blocks of the HF tensors (`rank_blocks`): a column-parallel weight gives
dim-0 blocks (q, k, v per query group, gate and up), a row-parallel one dim-1 blocks (o_proj, down_proj), a
vocabulary-parallel one its rows below the vocabulary size; the replicated norms are read from rank 0. A weight sync
sends each rank's blocks as they are (`weights.py`); a checkpoint read at another tensor-parallel size, or an export
to HF, assembles slices from them (`MegatronShards`, `iter_megatron_to_hf`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from rlrunner.backends.megatron.layout import (
    EXTRA_STATE,
    DecoderDims,
    check_splittable,
    expected_hf_keys,
    expected_megatron_keys,
    layer_keys,
    rank_shapes,
)
from rlrunner.models.hf_tensors import HFTensors


def _check_shards(shards: Sequence[Mapping[str, Any]], dims: DecoderDims) -> None:
    if not shards:
        raise ValueError("no tensor-parallel shards given")
    tp = len(shards)
    check_splittable(dims, tp)
    expected = expected_megatron_keys(dims)
    tensors = {key for key in expected if not key.endswith(EXTRA_STATE)}
    shapes = rank_shapes(dims, tp)
    for rank, shard in enumerate(shards):
        missing = sorted(tensors - set(shard))
        unexpected = sorted(set(shard) - set(expected))
        if missing:
            raise ValueError(f"tensor-parallel rank {rank} lacks {len(missing)} key(s), e.g. {missing[:3]}")
        if unexpected:
            raise ValueError(
                f"tensor-parallel rank {rank} has {len(unexpected)} unexpected key(s), e.g. {unexpected[:3]}"
            )
        for key, shape in shapes.items():
            if tuple(shard[key].shape) != shape:
                raise ValueError(
                    f"tensor-parallel rank {rank}: {key} has shape {tuple(shard[key].shape)}, expected {shape} "
                    f"for this config split {tp} ways"
                )
        for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if key not in shard:
                continue
            rows = shards[0][key].shape[0]
            if tuple(shard[key].shape) != (rows, dims.hidden_size):
                raise ValueError(
                    f"tensor-parallel rank {rank}: {key} has shape {tuple(shard[key].shape)}, "
                    f"expected ({rows}, {dims.hidden_size}) like rank 0"
                )


@dataclass(frozen=True)
class HFBlock:
    """What one tensor-parallel rank's dict holds of one HF tensor: indices [start, stop) along `dim` of the tensor
    `name` (full shape `shape`), taken from the rank's megatron tensor `key` by `take`; `replicated` when every rank
    holds the whole tensor (the norms: listed for rank 0 only)."""

    name: str
    shape: tuple[int, ...]
    dim: int
    start: int
    stop: int
    key: str
    take: Callable[[torch.Tensor], torch.Tensor]
    replicated: bool = False


def rank_blocks(dims: DecoderDims, tp: int, rank: int, vocab_rows: int) -> list[HFBlock]:
    """Every HF block tensor-parallel rank `rank` of `tp` holds (`vocab_rows`: the rows of its vocabulary-parallel
    tensors, padding included), in `expected_hf_keys` order. Column-parallel weights give dim-0 blocks (q, k, v per
    query group, gate and up), row-parallel ones dim-1 blocks (o_proj, down_proj), vocabulary-parallel ones their
    rows below the vocabulary size (none for a rank of padding only); the replicated norms come from rank 0 only.
    A block's `take` is a view of the megatron tensor, except q, k and v (one rank's rows of one tensor, copied)."""
    check_splittable(dims, tp)
    hidden, head_dim = dims.hidden_size, dims.head_dim
    out: list[HFBlock] = []

    def vocab(name: str, key: str) -> None:
        first = rank * vocab_rows
        count = max(0, min(vocab_rows, dims.vocab_size - first))
        if count:
            out.append(HFBlock(name, (dims.vocab_size, hidden), 0, first, first + count, key, lambda t, n=count: t[:n]))

    def split(name: str, full: tuple[int, ...], dim: int, key: str, take=lambda t: t) -> None:
        size = full[dim] // tp
        out.append(HFBlock(name, full, dim, rank * size, (rank + 1) * size, key, take))

    def norm(name: str, key: str) -> None:
        if rank == 0:
            out.append(HFBlock(name, (hidden,), 0, 0, hidden, key, lambda t: t, replicated=True))

    def qkv_rows(first: int, count: int, groups: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def take(fused: torch.Tensor) -> torch.Tensor:
            tail = tuple(fused.shape[1:])
            return fused.reshape(groups, -1, *tail)[:, first : first + count].reshape(-1, *tail)

        return take

    vocab("model.embed_tokens.weight", "embedding.word_embeddings.weight")
    groups = dims.num_kv_heads // tp
    q_rows = dims.heads_per_group * head_dim
    for layer in range(dims.num_layers):
        k = layer_keys(layer)
        attn, mlp = k["hf"] + "self_attn.", k["hf"] + "mlp."
        for suffix in ("weight", "bias") if dims.qkv_bias else ("weight",):
            tail = (hidden,) if suffix == "weight" else ()
            key = k["qkv"] + suffix
            split(attn + f"q_proj.{suffix}", (dims.num_heads * head_dim, *tail), 0, key, qkv_rows(0, q_rows, groups))
            split(
                attn + f"k_proj.{suffix}",
                (dims.num_kv_heads * head_dim, *tail),
                0,
                key,
                qkv_rows(q_rows, head_dim, groups),
            )
            split(
                attn + f"v_proj.{suffix}",
                (dims.num_kv_heads * head_dim, *tail),
                0,
                key,
                qkv_rows(q_rows + head_dim, head_dim, groups),
            )
        split(attn + "o_proj.weight", (hidden, dims.num_heads * head_dim), 1, k["proj"] + "weight")
        rows = dims.intermediate_size // tp
        split(mlp + "gate_proj.weight", (dims.intermediate_size, hidden), 0, k["fc1"] + "weight", lambda t: t[:rows])
        split(mlp + "up_proj.weight", (dims.intermediate_size, hidden), 0, k["fc1"] + "weight", lambda t: t[rows:])
        split(mlp + "down_proj.weight", (hidden, dims.intermediate_size), 1, k["fc2"] + "weight")
        norm(k["hf"] + "input_layernorm.weight", k["input_norm"])
        norm(k["hf"] + "post_attention_layernorm.weight", k["mlp_norm"])
    norm("model.norm.weight", "decoder.final_layernorm.weight")
    if not dims.tie_word_embeddings:
        vocab("lm_head.weight", "output_layer.weight")
    return out


class MegatronShards(HFTensors):
    """The HF tensors of a model saved as tensor-parallel shards (megatron-core dicts, in rank order), read in
    slices: a slice is assembled from the ranks' blocks it overlaps, so shards memory-mapped from their files are
    read only where the slice lies (for q, k and v, one rank's rows of the tensor). What a rank of another
    tensor-parallel size reads its own part through (`iter_hf_to_megatron_rank`), without a whole HF state dict."""

    def __init__(self, shards: Sequence[Mapping[str, Any]], config: Any):
        self.dims = DecoderDims.from_config(config)
        _check_shards(shards, self.dims)
        self.shards = shards
        rows = shards[0]["embedding.word_embeddings.weight"].shape[0]
        if rows * len(shards) < self.dims.vocab_size:
            raise ValueError(
                f"the shards hold {rows * len(shards)} rows of embedding.word_embeddings.weight for a "
                f"vocabulary of {self.dims.vocab_size}"
            )
        self.blocks: dict[str, list[tuple[int, HFBlock]]] = {}
        for rank in range(len(shards)):
            for block in rank_blocks(self.dims, len(shards), rank, rows):
                self.blocks.setdefault(block.name, []).append((rank, block))
        if self.dims.tie_word_embeddings:
            self.blocks["lm_head.weight"] = self.blocks["model.embed_tokens.weight"]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.blocks[name][0][1].shape

    def _read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        pieces = []
        for rank, block in self.blocks[name]:
            if block.replicated:
                self._check_replicated(block.key)
            if block.dim == dim:
                first, last = max(start, block.start), min(stop, block.stop)
                if first < last:
                    pieces.append(
                        block.take(self.shards[rank][block.key]).narrow(dim, first - block.start, last - first)
                    )
            else:
                pieces.append(block.take(self.shards[rank][block.key]).narrow(dim, start, stop - start))
        if not pieces:  # an empty slice (the real rows of a rank that holds only vocabulary padding)
            rank, block = self.blocks[name][0]
            pieces.append(block.take(self.shards[rank][block.key]).narrow(dim, 0, 0))
        return torch.cat(pieces, dim=self.blocks[name][0][1].dim)  # a tensor of its own, even from one piece

    def _check_replicated(self, key: str) -> None:
        first = self.shards[0][key]
        for rank, shard in enumerate(self.shards[1:], start=1):
            if not first.is_meta and not torch.equal(shard[key], first):
                raise ValueError(f"{key} is replicated but tensor-parallel rank {rank} differs from rank 0")


def iter_megatron_to_hf(
    shards: Sequence[Mapping[str, Any]], config: Any, consume: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, full tensor) pairs, one at a time, merged from every tensor-parallel rank's dict (in rank order).

    The shards are checked before the first pair comes. With `consume`, each megatron tensor is removed from the
    (mutable) shard dicts once the last HF tensor that needs it is merged, so a caller that writes each pair away
    holds about one copy of the weights in all. Meta tensors in, meta tensors out: the shapes and dtypes of the
    output for free."""
    tensors = MegatronShards(shards, config)
    names = expected_hf_keys(tensors.dims)
    last_use = {block.key: name for name in names for _, block in tensors.blocks[name]}
    for name in names:
        yield name, tensors.read(name)
        if consume:
            for key in [key for key, last in last_use.items() if last == name]:
                for shard in shards:
                    shard.pop(key, None)  # type: ignore[attr-defined]


def megatron_to_hf(shards: Sequence[Mapping[str, Any]], config: Any) -> dict[str, torch.Tensor]:
    """The full HF Qwen2 state dict from every tensor-parallel rank's dict, in rank order (the exact inverse of
    `hf_to_megatron`: vocabulary padding stripped, no `lm_head.weight` when the embeddings are tied)."""
    return dict(iter_megatron_to_hf(shards, config))
