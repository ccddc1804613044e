"""The actor worker every training backend subclasses: one rank of the policy, its optimizer and LR schedule.

The policy update is written once, here. The driver sends each rank its shard of the step's batch (see
`rlrunner.runner.batching` and `RankMap`): `num_minibatches` equal slices, one optimizer step each, every slice
split into micro-batches whose gradients accumulate. What is minimised is the algorithm's, not the backend's
(`rlrunner.algorithms.objective.PolicyObjective`: the policy loss, its correction and aggregation chosen by name);
the update gives it the log-probs and the whole mini-batch's token and sequence counts, known in advance.

A backend supplies, as abstract methods: building the model (`setup`), the forward pass, the gradient reduction and
clipped optimizer step, its state as named parts (`state_parts`: snapshots and checkpoints carry them), the checkpoint
files, the full weights (`full_state_dict`) and what this rank sends in a weight sync (`weight_source`). The
weight-sync endpoints and the save in flight are shared.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Callable, NamedTuple

import torch

from rlrunner.algorithms.grpo import token_entropy, token_log_probs
from rlrunner.algorithms.objective import MicroBatch, MiniBatchCounts, PolicyObjective
from rlrunner.backends.background_save import BackgroundSave
from rlrunner.backends.prompt_packing import ForwardCost, PackedRows, PromptPacker
from rlrunner.backends.rank_parts import RankRNG, local_tensors, placed_like
from rlrunner.backends.snapshot_stream import SkeletonCache, SnapshotStream, fetch_part
from rlrunner.cluster.node import node_ip
from rlrunner.cluster.worker import Worker
from rlrunner.models.hf_tensors import HFTensors
from rlrunner.models.loading import warm_up_model_code
from rlrunner.utils.stateful import Stateful, StateParts
from rlrunner.weight_sync.channels import connect_store, serve_store
from rlrunner.weight_sync.endpoints import WeightSource
from rlrunner.weight_sync.plan import WeightSyncError
from rlrunner.weight_sync.transport import WeightSender

ABANDON_SAVE_WAIT_S = 30.0  # how long a survivor of a lost rank waits for its save in flight to stop writing
WeightsReader = Callable[[Any], HFTensors]  # HF config -> the HF tensors of model.path's checkpoint


class Pass(NamedTuple):
    """One forward/backward pass of the update: its rows of the shard, the length they are padded to, and the rows
    packed by prompt (None: the padded rows as they are)."""

    rows: slice
    width: int
    packed: PackedRows | None

    @property
    def tokens(self) -> int:
        """The tokens its forward runs, padding included."""
        if self.packed is not None:
            return self.packed.input_ids.numel()
        return (self.rows.stop - self.rows.start) * self.width


class ActorWorker(Worker, ABC):
    def __init__(
        self,
        rank: int,
        world_size: int,
        model_cfg: dict[str, Any],
        actor_cfg: dict[str, Any],
        algorithm_cfg: dict[str, Any],
        init_seed: int,
        total_optimizer_steps: int,
        read_weights: WeightsReader | None = None,
        samples_per_optimizer_step: int = 1,
        threads: int = 1,
        use_gpu: bool = False,
    ):
        super().__init__(rank, world_size, threads, use_gpu)
        self.model_cfg = model_cfg
        self.actor_cfg = actor_cfg
        self.algorithm_cfg = algorithm_cfg
        self.init_seed = init_seed
        self.total_optimizer_steps = total_optimizer_steps
        self.samples_per_optimizer_step = samples_per_optimizer_step  # the rows of a mini-batch, all ranks together
        self.read_weights = read_weights  # set when model.path is a training checkpoint (of any backend)
        self.objective = PolicyObjective(algorithm_cfg)
        # the same bits at any data-parallel size (a backend that can: `begin_passes` and its reduction); the driver
        # resolves the setting (rlrunner.runner.elastic.layout_invariant)
        self.layout_invariant = bool(actor_cfg.get("layout_invariant"))
        self.saver = BackgroundSave()
        self.weight_sync: WeightSender | None = None
        self._kept_weights: list[torch.Tensor] | None = None  # what the last sync with `keep` sent (a policy lag)
        self._weight_sync_store = None
        self._snapshot: SnapshotStream | None = None  # this rank's part of a snapshot on its way to its holder
        self._skeletons = SkeletonCache()  # the part's skeleton, written again only when its structure changes
        self._update_failed = False  # the last update raised: its state is no step's, so no snapshot part is sent
        self.model: torch.nn.Module
        self.ref_model: torch.nn.Module | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR
        self.packer: PromptPacker | None = None  # the backend's setup sets it (`use_prompt_packing`); None: never packs

    def warm_up(self) -> dict:
        """A spare runs the model's code once (a one-layer throwaway), so that its setup and first update after it
        is adopted do not pay the lazy imports and first-call costs."""
        warm_up_model_code(self.model_cfg)
        return super().warm_up()

    # -- what each backend supplies --------------------------------------------------------------

    @abstractmethod
    def setup(self) -> None:
        """Build this rank's part of the policy (and of the frozen reference when KL is on), its optimizer and LR
        schedule. Called once the process group is up."""

    def use_prompt_packing(self, config: Any, takes_mask: bool) -> None:
        """A backend's setup: its policy's HF `config` and whether its attention takes a 4D boolean mask (without,
        rows are never packed; `actor.pack_shared_prompts=true` is refused by the config check)."""
        setting = self.actor_cfg["pack_shared_prompts"] if takes_mask else False
        self.packer = PromptPacker(setting, ForwardCost.from_config(config))

    @property
    @abstractmethod
    def data_parallel_size(self) -> int:
        """The ranks that see different rows of the batch (gradients are averaged over them)."""

    @abstractmethod
    def forward_logits(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Next-token logits [rows, width, vocab] of `model` (the policy or the reference) for `input_ids`
        [rows, width]; with `position_ids` [rows, width] and a boolean `attention_mask` [rows, 1, width, width] (True:
        may attend) where given, else positions 0..width-1 and a causal mask."""

    def begin_passes(self, passes: int) -> None:
        """Before the forward/backward passes of one optimizer step (`passes` of them on this rank): a layout-invariant
        backend's reduction counts them."""

    @abstractmethod
    def clip_and_step(self, max_norm: float) -> float:
        """Reduce the gradients if not done yet, clip them to `max_norm`, step the optimizer unless their norm is not
        finite (then no rank steps); returns the norm of the whole model's gradient."""

    @abstractmethod
    def start_checkpoint(self, url: str, step: int, background: bool, storage_options: dict[str, Any] | None) -> None:
        """Collective: save this rank's state under `url` (the checkpoint's actor folder: a local path or any store's
        URL), through `self.saver`; with `background`, return once the state is copied off the live tensors."""

    @abstractmethod
    def load_checkpoint(self, url: str, storage_options: dict[str, Any] | None) -> bool:
        """Collective: load the state saved under `url`, resharding as needed; returns whether RNG was restored."""

    @abstractmethod
    def state_parts(self) -> dict[str, Stateful]:
        """This rank's "model", "optimizer" and "scheduler" as `Stateful` parts over the live objects (their state
        dicts may hold DTensors): with the "rng" part, what `rank_state` gives a snapshot and the checkpoint files."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole policy's weights in HF layout on rank 0, None elsewhere. Every rank must call it."""

    @abstractmethod
    def weight_source(self) -> WeightSource:
        """What this rank sends to the rollout workers in a weight sync."""

    def rank_state(self) -> StateParts:
        """This rank's whole state as named parts: the backend's `state_parts` and the RNG. A snapshot is its state
        dict; a checkpoint writes the same parts in the backend's files."""
        return StateParts({**self.state_parts(), "rng": RankRNG(self.rank)})

    # -- checkpoint writes in flight ---------------------------------------------------------------

    def checkpoint_written(self) -> bool:
        """Whether the save in flight has finished writing (or failed); never waits."""
        return self.saver.written

    def finish_checkpoint(self) -> dict[str, Any]:
        """Wait for the save in flight; the files this rank wrote: {"files": {name: {size, crc32}}, "write_s"}."""
        return self.saver.finish()

    # -- in-memory snapshots (see rlrunner.runner.snapshots) ------------------------------------------

    def start_snapshot(self, step: int, holder_address: tuple[str, int, str]) -> None:
        """Start sending this rank's part of `step`'s snapshot (its training state and RNG, straight off the live
        tensors) to the holder at `holder_address` (`SnapshotHolder.address`), from a thread: the calls queued after
        this one (the weight sync) run meanwhile, and read the same tensors. Nothing may change them before
        `finish_snapshot`. The driver queues it behind the step's update; after an update that raised it sends
        nothing and raises."""
        self.abandon_snapshot()
        if self._update_failed:
            raise RuntimeError(f"actor rank {self.rank}: no snapshot part of step {step}: its update failed")
        with torch.no_grad():  # a DTensor's to_local outside no_grad goes through autograd, 20 times slower
            state = local_tensors(self.rank_state().state_dict())
        self._snapshot = SnapshotStream(step, self.rank, holder_address, state, skeletons=self._skeletons)

    def finish_snapshot(self, timeout_s: float | None = None) -> str | None:
        """Wait for the part started last: None once its holder keeps it whole, else why it keeps none."""
        stream, self._snapshot = self._snapshot, None
        if stream is None:
            return f"actor rank {self.rank}: no snapshot part was started"
        return stream.wait(timeout_s)

    def abandon_snapshot(self) -> None:
        """A part still on its way is given up (its thread ends at its holder's next answer)."""
        stream, self._snapshot = self._snapshot, None
        if stream is not None:
            stream.wait(ABANDON_SAVE_WAIT_S)

    def load_snapshot(self, holder: Any, step: int) -> None:
        """Put back this rank's part of `step`'s snapshot, read from `holder` (taken with the same ranks)."""
        saved = fetch_part(holder, step, self.rank)
        state = self.rank_state()
        state.load_state_dict(placed_like(saved, state.state_dict()))

    def load_resharded_snapshot(self, holders: list[Any], step: int) -> None:
        """Put back this rank's state from `step`'s snapshot taken by `len(holders)` ranks (`holders[r]` keeps old rank
        r's part): a backend whose snapshots reshard (`TrainingBackend.reshards_snapshots`) overrides it."""
        raise NotImplementedError(f"{type(self).__name__} cannot load a snapshot taken at another size")

    # -- the update ----------------------------------------------------------------------------

    def _passes(self, shard: dict[str, torch.Tensor]) -> list[Pass]:
        """The forward/backward passes over the micro-batches the driver planned (`shard["micro_batches"]`, row
        counts), in order: each one's rows, the length they are padded to, and the rows packed by prompt where the
        packer packs them."""
        passes, start = [], 0
        for size in shard["micro_batches"].tolist():
            index = slice(start, start + size)
            lengths = shard["lengths"][index].tolist()
            width = max(lengths)
            prompts = shard["prompt_lengths"][index].tolist()
            packed = (
                None if self.packer is None else self.packer.pack(shard["input_ids"][index, :width], prompts, lengths)
            )
            passes.append(Pass(index, width, None if packed is None else packed.to(self.device)))
            start += size
        return passes

    def _logits(self, model: torch.nn.Module, shard: dict[str, torch.Tensor], forward: Pass) -> torch.Tensor:
        """Next-token logits for positions 0..width-2 of the pass's (right-padded) rows."""
        if forward.packed is not None:
            rows = forward.packed
            return rows.gather(self.forward_logits(model, rows.input_ids, rows.position_ids, rows.attention_mask))
        return self.forward_logits(model, shard["input_ids"][forward.rows, : forward.width].to(self.device))[:, :-1]

    @torch.no_grad()
    def _log_probs(self, model: torch.nn.Module, shard: dict[str, torch.Tensor], passes: list[Pass]) -> torch.Tensor:
        """Token log-probs of every row under `model`, with the same passes as the update."""
        out = torch.zeros_like(shard["loss_mask"], dtype=torch.float32)
        for forward in passes:
            logits = self._logits(model, shard, forward)
            targets = shard["input_ids"][forward.rows, 1 : forward.width].to(self.device)
            out[forward.rows, : forward.width - 1] = token_log_probs(logits, targets).cpu()
        return out

    def update(self, shard: dict[str, torch.Tensor]) -> dict[str, float]:
        """One policy update on this rank's shard; returns sums for the driver to combine."""
        self._update_failed = True
        sums = self._update(shard)
        self._update_failed = False
        return sums

    def _update(self, shard: dict[str, torch.Tensor]) -> dict[str, float]:
        cfg, algo = self.actor_cfg, self.algorithm_cfg
        rows = shard["input_ids"].shape[0]
        token_counts, sequence_counts = shard["token_counts"].tolist(), shard["sequence_counts"].tolist()
        num_minibatches = len(token_counts)
        rows_per_minibatch = rows // num_minibatches
        # With one on-policy pass the old policy is the current one: its log-probs are the live ones, detached.
        reuse_live = num_minibatches == 1 and cfg["ppo_epochs"] == 1
        passes = self._passes(shard)
        old_log_probs = None if reuse_live else self._log_probs(self.model, shard, passes)
        ref_log_probs = self._log_probs(self.ref_model, shard, passes) if self.ref_model is not None else None
        max_norm = cfg["grad_clip"] if cfg["grad_clip"] > 0 else float("inf")

        sums = self.objective.new_sums()
        # layout-invariant: each pass's metric sums apart, for the driver to add in the logical micro-batches' order
        leaf_sums: list[list[dict[str, float]]] = []  # per optimizer step, its passes in order
        # the gradients are averaged over the data-parallel ranks, unless the backend adds them in its tree
        loss_scale = 1 if self.layout_invariant else self.data_parallel_size
        grad_norms: list[float] = []
        skipped = 0
        for _ in range(cfg["ppo_epochs"]):
            for mb, (tokens, sequences) in enumerate(zip(token_counts, sequence_counts)):
                rows_mb = range(mb * rows_per_minibatch, (mb + 1) * rows_per_minibatch)
                counts = MiniBatchCounts(tokens, sequences)
                minibatch_passes = [f for f in passes if rows_mb.start <= f.rows.start < rows_mb.stop]
                self.begin_passes(len(minibatch_passes))
                leaf_sums.append([])
                # FSDP reduce-scatters each micro-batch's gradients in its backward: accumulating them unsharded
                # over the micro-batches would hold the whole model's gradients on every rank
                for forward in minibatch_passes:
                    index, width = forward.rows, forward.width
                    logits = self._logits(self.model, shard, forward)
                    targets = shard["input_ids"][index, 1:width].to(self.device)
                    log_probs = token_log_probs(logits, targets)
                    positions = (index, slice(0, width - 1))
                    if algo["entropy_coef"]:
                        entropy = token_entropy(logits)
                    else:
                        with torch.no_grad():
                            entropy = token_entropy(logits)
                    batch = MicroBatch(
                        old_log_probs=log_probs.detach() if reuse_live else old_log_probs[positions].to(self.device),
                        advantages=shard["advantages"][index].to(self.device),
                        mask=shard["loss_mask"][positions].to(self.device),
                        rollout_log_probs=shard["rollout_logprobs"][positions].to(self.device),
                        entropy=entropy,
                        ref_log_probs=None if ref_log_probs is None else ref_log_probs[positions].to(self.device),
                    )
                    pass_sums = self.objective.new_sums() if self.layout_invariant else sums
                    self.objective.micro_batch_loss(log_probs, batch, counts, loss_scale, pass_sums).backward()
                    if self.layout_invariant:
                        leaf_sums[-1].append(pass_sums)
                grad_norm = self.clip_and_step(max_norm)
                if not math.isfinite(grad_norm):
                    skipped += 1  # a non-finite gradient would poison the weights: the step was dropped
                self.optimizer.zero_grad()
                self.scheduler.step()
                grad_norms.append(grad_norm)
        return {
            **sums,
            **({"leaf_sums": leaf_sums} if self.layout_invariant else {}),
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "lr": self.scheduler.get_last_lr()[0],
            "skipped_steps": float(skipped),
            "pass_tokens": float(sum(forward.tokens for forward in passes)),
        }

    # -- weight sync (see rlrunner.weight_sync) --------------------------------------------------

    def weight_sync_address(self) -> tuple[str, int]:
        """Rank 0: start a new rendezvous store for the weight-sync channels on a free port; its (host, port)."""
        self.close_weight_sync()
        host = node_ip()
        self._weight_sync_store = serve_store(host)  # kept alive as long as this rank's channel
        return host, self._weight_sync_store.port

    def join_weight_sync(
        self, host: str, port: int, num_actor_ranks: int, num_rollout_workers: int, timeout_s: float
    ) -> str:
        """Collective with every actor rank and rollout worker: build this rank's channel; returns its backend."""
        if num_actor_ranks != self.world_size:
            raise ValueError(
                f"join_weight_sync: {num_actor_ranks} actor ranks given, the actor group has {self.world_size}"
            )
        self._drop_weight_sync_channels()
        store = connect_store(host, port, timeout_s)
        self.weight_sync = WeightSender(
            store,
            self.rank,
            num_actor_ranks,
            num_rollout_workers,
            self.weight_source(),
            self.device,
            timeout_s,
            node_ip(),
        )
        return self.weight_sync.backend

    def send_weights(self, bucket_bytes: int, keep: bool = False, kept: bool = False) -> dict[str, float]:
        """Collective with every rollout worker's `receive_weights`: broadcast this rank's blocks in the rollout
        dtype; `keep` a copy of them (held here, so it outlives the channels: a rollout repair joins them again), or
        send the `kept` copy of an earlier sync instead (`WeightSender.send_copy`)."""
        if self.weight_sync is None:
            raise RuntimeError("send_weights before join_weight_sync")
        if kept:
            if self._kept_weights is None:
                raise WeightSyncError(f"actor rank {self.rank}: no copy of an earlier sync's weights was kept")
            return self.weight_sync.send_copy(bucket_bytes, self._kept_weights)
        self._kept_weights = None  # the older copy goes before a new one is made
        if not keep:
            return self.weight_sync.send(bucket_bytes)
        # Copied whole first: a send that fails (a rollout worker lost in it) leaves the copy for the repair to push,
        # even after the next update (already queued behind this sync) has changed the live weights.
        self._kept_weights = self.weight_sync.copy_blocks()
        return self.weight_sync.send_copy(bucket_bytes, self._kept_weights)

    def _drop_weight_sync_channels(self) -> None:
        sync, self.weight_sync = self.weight_sync, None
        if sync is not None:
            sync.close()

    def leave_process_group(self) -> None:
        """A survivor of a lost rank: drop the weight-sync channel, the save in flight and the process group. The rank
        is then set up again, in the group formed with the replacement, and loads its part of the snapshot."""
        self.close_weight_sync()
        self.abandon_snapshot()
        self.saver.abandon(timeout_s=ABANDON_SAVE_WAIT_S)
        super().leave_process_group()

    def close_weight_sync(self) -> None:
        """Drop the channel and (rank 0) the store; a later sync needs a new address and join."""
        self._drop_weight_sync_channels()
        self._weight_sync_store = None
