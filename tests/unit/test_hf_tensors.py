"""Initial weights read by name and slice: a slice is always the same indices of the same whole tensor, whichever
source (seeded init, safetensors folder, state dict) and however it is cut."""

from __future__ import annotations

import pytest
import torch

from rlrunner.models import hf_tensors
from rlrunner.models.hf_tensors import SafetensorsFolder, SeededInit, StateDict
from rlrunner.models.loading import build_hf_config, build_model, build_tokenizer, meta_model

from conftest import assert_bit_equal

TINY = {"path": None, "dtype": "float32", "attn_implementation": "sdpa", "override_config": {}}


def _config(**overrides):
    cfg = {**TINY, "override_config": overrides}
    return build_hf_config(cfg, build_tokenizer(cfg))


def test_seeded_init_slices_are_the_whole_tensors_rows_and_columns(monkeypatch):
    monkeypatch.setattr(hf_tensors, "BLOCK_ELEMENTS", 300)  # several blocks per tensor at this tiny size
    config = _config()
    init = SeededInit(meta_model(config, "sdpa", torch.float32), config, seed=5)
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.self_attn.q_proj.bias",
    ):
        whole = init.read(name)
        assert whole.shape == init.shape(name)
        rows = whole.shape[0]
        for start, stop in ((0, rows), (1, rows // 2), (rows // 3, rows - 1), (rows, rows)):
            assert torch.equal(init.read(name, 0, start, stop), whole[start:stop]), (name, start, stop)
        if whole.dim() == 2:
            cols = whole.shape[1]
            assert torch.equal(init.read(name, 1, 3, cols - 2), whole[:, 3 : cols - 2])
    # HF's distributions: normal weights, zero biases and padding row, unit norms
    embed = init.read("model.embed_tokens.weight")
    assert embed[config.pad_token_id].abs().sum() == 0 and 0.015 < embed.std() < 0.025
    assert torch.equal(init.read("model.norm.weight"), torch.ones(config.hidden_size))
    assert not init.read("model.layers.0.self_attn.q_proj.bias").any()


def test_seeded_init_depends_on_seed_and_name_only():
    config = _config()
    plan = meta_model(config, "sdpa", torch.float32)
    a, b, other = SeededInit(plan, config, 1), SeededInit(plan, config, 1), SeededInit(plan, config, 2)
    name = "model.layers.0.mlp.gate_proj.weight"
    assert torch.equal(a.read(name), b.read(name)) and not torch.equal(a.read(name), other.read(name))
    assert not torch.equal(a.read(name), a.read("model.layers.1.mlp.gate_proj.weight"))
    # the whole model built from it holds exactly these tensors, and the caller's RNG is left alone
    before = torch.random.get_rng_state()
    model = build_model(TINY, build_tokenizer(TINY), seed=1)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert_bit_equal(model.state_dict(), {key: a.read(key) for key in model.state_dict()})


def test_tied_output_layer_reads_the_embedding():
    config = _config(tie_word_embeddings=True)
    init = SeededInit(meta_model(config, "sdpa", torch.float32), config, 0)
    assert torch.equal(init.read("lm_head.weight", 0, 2, 5), init.read("model.embed_tokens.weight", 0, 2, 5))
    model = build_model({**TINY, "override_config": {"tie_word_embeddings": True}}, build_tokenizer(TINY), seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_safetensors_and_state_dict_slices_match_the_saved_model(tmp_path):
    model = build_model(TINY, build_tokenizer(TINY), seed=3)
    model.save_pretrained(tmp_path)
    state = model.state_dict()
    folder, memory = SafetensorsFolder(tmp_path, model.config), StateDict(state)
    for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.o_proj.weight", "model.norm.weight"):
        for source in (folder, memory):
            assert source.shape(name) == tuple(state[name].shape)
            assert torch.equal(source.read(name), state[name])
            assert torch.equal(source.read(name, 0, 1, 4), state[name][1:4])
            if state[name].dim() == 2:
                assert torch.equal(source.read(name, 1, 2, 7), state[name][:, 2:7])
    with pytest.raises(KeyError, match="no tensor 'model.nope'"):
        folder.read("model.nope")
    with pytest.raises(ValueError, match="outside its shape"):
        folder.read("model.norm.weight", 0, 0, 10_000)
