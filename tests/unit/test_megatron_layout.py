"""The Megatron-LM layout: HF <-> tensor-parallel shards, what each rank sends in a weight sync, the per-rank files and
the converters (megatron-core's own reading of our files: tests/integration/test_megatron_core.py)."""

from __future__ import annotations

import argparse
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_MODEL_CFG, load_toolkit
from megatron_models import GQA, SHAPES, TIED, build_test_model, model_cfg, save_hf_folder
from rlrunner.backends.megatron import files as mf
from rlrunner.models.loading import build_hf_config
from rlrunner.backends.megatron.weights import hf_blocks
from rlrunner.backends.megatron.layout import (
    Qwen2Dims,
    check_splittable,
    expected_megatron_keys,
    hf_to_megatron,
    hf_to_megatron_rank,
    iter_megatron_to_hf,
    megatron_to_hf,
    padded_vocab_size,
)
from rlrunner.models.tokenizer import build_char_tokenizer
from rlrunner.storage import open_storage
from rlrunner.utils.rng import capture_rng, restore_rng

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
        ({"num_attention_heads": 4, "num_key_value_heads": 2}, 4,
         r"cannot split num_key_value_heads \(query groups\)=2 over tensor_model_parallel_size=4: not divisible"),
        ({"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 48}, 4,
         "cannot split num_attention_heads=6 over tensor_model_parallel_size=4"),
        ({"intermediate_size": 66, "num_key_value_heads": 4}, 4, "cannot split intermediate_size=66 over tensor_model_parallel_size=4"),
        ({}, 0, "tensor_model_parallel_size must be a positive integer, got 0"),
    ],
)
def test_unsplittable_configs_are_named(overrides, tp, message) -> None:
    config = build_hf_config(model_cfg({**TINY_MODEL_CFG["override_config"], "num_attention_heads": 4, **overrides}),
                             build_char_tokenizer())
    with pytest.raises(ValueError, match=message):
        check_splittable(Qwen2Dims.from_config(config), tp)


def test_the_repo_tiny_test_model_cannot_split_its_single_kv_head() -> None:
    model, _ = build_test_model(TINY_MODEL_CFG["override_config"])
    with pytest.raises(ValueError, match=r"num_key_value_heads \(query groups\)=1 over tensor_model_parallel_size=2"):
        hf_to_megatron(model.state_dict(), model.config, 2)
    assert len(hf_to_megatron(model.state_dict(), model.config, 1)) == 1


def test_other_model_families_and_incomplete_states_are_refused(megatron_models) -> None:
    model = megatron_models["gqa"]
    llama = {**model.config.to_dict(), "model_type": "llama"}
    with pytest.raises(ValueError, match="covers model types \\('qwen2',\\), not 'llama'"):
        hf_to_megatron(model.state_dict(), llama, 1)
    state = dict(model.state_dict())
    del state["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"lacks 1 key\(s\) of a Qwen2 model, e.g. \['model.layers.1.self_attn.k_proj.bias'\]"):
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
        layer + "self_attention.linear_proj.weight", layer + "self_attention.linear_proj._extra_state",
        layer + "self_attention.linear_qkv.weight", layer + "self_attention.linear_qkv.bias",
        layer + "self_attention.linear_qkv._extra_state",
        layer + "pre_mlp_layernorm.weight",
        layer + "mlp.linear_fc1.weight", layer + "mlp.linear_fc1._extra_state",
        layer + "mlp.linear_fc2.weight", layer + "mlp.linear_fc2._extra_state",
    ]
    assert list(shards[0])[0] == "embedding.word_embeddings.weight"
    assert list(shards[0])[-3:] == ["decoder.final_layernorm.weight", "output_layer.weight", "output_layer._extra_state"]
    tied = megatron_models["tied"]
    assert list(hf_to_megatron(tied.state_dict(), tied.config, 2)[1])[-2:] == [
        "decoder.final_layernorm.weight", "output_layer._extra_state"]  # as megatron-core's tied GPTModel has them
    assert all(shards[r][k] is None for r in range(2) for k in shards[r] if k.endswith("_extra_state"))
    shapes = {k: tuple(v.shape) for k, v in shards[1].items() if v is not None}
    # 8 query heads in 4 groups of head_dim 8: each rank holds 2 groups = 2 x (2 q + 1 k + 1 v) heads = 64 rows
    assert shapes[layer + "self_attention.linear_qkv.weight"] == (64, 64)
    assert shapes[layer + "self_attention.linear_proj.weight"] == (64, 32)
    assert shapes[layer + "mlp.linear_fc1.weight"] == (128, 64) and shapes[layer + "mlp.linear_fc2.weight"] == (64, 64)
    assert shapes["embedding.word_embeddings.weight"] == shapes["output_layer.weight"] == (128, 64)  # 256 padded rows / 2
    # the vocabulary's 99 rows sit on rank 0; rank 1 holds only padding, all zero
    embed = model.state_dict()["model.embed_tokens.weight"]
    assert torch.equal(shards[0]["embedding.word_embeddings.weight"][:99], embed)
    assert not shards[0]["embedding.word_embeddings.weight"][99:].any() and not shards[1]["output_layer.weight"].any()
    # every tensor has its own storage: torch.save of a view would write the whole HF tensor
    assert all(v.untyped_storage().nbytes() == v.numel() * v.element_size() for v in shards[1].values() if v is not None)


def test_fused_qkv_is_interleaved_per_query_group_and_fc1_is_gate_then_up_per_rank(megatron_models) -> None:
    model = megatron_models["gqa"]
    state, d = model.state_dict(), 8  # head_dim
    shards = hf_to_megatron(state, model.config, 2)
    q, k, v = (state[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    qb, kb, vb = (state[f"model.layers.0.self_attn.{n}_proj.bias"] for n in "qkv")
    for rank in range(2):
        rows, bias = [], []
        for group in (2 * rank, 2 * rank + 1):  # 4 groups, 2 per rank; query heads 2g and 2g+1 use key head g
            rows += [q[2 * group * d:(2 * group + 2) * d], k[group * d:(group + 1) * d], v[group * d:(group + 1) * d]]
            bias += [qb[2 * group * d:(2 * group + 2) * d], kb[group * d:(group + 1) * d], vb[group * d:(group + 1) * d]]
        assert torch.equal(shards[rank]["decoder.layers.0.self_attention.linear_qkv.weight"], torch.cat(rows))
        assert torch.equal(shards[rank]["decoder.layers.0.self_attention.linear_qkv.bias"], torch.cat(bias))
        gate, up = state["model.layers.0.mlp.gate_proj.weight"], state["model.layers.0.mlp.up_proj.weight"]
        expected = torch.cat([gate[64 * rank:64 * (rank + 1)], up[64 * rank:64 * (rank + 1)]])
        assert torch.equal(shards[rank]["decoder.layers.0.mlp.linear_fc1.weight"], expected)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_round_trip_hf_to_tp_to_hf_is_bit_exact(megatron_models, shape, tp) -> None:
    model = megatron_models[shape]
    state = model.state_dict()
    shards = hf_to_megatron(state, model.config, tp)
    assert len(shards) == tp and set(shards[0]) == set(expected_megatron_keys(Qwen2Dims.from_config(model.config)))
    back = megatron_to_hf(shards, model.config)
    expected = {k: v for k, v in state.items() if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    assert set(back) == set(expected)
    for key, tensor in expected.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


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
    for name, tensor in expected.items():
        assert bool((covered[name] == 1).all()), f"{name} is not covered exactly once"
        assert torch.equal(assembled[name], tensor), name


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


def test_bfloat16_weights_round_trip_in_their_dtype(megatron_models) -> None:
    model = megatron_models["gqa"]
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    shards = hf_to_megatron(state, model.config, 2)
    assert shards[1]["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    back = megatron_to_hf(shards, model.config)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_megatron_to_hf_names_inconsistent_shards(megatron_models) -> None:
    model = megatron_models["gqa"]
    shards = hf_to_megatron(model.state_dict(), model.config, 2)
    with pytest.raises(ValueError, match="cannot split num_attention_heads=8 over tensor_model_parallel_size=3"):
        megatron_to_hf(shards + [shards[0]], model.config)
    bad = [dict(shards[0]), shards[1]]
    bad[0]["decoder.layers.0.pre_mlp_layernorm.weight"] = bad[0]["decoder.layers.0.pre_mlp_layernorm.weight"] + 1
    with pytest.raises(ValueError, match="decoder.layers.0.pre_mlp_layernorm.weight is replicated but tensor-parallel rank 1 differs"):
        megatron_to_hf(bad, model.config)
    with pytest.raises(ValueError, match=r"rank 0: decoder.layers.0.self_attention.linear_proj.weight has shape \(64, 64\), "
                                         r"expected \(64, 32\) for this config split 2 ways"):
        megatron_to_hf([hf_to_megatron_rank(model.state_dict(), model.config, 1, 0), shards[1]], model.config)
    missing = dict(shards[1])
    del missing["decoder.final_layernorm.weight"]
    with pytest.raises(ValueError, match=r"tensor-parallel rank 1 lacks 1 key\(s\), e.g. \['decoder.final_layernorm.weight'\]"):
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
            qkv = F.linear(normed, shard[layer + "self_attention.linear_qkv.weight"], shard[layer + "self_attention.linear_qkv.bias"])
            qkv = qkv.view(2, 5, -1, 4 * d)  # [batch, seq, local groups, (2 q + k + v heads) x head_dim]
            q, k, v = qkv.split([2 * d, d, d], dim=-1)
            q = q.reshape(2, 5, -1, d).transpose(1, 2)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            local = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
            attn_out = attn_out + F.linear(local.transpose(1, 2).reshape(2, 5, -1), shard[layer + "self_attention.linear_proj.weight"])
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
            embedded = embedded + F.embedding(local_ids.clamp(0, rows - 1), shard["embedding.word_embeddings.weight"]) * inside[..., None]
        assert torch.equal(embedded, model.model.embed_tokens(ids))
        # vocab-parallel output layer: logits concatenated over ranks, padding columns cut
        logits = torch.cat([F.linear(x, shard["output_layer.weight"]) for shard in shards], dim=-1)
        assert logits.shape[-1] == 256 and not logits[..., 99:].any()
        assert torch.allclose(logits[..., :99], model.lm_head(x), atol=1e-6)


# --- the per-rank files -----------------------------------------------------------------------------


def test_names_follow_megatron() -> None:
    assert mf.rank_file(50, 1) == "iter_0000050/mp_rank_01/model_optim_rng.pt"
    assert mf.iteration_dir(0) == "iter_0000000" and mf.rank_dir(12) == "mp_rank_12"
    assert mf.TRACKER_FILE == "latest_checkpointed_iteration.txt"


def test_args_record_dimensions_padding_and_parallel_sizes(megatron_models) -> None:
    args = mf.megatron_args(megatron_models["gqa"].config, tp=2, dp=2)
    assert isinstance(args, argparse.Namespace)
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads) == (2, 64, 128, 8)
    assert (args.num_query_groups, args.group_query_attention, args.kv_channels) == (4, True, 8)
    assert (args.vocab_size, args.padded_vocab_size, args.make_vocab_size_divisible_by) == (99, 256, 128)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == (2, 1, 2)
    assert args.untie_embeddings_and_output_weights and args.add_qkv_bias and not args.add_bias_linear and args.swiglu
    assert (args.normalization, args.rotary_base, args.params_dtype) == ("RMSNorm", 10000, torch.float32)
    assert not mf.megatron_args(megatron_models["tied"].config, tp=1).untie_embeddings_and_output_weights


def _rank_file_round_trip(storage, root, model) -> None:
    args = mf.megatron_args(model.config, tp=2)
    shards = hf_to_megatron(model.state_dict(), model.config, 2)
    params = [torch.nn.Parameter(v.clone()) for v in shards[1].values() if v is not None]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    sum(p.sum() for p in params).backward()
    optimizer.step()
    scheduler = {"max_lr": 1e-3, "num_steps": 1}
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    rng = [mf.megatron_rng_entry(capture_rng())]
    draws = (random.random(), np.random.rand(), torch.rand(1))
    records = mf.write_rank_file(storage, root, 50, 1, shards[1], args, optimizer.state_dict(), scheduler, rng)
    name = "iter_0000050/mp_rank_01/model_optim_rng.pt"
    assert list(records) == [name]
    assert records[name] == storage.checksum(storage.join(root, name))  # size and CRC-32 computed while writing
    for mmap in (False, True):
        state = mf.read_rank_file(storage, storage.join(root, name), mmap=mmap)
        assert set(state) == {"args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler", "rng_state"}
        assert (state["checkpoint_version"], state["iteration"], state["opt_param_scheduler"]) == (3.0, 50, scheduler)
        assert state["args"] == args
        assert list(state["model"]) == list(shards[1])
        assert all(torch.equal(state["model"][k], v) for k, v in shards[1].items() if v is not None)
        assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
        assert isinstance(state["rng_state"], list) and len(state["rng_state"]) == 1
        assert set(state["rng_state"][0]) >= {"random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states"}
        restore_rng(mf.rng_from_megatron_entry(state["rng_state"][0]))
        assert (random.random(), np.random.rand(), torch.rand(1)) == draws


def test_rank_file_round_trip_local(tmp_path, megatron_models) -> None:
    storage = open_storage(str(tmp_path))
    _rank_file_round_trip(storage, storage.url, megatron_models["gqa"])
    # the allow-list is exactly what the file needs: weights_only's own types plus argparse.Namespace
    path = tmp_path / "iter_0000050/mp_rank_01/model_optim_rng.pt"
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) == ["argparse.Namespace"]
    assert [f"{c.__module__}.{c.__qualname__}" for c in mf.ALLOWED_GLOBALS] == ["argparse.Namespace"]
    with pytest.raises(pickle.UnpicklingError, match="argparse.Namespace"):  # without the allow-list it is refused
        torch.load(path, weights_only=True)


def test_rank_file_round_trip_on_s3(s3_store, megatron_models) -> None:
    url, options = s3_store
    storage = open_storage(url, options)
    _rank_file_round_trip(storage, storage.url, megatron_models["tied"])


class _Planted:
    """Unpickling it would create a file: proof that the load ran code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_file_holding_another_class_is_refused_and_not_run(tmp_path) -> None:
    from fractions import Fraction

    storage = open_storage(str(tmp_path))
    marker = tmp_path / "pwned"
    for name, payload in (("planted.pt", _Planted(str(marker))), ("fraction.pt", Fraction(1, 3))):
        with open(tmp_path / name, "wb") as handle:
            torch.save({"args": argparse.Namespace(tensor_model_parallel_size=1), "model": {}, "extra": payload}, handle)
        for mmap in (False, True):
            with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
                mf.read_rank_file(storage, str(tmp_path / name), mmap=mmap)
    assert not marker.exists()


def test_save_refuses_what_the_reader_would_refuse(tmp_path, megatron_models) -> None:
    from fractions import Fraction

    storage = open_storage(str(tmp_path))
    args = mf.megatron_args(megatron_models["gqa"].config, tp=1)
    with pytest.raises(TypeError, match=r"\['opt_param_scheduler'\]\['ratio'\] holds a fractions.Fraction"):
        mf.write_rank_file(storage, storage.url, 1, 0, {}, args, opt_param_scheduler={"ratio": Fraction(1, 2)})
    with pytest.raises(ValueError, match="tensor-parallel rank 1 is outside 0..0"):
        mf.write_rank_file(storage, storage.url, 1, 1, {}, args)
    assert storage.walk(storage.url) == {}


def test_reading_checks_tracker_ranks_and_iteration(tmp_path, megatron_models) -> None:
    model = megatron_models["gqa"]
    storage = open_storage(str(tmp_path))
    root = storage.url
    records = mf.write_model_checkpoint(storage, root, model.state_dict(), model.config, tp=2, iteration=3)
    assert sorted(records) == ["iter_0000003/mp_rank_00/model_optim_rng.pt", "iter_0000003/mp_rank_01/model_optim_rng.pt",
                               "latest_checkpointed_iteration.txt"]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3"
    iteration, states = mf.read_rank_states(storage, root)
    assert iteration == 3 and [s["args"].tensor_model_parallel_size for s in states] == [2, 2]
    assert "optimizer" not in states[0] and "rng_state" not in states[0]  # model only
    assert mf.find_root(storage, root) == root
    # a global_step_N folder whose actor/ holds the checkpoint
    (tmp_path / "global_step_3").mkdir()
    (tmp_path / "iter_0000003").rename(tmp_path / "global_step_3" / "iter_0000003")
    with pytest.raises(FileNotFoundError, match="no iter_0000003/mp_rank_\\* folders under"):
        mf.read_rank_states(storage, root)
    (tmp_path / "global_step_3").rename(tmp_path / "actor")
    (tmp_path / "latest_checkpointed_iteration.txt").rename(tmp_path / "actor" / "latest_checkpointed_iteration.txt")
    actor = storage.join(root, "actor")
    assert mf.find_root(storage, root) == actor
    (tmp_path / "actor/iter_0000003/mp_rank_01").rename(tmp_path / "actor/iter_0000003/mp_rank_02")
    with pytest.raises(ValueError, match=r"has tensor-parallel ranks \[0, 2\], not 0..1"):
        mf.read_rank_states(storage, actor)
    (tmp_path / "actor/iter_0000003/mp_rank_02").rename(tmp_path / "actor/iter_0000003/mp_rank_01")
    (tmp_path / "actor/iter_0000003").rename(tmp_path / "actor/iter_0000004")
    (tmp_path / "actor/latest_checkpointed_iteration.txt").write_text("4\n")
    with pytest.raises(ValueError, match="holds iteration 3, its folder says 4"):
        mf.read_rank_states(storage, actor)
    (tmp_path / "actor/latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(ValueError, match="holds 'release', not an iteration number"):
        mf.read_rank_states(storage, actor)


# --- the converters ---------------------------------------------------------------------------------


def test_streamed_safetensors_file_is_what_safetensors_reads(tmp_path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    tool = load_toolkit("convert_megatron_to_hf")
    state = {"b.weight": torch.randn(3, 5).to(torch.bfloat16), "a.bias": torch.arange(7, dtype=torch.int64),
             "c.scale": torch.randn(()), "d.empty": torch.zeros(0, 4, dtype=torch.float16), "e.t": torch.randn(4, 6).t()}
    record = tool.write_safetensors(open_storage(str(tmp_path)), str(tmp_path / "w.safetensors"), list(state.items()))
    assert record == open_storage(str(tmp_path)).checksum(str(tmp_path / "w.safetensors"))
    loaded = load_file(str(tmp_path / "w.safetensors"))
    assert set(loaded) == set(state) and all(loaded[k].dtype == v.dtype and torch.equal(loaded[k], v) for k, v in state.items())
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as reader:
        assert reader.metadata() == {"format": "pt"}  # what transformers checks before loading
    with pytest.raises(ValueError, match="x has dtype torch.complex64, which this writer does not store"):
        tool.write_safetensors(open_storage(str(tmp_path)), str(tmp_path / "bad.safetensors"), [("x", torch.zeros(2, dtype=torch.complex64))])
    layout = [("a", torch.zeros(2, device="meta")), ("b", torch.zeros(3, device="meta"))]
    with pytest.raises(ValueError, match=r"expected b torch.float32 \(3,\) next, got c"):
        tool.write_safetensors(open_storage(str(tmp_path)), str(tmp_path / "bad.safetensors"), layout,
                               iter([("a", torch.ones(2)), ("c", torch.ones(3))]))
    assert not (tmp_path / "bad.safetensors").exists()  # a failed write leaves no file


def _assert_same_model(folder: Path, model) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = load_file(str(folder / "model.safetensors"))
    expected = {k: v for k, v in model.state_dict().items() if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    assert set(weights) == set(expected) and all(torch.equal(weights[k], v) for k, v in expected.items())
    reloaded = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = torch.tensor([tokenizer("12+30=42\n", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_converters_end_to_end_local(tmp_path, capsys) -> None:
    to_megatron, to_hf = load_toolkit("convert_hf_to_megatron"), load_toolkit("convert_megatron_to_hf")
    hf, model = save_hf_folder(tmp_path / "hf", TIED)
    actor = tmp_path / "global_step_0" / "actor"
    assert to_megatron.main(["--hf_path", str(hf), "--output_path", str(actor), "--tensor_model_parallel_size", "4"]) == 0
    files = sorted(str(p.relative_to(actor)) for p in actor.rglob("*") if p.is_file())
    assert [f for f in files if not f.startswith("huggingface/")] == [
        f"iter_0000000/mp_rank_0{r}/model_optim_rng.pt" for r in range(4)] + ["latest_checkpointed_iteration.txt"]
    assert {"huggingface/config.json", "huggingface/tokenizer.json"} <= set(files)
    assert not any(f.endswith(".safetensors") for f in files)
    state = mf.load_file(str(actor / "iter_0000000/mp_rank_03/model_optim_rng.pt"))
    assert state["args"].padded_vocab_size == 512 and state["model"]["embedding.word_embeddings.weight"].shape == (128, 32)
    out = tmp_path / "exported"
    assert to_hf.main(["--ckpt_path", str(tmp_path / "global_step_0"), "--output_path", str(out)]) == 0
    _assert_same_model(out, model)
    capsys.readouterr()
    # refusals: one line each, exit code 2
    assert to_hf.main(["--ckpt_path", str(tmp_path / "global_step_0"), "--output_path", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"convert_megatron_to_hf: error: {out} exists and is not an empty folder " \
                                              "(stale weight files would mix with the new ones)"
    assert to_megatron.main(["--hf_path", str(hf), "--output_path", str(actor), "--tensor_model_parallel_size", "2"]) == 2
    assert "already holds a Megatron checkpoint" in capsys.readouterr().err
    assert to_megatron.main(["--hf_path", str(hf), "--output_path", str(tmp_path / "x"), "--tensor_model_parallel_size", "8"]) == 2
    assert capsys.readouterr().err.strip() == ("convert_hf_to_megatron: error: cannot split num_attention_heads=4 over "
                                              "tensor_model_parallel_size=8: not divisible")
    assert not (tmp_path / "x").exists()


def test_converters_end_to_end_on_s3(tmp_path, s3_store) -> None:
    import json

    url, options = s3_store
    to_megatron, to_hf = load_toolkit("convert_hf_to_megatron"), load_toolkit("convert_megatron_to_hf")
    hf, model = save_hf_folder(tmp_path / "hf", GQA)
    flags = ["--storage_options", json.dumps(options)]
    assert to_megatron.main(["--hf_path", str(hf), "--output_path", url, "--tensor_model_parallel_size", "2", *flags]) == 0
    storage = open_storage(url, options)
    assert storage.read_bytes(storage.join(url, "latest_checkpointed_iteration.txt")) == b"0"
    out = tmp_path / "exported"
    assert to_hf.main(["--ckpt_path", url, "--output_path", str(out), *flags]) == 0
    _assert_same_model(out, model)


# --- megatron-core reads our files (the `megatron` test extra) -------------------------------------------


