"""The FSDP backend's "model" and "optimizer" parts hand out the state dict they read at an earlier step while the live
tensors are the same ones (`rlrunner.backends.fsdp.reused_state`): what they give is, bit for bit and key for key, what
DCP's `get_model_state_dict` / `get_optimizer_state_dict` give at that moment, after training steps (the learning rate
changing), after the optimizer's state is loaded (its tensors replaced: read again) and after the model's is (copied
in place: reused). Two real gloo ranks, uneven shards."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from spawned_ranks import spawn_ranks

from rlrunner.utils.tensors import map_tensors

from conftest import assert_bit_equal

WORLD = 2
OPTIM_CFG = {
    "lr": 1e-2,
    "betas": [0.9, 0.99],
    "weight_decay": 0.01,
    "warmup_steps": 3,  # the learning rate changes at every step of the test
    "lr_schedule": "cosine",
    "min_lr_ratio": 0.1,
}


def _build(seed: int):
    from torch.distributed.fsdp import fully_shard

    from rlrunner.backends.optim import build_optimizer

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.Linear(33, 4))  # 33 rows: uneven
    fully_shard(model)
    optimizer, scheduler = build_optimizer(model.parameters(), OPTIM_CFG, total_steps=10)
    return model, optimizer, scheduler


def _train_step(model, optimizer, scheduler, seed: int) -> None:
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _flat(state, prefix: str = "") -> dict:
    """Every leaf of a nested state by its path, tensors as this rank's local values (cloned), plain values as
    0-d float64 tensors (the learning rate), names as their position in a sorted list; for `assert_bit_equal`."""
    out: dict = {}
    if isinstance(state, dict):
        for key in state:
            out.update(_flat(state[key], f"{prefix}{key}."))
    elif isinstance(state, (list, tuple)):
        if state and all(isinstance(v, str) for v in state):
            out[prefix + "names"] = torch.tensor([hash(v) % 2**31 for v in state])
        else:
            for i, value in enumerate(state):
                out.update(_flat(value, f"{prefix}{i}."))
    elif isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        out[prefix.rstrip(".")] = local.detach().clone()
    elif isinstance(state, (int, float, bool)):
        out[prefix.rstrip(".")] = torch.tensor(float(state), dtype=torch.float64)
    return out


def _rank(rank: int, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from rlrunner.backends.fsdp.dcp_state import fsdp_parts

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    model, optimizer, scheduler = _build(seed=1)
    parts = fsdp_parts(model, optimizer, scheduler)
    results: dict = {}

    def record(name: str) -> None:
        results[name] = {
            "model": (_flat(parts["model"].state_dict()), _flat(get_model_state_dict(model))),
            "optimizer": (_flat(parts["optimizer"].state_dict()), _flat(get_optimizer_state_dict(model, optimizer))),
            "reads": (parts["model"].reused.reads, parts["optimizer"].reused.reads),
        }

    _train_step(model, optimizer, scheduler, seed=10)
    record("after_step_1")
    given = parts["optimizer"].state_dict()
    given["param_groups"][0]["lr"] = -1.0  # a caller changing what it was given changes nothing of the next's
    given["state"].clear()
    for step in (11, 12, 13):
        _train_step(model, optimizer, scheduler, seed=step)
        record(f"after_step_{step - 9}")

    # The optimizer's state loaded from another run (its tensors replaced), the model's too (copied in place).
    other = _build(seed=2)
    for step in (20, 21):
        _train_step(*other, seed=step)
    parts["optimizer"].load_state_dict(get_optimizer_state_dict(other[0], other[1]))
    parts["model"].load_state_dict(get_model_state_dict(other[0]))
    record("after_load")
    results["loaded_from"] = _flat(get_optimizer_state_dict(other[0], other[1]))
    _train_step(model, optimizer, scheduler, seed=14)
    record("after_load_and_step")
    dist.destroy_process_group()
    torch.save(results, Path(out) / f"rank{rank}.pt")


def test_the_fsdp_parts_reuse_what_they_read_and_give_what_dcp_gives(tmp_path):
    spawn_ranks(_rank, args=(str(tmp_path),), nprocs=WORLD)
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for name in [*(f"after_step_{i}" for i in (1, 2, 3, 4)), "after_load", "after_load_and_step"]:
            for part in ("model", "optimizer"):
                got, expected = results[name][part]
                assert_bit_equal(got, expected)
        # each part read once in training; the optimizer's again after its tensors were replaced by the load, the
        # model's never again (its parameters were copied into)
        assert results["after_step_4"]["reads"] == (1, 1)
        assert results["after_load"]["reads"] == (1, 2)
        assert results["after_load_and_step"]["reads"] == (1, 2)
        learning_rates = [results[f"after_step_{i}"]["optimizer"][0]["param_groups.0.lr"] for i in (1, 2, 3, 4)]
        assert len({float(lr) for lr in learning_rates}) == 3  # warmup then cosine: the reused dicts followed it
        loaded = {k: v for k, v in results["after_load"]["optimizer"][0].items() if k.startswith("state.")}
        assert_bit_equal(loaded, {k: v for k, v in results["loaded_from"].items() if k.startswith("state.")})


def test_a_read_is_reused_only_while_its_tensors_are_the_live_ones_at_the_same_place() -> None:
    from rlrunner.backends.fsdp.reused_state import Live, ReusedRead

    live = {"w": torch.zeros(3), "b": torch.zeros(2)}
    reused = ReusedRead()

    def get(read):
        return reused.get(read, lambda: Live(live.values()))

    first = get(lambda: dict(live))
    first["w"] = "changed by the caller"
    live["w"].add_(1.0)  # in place: the read holds it
    second = get(lambda: dict(live))
    assert reused.reads == 1 and torch.equal(second["w"], torch.ones(3)) and second["w"] is live["w"]
    live["w"] = torch.full((3,), 5.0)  # replaced: read again
    assert torch.equal(get(lambda: dict(live))["w"], torch.full((3,), 5.0)) and reused.reads == 2
    live["w"].data = torch.full((3,), 7.0)  # the same object, its values elsewhere: read again
    assert torch.equal(get(lambda: dict(live))["w"], torch.full((3,), 7.0)) and reused.reads == 3
    get(lambda: dict(live))
    assert reused.reads == 3
    reused = ReusedRead()  # a read of copies is never handed out again
    for _ in range(2):
        get(lambda: map_tensors(live, lambda t: t.clone()))
    assert reused.reads == 2
