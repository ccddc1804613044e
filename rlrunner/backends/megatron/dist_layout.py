"""Where each parameter of a tensor-parallel rank lies in megatron-core's distributed checkpoint format (`torch_dist`):
its sharded key, its global shape, and the global chunks (hyper-rectangles) a piece of the rank's tensor covers.
Pure functions: no files, no process groups.

megatron-core's `GPTModel.sharded_state_dict()` (local layer spec) names and shapes its tensors independently of the
parallel layout, so that a checkpoint loads at any tensor-parallel and data-parallel size:

    embedding.word_embeddings.weight                          [padded vocab, hidden]   split by rows over TP
    decoder.layers.self_attention.linear_qkv.layer_norm_weight [layers, hidden]          the input norm, replicated
    decoder.layers.self_attention.linear_qkv.weight|bias      [layers, qkv rows, ...]  split by rows (query groups)
    decoder.layers.self_attention.linear_proj.weight          [layers, hidden, q dim]  split by columns
    decoder.layers.mlp.linear_fc1.layer_norm_weight           [layers, hidden]         the pre-MLP norm, replicated
    decoder.layers.mlp.linear_fc1.weight                      [layers, 2 ffn, hidden]  all gate rows, then all up
                                                                                       rows; each split over TP
    decoder.layers.mlp.linear_fc2.weight                      [layers, hidden, ffn]    split by columns
    decoder.final_layernorm.weight                            [hidden]                 replicated
    output_layer.weight                                       [padded vocab, hidden]   split by rows (untied only)

The layers are stacked along a first axis (layer l at offset l). Each TP rank's fused QKV rows are its query groups
in order, so the ranks' rows in rank order are the whole fused QKV; its `linear_fc1` holds its gate rows then its up
rows, which land in the two halves of the global tensor. The vocabulary's padding rows are part of the global shape,
which therefore depends on the TP size (megatron-core loads it allowing that mismatch).

A piece of a rank's tensor is given as a flat range of it (a data-parallel rank owns a flat slice of its
tensor-parallel rank's parameters); `flat_range_chunks` cuts it into rectangles (a partial first row, whole rows, a
partial last row), each a contiguous run of the flat range, and places them in the global tensor.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from rlrunner.backends.megatron.buffer_geometry import megatron_param_names
from rlrunner.backends.megatron.layout import (
    DEFAULT_VOCAB_DIVISIBLE_BY,
    DecoderDims,
    padded_vocab_size,
)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# our (megatron-core local spec) name inside a layer -> the sharded key's tail, and the TP axis of the local tensor
_LAYER_TENSORS = {
    "input_layernorm.weight": ("self_attention.linear_qkv.layer_norm_weight", None),
    "self_attention.linear_qkv.weight": ("self_attention.linear_qkv.weight", 0),
    "self_attention.linear_qkv.bias": ("self_attention.linear_qkv.bias", 0),
    "self_attention.linear_proj.weight": ("self_attention.linear_proj.weight", 1),
    "pre_mlp_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight", None),
    "mlp.linear_fc1.weight": ("mlp.linear_fc1.weight", 0),
    "mlp.linear_fc2.weight": ("mlp.linear_fc2.weight", 1),
}
_EXTRA_STATE_MODULES = (
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


@dataclass(frozen=True)
class Chunk:
    """A rectangle of a global tensor: `offsets` and `sizes` per axis; `flat_start` is where its elements start in
    the flat range it was cut from (its elements are that range's next prod(sizes), in order)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class ShardedParam:
    """One parameter of a tensor-parallel rank in the distributed format."""

    key: str  # the sharded key
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    layer: int | None  # its place on the stacked layer axis (None: no such axis)
    tp_axis: int | None  # the axis of the local tensor split over TP (None: replicated)
    tp_rank: int
    gate_up: bool = False  # linear_fc1: local rows [gate; up] land in the two halves of the global rows

    def local_chunks(self, lo: int, hi: int, flat_start: int = 0) -> list[Chunk]:
        """The global rectangles of rows [lo, hi) of the local tensor (viewed as rows of its trailing elements)."""
        shape = self.local_shape if len(self.local_shape) > 1 else (1, *self.local_shape)
        if self.gate_up:
            half = self.local_shape[0] // 2
            if lo < half < hi:  # a run across the gate/up boundary: two rectangles
                first = self.local_chunks(lo, half, flat_start)
                return first + self.local_chunks(half, hi, flat_start + (half - lo) * math.prod(shape[1:]))
        return [self._place((lo, *([0] * (len(shape) - 1))), (hi - lo, *shape[1:]), flat_start)]

    def _place(self, local_offsets: tuple[int, ...], sizes: tuple[int, ...], flat_start: int) -> Chunk:
        """A rectangle of the local tensor (in its `shape`, a 1-D tensor as one row) placed in the global tensor."""
        if len(self.local_shape) == 1:  # back from one row to 1-D
            local_offsets, sizes = local_offsets[1:], sizes[1:]
        offsets = list(local_offsets)
        if self.tp_axis is not None:
            local = self.local_shape[self.tp_axis]
            if self.gate_up:
                half = local // 2
                gate = offsets[0] < half
                within = offsets[0] - (0 if gate else half)
                offsets[0] = (0 if gate else self.global_shape[-2] // 2) + self.tp_rank * half + within
            else:
                offsets[self.tp_axis] += self.tp_rank * local
        if self.layer is not None:
            return Chunk((self.layer, *offsets), (1, *sizes), flat_start)
        return Chunk(tuple(offsets), tuple(sizes), flat_start)

    def flat_range_chunks(self, start: int, stop: int) -> list[Chunk]:
        """The global rectangles holding elements [start, stop) of the local tensor flattened, in order; each chunk's
        `flat_start` counts from `start`."""
        numel = math.prod(self.local_shape)
        if not 0 <= start <= stop <= numel:
            raise ValueError(f"{self.key}: elements {start}:{stop} of a tensor of {numel}")
        width = math.prod(self.local_shape[1:]) if len(self.local_shape) > 1 else numel
        chunks: list[Chunk] = []
        position = start
        while position < stop:
            row, column = divmod(position, width)
            if column or stop - position < width:  # part of one row
                end = min(stop, (row + 1) * width)
                chunks.append(self._place((row, column), (1, end - position), position - start))
                position = end
            else:  # whole rows
                rows = (stop - position) // width
                chunks += self.local_chunks(row, row + rows, position - start)
                position += rows * width
        return chunks


def sharded_params(
    names_shapes: list[tuple[str, tuple[int, ...]]],
    dims: DecoderDims,
    tp: int,
    tp_rank: int,
    divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
) -> dict[str, ShardedParam]:
    """{our name: where it lies} for a tensor-parallel rank's parameters (`names_shapes`: local shapes)."""
    vocab = padded_vocab_size(dims.vocab_size, tp, divisible_by)
    out: dict[str, ShardedParam] = {}
    for name, shape in names_shapes:
        shape = tuple(int(d) for d in shape)
        if len(shape) > 2:
            raise ValueError(f"{name}: a parameter of {len(shape)} dimensions is not laid out")
        match = _LAYER.match(name)
        if match:
            layer, tail = int(match.group(1)), match.group(2)
            if tail not in _LAYER_TENSORS:
                raise ValueError(f"{name}: not a parameter of the distributed layout")
            key_tail, axis = _LAYER_TENSORS[tail]
            full = list(shape)
            if axis is not None:
                full[axis] *= tp
            out[name] = ShardedParam(
                f"decoder.layers.{key_tail}",
                (dims.num_layers, *full),
                shape,
                layer,
                axis,
                tp_rank,
                gate_up=tail == "mlp.linear_fc1.weight",
            )
        elif name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            out[name] = ShardedParam(name, (vocab, shape[1]), shape, None, 0, tp_rank)
        elif name == "decoder.final_layernorm.weight":
            out[name] = ShardedParam(name, shape, shape, None, None, tp_rank)
        else:
            raise ValueError(f"{name}: not a parameter of the distributed layout")
    return out


def rank_shapes(
    dims: DecoderDims, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of a tensor-parallel rank, in megatron-core's order."""
    hidden, head_dim = dims.hidden_size, dims.head_dim
    qkv_rows = (dims.num_heads + 2 * dims.num_kv_heads) * head_dim // tp
    rows = padded_vocab_size(dims.vocab_size, tp, divisible_by) // tp
    by_tail = {
        "input_layernorm.weight": (hidden,),
        "self_attention.linear_proj.weight": (hidden, dims.num_heads * head_dim // tp),
        "self_attention.linear_qkv.weight": (qkv_rows, hidden),
        "self_attention.linear_qkv.bias": (qkv_rows,),
        "pre_mlp_layernorm.weight": (hidden,),
        "mlp.linear_fc1.weight": (2 * dims.intermediate_size // tp, hidden),
        "mlp.linear_fc2.weight": (hidden, dims.intermediate_size // tp),
    }
    shapes = []
    for name in megatron_param_names(dims):
        match = _LAYER.match(name)
        if match:
            shapes.append((name, by_tail[match.group(2)]))
        elif name == "decoder.final_layernorm.weight":
            shapes.append((name, (hidden,)))
        else:  # the embedding, the untied output layer
            shapes.append((name, (rows, hidden)))
    return shapes


def extra_state_keys(dims: DecoderDims) -> list[str]:
    """The keys megatron-core's ShardedObjects of the layers' `_extra_state` are stored under (one per layer)."""
    return [
        f"decoder.layers.{module}._extra_state/shard_{layer}_{dims.num_layers}"
        for layer in range(dims.num_layers)
        for module in _EXTRA_STATE_MODULES
    ]


def rng_state_key(tp_rank: int, tp: int) -> str:
    """The key of tensor-parallel rank `tp_rank`'s RNG states (Megatron-LM's ShardedObject `rng_state`, one per
    pipeline x tensor-parallel rank, holding every data-parallel rank's)."""
    return f"rng_state/shard_0.{tp_rank}_1.{tp}"


def optimizer_key(state: str, key: str) -> str:
    """megatron-core's `fully_reshardable` key of a parameter's optimizer state (`param`, `exp_avg`, `exp_avg_sq`)."""
    return f"optimizer.state.{state}.{key}"


# What Megatron-LM's `save_checkpoint` stores as the checkpoint's content metadata (`dist_checkpointing.save(...,
# content_metadata=...)`, the `content_metadata` entry of `common.pt`) for a distributed optimizer whose state is laid
# out per parameter: its `load_checkpoint` reads it back (`load_content_metadata`) to ask for the optimizer state in
# the layout the checkpoint holds; without it, it assumes another layout and refuses the file
CONTENT_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}
