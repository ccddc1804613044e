"""The actor worker of the Megatron backend: one (data-parallel, tensor-parallel) rank of the policy.

Ranks are laid out Megatron's way, tensor-parallel innermost: rank = dp_rank * tp + tp_rank, so a
tensor-parallel group is `tp` consecutive ranks (placed on one node by the WorkerGroup). Each rank holds
its tensor-parallel shard of the model (`TPCausalLM`, megatron-core's layout and names) in float32;
the ranks of a tensor-parallel group get the same rows of the batch and compute the same loss; gradients are
averaged over the data-parallel group, and AdamW's state is sharded over it (`DistributedAdamW`).

The update loop is every backend's (`rlrunner.backends.actor.ActorWorker.update`); this class supplies the
model, the gradient reduction and step, its checkpoints (`worker_checkpoints.MegatronCheckpoints`, a mixin) and what
each rank sends in a weight sync: its own tensor-parallel slices, in HF layout (data-parallel rank 0's group).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist

from rlrunner.backends.actor import ActorWorker
from rlrunner.backends.megatron.distrib_optim import DistributedAdamW
from rlrunner.backends.megatron.flat_space import bind_to_buffer
from rlrunner.backends.megatron.layout import (
    DEFAULT_VOCAB_DIVISIBLE_BY,
    iter_hf_to_megatron_rank,
)
from rlrunner.backends.megatron.model import TPCausalLM
from rlrunner.backends.megatron.moment_save import save_group
from rlrunner.backends.megatron.to_hf import megatron_to_hf
from rlrunner.backends.megatron.weight_units import UnitCursor
from rlrunner.backends.megatron.weights import MegatronWeightSource
from rlrunner.backends.megatron.worker_checkpoints import MegatronCheckpoints
from rlrunner.backends.optim import build_schedule
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


class MegatronActorWorker(MegatronCheckpoints, ActorWorker):
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
        cursor = UnitCursor(self.optimizer.units, self.optimizer.space)
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
