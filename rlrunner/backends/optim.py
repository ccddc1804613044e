"""Optimizer and learning-rate schedule of the actor."""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from rlrunner.models.loading import SMALL_MODEL_BYTES


class LRSchedule:
    """Multiplier of the base LR at optimizer step `step`: linear warmup, then constant or cosine decay.

    A callable object (not a lambda) so that it pickles; its parameters come from the run's config,
    never from a checkpoint (see `ConfiguredLambdaLR`).
    """

    def __init__(self, warmup_steps: int, total_steps: int, kind: str = "constant", min_ratio: float = 0.0):
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.kind = kind
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw_implementation(device: torch.device, model_bytes: int = 0) -> str:
    """Which of torch's AdamW implementations steps the parameters (`model_bytes` float32 bytes in all) on `device`:
    "fused" on CUDA, where torch's default (foreach) makes temporaries of the whole shard (the square root of
    exp_avg_sq, the update) while the fused kernel goes element by element (benchmarks/bench_adamw_gpu.py). On the CPU
    "foreach" for a small model (at most `SMALL_MODEL_BYTES`, whose temporaries are small): one call per operation for
    all the tensors, where the per-tensor loop pays DTensor's dispatch for every tensor (1.5 ms against 3.5 ms a step
    for 41 sharded tensors); "for-loop" above it, whose temporaries are one tensor's. On the CPU both run the same
    kernel per tensor, the same bits; element by element, every implementation gives every element the same bits
    whatever shard it falls in."""
    if device.type == "cuda":
        return "fused"
    return "foreach" if model_bytes <= SMALL_MODEL_BYTES else "for-loop"


def build_optimizer(
    params: Iterable[torch.nn.Parameter], optim_cfg: dict[str, Any], total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    params = list(params)
    model_bytes = sum(p.numel() for p in params) * 4
    implementation = adamw_implementation(params[0].device, model_bytes) if params else "for-loop"
    optimizer = torch.optim.AdamW(
        params,
        lr=optim_cfg["lr"],
        betas=tuple(optim_cfg["betas"]),
        weight_decay=optim_cfg["weight_decay"],
        fused=True if implementation == "fused" else None,
        foreach=implementation == "foreach",
    )
    return optimizer, build_schedule(optimizer, optim_cfg, total_steps)


def build_schedule(
    optimizer: torch.optim.Optimizer, optim_cfg: dict[str, Any], total_steps: int
) -> "ConfiguredLambdaLR":
    """The LR schedule of `actor.optim` over `total_steps` optimizer steps."""
    schedule = LRSchedule(optim_cfg["warmup_steps"], total_steps, optim_cfg["lr_schedule"], optim_cfg["min_lr_ratio"])
    return ConfiguredLambdaLR(optimizer, schedule)


class ConfiguredLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose saved state is the step count, not the schedule.

    Stock LambdaLR saves a callable object's `__dict__` and restores it on load, so a run resumed with a
    larger `runner.max_steps` would silently keep the saved run's schedule length.
    """

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.pop("lr_lambdas", None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict({**state_dict, "lr_lambdas": [None] * len(self.lr_lambdas)})


def apply_schedule(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set each group's LR from this run's schedule at the restored step.

    The optimizer's state (restored from a checkpoint) holds the LR the saved run's schedule gave; a
    run resumed with another length (`runner.max_steps`) must use its own from the first step on. With
    the same schedule this is the very product LambdaLR computes, so a plain resume stays bitwise.
    """
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
