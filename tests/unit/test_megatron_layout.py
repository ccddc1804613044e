"""The Megatron-LM layout: HF <-> tensor-parallel shards, and what each rank sends in a weight sync (the per-rank files
and the converters: test_megatron_files.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlrunner.backends.megatron.layout import (
    DecoderDims,
    check_splittable,
    expected_megatron_keys,
    hf_to_megatron,
    hf_to_megatron_rank,
    iter_hf_to_megatron_rank,
    padded_vocab_size,
)
from rlrunner.backends.megatron.to_hf import MegatronShards, iter_megatron_to_hf, megatron_to_hf
from rlrunner.backends.megatron.weights import hf_blocks
from rlrunner.models.loading import build_hf_config
from rlrunner.models.tokenizer import build_char_tokenizer

from conftest import TINY_MODEL_CFG, assert_bit_equal
from megatron_models import SHAPES, build_test_model, model_cfg

# --- vocabulary padding and the split's preconditions ------------------------------------------------


def test_padded_vocab_size_is_megatrons() -> None:
    assert [padded_vocab_size(99, tp) for tp in (1, 2, 4)] == [128, 256, 512]
    assert padded_vocab_size(128, 1) == 128 and padded_vocab_size(129, 1) == 256
    assert padded_vocab_size(151_936, 2) == 152_064  # Qwen2.5's 151936: a multiple of 128 but not of 256
    assert padded_vocab_size(99, 2, divisible_by=1) == 100
    with pytest.raises(ValueError, match="must be positive"):
        padded_vocab_size(99, 0)


@pytest.mark.parametrize(
    "overrides, tp, message",
    [
        (
            {"num_attention_heads": 4, "num_key_value_heads": 2},
            4,
            r"cannot split num_key_value_heads \(query groups\)=2 over tensor_model_parallel_size=4: not divisible",
        ),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 48},
            4,
            "cannot split num_attention_heads=6 over tensor_model_parallel_size=4",
        ),
        (
            {"intermediate_size": 66, "num_key_value_heads": 4},
            4,
            "cannot split intermediate_size=66 over tensor_model_parallel_size=4",
        ),
        ({}, 0, "tensor_model_parallel_size must be a positive integer, got 0"),
    ],
)
def test_unsplittable_configs_are_named(overrides, tp, message) -> None:
    config = build_hf_config(
        model_cfg({**TINY_MODEL_CFG["override_config"], "num_attention_heads": 4, **overrides}), build_char_tokenizer()
    )
    with pytest.raises(ValueError, match=message):
        check_splittable(DecoderDims.from_config(config), tp)


def test_the_repo_tiny_test_model_cannot_split_its_single_kv_head() -> None:
    model, _ = build_test_model(TINY_MODEL_CFG["override_config"])
    with pytest.raises(ValueError, match=r"num_key_value_heads \(query groups\)=1 over tensor_model_parallel_size=2"):
        hf_to_megatron(model.state_dict(), model.config, 2)
    assert len(hf_to_megatron(model.state_dict(), model.config, 1)) == 1


def test_other_model_families_and_incomplete_states_are_refused(megatron_models) -> None:
    model = megatron_models["gqa"]
    qwen3 = {**model.config.to_dict(), "model_type": "qwen3"}
    with pytest.raises(ValueError, match="covers model types \\('qwen2', 'llama'\\), not 'qwen3'"):
        hf_to_megatron(model.state_dict(), qwen3, 1)
    # a Llama has no QKV bias: the Qwen2 model's biases are keys its layout does not map
    llama = {**model.config.to_dict(), "model_type": "llama"}
    with pytest.raises(ValueError, match="has 6 key\\(s\\) this layout does not map"):
        hf_to_megatron(model.state_dict(), llama, 1)
    for bias in ("attention_bias", "mlp_bias"):
        with pytest.raises(ValueError, match=f"a Llama model with {bias}=true has biases the Megatron layout"):
            hf_to_megatron(model.state_dict(), {**llama, bias: True}, 1)
    state = dict(model.state_dict())
    del state["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(
        ValueError, match=r"lacks 1 key\(s\) of a Qwen2 model, e.g. \['model.layers.1.self_attn.k_proj.bias'\]"
    ):
        hf_to_megatron(state, model.config, 1)
    state = {**model.state_dict(), "model.layers.0.self_attn.q_norm.weight": torch.ones(8)}  # a Qwen3 key
    with pytest.raises(ValueError, match="has 1 key\\(s\\) this layout does not map"):
        hf_to_megatron(state, model.config, 1)


# --- the layout of one rank ------------------------------------------------------------------------


def test_rank_dict_has_megatron_core_local_spec_names_and_shapes(megatron_models) -> None:
    model = megatron_models["gqa"]
    shards = hf_to_megatron(model.state_dict(), model.config, 2)
    layer = "decoder.layers.1."
    # megatron-core's GPTModel(local spec).state_dict() names, for the last layer and the model's ends
    assert [k for k in shards[1] if k.startswith(layer)] == [
        layer + "input_layernorm.weight",
        layer + "self_attention.linear_proj.weight",
        layer + "self_attention.linear_proj._extra_state",
        layer + "self_attention.linear_qkv.weight",
        layer + "self_attention.linear_qkv.bias",
        layer + "self_attention.linear_qkv._extra_state",
        layer + "pre_mlp_layernorm.weight",
        layer + "mlp.linear_fc1.weight",
        layer + "mlp.linear_fc1._extra_state",
        layer + "mlp.linear_fc2.weight",
        layer + "mlp.linear_fc2._extra_state",
    ]
    assert list(shards[0])[0] == "embedding.word_embeddings.weight"
    assert list(shards[0])[-3:] == [
        "decoder.final_layernorm.weight",
        "output_layer.weight",
        "output_layer._extra_state",
    ]
    tied = megatron_models["tied"]
    assert list(hf_to_megatron(tied.state_dict(), tied.config, 2)[1])[-2:] == [
        "decoder.final_layernorm.weight",
        "output_layer._extra_state",
    ]  # as megatron-core's tied GPTModel has them
    assert all(shards[r][k] is None for r in range(2) for k in shards[r] if k.endswith("_extra_state"))
    shapes = {k: tuple(v.shape) for k, v in shards[1].items() if v is not None}
    # 8 query heads in 4 groups of head_dim 8: each rank holds 2 groups = 2 x (2 q + 1 k + 1 v) heads = 64 rows
    assert shapes[layer + "self_attention.linear_qkv.weight"] == (64, 64)
    assert shapes[layer + "self_attention.linear_proj.weight"] == (64, 32)
    assert shapes[layer + "mlp.linear_fc1.weight"] == (128, 64) and shapes[layer + "mlp.linear_fc2.weight"] == (64, 64)
    assert (
        shapes["embedding.word_embeddings.weight"] == shapes["output_layer.weight"] == (128, 64)
    )  # 256 padded rows / 2
    # the vocabulary's 99 rows sit on rank 0; rank 1 holds only padding, all zero
    embed = model.state_dict()["model.embed_tokens.weight"]
    assert torch.equal(shards[0]["embedding.word_embeddings.weight"][:99], embed)
    assert not shards[0]["embedding.word_embeddings.weight"][99:].any() and not shards[1]["output_layer.weight"].any()
    # every tensor has its own storage: torch.save of a view would write the whole HF tensor
    assert all(
        v.untyped_storage().nbytes() == v.numel() * v.element_size() for v in shards[1].values() if v is not None
    )


def test_fused_qkv_is_interleaved_per_query_group_and_fc1_is_gate_then_up_per_rank(megatron_models) -> None:
    model = megatron_models["gqa"]
    state, d = model.state_dict(), 8  # head_dim
    shards = hf_to_megatron(state, model.config, 2)
    q, k, v = (state[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    qb, kb, vb = (state[f"model.layers.0.self_attn.{n}_proj.bias"] for n in "qkv")
    for rank in range(2):
        rows, bias = [], []
        for group in (2 * rank, 2 * rank + 1):  # 4 groups, 2 per rank; query heads 2g and 2g+1 use key head g
            rows += [
                q[2 * group * d : (2 * group + 2) * d],
                k[group * d : (group + 1) * d],
                v[group * d : (group + 1) * d],
            ]
            bias += [
                qb[2 * group * d : (2 * group + 2) * d],
                kb[group * d : (group + 1) * d],
                vb[group * d : (group + 1) * d],
            ]
        assert torch.equal(shards[rank]["decoder.layers.0.self_attention.linear_qkv.weight"], torch.cat(rows))
        assert torch.equal(shards[rank]["decoder.layers.0.self_attention.linear_qkv.bias"], torch.cat(bias))
        gate, up = state["model.layers.0.mlp.gate_proj.weight"], state["model.layers.0.mlp.up_proj.weight"]
        expected = torch.cat([gate[64 * rank : 64 * (rank + 1)], up[64 * rank : 64 * (rank + 1)]])
        assert torch.equal(shards[rank]["decoder.layers.0.mlp.linear_fc1.weight"], expected)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_round_trip_hf_to_tp_to_hf_is_bit_exact(megatron_models, shape, tp) -> None:
    model = megatron_models[shape]
    state = model.state_dict()
    shards = hf_to_megatron(state, model.config, tp)
    assert len(shards) == tp and set(shards[0]) == set(expected_megatron_keys(DecoderDims.from_config(model.config)))
    back = megatron_to_hf(shards, model.config)
    expected = {k: v for k, v in state.items() if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    assert_bit_equal(dict(sorted(back.items())), dict(sorted(expected.items())))  # q, k and v come out together


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_ranks_hf_blocks_assemble_into_the_merged_weights(megatron_models, shape, tp) -> None:
    """What the weight sync sends from each tensor-parallel rank (its own slices, nothing gathered) tiles every HF
    tensor exactly once and gives megatron_to_hf's weights, bit for bit (vocabulary padding never sent)."""
    model = megatron_models[shape]
    shards = hf_to_megatron(model.state_dict(), model.config, tp)
    expected = megatron_to_hf(shards, model.config)
    assembled = {name: torch.full_like(tensor, float("nan")) for name, tensor in expected.items()}
    covered = {name: torch.zeros(tensor.shape, dtype=torch.int64) for name, tensor in expected.items()}
    for rank, shard in enumerate(shards):
        blocks = hf_blocks({k: v for k, v in shard.items() if v is not None}, model.config, tp, rank)
        for name, shape_, dim, start, stop, block in blocks:
            assert tuple(shape_) == tuple(expected[name].shape), name
            assembled[name].narrow(dim, start, stop - start).copy_(block)
            covered[name].narrow(dim, start, stop - start).add_(1)
        names = [name for name, *_ in blocks]
        assert ("model.norm.weight" in names) == (rank == 0)  # replicated tensors come from one rank
    for name in expected:
        assert bool((covered[name] == 1).all()), f"{name} is not covered exactly once"
    assert_bit_equal(assembled, expected)


def test_streamed_merge_consumes_the_shards_and_its_meta_run_predicts_the_output(megatron_models) -> None:
    model = megatron_models["gqa"]
    shards = hf_to_megatron(model.state_dict(), model.config, 2)
    meta = [{k: v.to("meta") if v is not None else v for k, v in shard.items()} for shard in shards]
    layout = [(k, v.dtype, v.shape) for k, v in iter_megatron_to_hf(meta, model.config)]
    merged = []
    for key, tensor in iter_megatron_to_hf(shards, model.config, consume=True):
        merged.append((key, tensor.dtype, tensor.shape))
        assert torch.equal(tensor, model.state_dict()[key])
    assert merged == layout and len(merged) == len(model.state_dict())
    assert all(v is None for shard in shards for v in shard.values())  # every tensor released once merged


@pytest.mark.parametrize("saved_tp, tp", [(1, 2), (2, 1), (2, 4), (4, 2)])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_rank_of_another_tp_size_reads_its_part_from_the_saved_shards(megatron_models, shape, saved_tp, tp) -> None:
    """A load that reshards: each rank's dict, read slice by slice from shards saved at another size, is the one
    split from the HF weights, bit for bit (vocabulary padding zero at the new size too)."""
    model = megatron_models[shape]
    state = model.state_dict()
    shards = hf_to_megatron(state, model.config, saved_tp)
    for rank in range(tp):
        read = dict(iter_hf_to_megatron_rank(MegatronShards(shards, model.config), model.config, tp, rank))
        expected = hf_to_megatron_rank(state, model.config, tp, rank)
        assert list(read) == list(expected)
        assert [k for k, v in read.items() if v is None] == [k for k, v in expected.items() if v is None]
        assert_bit_equal(
            {k: v for k, v in read.items() if v is not None}, {k: v for k, v in expected.items() if v is not None}
        )


def test_a_slice_reads_only_the_saved_ranks_it_overlaps(megatron_models) -> None:
    """Rank 1's tensors on the meta device (no values to read): a slice that lies in rank 0's blocks still comes out
    right, so nothing of rank 1 was read; a slice that reaches rank 1 has no values."""
    model = megatron_models["gqa"]
    state = model.state_dict()
    shards = hf_to_megatron(state, model.config, 2)
    tensors = MegatronShards(
        [shards[0], {k: v if v is None else v.to("meta") for k, v in shards[1].items()}], model.config
    )
    gate, q, o = (
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
    )
    assert torch.equal(tensors.read(gate, 0, 3, 60), state[gate][3:60])  # rows 0..63 of 128 are rank 0's
    assert torch.equal(tensors.read(q, 0, 8, 32), state[q][8:32])  # query groups 0 and 1: rows 0..31 of 64
    assert torch.equal(tensors.read(o, 1, 0, 32), state[o][:, :32])  # input columns 0..31 of 64
    assert torch.equal(tensors.read("model.embed_tokens.weight"), state["model.embed_tokens.weight"])  # 99 rows of 128
    assert tensors.read("model.embed_tokens.weight", 0, 99, 99).shape == (0, 64)
    with pytest.raises((RuntimeError, NotImplementedError)):
        tensors.read(gate, 0, 60, 70).sum().item()  # rows 64..69 are rank 1's


def test_bfloat16_weights_round_trip_in_their_dtype(megatron_models) -> None:
    model = megatron_models["gqa"]
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    shards = hf_to_megatron(state, model.config, 2)
    assert shards[1]["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    back = megatron_to_hf(shards, model.config)
    assert_bit_equal(dict(sorted(back.items())), dict(sorted(state.items())))  # q, k and v come out together


def test_megatron_to_hf_names_inconsistent_shards(megatron_models) -> None:
    model = megatron_models["gqa"]
    shards = hf_to_megatron(model.state_dict(), model.config, 2)
    with pytest.raises(ValueError, match="cannot split num_attention_heads=8 over tensor_model_parallel_size=3"):
        megatron_to_hf(shards + [shards[0]], model.config)
    bad = [dict(shards[0]), shards[1]]
    bad[0]["decoder.layers.0.pre_mlp_layernorm.weight"] = bad[0]["decoder.layers.0.pre_mlp_layernorm.weight"] + 1
    with pytest.raises(
        ValueError, match="decoder.layers.0.pre_mlp_layernorm.weight is replicated but tensor-parallel rank 1 differs"
    ):
        megatron_to_hf(bad, model.config)
    with pytest.raises(
        ValueError,
        match=r"rank 0: decoder.layers.0.self_attention.linear_proj.weight has shape \(64, 64\), "
        r"expected \(64, 32\) for this config split 2 ways",
    ):
        megatron_to_hf([hf_to_megatron_rank(model.state_dict(), model.config, 1, 0), shards[1]], model.config)
    missing = dict(shards[1])
    del missing["decoder.final_layernorm.weight"]
    with pytest.raises(
        ValueError, match=r"tensor-parallel rank 1 lacks 1 key\(s\), e.g. \['decoder.final_layernorm.weight'\]"
    ):
        megatron_to_hf([shards[0], missing], model.config)


def test_tp2_shards_compute_the_hf_decoder_layer_embedding_and_logits(megatron_models) -> None:
    """The split is the right math: running column-parallel pieces side by side (outputs concatenated) and
    row-parallel pieces (partial outputs summed, as the all-reduce would) reproduces HF's modules."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    model = megatron_models["gqa"]
    config, tp, d = model.config, 2, 8
    shards = hf_to_megatron(model.state_dict(), config, tp)
    hf_layer = model.model.layers[0]
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 64, generator=generator)
    positions = torch.arange(5).expand(2, 5)
    cos, sin = model.model.rotary_emb(x, positions)
    layer = "decoder.layers.0."

    def rms(h, weight):
        return weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)

    with torch.no_grad():
        expected = hf_layer(x, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
        expected = expected[0] if isinstance(expected, tuple) else expected
        attn_out = mlp_out = 0
        normed = rms(x, shards[0][layer + "input_layernorm.weight"])
        for shard in shards:  # attention: each rank owns whole query groups, so it attends on its own
            qkv = F.linear(
                normed,
                shard[layer + "self_attention.linear_qkv.weight"],
                shard[layer + "self_attention.linear_qkv.bias"],
            )
            qkv = qkv.view(2, 5, -1, 4 * d)  # [batch, seq, local groups, (2 q + k + v heads) x head_dim]
            q, k, v = qkv.split([2 * d, d, d], dim=-1)
            q = q.reshape(2, 5, -1, d).transpose(1, 2)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            local = F.scaled_dot_product_attention(
                q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
            )
            attn_out = attn_out + F.linear(
                local.transpose(1, 2).reshape(2, 5, -1), shard[layer + "self_attention.linear_proj.weight"]
            )
        h = x + attn_out
        normed = rms(h, shards[0][layer + "pre_mlp_layernorm.weight"])
        for shard in shards:
            gate, up = F.linear(normed, shard[layer + "mlp.linear_fc1.weight"]).chunk(2, dim=-1)
            mlp_out = mlp_out + F.linear(F.silu(gate) * up, shard[layer + "mlp.linear_fc2.weight"])
        # the MLP alone against HF's MLP, then the whole layer
        assert torch.allclose(mlp_out, hf_layer.mlp(normed), atol=1e-5)
        assert torch.allclose(h + mlp_out, expected, atol=1e-5)
        assert not torch.allclose(attn_out, torch.zeros_like(attn_out))

        # vocab-parallel embedding: each rank looks up the ids in its row range, the rest are zero, then summed
        ids = torch.tensor([[0, 5, 98, 42, 7]])
        rows = shards[0]["embedding.word_embeddings.weight"].shape[0]
        embedded = 0
        for rank, shard in enumerate(shards):
            local_ids = ids - rank * rows
            inside = (local_ids >= 0) & (local_ids < rows)
            embedded = (
                embedded
                + F.embedding(local_ids.clamp(0, rows - 1), shard["embedding.word_embeddings.weight"])
                * inside[..., None]
            )
        assert torch.equal(embedded, model.model.embed_tokens(ids))
        # vocab-parallel output layer: logits concatenated over ranks, padding columns cut
        logits = torch.cat([F.linear(x, shard["output_layer.weight"]) for shard in shards], dim=-1)
        assert logits.shape[-1] == 256 and not logits[..., 99:].any()
        assert torch.allclose(logits[..., :99], model.lm_head(x), atol=1e-6)
