"""The checks of a composed config that types alone cannot express: each raises a one-line ConfigError naming the
first key whose value cannot work. A seam checks its own keys (the backend, the engine, the algorithm, the reward).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from rlrunner.backends.registry import get_backend
from rlrunner.errors import ConfigError
from rlrunner.rollout.registry import check_engine

_DTYPES = ("float32", "bfloat16", "float16")
# what one FSDP2 unit is (rlrunner/backends/fsdp/worker.py: resolve_unit, shard_model)
FSDP_UNITS = ("auto", "decoder_layer", "linear", "model")


def mini_batch_prompts(cfg: DictConfig) -> int:
    return cfg.actor.mini_batch_size or cfg.data.batch_size


def validate_config(cfg: DictConfig) -> None:
    """Raise ConfigError naming the first key whose value cannot work."""
    positive = {
        "runner.max_steps": cfg.runner.max_steps,
        "runner.max_epochs": cfg.runner.max_epochs,
        "data.batch_size": cfg.data.batch_size,
        "algorithm.group_size": cfg.algorithm.group_size,
        "actor.num_workers": cfg.actor.num_workers,
        "actor.ppo_epochs": cfg.actor.ppo_epochs,
        "rollout.num_workers": cfg.rollout.num_workers,
        "rollout.max_new_tokens": cfg.rollout.max_new_tokens,
        "rollout.generation_batch_size": cfg.rollout.generation_batch_size,
        "data.max_prompt_length": cfg.data.max_prompt_length,
        "cluster.threads_per_worker": cfg.cluster.threads_per_worker,
    }
    positive.update(
        {
            "runner.recovery.step_timeout_s": cfg.runner.recovery.step_timeout_s,
            "runner.recovery.wait_timeout_s": cfg.runner.recovery.wait_timeout_s,
            "runner.recovery.checkpoint_timeout_s": cfg.runner.recovery.checkpoint_timeout_s,
        }
    )
    for key in ("runner.max_wall_time_s", "actor.micro_batch_size", "actor.micro_batch_tokens"):
        if OmegaConf.select(cfg, key) is not None:  # null: no limit
            positive[key] = OmegaConf.select(cfg, key)
    for key in ("runner.snapshot.reserve_memory_gb", "cluster.spare_workers.actor", "cluster.spare_workers.rollout"):
        if OmegaConf.select(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0, got {OmegaConf.select(cfg, key)}")
    positive["runner.snapshot.interval"] = cfg.runner.snapshot.interval
    if cfg.runner.recovery.max_restarts < 0:
        raise ConfigError(f"runner.recovery.max_restarts must be >= 0, got {cfg.runner.recovery.max_restarts}")
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    if cfg.algorithm.group_size < 2:
        raise ConfigError(
            "algorithm.group_size must be at least 2 (GRPO compares samples within a group), "
            f"got {cfg.algorithm.group_size}"
        )
    if cfg.rollout.temperature < 0:
        raise ConfigError(f"rollout.temperature must be >= 0, got {cfg.rollout.temperature}")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {cfg.rollout.top_p}")
    if cfg.runner.max_ckpt_to_keep is not None and cfg.runner.max_ckpt_to_keep < 1:
        raise ConfigError(f"runner.max_ckpt_to_keep must be >= 1 or null, got {cfg.runner.max_ckpt_to_keep}")
    for key in ("model.dtype", "actor.param_dtype", "actor.reduce_dtype"):
        value = OmegaConf.select(cfg, key)
        if value not in _DTYPES:
            raise ConfigError(f"{key} must be one of {', '.join(_DTYPES)}, got '{value}'")
    _validate_parallel_sizes(cfg)
    _validate_elastic(cfg)
    if cfg.actor.fsdp.unit not in FSDP_UNITS:
        raise ConfigError(f"actor.fsdp.unit must be one of {', '.join(FSDP_UNITS)}, got '{cfg.actor.fsdp.unit}'")
    if cfg.actor.optim.lr_schedule not in ("constant", "cosine"):
        raise ConfigError(
            f"actor.optim.lr_schedule must be 'constant' or 'cosine', got '{cfg.actor.optim.lr_schedule}'"
        )
    if len(cfg.actor.optim.betas) != 2:
        raise ConfigError(f"actor.optim.betas must have two values, got {list(cfg.actor.optim.betas)}")
    strategies = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
    if cfg.cluster.placement_strategy not in strategies:
        raise ConfigError(
            f"cluster.placement_strategy must be one of {', '.join(strategies)}, got '{cfg.cluster.placement_strategy}'"
        )
    if set(cfg.data.synthetic.operations) - set("+-*") or not cfg.data.synthetic.operations:
        raise ConfigError(f"data.synthetic.operations must be made of + - *, got '{cfg.data.synthetic.operations}'")
    from rlrunner.agents.settings import check_multi_turn_config
    from rlrunner.algorithms.registry import check_algorithm
    from rlrunner.rewards.function import check_reward_config

    check_reward_config(cfg.reward)
    check_multi_turn_config(cfg)
    check_algorithm(cfg.algorithm)
    _validate_validation(cfg)
    if cfg.data.synthetic.max_operand < 1:
        raise ConfigError(f"data.synthetic.max_operand must be >= 1, got {cfg.data.synthetic.max_operand}")
    if cfg.data.synthetic.num_operands < 2:
        raise ConfigError(f"data.synthetic.num_operands must be >= 2, got {cfg.data.synthetic.num_operands}")
    if not 0 <= cfg.data.synthetic.min_operand <= cfg.data.synthetic.max_operand:
        raise ConfigError(
            f"data.synthetic.min_operand must be in 0..data.synthetic.max_operand ({cfg.data.synthetic.max_operand}), "
            f"got {cfg.data.synthetic.min_operand}"
        )
    _validate_batch_divisibility(cfg)


def _validate_validation(cfg: DictConfig) -> None:
    val = cfg.rollout.val
    if cfg.runner.val_interval < 0:
        raise ConfigError(f"runner.val_interval must be >= 0 (0: never), got {cfg.runner.val_interval}")
    if cfg.data.synthetic.val_size < 0:
        raise ConfigError(f"data.synthetic.val_size must be >= 0, got {cfg.data.synthetic.val_size}")
    if val.temperature < 0:
        raise ConfigError(f"rollout.val.temperature must be >= 0, got {val.temperature}")
    if not 0 < val.top_p <= 1:
        raise ConfigError(f"rollout.val.top_p must be in (0, 1], got {val.top_p}")
    if val.num_samples < 1:
        raise ConfigError(f"rollout.val.num_samples must be >= 1, got {val.num_samples}")
    if val.max_new_tokens is not None and val.max_new_tokens < 1:
        raise ConfigError(f"rollout.val.max_new_tokens must be positive or null, got {val.max_new_tokens}")
    mode = cfg.runner.logger.wandb.mode
    if mode is not None and mode not in ("online", "offline", "disabled"):
        raise ConfigError(f"runner.logger.wandb.mode must be online, offline, disabled or null, got '{mode}'")


def _validate_elastic(cfg: DictConfig) -> None:
    """The smallest groups an elastic run may train on, and where the update can be layout-invariant."""
    actor, cluster = cfg.actor, cfg.cluster
    tp = actor.tensor_model_parallel_size
    minimum = cluster.min_actor_ranks
    if minimum is not None and not (tp <= minimum <= actor.num_workers and minimum % tp == 0):
        raise ConfigError(
            f"cluster.min_actor_ranks ({minimum}) must be a multiple of actor.tensor_model_parallel_size ({tp}) "
            f"from {tp} to actor.num_workers ({actor.num_workers})"
        )
    if not 1 <= cluster.min_rollout_workers <= cfg.rollout.num_workers:
        raise ConfigError(
            f"cluster.min_rollout_workers ({cluster.min_rollout_workers}) must be from 1 to rollout.num_workers "
            f"({cfg.rollout.num_workers})"
        )
    if cfg.runner.recovery.shrink_after_s < 0:
        raise ConfigError(f"runner.recovery.shrink_after_s must be >= 0, got {cfg.runner.recovery.shrink_after_s}")
    if not actor.layout_invariant:
        return
    backend = get_backend(actor.training_backend)
    if not backend.layout_invariant:
        raise ConfigError(
            f"actor.layout_invariant=true needs actor.training_backend=fsdp ({actor.training_backend} adds its "
            "gradients in an order that depends on its data-parallel size)"
        )
    dp = actor.num_workers // tp
    if dp & (dp - 1):
        raise ConfigError(
            f"actor.layout_invariant=true needs a power-of-two data-parallel size, got actor.num_workers={dp}"
        )
    if actor.reduce_dtype not in ("float32", "bfloat16"):
        raise ConfigError(
            "actor.layout_invariant=true needs actor.reduce_dtype float32 or bfloat16 (FSDP scales other gradients "
            f"by the data-parallel size), got {actor.reduce_dtype}"
        )


def _validate_parallel_sizes(cfg: DictConfig) -> None:
    actor = cfg.actor
    backend = get_backend(actor.training_backend)
    check_engine(cfg.rollout.engine)
    tp = actor.tensor_model_parallel_size
    if tp < 1:
        raise ConfigError(f"actor.tensor_model_parallel_size must be positive, got {tp}")
    backend.check_config(cfg)
    if actor.num_workers % tp:
        raise ConfigError(
            f"actor.num_workers ({actor.num_workers}) must be a multiple of actor.tensor_model_parallel_size ({tp}): "
            "ranks = data-parallel x tensor-parallel"
        )


def _validate_batch_divisibility(cfg: DictConfig) -> None:
    """Every data-parallel rank must get the same number of micro-batches, or the collectives would hang."""
    batch = cfg.data.batch_size
    mini = mini_batch_prompts(cfg)
    group = cfg.algorithm.group_size
    ranks = get_backend(cfg.actor.training_backend).rank_map(cfg.actor)
    workers, tp = ranks.dp, ranks.tp
    ranks_key = (
        "actor.num_workers" if tp == 1 else "data-parallel ranks (actor.num_workers / actor.tensor_model_parallel_size)"
    )
    micro = cfg.actor.micro_batch_size
    # With actor.mini_batch_size null, the whole step's batch is one mini-batch: name the key the user set.
    mini_key = "actor.mini_batch_size" if cfg.actor.mini_batch_size else "data.batch_size"
    if batch % mini:
        raise ConfigError(f"data.batch_size ({batch}) must be a multiple of actor.mini_batch_size ({mini})")
    sequences = mini * group
    if sequences % workers:
        raise ConfigError(
            f"sequences per mini-batch ({mini_key} {mini} x algorithm.group_size {group} = {sequences}) "
            f"must be divisible by {ranks_key} ({workers})"
        )
    per_rank = sequences // workers
    if micro is not None and per_rank % micro:
        raise ConfigError(
            f"sequences per rank per mini-batch ({mini_key} {mini} x algorithm.group_size {group} / "
            f"{ranks_key} {workers} = {per_rank}) must be a multiple of actor.micro_batch_size ({micro})"
        )
