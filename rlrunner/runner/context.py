"""What a run sets up once and keeps across its attempts: the config, the data, the model's config, the training
backend and its rank layout, the experiment folder with its checkpoint handler, lock and logs, the in-memory
snapshots, the warm spares.

Building it checks everything that can be checked before Ray starts (a model the backend cannot split, say);
an attempt (`rlrunner.runner.trainer.Trainer`) takes it and adds the worker groups and the step counter.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlrunner.agents.settings import check_chat_template, described, multi_turn_settings
from rlrunner.algorithms.objective import PolicyObjective
from rlrunner.algorithms.registry import get_adv_estimator
from rlrunner.backends.registry import checkpoint_weights_reader, get_backend
from rlrunner.checkpoint import layout
from rlrunner.checkpoint.handler import CheckpointHandler
from rlrunner.checkpoint.manager import CheckpointManager
from rlrunner.checkpoint.policy import flatten
from rlrunner.config_checks import mini_batch_prompts
from rlrunner.data.datasets import build_dataset, build_val_dataset
from rlrunner.data.loader import PromptLoader
from rlrunner.experiment.lock import ExperimentLock
from rlrunner.models.loading import build_hf_config, build_tokenizer, token_ids
from rlrunner.rewards.function import parse_spec
from rlrunner.rewards.scorer import RewardSettings
from rlrunner.rollout.registry import get_engine
from rlrunner.runner.elastic import ElasticSizes, Layout, layout_invariant
from rlrunner.runner.experiment_logs import ExperimentLogs
from rlrunner.runner.metrics import MetricsLogger
from rlrunner.runner.recovery import RecoveryLog
from rlrunner.runner.snapshots import SnapshotStore
from rlrunner.runner.stopping import StopRequest
from rlrunner.runner.tool_records import JOURNAL_FILE, ToolRecords
from rlrunner.storage import open_storage

# HF config keys that do not shape the weights (or are bookkeeping) and may differ between saves.
_VOLATILE_HF_KEYS = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache", "_commit_hash"}


def reward_settings(cfg: DictConfig, base_dir: str | None = None) -> RewardSettings:
    """What scores the run: `reward.function` (a relative file path taken from `base_dir`, the driver's working
    directory), else `reward.verifier`, else the natural verifier for the data (arithmetic for the synthetic task,
    math for prompt files)."""
    reward = cfg.reward
    options = {
        "kwargs": OmegaConf.to_container(reward.function_kwargs, resolve=True),
        "num_workers": reward.num_workers,
        "timeout_s": reward.timeout_s,
        "on_error": reward.on_error,
    }
    if reward.function:
        return RewardSettings(parse_spec(reward.function, base_dir or os.getcwd()), **options)
    verifier = reward.verifier or ("math" if cfg.data.train_files else "arithmetic")
    return RewardSettings.builtin(verifier, **options)


def model_optimizer_fingerprint(cfg: DictConfig, hf_config: dict[str, Any]) -> dict[str, Any]:
    """The settings a checkpoint's model and optimizer state depend on; a resume must match them all."""
    architecture = {k: v for k, v in hf_config.items() if k not in _VOLATILE_HF_KEYS and not k.startswith("_attn")}
    return {**flatten("model.config", architecture), **flatten("actor.optim", OmegaConf.to_container(cfg.actor.optim))}


class RunContext:
    def __init__(self, cfg: DictConfig, stop: StopRequest | None = None):
        self.cfg = cfg
        self.stop = stop or StopRequest(cfg.runner.max_wall_time_s)
        self.storage_options = OmegaConf.to_container(cfg.runner.storage_options, resolve=True)
        # logs are written locally (a cache folder when log_path is on a store) and uploaded at every commit
        self.logs = ExperimentLogs(
            cfg.runner.logger.log_path, self.storage_options, cfg.runner.local_cache_dir, cfg.runner.experiment_name
        )
        self.log_path = self.logs.local_dir
        self.recovery_log = RecoveryLog(self.log_path)
        self.tokenizer = build_tokenizer(cfg.model)
        self.token_ids = token_ids(cfg.model, self.tokenizer)
        # tools or an environment between the model's turns: its code loaded once here (a one-line error if it cannot
        # be), the tools' schemas rendered into the prompts
        self.multi_turn = multi_turn_settings(cfg, os.getcwd())
        if self.multi_turn is not None:
            self.multi_turn = described(self.multi_turn)
            check_chat_template(self.tokenizer, self.multi_turn.schemas)
        tools = self.multi_turn.schemas if self.multi_turn is not None else None
        self.dataset = build_dataset(cfg.data, self.tokenizer, cfg.runner.seed, tools)
        self.val_dataset = build_val_dataset(cfg.data, self.tokenizer, cfg.runner.seed, tools)
        self.reward = reward_settings(cfg)
        self.advantages = get_adv_estimator(cfg.algorithm.adv_estimator)  # the driver's part of the algorithm
        self.objective = PolicyObjective(OmegaConf.to_container(cfg.algorithm, resolve=True))  # its metrics
        self.total_steps = min(cfg.runner.max_steps, cfg.runner.max_epochs * self.new_loader().steps_per_epoch)
        self.num_minibatches = cfg.data.batch_size // mini_batch_prompts(cfg)
        self.optimizer_steps = self.total_steps * self.num_minibatches * cfg.actor.ppo_epochs
        self.samples_per_optimizer_step = mini_batch_prompts(cfg) * cfg.algorithm.group_size  # a mini-batch's rows
        self.backend = get_backend(cfg.actor.training_backend)
        # the groups' sizes: configured, and those an elastic run may shrink to; the current attempt's (`use_layout`)
        self.layout_invariant = layout_invariant(cfg, self.backend.layout_invariant)
        self.sizes = ElasticSizes.of(cfg, self.samples_per_optimizer_step, self.layout_invariant)
        self.use_layout(self.sizes.configured)
        self.hf_config = build_hf_config(cfg.model, self.tokenizer)
        self.backend.check_model(self.hf_config, cfg.actor)
        get_engine(cfg.rollout.engine).check(cfg, self.hf_config)
        # model.path may be a training checkpoint of any backend: its weights are read by the backend that wrote it
        self.read_weights = None
        if cfg.model.path is not None:
            storage = open_storage(str(Path(cfg.model.path).expanduser()))
            self.read_weights = checkpoint_weights_reader(storage, storage.url)
        self.storage, self.experiment = layout.experiment_url(
            cfg.runner.output_dir, cfg.runner.experiment_name, self.storage_options
        )
        self.handler = CheckpointHandler(
            self.storage,
            self.experiment,
            cfg.runner.save_interval,
            cfg.runner.max_ckpt_to_keep,
            model_optimizer_fingerprint(cfg, self.hf_config.to_dict()),
            verify_checksums=cfg.runner.verify_checksums,
        )
        self.lock = ExperimentLock(self.storage, self.experiment)
        # in-memory snapshots of the actor, held across attempts (their holders start with the first snapshot)
        self.snapshots = SnapshotStore(cfg.runner.snapshot, reuse=cfg.cluster.reuse_workers)
        self.spare_pools: dict[str, Any] | None = None  # warm spares by group (rlrunner.runner.placement.spare_pools)
        # a multi-turn run's record of every tool call, kept across attempts (a relaunched driver reads its journal)
        self.tool_records = None
        if self.multi_turn is not None:
            self.tool_records = ToolRecords(
                os.path.join(self.log_path, JOURNAL_FILE),
                keep=cfg.runner.resume_dir is not None,
                settle_timeout_s=self.multi_turn.tool_timeout_s + 5.0,
            )
        self.metrics: MetricsLogger | None = None  # metrics.jsonl and the trackers, once the run's start is known

    def open_metrics(self, continue_runs: bool) -> MetricsLogger:
        """metrics.jsonl and the trackers of `runner.logger.backends`; `continue_runs`: the trackers' runs recorded in
        the experiment folder go on (a resumed run), else new ones start (a fresh start, a new branch)."""
        from rlrunner.trackers.session import Trackers

        logger_cfg = self.cfg.runner.logger
        trackers = (
            Trackers(
                list(logger_cfg.backends),
                logger_cfg,
                self.log_path,
                self.cfg.runner.experiment_name,
                OmegaConf.to_container(self.cfg, resolve=True),
                continue_runs,
            )
            if logger_cfg.backends
            else None
        )
        self.metrics = MetricsLogger(self.log_path, trackers)
        return self.metrics

    def close_spares(self, lost: bool = False) -> None:
        """Kill the warm spares (the run is over), or only forget them (`lost`: the embedded Ray went with them)."""
        for pool in (self.spare_pools or {}).values():
            pool.forget() if lost else pool.close()

    def use_layout(self, layout: Layout) -> None:
        """The next attempt's group sizes (and its actor ranks' data- x tensor-parallel map)."""
        self.layout = layout
        tp = self.cfg.actor.tensor_model_parallel_size
        self.rank_map = self.backend.rank_map({"num_workers": layout.actor_ranks, "tensor_model_parallel_size": tp})

    @property
    def invariant_min_count(self) -> int | None:
        """A layout-invariant update's least number of logical micro-batches: the configured data-parallel size."""
        return self.sizes.configured.actor_ranks // self.rank_map.tp if self.layout_invariant else None

    def new_loader(self) -> PromptLoader:
        return PromptLoader(self.dataset, self.cfg.data.batch_size, self.cfg.runner.seed, self.cfg.data.shuffle)

    def checkpoint_manager(self, actor_group: Any) -> CheckpointManager:
        return self.backend.checkpoint_manager(
            actor_group,
            self.rank_map,
            self.cfg.runner.recovery.checkpoint_timeout_s,
            self.cfg.runner.async_save,
            self.storage_options,
        )

    def write_hf_files(self, local_folder: str) -> None:
        """HF config and tokenizer beside the actor's files, so converters need nothing but the checkpoint."""
        folder = Path(local_folder) / layout.ACTOR_HF_DIR
        self.hf_config.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
