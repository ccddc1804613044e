"""Sharded weights (ZeRO-3) in the Megatron backend's model and optimizer, with real gloo groups, dp 2 x tp 2: training
gives the same bits as with whole weights (ZeRO-2), recomputation on or off, tied or untied embeddings, and no unit
stays gathered outside its use."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ports import free_port
from spawned_ranks import spawn_ranks

from rlrunner.backends.megatron.distrib_optim import DistributedAdamW
from rlrunner.backends.megatron.layout import hf_to_megatron_rank
from rlrunner.backends.megatron.model import TPCausalLM
from rlrunner.backends.megatron.weight_units import UnitCursor
from rlrunner.backends.megatron.worker import parallel_groups, replicated_names

from conftest import assert_bit_equal
from megatron_models import SHAPES, build_test_model

DP, TP = 2, 2
IDS = torch.randint(0, 99, (4, 8), generator=torch.Generator().manual_seed(3))


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _build(config, tp_group, dp_group, shard, tp_rank: int, shard_weights: bool):
    model = TPCausalLM(config, tp_group, device="meta")
    optimizer = DistributedAdamW(
        list(model.named_parameters()),
        dp_group,
        tp_group,
        replicated_names(model),
        lr=0.05,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        step_chunk_elements=300,
        bucket_elements=1000,
        shard_weights=shard_weights,
        units=model.weight_unit_names(),
        device="cpu",
    )
    assert optimizer.shard_weights == shard_weights
    if shard_weights:
        model.weight_units = optimizer.units
    model.load_megatron_shard(shard, optimizer.load_weight)
    model.to("cpu")
    return model.train(), optimizer


def _whole(model, optimizer) -> dict[str, torch.Tensor]:
    cursor = UnitCursor(optimizer.units, optimizer.space)
    weights = {name: cursor.tensor(name).detach().clone() for name, _ in model.named_parameters()}
    cursor.finish()
    return weights


def _worker(rank: int, world: int, port: int, shape: str, recompute: bool, bf16: bool) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _check(rank, shape, recompute, bf16)
    finally:
        dist.destroy_process_group()


def _check(rank: int, shape: str, recompute: bool, bf16: bool) -> None:
    tp_rank, dp_rank = rank % TP, rank // TP
    tp_group, dp_group = parallel_groups(DP * TP, TP, rank, None)
    hf, _ = build_test_model(SHAPES[shape])
    shard = hf_to_megatron_rank(hf.state_dict(), hf.config, TP, tp_rank)
    whole, whole_opt = _build(hf.config, tp_group, dp_group, shard, tp_rank, shard_weights=False)
    sharded, sharded_opt = _build(hf.config, tp_group, dp_group, shard, tp_rank, shard_weights=True)
    for model in (whole, sharded):
        model.gradient_checkpointing = recompute
    # the rank keeps its slice only: no unit's storage outside a gather, and the slice is 1/DP of the TP shard
    assert all(b.untyped_storage().nbytes() == 0 for b in sharded_opt.units.buffers)
    assert sharded_opt.owned_params.numel() == -(-sum(p.numel() for p in whole.parameters()) // DP)
    assert_bit_equal(_whole(sharded, sharded_opt), whole.state_dict())

    ids = IDS[dp_rank * 2 : (dp_rank + 1) * 2]  # each DP rank its own rows
    for step in range(3):
        with torch.no_grad():  # a forward without backward (the log-probs' pass) gathers and releases in forward
            assert torch.equal(whole(ids), sharded(ids))
        assert all(b.untyped_storage().nbytes() == 0 for b in sharded_opt.units.buffers)
        norms = []
        for model, optimizer in ((whole, whole_opt), (sharded, sharded_opt)):
            optimizer.zero_grad()
            for micro in range(2):  # two micro-batches: the units are gathered again for each
                # bfloat16 compute as the worker runs it: autocast without its cache of cast weights
                with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=bf16):
                    logits = model(ids[micro : micro + 1])
                loss = _loss(logits.float(), ids[micro : micro + 1]) * (1.0 if step != 1 else 40.0)
                loss.backward()
            norms.append(optimizer.clip_and_step(max_norm=1.0))
        assert norms[0] == norms[1], norms
        assert all(b.untyped_storage().nbytes() == 0 for b in sharded_opt.units.buffers)
        assert_bit_equal(_whole(sharded, sharded_opt), whole.state_dict())  # after each step

    # a rank's own state (an in-memory snapshot's) carries its slice of the weights and puts it back
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sharded_opt.local_state().items()}
    assert torch.equal(state["weights"], sharded_opt.owned_params)
    sharded_opt.owned_params.zero_()
    sharded_opt.load_local_state(state)
    assert_bit_equal(_whole(sharded, sharded_opt), whole.state_dict())
    with pytest.raises(ValueError, match="weights has shape nothing"):
        sharded_opt.load_local_state({k: v for k, v in state.items() if k != "weights"})


@pytest.mark.parametrize("shape,recompute,bf16", [("gqa", True, False), ("gqa", False, True), ("tied", True, False)])
def test_sharded_weights_train_bitwise_like_whole_ones(shape: str, recompute: bool, bf16: bool) -> None:
    spawn_ranks(
        _worker, args=(DP * TP, free_port(), shape, recompute, bf16), nprocs=DP * TP
    )  # raises with a rank's traceback


def test_units_must_be_consecutive_runs_covering_every_parameter() -> None:
    from rlrunner.backends.megatron.weight_units import _unit_ranges

    names = ["a", "b", "c"]
    offsets = [0, 2, 5, 9]
    assert _unit_ranges(names, offsets, [["a"], ["b", "c"]]) == [(0, 1), (1, 3)]
    with pytest.raises(ValueError, match="not the next run"):
        _unit_ranges(names, offsets, [["b"], ["a", "c"]])
    with pytest.raises(ValueError, match="leave out 1 parameter"):
        _unit_ranges(names, offsets, [["a", "b"]])
    with pytest.raises(ValueError, match="needs the units"):
        _unit_ranges(names, offsets, None)
