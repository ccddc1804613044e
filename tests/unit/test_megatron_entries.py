"""What a Megatron-layout training checkpoint holds besides the weights, in the shapes Megatron reads: the optimizer's
groups, the LR schedule (read back by megatron-core's own `OptimizerParamScheduler`), the RNG entries; and
megatron-core's buffer geometry of the coalesced `distrib_optim.pt` (held against megatron-core's own buffer in
tests/integration/test_megatron_core.py)."""

from __future__ import annotations

import math

import pytest
import torch

from rlrunner.backends.megatron.buffer_geometry import bucket_size, coalesced_offsets
from rlrunner.backends.megatron.megatron_entries import (
    RLRUNNER_SCHEDULER,
    optimizer_entry,
    optimizer_step,
    our_scheduler,
    rng_entry,
    rng_from_entry,
    scheduler_entry,
    tracker_states,
)
from rlrunner.backends.optim import build_schedule
from rlrunner.utils.rng import capture_rng, restore_rng

from conftest import assert_bit_equal


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_megatron_core_s_scheduler_continues_our_schedule_after_the_warmup(schedule) -> None:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    lr, warmup, total, samples = 1e-3, 4, 30, 16
    optim = {"warmup_steps": warmup, "lr_schedule": schedule, "min_lr_ratio": 0.1}
    param = torch.nn.Parameter(torch.zeros(2))
    ours = build_schedule(torch.optim.AdamW([param], lr=lr), optim, total)
    for step in range(1, total + 1):
        ours.optimizer.step()
        ours.step()
        entry = scheduler_entry(ours.state_dict(), lr, lr * 0.1, warmup, total, schedule, 0.01, samples)
        assert entry["num_steps"] == step * samples and our_scheduler(entry) == ours.state_dict()
        theirs = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
        megatron = OptimizerParamScheduler(
            theirs, 0.0, lr, lr * 0.1, warmup * samples, total * samples, schedule, 0.01, 0.01, total * samples,
            "constant", use_checkpoint_opt_param_scheduler=True,
        )  # fmt: skip
        megatron.load_state_dict(entry)  # also sets the optimizer's LR for the next step
        if step >= warmup:  # Megatron's warmup is max_lr * k / warmup, ours max_lr * (k + 1) / warmup
            assert math.isclose(theirs.param_groups[0]["lr"], ours.get_last_lr()[0], rel_tol=1e-12)
    with pytest.raises(ValueError, match="LR schedule 'linear' has no Megatron decay style"):
        scheduler_entry(ours.state_dict(), lr, 0.0, warmup, total, "linear", 0.0, samples)


def test_older_checkpoints_scheduler_entry_is_ours_alone() -> None:
    assert our_scheduler({"last_epoch": 3, "base_lrs": [0.1]}) == {"last_epoch": 3, "base_lrs": [0.1]}
    assert our_scheduler({"max_lr": 0.1, RLRUNNER_SCHEDULER: {"last_epoch": 3}}) == {"last_epoch": 3}


def test_the_optimizer_entry_has_megatron_core_s_two_default_groups() -> None:
    entry = optimizer_entry(5e-4, (0.9, 0.95), 1e-8, 0.01, 12, 1e-3, 1e-4)
    groups = entry["optimizer"]["param_groups"]
    identity = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")  # how megatron-core matches groups
    assert [tuple(g[k] for k in identity) for g in groups] == [(1.0, 1.0, False, False), (0.0, 1.0, False, False)]
    assert all(
        (g["lr"], g["max_lr"], g["min_lr"], g["betas"], g["step"]) == (5e-4, 1e-3, 1e-4, (0.9, 0.95), 12)
        for g in groups
    )
    assert optimizer_step(entry) == 12
    groups[1]["step"] = 11
    with pytest.raises(ValueError, match=r"different step counts \[11, 12\]"):
        optimizer_step(entry)


def test_rng_entries_restore_the_cpu_generators_and_carry_megatron_s_tracker_seeds() -> None:
    import random

    import numpy as np

    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    entry = rng_entry(capture_rng(), seed=42, tp_rank=1)
    draws = (random.random(), np.random.rand(), torch.rand(2))
    restore_rng(rng_from_entry(entry))
    after = (random.random(), np.random.rand(), torch.rand(2))
    assert after[:2] == draws[:2] and torch.equal(after[2], draws[2])
    assert set(entry) == {"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states"}
    # a CUDA generator's state is its seed and Philox offset, two little-endian 64-bit integers
    as_ints = {name: state.view(torch.int64).tolist() for name, state in entry["rng_tracker_states"].items()}
    assert as_ints == {
        "data-parallel-rng": [42, 0],
        "model-parallel-rng": [42 + 2718 + 1, 0],
        "expert-parallel-rng": [42 + 1024, 0],
    }
    assert entry["cuda_rng_state"].dtype == torch.uint8 and entry["cuda_rng_state"].view(torch.int64).tolist() == [
        42,
        0,
    ]
    assert_bit_equal(tracker_states(42, 1), entry["rng_tracker_states"])


def test_coalesced_offsets_follow_megatron_core_s_buffer() -> None:
    # reversed, each parameter 64-aligned; one bucket: nothing cut
    assert coalesced_offsets([10, 100, 3], dp=2) == ([192, 64, 0], 202)
    # buckets of at least 100 elements: after the 100-element parameter (64..164) the bucket closes and its end padding
    # (to lcm(dp, 128) = 384 at dp 3) is cut from the file; the last bucket starts right after in the file
    assert coalesced_offsets([10, 100, 3], dp=3, bucket_size=100) == ([164, 64, 0], 174)
    assert coalesced_offsets([10, 100, 3], dp=3) == ([192, 64, 0], 202)
    with pytest.raises(ValueError, match="a data-parallel size is a positive integer, got 0"):
        coalesced_offsets([1], dp=0)


def test_the_bucket_size_is_megatron_core_s_for_the_run_s_flags() -> None:
    assert bucket_size(8, overlap_grad_reduce=False, ddp_bucket_size=1000) is None  # one bucket without overlap
    assert bucket_size(8, overlap_grad_reduce=True) == 40_000_000
    assert bucket_size(64, overlap_grad_reduce=True) == 64_000_000  # grows with dp past 40
    assert bucket_size(64, overlap_grad_reduce=True, ddp_bucket_size=1000) == 1000
