"""Optimizer and learning-rate schedule of the actor."""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch


class LRSchedule:
    """Multiplier of the base LR at optimizer step `step`: linear warmup, then constant or cosine decay.

    A callable object (not a lambda) so LambdaLR's state_dict holds it as plain numbers.
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


def build_optimizer(
    params: Iterable[torch.nn.Parameter], optim_cfg: dict[str, Any], total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = torch.optim.AdamW(
        params,
        lr=optim_cfg["lr"],
        betas=tuple(optim_cfg["betas"]),
        weight_decay=optim_cfg["weight_decay"],
    )
    schedule = LRSchedule(optim_cfg["warmup_steps"], total_steps, optim_cfg["lr_schedule"], optim_cfg["min_lr_ratio"])
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
