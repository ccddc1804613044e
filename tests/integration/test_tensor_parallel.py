"""The tensor-parallel Qwen2 model is the HF model's math: same logits, and a training step through the shards
gives the HF gradients split by the Megatron layout (real gloo process groups, one process per TP rank)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ports import free_port
from spawned_ranks import spawn_ranks

from rlrunner.backends.megatron.layout import hf_to_megatron_rank
from rlrunner.backends.megatron.model import TPCausalLM
from rlrunner.backends.prompt_packing import pack_shared_prompts

from conftest import assert_bit_equal
from megatron_models import SHAPES, build_test_model

# left padding on the first row: its padding queries see no key at all (HF and we must agree there too)
IDS = torch.tensor([[0, 0, 0, 12, 40, 98, 7, 3], [5, 17, 42, 61, 2, 9, 0, 0]])
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0]])


def _loss(logits: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the real (unpadded) targets."""
    keep = (MASK[:, :-1] * MASK[:, 1:]).bool()
    return F.cross_entropy(logits[:, :-1][keep], IDS[:, 1:][keep])


def _worker(rank: int, world: int, port: int, shape: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _check_rank(rank, world, shape)
    finally:
        dist.destroy_process_group()


def _check_rank(rank: int, world: int, shape: str) -> None:
    hf, _ = build_test_model(SHAPES[shape])  # the same seed on every rank: the same model
    hf.train()
    config = hf.config
    tp_model = TPCausalLM(config, dist.group.WORLD)
    shard = hf_to_megatron_rank(hf.state_dict(), config, world, rank)
    assert set(tp_model.state_dict()) == {k for k in shard if not k.endswith("_extra_state")}
    tp_model.load_megatron_shard(shard)

    # forward: the real vocabulary only, equal to HF's everywhere (padding positions included)
    hf_logits = hf(input_ids=IDS, attention_mask=MASK, use_cache=False).logits
    logits = tp_model(IDS, attention_mask=MASK)
    assert logits.shape == hf_logits.shape == (2, 8, 99)
    assert torch.allclose(logits, hf_logits, atol=1e-5), (logits - hf_logits).abs().max()
    # no mask = causal over every token, as HF's; explicit positions (the rollout's, counted from the first real
    # token) are used as HF uses them
    assert torch.allclose(tp_model(IDS), hf(input_ids=IDS, use_cache=False).logits, atol=1e-5)
    positions = (MASK.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        shifted = hf(input_ids=IDS, attention_mask=MASK, position_ids=positions, use_cache=False).logits
        assert torch.allclose(tp_model(IDS, MASK, positions), shifted, atol=1e-5)
        assert not torch.allclose(shifted, hf_logits, atol=1e-3)
        # rows packed by prompt: a boolean 4D mask and positions that restart, as HF takes them
        rows = torch.tensor([[12, 40, 98, 7, 3], [12, 40, 5, 17, 0]])
        packed = pack_shared_prompts(rows, [2, 2], [5, 4], [[0, 1]])
        inputs = (packed.input_ids, packed.attention_mask, packed.position_ids)
        expected = hf(input_ids=inputs[0], attention_mask=inputs[1], position_ids=inputs[2], use_cache=False).logits
        assert torch.allclose(tp_model(*inputs), expected, atol=1e-5)

    # backward: every shard's gradient is the HF gradient split by the layout
    _loss(hf_logits).backward()
    loss = _loss(logits)
    loss.backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    expected = hf_to_megatron_rank(hf_grads, config, world, rank)
    grads = {name: p.grad for name, p in tp_model.named_parameters()}
    assert set(grads) == {k for k in expected if not k.endswith("_extra_state")}
    for name, grad in grads.items():
        vocab_parallel = name in ("embedding.word_embeddings.weight", "output_layer.weight")  # rank 1: all padding
        assert vocab_parallel or grad.abs().sum() > 0, name
        assert torch.allclose(grad, expected[name], atol=1e-5), (name, (grad - expected[name]).abs().max())

    # activation recomputation: each layer runs again in the backward (counted as it starts: a recomputation stops
    # once it has the saved tensors back, before forward hooks), and the gradients are the same bit for bit
    calls = []
    hooks = [layer.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in tp_model.decoder.layers]
    tp_model.zero_grad()
    tp_model.gradient_checkpointing = True
    _loss(tp_model(IDS, attention_mask=MASK)).backward()
    tp_model.gradient_checkpointing = False
    for hook in hooks:
        hook.remove()
    assert len(calls) == 2 * len(tp_model.decoder.layers)
    assert_bit_equal({name: p.grad for name, p in tp_model.named_parameters()}, grads)

    # one SGD step on both: the shards stay the HF weights split by the layout, and the logits agree again
    for model in (hf, tp_model):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
    stepped = hf_to_megatron_rank(hf.state_dict(), config, world, rank)
    for name, tensor in tp_model.state_dict().items():
        assert torch.allclose(tensor, stepped[name], atol=1e-5), name
    assert not torch.allclose(stepped["decoder.final_layernorm.weight"], shard["decoder.final_layernorm.weight"])
    with torch.no_grad():
        assert torch.allclose(tp_model(IDS, MASK), hf(input_ids=IDS, attention_mask=MASK).logits, atol=1e-5)

    # the padding token as an input inside the loss: its embedding row gets no gradient, as with HF's padding_idx
    pad = config.pad_token_id
    ids = IDS.masked_fill(IDS == 0, pad)
    for model in (hf, tp_model):
        model.zero_grad()
    hf(input_ids=ids, use_cache=False).logits.logsumexp(-1).sum().backward()
    tp_model(ids).logsumexp(-1).sum().backward()
    expected = hf_to_megatron_rank({n: p.grad for n, p in hf.named_parameters()}, config, world, rank)
    grad = tp_model.embedding.word_embeddings.weight.grad
    assert torch.allclose(grad, expected["embedding.word_embeddings.weight"], atol=1e-5)
    if not config.tie_word_embeddings:  # tied, the row also gets the output layer's gradient
        assert hf.model.embed_tokens.weight.grad[pad].abs().sum() == 0

    # a shard of another split or an incomplete one is named, not half-loaded
    other = hf_to_megatron_rank(hf.state_dict(), config, 2 if world == 1 else 1, 0)
    with pytest.raises(ValueError, match="has shape .* expected .* tensor-parallel size"):
        tp_model.load_megatron_shard(other)
    with pytest.raises(ValueError, match="lacks 1 key"):
        tp_model.load_megatron_shard({k: v for k, v in stepped.items() if k != "decoder.final_layernorm.weight"})


@pytest.mark.parametrize("tp, shape", [(2, "gqa"), (2, "tied"), (1, "tied"), (2, "llama"), (1, "llama_tied")])
def test_tp_model_matches_hf_forward_gradients_and_sgd_step(tp: int, shape: str) -> None:
    spawn_ranks(_worker, args=(tp, free_port(), shape), nprocs=tp)  # raises with the rank's traceback if it fails
