"""FSDP2 units (`actor.fsdp.unit`) and activation recomputation (`actor.gradient_checkpointing`): with each projection
its own unit, the model is sharded into more, smaller units, and with `model` into one; with recomputation each layer
runs again in the backward; every way a forward and backward give the plain decoder-layer run's loss and gradients bit
for bit (two real gloo ranks)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from ports import free_port
from spawned_ranks import spawn_ranks

from rlrunner.backends.fsdp.worker import decoder_layers, enable_recomputation, fill_own_rows, shard_model
from rlrunner.models.hf_tensors import SeededInit
from rlrunner.models.loading import build_hf_config, meta_model, restore_buffers
from rlrunner.models.tokenizer import build_char_tokenizer

from conftest import TINY_MODEL_CFG, assert_bit_equal

WORLD = 2
LAYERS = 2
LINEARS_PER_LAYER = 7  # q, k, v, o; gate, up, down


VARIANTS = {
    "decoder_layer": ("decoder_layer", False),
    "linear": ("linear", False),
    "model": ("model", False),
    "recompute": ("decoder_layer", True),
    "model_recompute": ("model", True),  # the default job's (`auto` on a small model, recomputation on)
}


def _sharded(unit: str, recompute: bool) -> torch.nn.Module:
    model_cfg = {
        **TINY_MODEL_CFG,
        "override_config": {**TINY_MODEL_CFG["override_config"], "num_hidden_layers": LAYERS},
    }
    config = build_hf_config(model_cfg, build_char_tokenizer())
    model = meta_model(config, "eager", torch.float32)
    tensors = SeededInit(model, config, seed=3)
    shard_model(model, "float32", "float32", trainable=True, unit=unit)
    model.to_empty(device="cpu")
    fill_own_rows(model, tensors)
    restore_buffers(model, config, torch.device("cpu"))
    if recompute:  # as FSDPActorWorker.setup does
        enable_recomputation(model)
    model.train()
    return model


def _units(model: torch.nn.Module) -> int:
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in model.modules())


def _counted(forward, calls: list):
    def counting(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    return counting


def _loss_and_grads(model: torch.nn.Module) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    """(decoder-layer forwards run, the loss, this rank's gradient shards) of one forward and backward."""
    calls = []
    for layer in decoder_layers(model):  # counted as it starts: a recomputation stops before forward hooks run
        layer.mlp.forward = _counted(layer.mlp.forward, calls)
    input_ids = torch.arange(4 * 9).reshape(4, 9) % 90 + 3
    loss = model(input_ids=input_ids, use_cache=False).logits.float().logsumexp(-1).mean()
    loss.backward()
    return len(calls), loss.detach(), {name: p.grad.to_local().clone() for name, p in model.named_parameters()}


def _rank(rank: int, port: int, out: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results = {}
        for variant, (unit, recompute) in VARIANTS.items():
            model = _sharded(unit, recompute)
            results[variant] = (_units(model), *_loss_and_grads(model))
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("units")
    spawn_ranks(_rank, args=(free_port(), str(out)), nprocs=WORLD)  # raises with a rank's traceback
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)]


def test_linear_units_shard_each_projection_on_its_own_and_model_the_whole_model_at_once(ranks):
    for results in ranks:
        assert results["decoder_layer"][0] == LAYERS + 1  # the layers and the root
        assert results["linear"][0] == LAYERS * (LINEARS_PER_LAYER + 1) + 1
        assert results["model"][0] == 1  # the root alone


def test_recomputation_runs_each_layer_again_in_the_backward(ranks):
    for results in ranks:
        assert results["decoder_layer"][1] == LAYERS
        assert results["linear"][1] == LAYERS
        assert results["recompute"][1] == 2 * LAYERS
        assert results["model_recompute"][1] == 2 * LAYERS


@pytest.mark.parametrize("variant", ["linear", "model", "recompute", "model_recompute"])
def test_the_loss_and_gradients_are_the_plain_runs_bitwise(ranks, variant):
    for results in ranks:
        _, _, plain_loss, plain_grads = results["decoder_layer"]
        _, _, loss, grads = results[variant]
        assert torch.equal(plain_loss, loss)
        assert len(plain_grads) > LAYERS * LINEARS_PER_LAYER
        assert_bit_equal(grads, plain_grads)
        assert any(g.abs().sum() > 0 for g in plain_grads.values())
