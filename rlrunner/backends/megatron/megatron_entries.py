"""The training-state entries of a `model_optim_rng.pt` in the shapes Megatron-LM reads back (`load_checkpoint` in
megatron/training/checkpointing.py, megatron-core's `DistributedOptimizer.load_state_dict`,
`OptimizerParamScheduler.load_state_dict`), from what our run holds. Pure functions: no files, no process groups.

- `optimizer`: megatron-core's `DistributedOptimizer.state_dict()`: `{"optimizer": {"param_groups": [...]}}`, the
  inner torch AdamW's groups without their parameters, each carrying megatron-core's group keys (`wd_mult`, `lr_mult`,
  `is_expert_parallel`, `is_decoupled_lr`, by which a loading run matches its groups to the saved ones) and `step`
  (the plain-torch path reads the Adam step count there). megatron-core's default grouping has two groups, weights
  with weight decay (`wd_mult` 1.0) and biases and norms without (0.0); both carry our run's hyperparameters (our run
  decays every parameter: a run continued by Megatron decays as its own configuration says).
- `opt_param_scheduler`: `OptimizerParamScheduler.state_dict()`, counted in samples as Megatron-LM counts them
  (each optimizer step advances it by the global batch), and our own LR scheduler's state beside it
  (`RLRUNNER_SCHEDULER`), which our resume reads (Megatron's loader ignores the extra key). Megatron's warmup gives
  `max_lr * k / warmup` where ours gives `max_lr * (k + 1) / warmup`; past the warmup the constant and cosine
  schedules are the same function of the step.
- `rng_state`: one entry per data-parallel rank with Python's, numpy's and torch's CPU generator states, the CUDA
  generator's (the real one where the rank has CUDA; else the state a CUDA generator seeded as Megatron seeds its
  default one holds: `seed` at offset 0), and megatron-core's tracker states for its named CUDA streams
  (`model_parallel_cuda_manual_seed`'s seeds, at offset 0: our model has no dropout, so no stream was ever drawn from).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

RLRUNNER_SCHEDULER = "rlrunner_lr_scheduler"  # our LambdaLR's state inside `opt_param_scheduler`
DECAY_STYLES = {"constant": "constant", "cosine": "cosine"}  # our `actor.optim.lr_schedule` -> Megatron's style

# megatron-core's named CUDA RNG streams (tensor_parallel/random.py) and their seeds' offsets from the run's seed
DATA_PARALLEL_RNG = "data-parallel-rng"
MODEL_PARALLEL_RNG = "model-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"
TENSOR_PARALLEL_SEED_OFFSET = 2718
EXPERT_PARALLEL_SEED_OFFSET = 1024


def optimizer_entry(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float, step: int, max_lr: float, min_lr: float
) -> dict[str, Any]:
    """megatron-core's `DistributedOptimizer.state_dict()` for our AdamW at optimizer step `step` (`lr`: the current
    one; `max_lr`, `min_lr`: the schedule's bounds)."""

    def group(wd_mult: float) -> dict[str, Any]:
        return {
            "is_expert_parallel": False,
            "default_config": True,
            "wd_mult": wd_mult,
            "lr_mult": 1.0,
            "is_decoupled_lr": False,
            "max_lr": float(max_lr),
            "min_lr": float(min_lr),
            "lr": float(lr),
            "betas": (float(betas[0]), float(betas[1])),
            "eps": float(eps),
            "weight_decay": float(weight_decay),
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": True,
            "step": int(step),
        }

    return {"optimizer": {"param_groups": [group(1.0), group(0.0)]}}


def optimizer_step(entry: Mapping[str, Any]) -> int:
    """The Adam step count an `optimizer_entry` holds."""
    steps = {int(group["step"]) for group in entry["optimizer"]["param_groups"]}
    if len(steps) != 1:
        raise ValueError(f"the optimizer's parameter groups hold different step counts {sorted(steps)}")
    return steps.pop()


def scheduler_entry(
    ours: Mapping[str, Any],
    max_lr: float,
    min_lr: float,
    warmup_steps: int,
    total_steps: int,
    schedule: str,
    weight_decay: float,
    samples_per_step: int,
) -> dict[str, Any]:
    """`OptimizerParamScheduler.state_dict()` of our schedule after `ours["last_epoch"]` optimizer steps (our LambdaLR's
    state, kept under RLRUNNER_SCHEDULER), in samples of `samples_per_step` per optimizer step."""
    if schedule not in DECAY_STYLES:
        raise ValueError(f"LR schedule {schedule!r} has no Megatron decay style (known: {sorted(DECAY_STYLES)})")
    return {
        "max_lr": float(max_lr),
        "lr_warmup_steps": int(warmup_steps) * samples_per_step,
        "num_steps": int(ours["last_epoch"]) * samples_per_step,
        "lr_decay_style": DECAY_STYLES[schedule],
        "lr_decay_steps": int(total_steps) * samples_per_step,
        "min_lr": float(min_lr),
        "start_wd": float(weight_decay),
        "end_wd": float(weight_decay),
        "wd_incr_style": "constant",
        "wd_incr_steps": int(total_steps) * samples_per_step,
        RLRUNNER_SCHEDULER: dict(ours),
    }


def our_scheduler(entry: Mapping[str, Any]) -> dict[str, Any]:
    """Our LambdaLR's state from an `opt_param_scheduler` entry (older checkpoints held it alone)."""
    return dict(entry[RLRUNNER_SCHEDULER] if RLRUNNER_SCHEDULER in entry else entry)


def cuda_generator_state(seed: int, offset: int = 0) -> torch.Tensor:
    """What `torch.cuda.get_rng_state()` returns after `torch.cuda.manual_seed(seed)` and `offset` Philox draws: the
    seed and the offset, each a little-endian 64-bit integer (CUDA's generator state is only those)."""
    return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8).clone()


def tracker_states(seed: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """megatron-core's tracker states as `model_parallel_cuda_manual_seed(seed)` makes them on tensor-parallel rank
    `tp_rank` (no expert parallelism), none drawn from yet."""
    return {
        DATA_PARALLEL_RNG: cuda_generator_state(seed),
        MODEL_PARALLEL_RNG: cuda_generator_state(seed + TENSOR_PARALLEL_SEED_OFFSET + tp_rank),
        EXPERT_PARALLEL_RNG: cuda_generator_state(seed + EXPERT_PARALLEL_SEED_OFFSET),
    }


def rng_entry(state: Mapping[str, Any], seed: int, tp_rank: int) -> dict[str, Any]:
    """One entry of Megatron's `rng_state` list from `rlrunner.utils.rng.capture_rng()`'s state."""
    if "cuda" in state:
        cuda = state["cuda"][torch.cuda.current_device()]  # Megatron keeps the current device's
    else:
        cuda = cuda_generator_state(seed)
    return {
        "random_rng_state": state["python"],
        "np_rng_state": state["numpy"],
        "torch_rng_state": state["torch"],
        "cuda_rng_state": cuda,
        "rng_tracker_states": tracker_states(seed, tp_rank),
    }


def rng_from_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The state `rlrunner.utils.rng.restore_rng` puts back, from one entry of Megatron's `rng_state` list (a CUDA
    state only where this process has CUDA)."""
    state: dict[str, Any] = {
        "python": entry["random_rng_state"],
        "numpy": entry["np_rng_state"],
        "torch": entry["torch_rng_state"],
    }
    if "cuda_rng_state" in entry and torch.cuda.is_available():
        devices = torch.cuda.get_rng_state_all()
        devices[torch.cuda.current_device()] = entry["cuda_rng_state"]
        state["cuda"] = torch.stack(devices)
    return state
