"""The GRPO step loop on the driver: rollout -> reward -> advantages -> policy update -> weight sync.

Reads top to bottom: entering the runner locks the experiment folder, finds the checkpoint to
resume from, builds the worker groups, restores the checkpoint and pushes the actor's weights to
the rollout group; `train` then runs `train_step` for each global step, logs its metrics and
saves a checkpoint when the handler says so.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlrunner.algorithms.grpo import group_advantages
from rlrunner.checkpoint import layout
from rlrunner.checkpoint.handler import Checkpoint, CheckpointHandler
from rlrunner.checkpoint.lock import ExperimentLock
from rlrunner.checkpoint.manager import FSDPCheckpointManager
from rlrunner.checkpoint.policy import flatten
from rlrunner.cluster.worker_group import WorkerGroup
from rlrunner.config import mini_batch_prompts
from rlrunner.data.datasets import build_dataset
from rlrunner.data.loader import PromptLoader
from rlrunner.errors import CheckpointError
from rlrunner.models.loading import build_hf_config, build_tokenizer, token_ids
from rlrunner.runner.batching import build_actor_batch, chunk, shard_actor_batch, split_evenly
from rlrunner.runner.metrics_logger import MetricsLogger, Progress
from rlrunner.utils.seeding import derive_seed
from rlrunner.workers.actor import ActorWorker
from rlrunner.workers.rollout import RolloutWorker

logger = logging.getLogger(__name__)


def reward_verifier(cfg: DictConfig) -> str:
    """`reward.verifier`, or the natural one for the data: arithmetic for the synthetic task, math for files."""
    if cfg.reward.verifier:
        return cfg.reward.verifier
    return "math" if cfg.data.train_files else "arithmetic"


# HF config keys that do not shape the weights (or are bookkeeping) and may differ between saves.
_VOLATILE_HF_KEYS = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache", "_commit_hash"}


def model_optimizer_fingerprint(cfg: DictConfig, hf_config: dict[str, Any]) -> dict[str, Any]:
    """The settings a checkpoint's model and optimizer state depend on; a resume must match them all."""
    architecture = {k: v for k, v in hf_config.items() if k not in _VOLATILE_HF_KEYS and not k.startswith("_attn")}
    return {**flatten("model.config", architecture), **flatten("actor.optim", OmegaConf.to_container(cfg.actor.optim))}


class GRPORunner:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.log_path = Path(cfg.runner.logger.log_path).expanduser().resolve()
        self.tokenizer = build_tokenizer(cfg.model)
        self.token_ids = token_ids(cfg.model, self.tokenizer)
        self.dataset = build_dataset(cfg.data, self.tokenizer, cfg.runner.seed)
        self.loader = PromptLoader(self.dataset, cfg.data.batch_size, cfg.runner.seed, cfg.data.shuffle)
        self.total_steps = min(cfg.runner.max_steps, cfg.runner.max_epochs * self.loader.steps_per_epoch)
        self.num_minibatches = cfg.data.batch_size // mini_batch_prompts(cfg)
        self.global_step = 0
        self.actor_group: WorkerGroup | None = None
        self.rollout_group: WorkerGroup | None = None
        self.experiment = layout.experiment_dir(cfg.runner.output_dir, cfg.runner.experiment_name)
        self.hf_config = build_hf_config(cfg.model, self.tokenizer)
        self.handler = CheckpointHandler(
            self.experiment,
            cfg.runner.save_interval,
            cfg.runner.max_ckpt_to_keep,
            model_optimizer_fingerprint(cfg, self.hf_config.to_dict()),
            verify_checksums=cfg.runner.verify_checksums,
        )
        self.lock = ExperimentLock(self.experiment)

    # -- worker groups -------------------------------------------------------------------------

    def build_groups(self) -> None:
        cfg = self.cfg.cluster
        plain = lambda node: OmegaConf.to_container(node, resolve=True)  # noqa: E731
        common = {"threads": cfg.threads_per_worker, "use_gpu": cfg.gpus_per_worker > 0}
        placement = {
            "gpus_per_worker": cfg.gpus_per_worker,
            "placement_strategy": cfg.placement_strategy,
            "placement_timeout_s": cfg.placement_timeout_s,
        }
        optimizer_steps = self.total_steps * self.num_minibatches * self.cfg.actor.ppo_epochs
        self.actor_group = WorkerGroup(
            "actor",
            ActorWorker,
            self.cfg.actor.num_workers,
            worker_kwargs={
                "model_cfg": plain(self.cfg.model),
                "actor_cfg": plain(self.cfg.actor),
                "algorithm_cfg": plain(self.cfg.algorithm),
                "init_seed": derive_seed(self.cfg.runner.seed, "model_init"),
                "total_optimizer_steps": optimizer_steps,
                **common,
            },
            cpus_per_worker=cfg.cpus_per_actor_worker,
            distributed=True,
            **placement,
        )
        self.rollout_group = WorkerGroup(
            "rollout",
            RolloutWorker,
            self.cfg.rollout.num_workers,
            worker_kwargs={
                "model_cfg": plain(self.cfg.model),
                "rollout_cfg": plain(self.cfg.rollout),
                "group_size": self.cfg.algorithm.group_size,
                "verifier": reward_verifier(self.cfg),
                "seed": self.cfg.runner.seed,
                **common,
            },
            cpus_per_worker=cfg.cpus_per_rollout_worker,
            **placement,
        )
        self.actor_group.call_all("setup")

    def teardown_groups(self) -> None:
        for group in (self.actor_group, self.rollout_group):
            if group is not None:
                group.shutdown()
        self.actor_group = self.rollout_group = None

    # -- one step ------------------------------------------------------------------------------

    def sync_weights(self) -> None:
        """Every actor rank joins the gather; rank 0's full state dict goes to all rollout workers."""
        refs = self.actor_group.call_all_async("full_state_dict")
        loads = self.rollout_group.call_all_async("load_weights", refs[0])
        self.actor_group.get(refs[1:])
        self.rollout_group.get(loads)

    def generate(self, step: int, prompts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Samples in prompt order; chunks of prompts are fixed here, so the result is the same for any worker count."""
        chunks = chunk(prompts, self.cfg.rollout.generation_batch_size)
        assignment = split_evenly(chunks, self.rollout_group.num_workers)
        results = self.rollout_group.call_each("generate", [(step, part) for part in assignment])
        return [sample for part in results for sample in part]

    def train_step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        started = time.perf_counter()
        prompts = self.loader.next_batch()
        epoch = self.loader.epoch

        samples = self.generate(step, prompts)
        rollout_done = time.perf_counter()

        rewards = torch.tensor([s["reward"] for s in samples], dtype=torch.float32)
        advantages = group_advantages(rewards, cfg.algorithm.group_size, cfg.algorithm.norm_adv_by_std)
        batch = build_actor_batch(samples, advantages, self.token_ids.pad)
        shards = shard_actor_batch(batch, self.actor_group.num_workers, self.num_minibatches)
        actor_stats = self.actor_group.call_each("update", [(shard,) for shard in shards])
        update_done = time.perf_counter()

        self.sync_weights()
        sync_done = time.perf_counter()

        metrics = {"data/epoch": epoch, **rollout_metrics(samples), **actor_metrics(actor_stats, cfg.algorithm)}
        metrics.update(
            {
                "time/rollout_s": rollout_done - started,
                "time/update_s": update_done - rollout_done,
                "time/weight_sync_s": sync_done - update_done,
                "time/step_s": sync_done - started,
            }
        )
        return metrics

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, step: int) -> Path:
        data_state = {
            "dataloader": self.loader.state_dict(),
            "runner": {"global_step": step, "epoch": self.loader.epoch, "total_steps": self.total_steps},
        }
        return self.handler.save(
            step,
            FSDPCheckpointManager(self.actor_group),
            data_state,
            write_extra=self._write_hf_files,
            extra_manifest={"epoch": self.loader.epoch, "experiment_name": self.cfg.runner.experiment_name},
        )

    def _write_hf_files(self, checkpoint: Path) -> None:
        """HF config and tokenizer beside the shards, so converters need nothing but the checkpoint."""
        folder = checkpoint / layout.HF_DIR
        self.hf_config.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)

    def restore(self, checkpoint: Checkpoint) -> None:
        data_state = self.handler.load(checkpoint, FSDPCheckpointManager(self.actor_group))
        try:
            self.loader.load_state_dict(data_state["dataloader"])
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {checkpoint.path} does not fit this run's data: {exc}") from None
        self.global_step = int(data_state["runner"]["global_step"])

    # -- the run -------------------------------------------------------------------------------

    def __enter__(self) -> "GRPORunner":
        """Lock the experiment, find the checkpoint to resume, start the groups, restore, sync the weights."""
        self.lock.acquire()
        try:
            self.handler.remove_leftovers()
            checkpoint = self.handler.find_resume(self.cfg.runner.resume_dir)
            self.build_groups()
            if checkpoint is not None:
                self.restore(checkpoint)
            self.sync_weights()
        except BaseException:
            self.teardown_groups()
            self.lock.release()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.teardown_groups()
        self.lock.release()

    def train(self) -> dict[str, Any]:
        """Run the steps up to `total_steps`; returns the last step's metrics."""
        cfg = self.cfg.runner
        logger.info("run %s: steps %d..%d, logs in %s", cfg.experiment_name, self.global_step + 1, self.total_steps, self.log_path)
        logger.info(self.handler.describe_schedule())
        if self.global_step >= self.total_steps:
            logger.info("nothing to do: the resumed checkpoint is at step %d of %d", self.global_step, self.total_steps)
        metrics_log = MetricsLogger(self.log_path, self.global_step, cfg.logger.tensorboard)
        progress = Progress(self.total_steps, self.global_step, cfg.logger.progress_bar)
        last: dict[str, Any] = {}
        try:
            while self.global_step < self.total_steps:
                step = self.global_step + 1
                last = self.train_step(step)
                self.global_step = step
                metrics_log.log(step, last)
                progress.update(step, last)
                if self.handler.should_save(step, self.total_steps):
                    self.save_checkpoint(step)
        finally:
            progress.close()
            metrics_log.close()
        return last

    def run(self) -> dict[str, Any]:
        with self:
            return self.train()

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """The actor's full weights (HF key names), gathered from the shards."""
        return self.actor_group.call_all("full_state_dict")[0]


def rollout_metrics(samples: list[dict[str, Any]]) -> dict[str, float]:
    rewards = torch.tensor([s["reward"] for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s["response_ids"]) for s in samples], dtype=torch.float64)
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item(),
        "rollout/reward_max": rewards.max().item(),
        "rollout/reward_min": rewards.min().item(),
        "rollout/accuracy": (rewards == 1.0).double().mean().item(),
        "rollout/response_length_mean": lengths.mean().item(),
        "rollout/eos_frac": sum(s["finished"] for s in samples) / len(samples),
    }


def actor_metrics(per_rank: list[dict[str, float]], algorithm: DictConfig) -> dict[str, float]:
    """Token means over all ranks (sums added in rank order, so the result is reproducible)."""
    total = {key: sum(stats[key] for stats in per_rank) for key in per_rank[0]}
    tokens = max(total["tokens"], 1.0)
    pg_loss = total["pg_loss"] / tokens
    metrics = {
        "actor/pg_loss": pg_loss,
        "actor/entropy": total["entropy"] / tokens,
        "actor/pg_clipfrac": total["clipped"] / tokens,
        "actor/ppo_kl": total["ppo_kl"] / tokens,
        "actor/grad_norm": per_rank[0]["grad_norm"],
        "actor/lr": per_rank[0]["lr"],
        "actor/skipped_steps": per_rank[0]["skipped_steps"],
    }
    loss = pg_loss
    if algorithm.use_kl_loss:
        metrics["actor/kl"] = total["kl"] / tokens
        loss += algorithm.kl_coef * metrics["actor/kl"]
    if algorithm.entropy_coef:
        loss -= algorithm.entropy_coef * metrics["actor/entropy"]
    metrics["actor/loss"] = loss
    return {"actor/loss": metrics.pop("actor/loss"), **metrics}
