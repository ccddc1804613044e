"""The GRPO step loop on the driver: rollout -> reward -> advantages -> policy update -> weight sync.

Reads top to bottom. `run()` holds the experiment lock and makes attempts: each attempt starts
the worker groups, restores the checkpoint (if any), pushes the actor's weights to the rollout
group and trains, logging every step and saving when the handler says so. When a worker, a node
or a collective fails, the attempt's groups are torn down and the next attempt resumes from the
newest complete checkpoint, up to `runner.recovery.max_restarts` times in a row without a new
checkpoint committed in between. A stop request (SIGTERM,
SIGINT, `runner.max_wall_time_s`) ends the loop with an emergency checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlrunner.algorithms.grpo import group_advantages
from rlrunner.checkpoint import layout
from rlrunner.checkpoint.handler import Checkpoint, CheckpointHandler, PendingSave
from rlrunner.checkpoint.lock import ExperimentLock
from rlrunner.checkpoint.manager import FSDPCheckpointManager, MegatronCheckpointManager
from rlrunner.checkpoint.policy import flatten
from rlrunner.cluster.ray_setup import cluster_lost, is_embedded, restart_embedded
from rlrunner.cluster.shared_storage import check_shared_folder
from rlrunner.cluster.worker_group import CallAbandoned, WorkerGroup, WorkerRaised
from rlrunner.config import data_parallel_size, mini_batch_prompts, tensor_parallel_size
from rlrunner.data.datasets import build_dataset
from rlrunner.data.loader import PromptLoader
from rlrunner.errors import (
    CheckpointError,
    ClusterLostError,
    ConfigError,
    ExperimentLockedError,
    RecoveryExhaustedError,
    StoppedEarly,
    WorkerError,
    exception_chain,
    user_error,
)
from rlrunner.models.loading import build_hf_config, build_tokenizer, token_ids
from rlrunner.models.megatron_layout import Qwen2Dims, check_splittable
from rlrunner.runner.batching import build_actor_batch, chunk, per_rank_shards, shard_actor_batch, split_evenly
from rlrunner.runner.experiment_logs import ExperimentLogs
from rlrunner.runner.metrics_logger import MetricsLogger, Progress
from rlrunner.runner.recovery import RecoveryLog, RestartBudget, describe, failure_cause, same_failure
from rlrunner.runner.stopping import StopRequest
from rlrunner.runner.weight_sync import DEFAULT_BUCKET_BYTES, connect_weight_sync
from rlrunner.runner.weight_sync import sync_weights as push_weights
from rlrunner.storage import basename
from rlrunner.utils.seeding import derive_seed
from rlrunner.workers.actor import ActorWorker
from rlrunner.workers.megatron_actor import MegatronActorWorker
from rlrunner.workers.rollout import RolloutWorker

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # bound on starting workers (imports, model build), whatever the step timeout


def reward_verifier(cfg: DictConfig) -> str:
    """`reward.verifier`, or the natural one for the data: arithmetic for the synthetic task, math for files."""
    if cfg.reward.verifier:
        return cfg.reward.verifier
    return "math" if cfg.data.train_files else "arithmetic"


# HF config keys that do not shape the weights (or are bookkeeping) and may differ between saves.
_VOLATILE_HF_KEYS = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache", "_commit_hash"}


def check_megatron_model(hf_config: Any, tp: int) -> None:
    """ConfigError (one line) unless the Megatron backend can split this model `tp` ways: found before any worker starts."""
    try:
        check_splittable(Qwen2Dims.from_config(hf_config), tp)
    except ValueError as exc:
        raise ConfigError(f"actor.training_backend=megatron with actor.tensor_model_parallel_size={tp}: {exc}") from None


def model_optimizer_fingerprint(cfg: DictConfig, hf_config: dict[str, Any]) -> dict[str, Any]:
    """The settings a checkpoint's model and optimizer state depend on; a resume must match them all."""
    architecture = {k: v for k, v in hf_config.items() if k not in _VOLATILE_HF_KEYS and not k.startswith("_attn")}
    return {**flatten("model.config", architecture), **flatten("actor.optim", OmegaConf.to_container(cfg.actor.optim))}


class GRPORunner:
    def __init__(self, cfg: DictConfig, stop: StopRequest | None = None):
        self.cfg = cfg
        self.storage_options = OmegaConf.to_container(cfg.runner.storage_options, resolve=True)
        # logs are written locally (a cache folder when log_path is on a store) and uploaded at every commit
        self.logs = ExperimentLogs(cfg.runner.logger.log_path, self.storage_options, cfg.runner.local_cache_dir, cfg.runner.experiment_name)
        self.log_path = self.logs.local_dir
        self.tokenizer = build_tokenizer(cfg.model)
        self.token_ids = token_ids(cfg.model, self.tokenizer)
        self.dataset = build_dataset(cfg.data, self.tokenizer, cfg.runner.seed)
        self.loader = self._new_loader()
        self.total_steps = min(cfg.runner.max_steps, cfg.runner.max_epochs * self.loader.steps_per_epoch)
        self.num_minibatches = cfg.data.batch_size // mini_batch_prompts(cfg)
        self.megatron = cfg.actor.training_backend == "megatron"
        self.tp, self.dp = tensor_parallel_size(cfg), data_parallel_size(cfg)
        self.global_step = 0
        self.last_saved_step: int | None = None  # the newest committed checkpoint's step
        self.pending_save: PendingSave | None = None  # a save whose files are still being written
        self.actor_group: WorkerGroup | None = None
        self.rollout_group: WorkerGroup | None = None
        self.storage, self.experiment = layout.experiment_url(cfg.runner.output_dir, cfg.runner.experiment_name, self.storage_options)
        self.hf_config = build_hf_config(cfg.model, self.tokenizer)
        if self.megatron:
            check_megatron_model(self.hf_config, self.tp)
        self.handler = CheckpointHandler(
            self.storage,
            self.experiment,
            cfg.runner.save_interval,
            cfg.runner.max_ckpt_to_keep,
            model_optimizer_fingerprint(cfg, self.hf_config.to_dict()),
            verify_checksums=cfg.runner.verify_checksums,
        )
        self.lock = ExperimentLock(self.storage, self.experiment)
        self.stop = stop or StopRequest(cfg.runner.max_wall_time_s)
        self.recovery_log = RecoveryLog(self.log_path)
        self.start_timings: dict[str, float] = {}
        self.restart_to_report: int | None = None  # the restart whose first completed step is still to be logged

    def _new_loader(self) -> PromptLoader:
        return PromptLoader(self.dataset, self.cfg.data.batch_size, self.cfg.runner.seed, self.cfg.data.shuffle)

    # -- worker groups -------------------------------------------------------------------------

    def build_groups(self, placement_timeout_s: float) -> None:
        cfg = self.cfg.cluster
        recovery = self.cfg.runner.recovery
        plain = lambda node: OmegaConf.to_container(node, resolve=True)  # noqa: E731
        common = {"threads": cfg.threads_per_worker, "use_gpu": cfg.gpus_per_worker > 0}
        placement = {
            "gpus_per_worker": cfg.gpus_per_worker,
            "placement_strategy": cfg.placement_strategy,
            "placement_timeout_s": placement_timeout_s,
            "call_timeout_s": recovery.step_timeout_s,
            # a collective inside a save or load may wait as long as the slowest rank's I/O
            "dist_timeout_s": max(recovery.step_timeout_s, recovery.checkpoint_timeout_s),
            "abandon": self._stop_requested,  # a stop while waiting for resources ends the wait
            "start_timeout_s": START_TIMEOUT_S,
            "wait": False,  # both groups start side by side; waited for below
        }
        optimizer_steps = self.total_steps * self.num_minibatches * self.cfg.actor.ppo_epochs
        self.actor_group = WorkerGroup(
            "actor",
            MegatronActorWorker if self.megatron else ActorWorker,
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
            workers_per_bundle=self.tp,  # a tensor-parallel group is one bundle: never split across nodes
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
        self.actor_group.wait_ready(self._stop_requested)
        # Building and sharding the model is start-up work (bounded like it), overlapping the rollout workers' start.
        setup = self.actor_group.call_all_async("setup")
        self.rollout_group.wait_ready(self._stop_requested)
        self.actor_group.get(setup, max(recovery.step_timeout_s, START_TIMEOUT_S), self._stop_requested)
        # The direct channels from the actor ranks to every rollout worker (rebuilt with the groups on every restart).
        connect_weight_sync(self.actor_group, self.rollout_group, timeout_s=recovery.step_timeout_s)

    def _stop_requested(self) -> bool:
        return self.stop.requested

    def teardown_groups(self) -> None:
        for group in (self.actor_group, self.rollout_group):
            if group is not None:
                group.shutdown()
        self.actor_group = self.rollout_group = None

    def groups(self) -> list[WorkerGroup]:
        return [g for g in (self.actor_group, self.rollout_group) if g is not None]

    # -- one step ------------------------------------------------------------------------------

    def sync_weights(self) -> None:
        """Every actor rank broadcasts its own shards, in the rollout's dtype, to every rollout worker.

        Straight from worker to worker over collective channels (gloo on CPU, NCCL on GPU): nothing passes
        through the driver or the object store.
        """
        push_weights(self.actor_group, self.rollout_group, DEFAULT_BUCKET_BYTES)

    def generate(self, step: int, prompts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Samples in prompt order; chunks of prompts are fixed here, so the result is the same for any worker count.

        A stop request abandons the generation in flight (CallAbandoned): nothing has changed yet.
        """
        chunks = chunk(prompts, self.cfg.rollout.generation_batch_size)
        assignment = split_evenly(chunks, self.rollout_group.num_workers)
        refs = self.rollout_group.call_each_async("generate", [(step, part) for part in assignment])
        results = self.rollout_group.get(refs, abandon=lambda: self.stop.requested)
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
        shards = shard_actor_batch(batch, self.dp, self.num_minibatches)
        per_rank = self.actor_group.call_each("update", [(shard,) for shard in per_rank_shards(shards, self.tp)])
        actor_stats = per_rank[:: self.tp]  # tensor-parallel rank 0 of each data-parallel rank: each counted once
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

    def save_checkpoint(self, step: int) -> None:
        """Save `step`: committed before returning, or (`runner.async_save`) written in the background and
        committed by `commit_pending_save` once every rank's write has finished. One save in flight at a time."""
        self.commit_pending_save(wait=True)
        data_state = {
            "dataloader": self.loader.state_dict(),
            "runner": {"global_step": step, "epoch": self.loader.epoch, "total_steps": self.total_steps},
        }
        self.pending_save = self.handler.begin_save(
            step,
            self.checkpoint_manager(),
            data_state,
            write_extra=self._write_hf_files,
            extra_manifest={"epoch": self.loader.epoch, "experiment_name": self.cfg.runner.experiment_name},
        )
        if not self.cfg.runner.async_save:
            self.commit_pending_save(wait=True)

    def commit_pending_save(self, wait: bool) -> str | None:
        """Commit the save in flight once its writes are done (waiting for them with `wait`); its URL, or None.

        Only a committed checkpoint counts: `last_saved_step` moves here, never when a save begins.
        """
        if self.pending_save is None:
            return None
        self._raise_if_lock_lost(f"committing global_step_{self.pending_save.step}")
        path = self.handler.finish_save(self.pending_save, wait)
        if path is not None:
            self.last_saved_step = self.pending_save.step
            self.pending_save = None
        return path

    def checkpoint_manager(self) -> FSDPCheckpointManager:
        recovery = self.cfg.runner.recovery
        common = {"background": self.cfg.runner.async_save, "storage_options": self.storage_options}
        if self.megatron:
            return MegatronCheckpointManager(self.actor_group, recovery.checkpoint_timeout_s, tensor_parallel_size=self.tp, **common)
        return FSDPCheckpointManager(self.actor_group, recovery.checkpoint_timeout_s, **common)

    def _write_hf_files(self, local_folder: str) -> None:
        """HF config and tokenizer beside the shards, so converters need nothing but the checkpoint."""
        folder = Path(local_folder) / layout.HF_DIR
        self.hf_config.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)

    def restore(self, checkpoint: Checkpoint) -> None:
        data_state = self.handler.load(checkpoint, self.checkpoint_manager())
        try:
            self.loader.load_state_dict(data_state["dataloader"])
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {checkpoint.url} does not fit this run's data: {exc}") from None
        self.global_step = int(data_state["runner"]["global_step"])
        self.last_saved_step = self.global_step

    # -- one attempt ---------------------------------------------------------------------------

    def start(self, checkpoint: Checkpoint | None, placement_timeout_s: float) -> None:
        """Fresh state, groups up, storage checked, checkpoint restored, weights pushed to the rollout group."""
        self.loader = self._new_loader()
        self.global_step, self.last_saved_step, self.pending_save = 0, None, None
        started = time.monotonic()
        self.build_groups(placement_timeout_s)
        built = time.monotonic()
        check_shared_folder(self.storage, self.handler.root, self.groups())
        if checkpoint is not None:
            self._raise_if_stopping()
            self.restore(checkpoint)
        self._raise_if_stopping()
        self.sync_weights()
        waited = sum(g.placement_wait_s for g in self.groups())
        self.start_timings = {"wait_s": waited, "rebuild_s": built - started - waited, "load_s": time.monotonic() - built}

    def _raise_if_lock_lost(self, before: str) -> None:
        """A run whose experiment lease lapsed or was taken over must not write on: another run owns the folder."""
        lost = self.lock.lost()
        if lost is not None:
            raise ExperimentLockedError(f"stopping before {before}: the experiment lock was lost ({lost})")

    def _raise_if_stopping(self) -> None:
        if self.stop.requested:
            raise CallAbandoned("stopped while starting the workers")

    def __enter__(self) -> "GRPORunner":
        """One attempt, without in-job recovery: lock, find the checkpoint, start (tests use this to look inside)."""
        self.lock.acquire()
        try:
            self.logs.restore()
            self.handler.remove_leftovers()
            self.start(self.handler.find_resume(self.cfg.runner.resume_dir), self.cfg.cluster.placement_timeout_s)
        except BaseException:
            self.teardown_groups()
            self.lock.release()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.teardown_groups()
        self.logs.upload()
        self.lock.release()

    def train(self) -> dict[str, Any]:
        """Run the steps up to `total_steps`; returns the last step's metrics. StoppedEarly after a stop request."""
        cfg = self.cfg.runner
        logger.info("run %s: steps %d..%d, logs in %s", cfg.experiment_name, self.global_step + 1, self.total_steps, self.log_path)
        logger.info(self.handler.describe_schedule())
        if self.global_step >= self.total_steps:
            logger.info("nothing to do: the resumed checkpoint is at step %d of %d", self.global_step, self.total_steps)
        metrics_log = MetricsLogger(self.log_path, self.global_step, cfg.logger.tensorboard)
        progress = Progress(self.total_steps, self.global_step, cfg.logger.progress_bar)
        last: dict[str, Any] = {}
        try:
            while self.global_step < self.total_steps and not self.stop.requested:
                step = self.global_step + 1
                committed_before = self.last_saved_step
                self._raise_if_lock_lost(f"step {step}")
                position = self.loader.state_dict()
                try:
                    last = self.train_step(step)
                except CallAbandoned:
                    self.loader.load_state_dict(position)  # the abandoned step never happened
                    break
                self.global_step = step
                try:
                    save_started = time.perf_counter()
                    committed = self.commit_pending_save(wait=False)  # a background save that finished writing
                    saving = self.handler.should_save(step, self.total_steps)
                    if saving:
                        self.save_checkpoint(step)
                    if saving or committed:
                        last["time/save_s"] = time.perf_counter() - save_started  # what the loop was blocked for
                finally:  # the step happened even if its save failed: log it
                    metrics_log.log(step, last)
                    progress.update(step, last)
                if self.last_saved_step != committed_before:
                    self.logs.upload()  # the logs on the store reach at least the newest checkpoint
                if self.restart_to_report is not None:
                    self.recovery_log.write("first_step", restart=self.restart_to_report, step=step)
                    self.restart_to_report = None
        finally:
            progress.close()
            metrics_log.close()
            self.logs.upload()
        self.commit_pending_save(wait=True)  # the last step's save, or the one in flight when a stop came
        if self.global_step < self.total_steps:  # the loop ended on a stop request
            self.emergency_stop()
        return last

    def emergency_stop(self) -> None:
        step = self.global_step
        if step == 0:
            saved = "no step had finished, so there is nothing to save"
        elif self.last_saved_step == step:
            saved = f"global_step_{step} is already saved"
        else:
            self.save_checkpoint(step)
            saved = f"saved {basename(self.commit_pending_save(wait=True))}"
        raise StoppedEarly(f"{self.stop.reason} at step {step}; {saved}; resume with runner.resume_dir=auto")

    # -- the resilient run ---------------------------------------------------------------------

    def run(self, connect: Callable[[], None] | None = None) -> dict[str, Any]:
        """Train to the end, repairing the worker groups in-job after worker, node or collective failures.

        `connect` (start or join Ray) is called once the lock is held and the checkpoint is chosen, so that a
        bad `runner.resume_dir` or a locked experiment is reported before Ray's start-up, not after it.
        """
        with self.lock:
            self.logs.restore()  # once per driver: an in-job restart must not drop log lines not yet uploaded
            try:
                return self._run_with_recovery(connect)
            finally:
                self.logs.upload()

    def _run_with_recovery(self, connect: Callable[[], None] | None) -> dict[str, Any]:
        """`run`'s attempts (called holding the experiment lock)."""
        recovery = self.cfg.runner.recovery
        self.handler.remove_leftovers()
        initial = self.handler.find_resume(self.cfg.runner.resume_dir)
        if initial is not None and self.cfg.runner.resume_dir != "auto":
            self.handler.start_branch(initial)
        if connect is not None:
            connect()
        checkpoint, placement_timeout_s = initial, self.cfg.cluster.placement_timeout_s
        budget = RestartBudget(recovery.max_restarts)
        while True:
            try:
                self.start(checkpoint, placement_timeout_s)
                if budget.total:
                    self.recovery_log.write("resumed", restart=budget.total, step=self.global_step, **self.start_timings)
                    self.restart_to_report = budget.total
                return self.train()
            except StoppedEarly:
                raise
            except CallAbandoned:  # stopped while the workers were starting: nothing new to save
                kept = self._newest_checkpoint_note()
                raise StoppedEarly(f"{self.stop.reason} while starting the workers; {kept}; resume with runner.resume_dir=auto") from None
            except Exception as exc:
                failed_at = time.time()
                cause = self.repairable_cause(exc)
                if cause is None:
                    error = self.unrepairable(exc)
                    if error is exc:
                        raise
                    raise error from exc
                lost_cluster = cluster_lost(force=True)
                if lost_cluster is not None and not is_embedded():
                    raise ClusterLostError(f"{lost_cluster}; the driver exits so that it can be relaunched") from exc
                if not recovery.enabled:
                    raise
                if self.stop.requested:  # no restart once a stop was asked for: the newest checkpoint stands
                    kept = self._newest_checkpoint_note()
                    raise StoppedEarly(f"{self.stop.reason}, then a failure ({cause}); {kept}; resume with runner.resume_dir=auto") from exc
                newest = self.handler.newest_complete()
                if not budget.spend(str(newest) if newest else None, cause):
                    same = same_failure(budget.causes)
                    raise RecoveryExhaustedError(
                        f"giving up after {recovery.max_restarts} in-job restarts without a new checkpoint in between "
                        f"(runner.recovery.max_restarts); last failure{' (the same each time)' if same else ''}: {cause}",
                        same_error=same,
                    ) from exc
                lost = self.global_step - (self.last_saved_step or 0)
                logger.error(
                    "restart %d (%d of %d since the last new checkpoint; last completed step %d, %d steps to redo): %s",
                    budget.total, budget.count, recovery.max_restarts, self.global_step, lost, cause,
                )
                teardown_started = time.monotonic()
                self.teardown_groups()
                self.recovery_log.write(
                    "failure", restart=budget.total, cause=cause, step=self.global_step, lost_steps=lost,
                    failed_at_unix=failed_at, teardown_s=time.monotonic() - teardown_started,
                )
                if lost_cluster is not None:  # the embedded Ray lost its node: nobody else will bring it back
                    logger.error("%s: restarting the embedded Ray", lost_cluster)
                    restart_embedded()
                    if connect is not None:
                        connect()  # signal handlers again (ray.init installs its own)
                self.handler.remove_leftovers()
                checkpoint = self.handler.find_resume("auto") or initial
                placement_timeout_s = recovery.wait_timeout_s
            finally:
                self.teardown_groups()

    def _newest_checkpoint_note(self) -> str:
        newest = self.handler.newest_complete()
        return f"the newest checkpoint is {basename(newest)}" if newest else "there is no checkpoint yet"

    def repairable_cause(self, exc: BaseException) -> str | None:
        """Why `exc` is a lost or hung worker, node or cluster the run can repair, or None (a bug or bad input).

        A worker is lost only when Ray reports it dead, or a call passed its time bound; ranks that are
        busy or stuck in a collective behind a peer that raised are alive. The dead workers are named:
        the error that arrives first often comes from a surviving peer whose collective broke.
        """
        cause = failure_cause(exc)
        lost = cluster_lost(force=True)
        if lost is not None:  # the root cause: every worker error that follows comes from it
            return f"cluster lost: {lost} (then {cause or describe(exc)})"
        dead = [f"{g.name} rank {r}" for g in self.groups() for r in g.dead_ranks(timeout_s=1.0)]
        if cause is None and not dead:
            return None
        if cause is None:
            cause = f"worker lost after {describe(exc)}"
        return f"{cause} [dead: {', '.join(dead)}]" if dead else cause

    @staticmethod
    def unrepairable(exc: BaseException) -> BaseException:
        """The error to end the run with: worker code that raised becomes a one-line WorkerError (not retried)."""
        raised = next((err for err in exception_chain(exc) if isinstance(err, WorkerRaised)), None)
        if raised is not None and user_error(exc) is None:
            return WorkerError(f"{raised} (an error in worker code: not retried)")
        return exc

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
    return {"actor/loss": loss, **metrics}
