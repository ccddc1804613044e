"""Where a tensor-parallel rank's parameters lie in megatron-core's distributed format (`dist_layout`): the sharded
keys and global shapes, and the rectangles a flat range of a rank's tensor covers (megatron-core's own reading of
them: tests/integration/test_megatron_torch_dist.py)."""

from __future__ import annotations

import math

import pytest
import torch

from rlrunner.backends.megatron.dist_layout import rank_shapes, sharded_params
from rlrunner.backends.megatron.layout import DecoderDims

DIMS = DecoderDims(
    num_layers=2,
    hidden_size=8,
    intermediate_size=12,
    num_heads=4,
    num_kv_heads=2,
    head_dim=2,
    vocab_size=99,
    tie_word_embeddings=False,
)


def _global(tp: int, name: str) -> torch.Tensor:
    """The global tensor of `name` assembled from every tensor-parallel rank's whole shard (each rank's values
    distinct), through the rectangles of arbitrary flat ranges of each shard."""
    target = None
    for tp_rank in range(tp):
        params = sharded_params(rank_shapes(DIMS, tp), DIMS, tp, tp_rank)
        param = params[name]
        target = torch.full(param.global_shape, float("nan")) if target is None else target
        offset = 1000 * tp_rank if param.tp_axis is not None else 0  # a replicated tensor is the same on every rank
        local = torch.arange(math.prod(param.local_shape), dtype=torch.float32) + offset
        numel = local.numel()
        for start, stop in ((0, numel // 3), (numel // 3, numel // 3 + 1), (numel // 3 + 1, numel)):
            for chunk in param.flat_range_chunks(start, stop):
                piece = local[start + chunk.flat_start : start + chunk.flat_start + chunk.numel].view(chunk.sizes)
                index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
                if param.tp_axis is None and tp_rank > 0:  # the same rectangles as rank 0's
                    assert torch.equal(target[index], piece)
                else:
                    assert target[index].isnan().all(), f"{name}: a rectangle written twice"
                target[index] = piece
    return target


@pytest.mark.parametrize("tp", [1, 2])
def test_rectangles_tile_every_global_tensor_once_in_megatron_core_s_order(tp) -> None:
    shapes = dict(rank_shapes(DIMS, tp))
    assert shapes["decoder.layers.1.mlp.linear_fc1.weight"] == (24 // tp, 8)
    qkv = _global(tp, "decoder.layers.1.self_attention.linear_qkv.weight")
    assert qkv.shape == (2, 16, 8) and qkv[0].isnan().all() and not qkv[1].isnan().any()  # layer 1 of the stack
    # fused QKV: rank r's rows (its query groups) are global rows [r * 16 / tp, (r + 1) * 16 / tp)
    assert qkv[1, 0, 0] == 0 and qkv[1, 16 // tp - 1, 7] == 16 // tp * 8 - 1
    if tp == 2:
        assert qkv[1, 8, 0] == 1000
    fc1 = _global(tp, "decoder.layers.0.mlp.linear_fc1.weight")
    assert fc1.shape == (2, 24, 8) and not fc1[0].isnan().any()
    # gate rows of every rank, then up rows of every rank: rank r's up rows start at 12 + r * 12 / tp
    half = 12 // tp
    assert fc1[0, 12, 0] == half * 8  # rank 0's first up row follows its gate rows locally
    if tp == 2:
        assert fc1[0, 6, 0] == 1000 and fc1[0, 18, 0] == 1000 + half * 8
    proj = _global(tp, "decoder.layers.0.self_attention.linear_proj.weight")  # split by columns
    assert proj.shape == (2, 8, 8) and not proj[0].isnan().any()
    if tp == 2:
        assert proj[0, 0, 4] == 1000 and proj[0, 1, 0] == 4
    embedding = _global(tp, "embedding.word_embeddings.weight")  # the padded vocabulary: 128 x tp rows
    assert embedding.shape == (128 * tp, 8) and not embedding.isnan().any()
    norm = _global(tp, "decoder.final_layernorm.weight")  # replicated: every rank writes the same rectangles
    assert norm.shape == (8,)
    keys = {p.key for p in sharded_params(rank_shapes(DIMS, tp), DIMS, tp, 0).values()}
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys  # the input norm, as megatron-core
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in keys


def test_a_range_outside_the_tensor_and_unknown_parameters_are_refused() -> None:
    params = sharded_params(rank_shapes(DIMS, 1), DIMS, 1, 0)
    with pytest.raises(ValueError, match=r"elements 0:999 of a tensor of 8"):
        params["decoder.final_layernorm.weight"].flat_range_chunks(0, 999)
    with pytest.raises(ValueError, match="decoder.layers.0.mlp.gate.weight: not a parameter of the distributed layout"):
        sharded_params([("decoder.layers.0.mlp.gate.weight", (4, 4))], DIMS, 1, 0)
