"""The actor worker: one rank of the FSDP2-sharded policy, its AdamW optimizer and LR schedule.

The driver sends each rank its shard of the step's batch (see `rlrunner.runner.batching`):
`num_minibatches` equal slices, one optimizer step each, every slice split into micro-batches
whose gradients accumulate. The loss is a token mean over the whole mini-batch on all ranks: each
rank divides its token sum by the mini-batch's global token count, known in advance.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlrunner.algorithms.grpo import clipped_policy_loss, kl_penalty, masked_sum, token_entropy, token_log_probs
from rlrunner.checkpoint.fsdp_dcp import ShardSaver, fsdp_state, load_fsdp_state
from rlrunner.cluster.worker import Worker
from rlrunner.models.loading import build_model, build_tokenizer, torch_dtype
from rlrunner.workers.optim import apply_schedule, build_optimizer


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks (each becomes its own FSDP unit), found by class name for any HF decoder."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def shard_model(model: torch.nn.Module, param_dtype: str, reduce_dtype: str, trainable: bool = True) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch_dtype(param_dtype), reduce_dtype=torch_dtype(reduce_dtype))
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.requires_grad_(trainable)
    return model


class ActorWorker(Worker):
    def __init__(
        self,
        rank: int,
        world_size: int,
        model_cfg: dict[str, Any],
        actor_cfg: dict[str, Any],
        algorithm_cfg: dict[str, Any],
        init_seed: int,
        total_optimizer_steps: int,
        threads: int = 1,
        use_gpu: bool = False,
    ):
        super().__init__(rank, world_size, threads, use_gpu)
        self.model_cfg = model_cfg
        self.actor_cfg = actor_cfg
        self.algorithm_cfg = algorithm_cfg
        self.init_seed = init_seed
        self.total_optimizer_steps = total_optimizer_steps

    def setup(self) -> None:
        """Build and shard the policy (and the frozen reference when KL is on). Needs the process group."""
        tokenizer = build_tokenizer(self.model_cfg)
        # Master weights stay float32; FSDP computes in actor.param_dtype.
        model = build_model(self.model_cfg, tokenizer, self.init_seed, dtype="float32").to(self.device)
        self.model = shard_model(model, self.actor_cfg["param_dtype"], self.actor_cfg["reduce_dtype"])
        self.model.train()
        self.optimizer, self.scheduler = build_optimizer(
            self.model.parameters(), self.actor_cfg["optim"], self.total_optimizer_steps
        )
        # Checkpoint collectives get a gloo group of their own: a save written in the background must never
        # interleave its collectives with training's (and DCP's background path needs a CPU backend on GPU too).
        import torch.distributed as dist

        self.saver = ShardSaver(dist.new_group(backend="gloo", timeout=self.dist_timeout))
        self.ref_model = None
        if self.algorithm_cfg["use_kl_loss"]:
            ref = build_model(self.model_cfg, tokenizer, self.init_seed, dtype="float32").to(self.device)
            self.ref_model = shard_model(ref, self.actor_cfg["param_dtype"], self.actor_cfg["reduce_dtype"], trainable=False)
            self.ref_model.eval()

    # -- forward helpers -----------------------------------------------------------------------

    def _logits(self, model: torch.nn.Module, input_ids: torch.Tensor, width: int) -> torch.Tensor:
        """Next-token logits for positions 0..width-2 of the (right-padded) rows."""
        return model(input_ids=input_ids[:, :width].to(self.device), use_cache=False).logits[:, :-1]

    def _micro_batches(self, shard: dict[str, torch.Tensor], rows: range):
        micro = self.actor_cfg["micro_batch_size"]
        for start in range(rows.start, rows.stop, micro):
            index = slice(start, start + micro)
            width = int(shard["lengths"][index].max())
            yield index, width

    @torch.no_grad()
    def _log_probs(self, model: torch.nn.Module, shard: dict[str, torch.Tensor]) -> torch.Tensor:
        """Token log-probs of every row under `model`, with the same micro-batching as the update."""
        out = torch.zeros_like(shard["loss_mask"], dtype=torch.float32)
        for index, width in self._micro_batches(shard, range(shard["input_ids"].shape[0])):
            logits = self._logits(model, shard["input_ids"][index], width)
            targets = shard["input_ids"][index, 1:width].to(self.device)
            out[index, : width - 1] = token_log_probs(logits, targets).cpu()
        return out

    # -- the update ----------------------------------------------------------------------------

    def update(self, shard: dict[str, torch.Tensor]) -> dict[str, float]:
        """One GRPO policy update on this rank's shard; returns sums for the driver to combine."""
        cfg, algo = self.actor_cfg, self.algorithm_cfg
        rows = shard["input_ids"].shape[0]
        token_counts = shard["token_counts"].tolist()
        num_minibatches = len(token_counts)
        rows_per_minibatch = rows // num_minibatches
        # With one on-policy pass the old policy is the current one: its log-probs are the live ones, detached.
        reuse_live = num_minibatches == 1 and cfg["ppo_epochs"] == 1
        old_log_probs = None if reuse_live else self._log_probs(self.model, shard)
        ref_log_probs = self._log_probs(self.ref_model, shard) if self.ref_model is not None else None
        clip_low = algo["clip_ratio"]
        clip_high = algo["clip_ratio_high"] if algo["clip_ratio_high"] is not None else clip_low

        sums = {"pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "clipped": 0.0, "ppo_kl": 0.0, "tokens": 0.0}
        grad_norms: list[float] = []
        skipped = 0
        for _ in range(cfg["ppo_epochs"]):
            for mb, global_tokens in enumerate(token_counts):
                rows_mb = range(mb * rows_per_minibatch, (mb + 1) * rows_per_minibatch)
                micro_batches = list(self._micro_batches(shard, rows_mb))
                for i, (index, width) in enumerate(micro_batches):
                    self._set_gradient_sync(i == len(micro_batches) - 1)
                    logits = self._logits(self.model, shard["input_ids"][index], width)
                    targets = shard["input_ids"][index, 1:width].to(self.device)
                    mask = shard["loss_mask"][index, : width - 1].to(self.device)
                    log_probs = token_log_probs(logits, targets)
                    old = log_probs.detach() if reuse_live else old_log_probs[index, : width - 1].to(self.device)
                    terms = clipped_policy_loss(
                        log_probs, old, shard["advantages"][index].to(self.device), clip_low, clip_high
                    )
                    per_token = terms.loss
                    if ref_log_probs is not None:
                        kl = kl_penalty(log_probs, ref_log_probs[index, : width - 1].to(self.device))
                        per_token = per_token + algo["kl_coef"] * kl
                        sums["kl"] += masked_sum(kl.detach(), mask).item()
                    if algo["entropy_coef"]:
                        entropy = token_entropy(logits)
                        per_token = per_token - algo["entropy_coef"] * entropy
                    else:
                        with torch.no_grad():
                            entropy = token_entropy(logits)
                    # Gradients are averaged over the data-parallel ranks; scaling by their number makes the result the
                    # global token mean.
                    loss = masked_sum(per_token, mask) * (self.data_parallel_size / global_tokens)
                    loss.backward()
                    sums["pg_loss"] += masked_sum(terms.loss.detach(), mask).item()
                    sums["entropy"] += masked_sum(entropy.detach(), mask).item()
                    sums["clipped"] += masked_sum(terms.clipped, mask).item()
                    sums["ppo_kl"] += masked_sum(terms.approx_kl, mask).item()
                    sums["tokens"] += mask.sum().item()
                grad_norm = self._clip_and_step()
                if not math.isfinite(grad_norm):
                    skipped += 1  # a non-finite gradient would poison the weights: the step was dropped
                self.optimizer.zero_grad()
                self.scheduler.step()
                grad_norms.append(grad_norm)
        return {
            **sums,
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "lr": self.scheduler.get_last_lr()[0],
            "skipped_steps": float(skipped),
        }

    # -- what the backends do differently (FSDP2 here; see MegatronActorWorker) -----------------

    @property
    def data_parallel_size(self) -> int:
        return self.world_size

    def _set_gradient_sync(self, enabled: bool) -> None:
        """FSDP reduces gradients in backward: only on the last micro-batch of a mini-batch."""
        self.model.set_requires_gradient_sync(enabled)

    def _max_grad_norm(self) -> float:
        return self.actor_cfg["grad_clip"] if self.actor_cfg["grad_clip"] > 0 else float("inf")

    def _clip_and_step(self) -> float:
        """Clip the gradients and step the optimizer unless their norm is not finite; returns the norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self._max_grad_norm())
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm = float(norm)
        if math.isfinite(norm):
            self.optimizer.step()
        return norm

    # -- checkpoints ---------------------------------------------------------------------------

    def start_checkpoint(self, path: str, background: bool, storage_options: dict[str, Any] | None = None) -> None:
        """Collective: save this rank's shards under `path` (a local folder or any store's URL, written straight
        there); with `background`, return once the state is copied."""
        state = fsdp_state(self.model, self.optimizer, self.scheduler, self.rank)
        self.saver.start(path, state, background, storage_options)

    def checkpoint_written(self) -> bool:
        """Whether the save in flight has finished writing (or failed); never waits."""
        return self.saver.written

    def finish_checkpoint(self) -> dict[str, Any]:
        """Wait for the save in flight; the files this rank wrote: {"files": {name: {size, crc32}}, "write_s"}."""
        return self.saver.finish()

    def load_checkpoint(self, path: str, storage_options: dict[str, Any] | None = None) -> bool:
        """Collective: load the shards under `path` (a local folder or any store's URL), resharding if the world size
        changed; returns whether RNG was restored."""
        restored_rng = load_fsdp_state(
            path, self.model, self.optimizer, self.scheduler, self.rank, self.world_size, storage_options
        )
        apply_schedule(self.optimizer, self.scheduler)  # this run's schedule, not the saved run's
        return restored_rng

    # -- weights out ---------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The unsharded weights with HF key names on rank 0 (None elsewhere). Every rank must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.rank == 0 else None

    # -- weight sync (see rlrunner.workers.weight_sync) ----------------------------------------

    def weight_sync_address(self) -> tuple[str, int]:
        """Rank 0: start a new rendezvous store for the weight-sync channels on a free port; its (host, port)."""
        from rlrunner.cluster.worker import node_ip
        from rlrunner.workers.weight_sync import serve_store

        self.close_weight_sync()
        host = node_ip()
        self._weight_sync_store = serve_store(host)  # kept alive as long as this rank's channel
        return host, self._weight_sync_store.port

    def join_weight_sync(self, host: str, port: int, num_actor_ranks: int, num_rollout_workers: int, timeout_s: float) -> str:
        """Collective with every actor rank and rollout worker: build this rank's channel; returns its backend."""
        from rlrunner.cluster.worker import node_ip
        from rlrunner.workers.weight_sync import ActorSync, connect_store

        if num_actor_ranks != self.world_size:
            raise ValueError(f"join_weight_sync: {num_actor_ranks} actor ranks given, the actor group has {self.world_size}")
        self._drop_weight_sync_channels()
        store = connect_store(host, port, timeout_s)
        self.weight_sync = ActorSync(
            store, self.rank, num_actor_ranks, num_rollout_workers, self._weight_sync_state(), self.device, timeout_s, node_ip()
        )
        return self.weight_sync.backend

    def send_weights(self, bucket_bytes: int) -> dict[str, float]:
        """Collective with every rollout worker's `receive_weights`: broadcast this rank's shards in the rollout dtype."""
        if getattr(self, "weight_sync", None) is None:
            raise RuntimeError("send_weights before join_weight_sync")
        return self.weight_sync.send(self._weight_sync_state(), bucket_bytes)

    def _weight_sync_state(self) -> dict[str, torch.Tensor]:
        """The tensors this rank sends from (its FSDP2 shards: the sync sends each rank's own rows)."""
        return self.model.state_dict()

    def _drop_weight_sync_channels(self) -> None:
        sync, self.weight_sync = getattr(self, "weight_sync", None), None
        if sync is not None:
            sync.close()

    def close_weight_sync(self) -> None:
        """Drop the channel and (rank 0) the store; a later sync needs a new address and join."""
        self._drop_weight_sync_channels()
        self._weight_sync_store = None
