"""The actor worker of the Megatron backend: one (data-parallel, tensor-parallel) rank of the policy.

Ranks are laid out Megatron's way, tensor-parallel innermost: rank = dp_rank * tp + tp_rank, so a
tensor-parallel group is `tp` consecutive ranks (placed on one node by the WorkerGroup). Each rank holds
its tensor-parallel shard of the model (`TPCausalLM`, megatron-core's layout and names) in float32;
the ranks of a tensor-parallel group get the same rows of the batch and compute the same loss; gradients are
averaged over the data-parallel group, and AdamW's state is sharded over it (`DistributedAdamW`).

The update loop is every backend's (`rlrunner.backends.actor.ActorWorker.update`); this class supplies the
model, the gradient reduction and step, the checkpoint files (`rlrunner.backends.megatron.rank_state`) and what
each rank sends in a weight sync: its own tensor-parallel slices, in HF layout (data-parallel rank 0's group).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist

from rlrunner.backends.actor import ActorWorker
from rlrunner.backends.megatron.buffer_geometry import megatron_param_names
from rlrunner.backends.megatron.dist_ckpt import (
    is_torch_dist,
    load_torch_dist,
    owned_pieces,
    read_common,
    save_torch_dist,
    slice_rectangles,
    whole_rectangles,
)
from rlrunner.backends.megatron.dist_layout import extra_state_keys, rng_state_key, sharded_params
from rlrunner.backends.megatron.distrib_optim import MOMENTS, DistributedAdamW
from rlrunner.backends.megatron.files import megatron_args, rank_file, rank_state, read_tracker
from rlrunner.backends.megatron.flat_space import bind_to_buffer
from rlrunner.backends.megatron.layout import (
    DEFAULT_VOCAB_DIVISIBLE_BY,
    EXTRA_STATE,
    DecoderDims,
    expected_megatron_keys,
    iter_hf_to_megatron_rank,
)
from rlrunner.backends.megatron.megatron_entries import (
    optimizer_entry,
    optimizer_step,
    our_scheduler,
    rng_entry,
    rng_from_entry,
    scheduler_entry,
)
from rlrunner.backends.megatron.model import TPCausalLM
from rlrunner.backends.megatron.moment_files import coalesced_offsets_of
from rlrunner.backends.megatron.moment_save import MomentSave, save_group
from rlrunner.backends.megatron.rank_state import MegatronRankState, load_rank
from rlrunner.backends.megatron.to_hf import megatron_to_hf
from rlrunner.backends.megatron.weight_units import UnitCursor
from rlrunner.backends.megatron.weights import MegatronWeightSource
from rlrunner.backends.optim import apply_schedule, build_schedule
from rlrunner.models.loading import (
    build_hf_config,
    build_tokenizer,
    fit_heap_to,
    float32_bytes,
    initial_tensors,
    meta_model,
    recomputes_activations,
    torch_dtype,
)
from rlrunner.storage import open_storage
from rlrunner.utils.rng import capture_rng, restore_rng
from rlrunner.weight_sync.endpoints import WeightSource


def parallel_groups(world_size: int, tp: int, rank: int, timeout) -> tuple[Any, Any]:
    """(this rank's tensor-parallel group, its data-parallel group). Every rank creates every group, in the same
    order, as torch.distributed requires."""
    tp_group = dp_group = None
    for first in range(0, world_size, tp):
        ranks = list(range(first, first + tp))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            tp_group = group
    for tp_rank in range(tp):
        ranks = list(range(tp_rank, world_size, tp))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            dp_group = group
    return tp_group, dp_group


def replicated_names(model: TPCausalLM) -> set[str]:
    """Parameters every tensor-parallel rank holds whole (the norms): counted once in the gradient norm."""
    return {name for name, _ in model.named_parameters() if name.endswith("layernorm.weight")}


class MegatronModelState:
    """The "model" part: this tensor-parallel rank's weights; empty when they are sharded over the data-parallel
    ranks (`actor.megatron.shard_weights`: the optimizer's part holds this rank's slice of them)."""

    def __init__(self, model: torch.nn.Module, optimizer: DistributedAdamW):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return {} if self.optimizer.shard_weights else {k: v.detach() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.optimizer.shard_weights:
            self.model.load_state_dict(state)


class MegatronOptimizerState:
    """The "optimizer" part: this rank's slice of the flat parameter space (master weights, moments) and the step."""

    def __init__(self, optimizer: DistributedAdamW):
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.local_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_local_state(state)


class MegatronActorWorker(ActorWorker):
    def setup(self) -> None:
        """Build this rank's shard of the policy (and of the frozen reference when KL is on). Needs the process
        group."""
        self.tp = int(self.actor_cfg["tensor_model_parallel_size"])
        if self.world_size % self.tp:
            raise ValueError(f"{self.world_size} actor ranks do not split into tensor-parallel groups of {self.tp}")
        self.tp_rank, self.dp_rank = self.rank % self.tp, self.rank // self.tp
        self.tp_group, self.dp_group = parallel_groups(self.world_size, self.tp, self.rank, self.dist_timeout)
        # a checkpoint's moments travel to data-parallel rank 0 over a group of their own (gloo), never the training's:
        # a background save's thread must not interleave with the training thread on one group
        self.save_group = save_group(self.world_size, self.tp, self.rank, self.dist_timeout)
        # the distributed format's saves and loads coordinate over every rank, also apart from the training groups
        self.dist_group = dist.new_group(timeout=self.dist_timeout, backend="gloo")
        self.ckpt_format = self.actor_cfg["megatron"]["ckpt_format"]
        self.divisible_by = DEFAULT_VOCAB_DIVISIBLE_BY
        tokenizer = build_tokenizer(self.model_cfg)
        self.hf_config = build_hf_config(self.model_cfg, tokenizer)
        # Built on the meta device: the parameters get their storage from the optimizer's buffer (or, for the frozen
        # reference, one of its own) and then only this rank's rows and columns of each HF tensor are read (or
        # generated) into them, one tensor at a time: no rank holds the whole model, nor a second copy of its part.
        self.model = TPCausalLM(self.hf_config, self.tp_group, self.divisible_by, device="meta")
        optim = self.actor_cfg["optim"]
        self.optimizer = DistributedAdamW(
            list(self.model.named_parameters()),
            self.dp_group,
            self.tp_group,
            replicated_names(self.model),
            lr=optim["lr"],
            betas=tuple(optim["betas"]),
            weight_decay=optim["weight_decay"],
            device=self.device,
            shard_gradients=bool(self.actor_cfg["megatron"]["shard_gradients"]),
            shard_weights=bool(self.actor_cfg["megatron"]["shard_weights"]),
            units=self.model.weight_unit_names(),
        )
        if self.optimizer.shard_weights:  # ZeRO-3: the model gathers each unit around its use
            self.model.weight_units = self.optimizer.units
        model_bytes = self._load_initial_weights(self.model, self.optimizer.load_weight)
        recompute = self.actor_cfg["gradient_checkpointing"]
        self.model.gradient_checkpointing = recomputes_activations(recompute, model_bytes)
        self.model.train()
        self.use_prompt_packing(self.hf_config, takes_mask=True)  # its attention is sdpa's
        self.scheduler = build_schedule(self.optimizer.optimizer, optim, self.total_optimizer_steps)
        if self.algorithm_cfg["use_kl_loss"]:
            self.ref_model = TPCausalLM(self.hf_config, self.tp_group, self.divisible_by, device="meta")
            params = list(self.ref_model.parameters())
            bind_to_buffer(params, sum(p.numel() for p in params), self.device)
            self._load_initial_weights(self.ref_model.requires_grad_(False))
            self.ref_model.eval()

    def _load_initial_weights(self, model: TPCausalLM, into: Callable[[str, torch.Tensor], None] | None = None) -> int:
        """Fill `model` (this rank's part) with the run's initial weights; returns the whole model's float32 bytes."""
        plan = meta_model(self.hf_config, self.model_cfg["attn_implementation"], torch.float32)  # names and shapes
        model_bytes = float32_bytes(plan)
        fit_heap_to(model_bytes)
        tensors = initial_tensors(self.model_cfg, self.hf_config, self.init_seed, plan, self.read_weights)
        model.load_megatron_shard(
            iter_hf_to_megatron_rank(tensors, self.hf_config, self.tp, self.tp_rank, self.divisible_by), into
        )
        model.to(self.device)  # the rotary table (the parameters are there already)
        return model_bytes

    # -- the update's backend parts ------------------------------------------------------------

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.tp

    def forward_logits(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        compute = torch_dtype(self.actor_cfg["param_dtype"])
        # sharded weights: no cache of each weight's cast copy, which would keep every unit's (in the compute dtype)
        # for the whole forward after the unit itself is released
        autocast = (
            torch.autocast(self.device.type, dtype=compute, cache_enabled=not self.optimizer.shard_weights)
            if compute != torch.float32
            else contextlib.nullcontext()
        )
        with autocast:
            return model(input_ids, attention_mask, position_ids)

    def clip_and_step(self, max_norm: float) -> float:
        self.optimizer.reduce_gradients()
        return self.optimizer.clip_and_step(max_norm)

    # -- checkpoints ---------------------------------------------------------------------------

    def start_checkpoint(self, url: str, step: int, background: bool, storage_options: dict[str, Any] | None) -> None:
        """Collective: data-parallel rank 0 of each tensor-parallel rank writes that rank's `model_optim_rng.pt` and its
        `distrib_optim.pt`, into which the other data-parallel ranks send their slices of the moments a chunk at a time
        (`moment_save`), under `url` (the checkpoint's actor folder): a copy of the state, in a thread, with
        `background`; the live tensors, before returning, without. Nothing but the RNG states is gathered. With
        `actor.megatron.ckpt_format=torch_dist`, every rank writes its own part of megatron-core's distributed format
        instead (`dist_ckpt`)."""
        own = self.optimizer.own_slice(copy=background)
        rng = [None] * self.data_parallel_size
        dist.all_gather_object(rng, rng_entry(capture_rng(), self.init_seed, self.tp_rank), group=self.dp_group)
        if self.ckpt_format == "torch_dist":
            self._start_dist_checkpoint(url, step, background, storage_options, own, rng)
            return
        layout = self.optimizer.layout()
        dims = DecoderDims.from_config(self.hf_config)
        offsets, numel = coalesced_offsets_of(layout, megatron_param_names(dims), self.data_parallel_size)
        moments = MomentSave(step, self.tp, self.tp_rank, layout, offsets, numel, own, self.save_group)
        # sharded weights are walked a unit at a time by every DP rank (`UnitCursor`); a synchronous save writes each
        # unit while it is gathered (a stand-in now, the values when they are due), a background one copies it now
        streamed = self.optimizer.shard_weights and not background
        cursor = UnitCursor(self.optimizer)
        deferred = {}
        weights: dict[str, torch.Tensor] = {}
        if self.dp_rank == 0:
            for key, param in self.model.state_dict().items():
                if streamed:
                    weights[key] = torch.empty(param.shape, dtype=param.dtype)
                    deferred[id(weights[key])] = lambda key=key: cursor.tensor(key).detach()
                else:
                    weights[key] = cursor.tensor(key).detach().to("cpu", copy=background)
        if not deferred:
            cursor.finish()  # the writer's walk ends in `write`
        files = {}
        if self.dp_rank == 0:
            model = {**weights, **{k: None for k in _extra_state_keys(self)}}
            files[rank_file(step, self.tp_rank)] = rank_state(step, model, *self._training_entries(step), rng)
        # every DP rank: the units' walk first (DP rank 0 writes model_optim_rng.pt), then the moments' transfers
        moment_files, moment_parts = moments.files()
        files.update(moment_files)
        deferred.update(moment_parts)
        after = (cursor.finish, moments.finish) if streamed else (moments.finish,)
        state = MegatronRankState(files, deferred, after)
        self.saver.run(lambda: state.write(url, storage_options), background)

    def _start_dist_checkpoint(
        self, url: str, step: int, background: bool, storage_options: Any, own: dict[str, Any], rng: list
    ) -> None:
        """This rank's part of a `torch_dist` checkpoint: its own flat slice of the weights and moments (the
        parameters' rectangles it covers), its tensor-parallel rank's RNG states (data-parallel rank 0), and, from
        rank 0, the layers' `_extra_state` objects and `common.pt`."""
        layout = self.optimizer.layout()
        dims = DecoderDims.from_config(self.hf_config)
        params = sharded_params(layout, dims, self.tp, self.tp_rank, self.divisible_by)
        pieces = owned_pieces(params, layout, own["start"], own["stop"])
        objects: dict[str, Any] = {rng_state_key(self.tp_rank, self.tp): rng} if self.dp_rank == 0 else {}
        common = None
        if self.rank == 0:
            objects.update({key: None for key in extra_state_keys(dims)})
            args, optimizer, scheduler = self._training_entries(step, ckpt_format="torch_dist", use_dist_ckpt=True)
            optimizer["param_state_sharding_type"] = "fully_reshardable"  # how the sharded optimizer state is laid out
            common = rank_state(step, {}, args, optimizer, scheduler)
            del common["model"]  # the sharded keys hold it
        group = self.dist_group
        self.saver.run(
            lambda: save_torch_dist(url, storage_options, step, pieces, own, objects, common, group), background
        )

    def _training_entries(self, step: int, **extra_args: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """(`args`, `optimizer`, `opt_param_scheduler`) of a `model_optim_rng.pt`, as Megatron-LM reads them."""
        optim = self.actor_cfg["optim"]
        samples = self.samples_per_optimizer_step
        steps_done = int(self.scheduler.last_epoch)
        max_lr, min_lr = float(optim["lr"]), float(optim["lr"]) * float(optim["min_lr_ratio"])
        betas = tuple(optim["betas"])
        args = megatron_args(
            self.hf_config,
            self.tp,
            self.data_parallel_size,
            self.divisible_by,
            torch.float32,
            iteration=step,
            train_iters=self.total_optimizer_steps,
            global_batch_size=samples,
            consumed_train_samples=steps_done * samples,
            seed=self.init_seed,
            optimizer="adam",
            lr=max_lr,
            min_lr=min_lr,
            lr_decay_style=optim["lr_schedule"],
            lr_warmup_iters=int(optim["warmup_steps"]),
            lr_decay_iters=self.total_optimizer_steps,
            weight_decay=float(optim["weight_decay"]),
            adam_beta1=float(betas[0]),
            adam_beta2=float(betas[1]),
            use_distributed_optimizer=True,
            **extra_args,
        )
        group = self.optimizer.param_groups_state()
        optimizer = optimizer_entry(
            group["lr"], group["betas"], group["eps"], group["weight_decay"], group["step"], max_lr, min_lr
        )
        scheduler = scheduler_entry(
            self.scheduler.state_dict(),
            max_lr,
            min_lr,
            int(optim["warmup_steps"]),
            self.total_optimizer_steps,
            optim["lr_schedule"],
            float(optim["weight_decay"]),
            samples,
        )
        return args, optimizer, scheduler

    def load_checkpoint(self, url: str, storage_options: dict[str, Any] | None) -> bool:
        """Load this rank's state from the checkpoint's actor folder `url`, resharding over tensor-parallel sizes;
        returns whether RNG was restored (only when the parallel sizes are the saved ones)."""
        storage = open_storage(url, storage_options)
        iteration = read_tracker(storage, url)
        if is_torch_dist(storage, url, iteration):
            return self._load_dist_checkpoint(url, storage_options, iteration)
        loaded = load_rank(
            url,
            storage_options,
            self.hf_config,
            self.tp,
            self.tp_rank,
            self.data_parallel_size,
            self.dp_rank,
            self.divisible_by,
        )
        self.model.load_megatron_shard(loaded.model, self.optimizer.load_weight)
        loaded.load_moments(self.optimizer)
        self.scheduler.load_state_dict(our_scheduler(loaded.scheduler))
        apply_schedule(self.optimizer.optimizer, self.scheduler)  # this run's schedule, not the saved run's
        if loaded.rng_state is not None:
            restore_rng(rng_from_entry(loaded.rng_state))
        return loaded.rng_state is not None

    def _load_dist_checkpoint(self, url: str, storage_options: Any, iteration: int) -> bool:
        """Load a `torch_dist` checkpoint at this run's layout, whatever the saved one: this rank's own flat slice of
        the moments and, with sharded weights, of the fp32 weights (`optimizer.state.param`), else each weight's whole
        tensor-parallel shard, each read from the saved chunks that cover it (collective over every rank)."""
        common = read_common(url, storage_options, iteration)
        saved = common["args"]
        layout = self.optimizer.layout()
        params = sharded_params(
            layout, DecoderDims.from_config(self.hf_config), self.tp, self.tp_rank, self.divisible_by
        )
        start, stop = self.optimizer._own_range()
        pieces = owned_pieces(params, layout, start, stop)
        moments = {key: torch.zeros(stop - start) for key in MOMENTS}
        weights: dict[str, torch.Tensor] = {}
        if self.optimizer.shard_weights:  # a rank holds its slice of the weights alone: it reads only that
            moments["param"] = torch.zeros(stop - start)
            wanted = slice_rectangles(pieces, moments)
        else:  # whole weights: each weight's tensor-parallel shard (the vocabulary's padding rows stay zero)
            weights = {name: torch.zeros(shape) for name, shape in layout}
            wanted = {**whole_rectangles(params, weights), **slice_rectangles(pieces, moments)}
        same_layout = (saved.tensor_model_parallel_size, saved.data_parallel_size) == (self.tp, self.data_parallel_size)
        rng_key = rng_state_key(self.tp_rank, self.tp)
        objects = load_torch_dist(
            url, storage_options, iteration, wanted, [rng_key] if same_layout else [], self.dist_group
        )
        if self.optimizer.shard_weights:
            self.optimizer.load_owned_weights(moments.pop("param"))
        else:
            self.model.load_megatron_shard(weights.items(), self.optimizer.load_weight)
        self.optimizer.load_flat_state(
            optimizer_step(common["optimizer"]), layout, lambda key, a, b: moments[key][a - start : b - start]
        )
        self.scheduler.load_state_dict(our_scheduler(common["opt_param_scheduler"]))
        apply_schedule(self.optimizer.optimizer, self.scheduler)
        if same_layout:
            restore_rng(rng_from_entry(objects[rng_key][self.dp_rank]))
        return same_layout

    # -- state -------------------------------------------------------------------------------------

    def state_parts(self) -> dict[str, Any]:
        return {
            "model": MegatronModelState(self.model, self.optimizer),
            "optimizer": MegatronOptimizerState(self.optimizer),
            "scheduler": self.scheduler,
        }

    # -- weights out ---------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective over data-parallel rank 0's tensor-parallel group: the full weights in the HF layout (tied output
        included under its HF name, as an HF model's state dict lists it) on rank 0, None elsewhere."""
        cursor = UnitCursor(self.optimizer)
        if self.dp_rank != 0:
            cursor.finish()  # with sharded weights, the other replicas take part in gathering them
            return None  # the other data-parallel replicas hold the same weights
        own = {
            k: cursor.tensor(k).detach().clone() if self.optimizer.shard_weights else v.detach()
            for k, v in self.model.state_dict().items()
        }
        cursor.finish()
        if self.tp == 1:
            shards = [own]
        else:
            shards = [{} for _ in range(self.tp)]
            for key, tensor in own.items():
                pieces = [torch.empty_like(tensor) for _ in range(self.tp)] if self.tp_rank == 0 else None
                dist.gather(tensor.contiguous(), pieces, group=self.tp_group, group_dst=0)
                for rank, piece in enumerate(pieces or []):
                    shards[rank][key] = piece
        if self.tp_rank != 0:
            return None
        state = megatron_to_hf(shards, self.hf_config)
        if self.hf_config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return {k: v.cpu() for k, v in state.items()}

    def weight_source(self) -> WeightSource:
        return MegatronWeightSource(self)


def _extra_state_keys(worker: MegatronActorWorker) -> list[str]:
    """megatron-core's `_extra_state` entries of the layers (None in its legacy checkpoints): our model has no such
    state, the files carry the keys so that megatron-core's strict load accepts them."""
    return [
        key for key in expected_megatron_keys(DecoderDims.from_config(worker.hf_config)) if key.endswith(EXTRA_STATE)
    ]
