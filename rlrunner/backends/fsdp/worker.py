"""The FSDP backend's actor worker: one rank of the policy sharded with FSDP2, AdamW, checkpoints through DCP."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from rlrunner.backends.actor import ActorWorker
from rlrunner.backends.fsdp import PACKING_ATTENTION
from rlrunner.backends.fsdp.dcp_state import (
    fsdp_parts,
    load_fsdp_state,
    stager_for_next_save,
    start_dcp_save,
)
from rlrunner.backends.fsdp.invariant_grads import LayoutInvariantGrads, clip_grads, grad_norm
from rlrunner.backends.fsdp.snapshot_reshard import resharded_state
from rlrunner.backends.fsdp.weights import FSDPWeightSource, shard_rows
from rlrunner.backends.optim import apply_schedule, build_optimizer
from rlrunner.backends.rank_parts import local_shard, placed_like
from rlrunner.backends.snapshot_stream import fetch_part
from rlrunner.models.hf_tensors import BLOCK_ELEMENTS, HFTensors
from rlrunner.models.loading import (
    SMALL_MODEL_BYTES,
    build_hf_config,
    build_tokenizer,
    fit_heap_to,
    float32_bytes,
    initial_tensors,
    meta_model,
    recomputes_activations,
    restore_buffers,
    torch_dtype,
)
from rlrunner.weight_sync.endpoints import WeightSource


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks (each becomes its own FSDP unit), found by class name for any HF decoder."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def resolve_unit(unit: str, model_bytes: int) -> str:
    """The FSDP unit `actor.fsdp.unit` means for a model of `model_bytes` (its float32 weights): `auto` is `model` for
    a small model (SMALL_MODEL_BYTES), else `decoder_layer`; any other value is itself. What one unit holds unsharded
    during a pass (a small model's weights and gradients, 128 MiB at most) is small beside a rank's fixed overhead, and
    it saves a collective per layer in the forward, the recomputation and the backward: the default job's update on 2
    ranks took 65 ms instead of 79 ms."""
    if unit != "auto":
        return unit
    return "model" if model_bytes <= SMALL_MODEL_BYTES else "decoder_layer"


def shard_model(
    model: torch.nn.Module, param_dtype: str, reduce_dtype: str, trainable: bool = True, unit: str = "decoder_layer"
) -> torch.nn.Module:
    """Apply FSDP2 to `model`: each decoder layer one unit (one all-gather, one reduce-scatter), or with
    `unit="linear"` each of a layer's projections one unit and its norms another, or with `unit="model"` the whole
    model one unit. Smaller units hold less unsharded at once (a layer's gathered weights, its unsharded gradients and
    the collectives' buffers are a projection's instead), at the price of more, smaller collectives. The root unit
    holds the rest (embeddings, final norm, head). Every unit shards each parameter the same way (dim-0 rows), so the
    checkpoints, snapshots and weight syncs are the same whatever the unit."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch_dtype(param_dtype), reduce_dtype=torch_dtype(reduce_dtype))
    for layer in decoder_layers(model) if unit != "model" else []:
        if unit == "linear":
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear):
                    fully_shard(module, mp_policy=policy)
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.requires_grad_(trainable)
    return model


def enable_recomputation(model: torch.nn.Module) -> None:
    """HF's activation checkpointing per decoder layer, non-reentrant: FSDP2's pre-backward hook all-gathers a layer
    for its recompute. Through `activation_checkpointing_enable` where transformers has it (5.2x), whose old name
    warns of its removal in v6 from every rank."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@torch.no_grad()
def fill_own_rows(model: torch.nn.Module, tensors: HFTensors) -> None:
    """Copy into each parameter's local shard (its dim-0 rows, FSDP2's torch.chunk split) those rows of the HF
    tensor."""
    for name, param in model.named_parameters():
        local = local_shard(param)
        if hasattr(param, "device_mesh"):
            start, stop = shard_rows(param.shape[0], param.device_mesh.size(), param.device_mesh.get_local_rank())
        else:
            start, stop = 0, param.shape[0]
        # a block of rows at a time (aligned as the seeded init's blocks are): the only temporary is one block, not
        # this rank's whole part of the largest tensor (half the embedding, at 2 ranks)
        rows_per_read = max(1, BLOCK_ELEMENTS // max(1, local[0].numel() if local.dim() else 1))
        lo = start
        while lo < stop:
            hi = min(stop, (lo // rows_per_read + 1) * rows_per_read)
            local[lo - start : hi - start].copy_(tensors.read(name, 0, lo, hi).reshape(hi - lo, *local.shape[1:]))
            lo = hi


class FSDPActorWorker(ActorWorker):
    def setup(self) -> None:
        """Build and shard the policy (and the frozen reference when KL is on). Needs the process group."""
        tokenizer = build_tokenizer(self.model_cfg)
        # Master weights stay float32; FSDP computes in actor.param_dtype.
        self.model = self._build(tokenizer, trainable=True)
        if recomputes_activations(self.actor_cfg["gradient_checkpointing"], float32_bytes(self.model)):
            enable_recomputation(self.model)
        self.model.train()
        self.use_prompt_packing(self.model.config, self.model_cfg["attn_implementation"] in PACKING_ATTENTION)
        self.optimizer, self.scheduler = build_optimizer(
            self.model.parameters(), self.actor_cfg["optim"], self.total_optimizer_steps
        )
        self.parts = fsdp_parts(self.model, self.optimizer, self.scheduler)  # kept: they reuse what they read
        self.invariant_grads = LayoutInvariantGrads(self.model) if self.layout_invariant else None
        # Checkpoint collectives get a gloo group of their own: a save written in the background must never
        # interleave its collectives with training's (and DCP's background path needs a CPU backend on GPU too).
        self.checkpoint_group = dist.new_group(backend="gloo", timeout=self.dist_timeout)
        self.stager = None  # made at the first background save; kept for the next ones where torch allows
        if self.algorithm_cfg["use_kl_loss"]:
            self.ref_model = self._build(tokenizer, trainable=False)
            self.ref_model.eval()

    def _build(self, tokenizer, trainable: bool) -> torch.nn.Module:
        # Sharded while on the meta device; then each rank gives storage to its own rows only and reads (or generates)
        # just those rows of each HF tensor, one tensor at a time: no rank holds the whole model.
        config = build_hf_config(self.model_cfg, tokenizer)
        model = meta_model(config, self.model_cfg["attn_implementation"], torch.float32)
        tensors = initial_tensors(self.model_cfg, config, self.init_seed, model, self.read_weights)
        model_bytes = float32_bytes(model)
        fit_heap_to(model_bytes)
        shard_model(
            model,
            self.actor_cfg["param_dtype"],
            self.actor_cfg["reduce_dtype"],
            trainable,
            resolve_unit(self.actor_cfg["fsdp"]["unit"], model_bytes),
        )
        model.to_empty(device=self.device)
        fill_own_rows(model, tensors)
        restore_buffers(model, config, self.device)
        return model

    # -- the update's backend parts ------------------------------------------------------------

    @property
    def data_parallel_size(self) -> int:
        return self.world_size

    def forward_logits(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False
        ).logits

    def begin_passes(self, passes: int) -> None:
        if self.invariant_grads is not None:
            self.invariant_grads.begin(passes)

    def clip_and_step(self, max_norm: float) -> float:
        if self.invariant_grads is not None:
            params = list(self.model.parameters())
            norm = grad_norm(params)
            if math.isfinite(norm):
                clip_grads(params, norm, max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            norm = float(norm)
        if math.isfinite(norm):
            self.optimizer.step()
        return norm

    # -- checkpoints ---------------------------------------------------------------------------

    def start_checkpoint(self, url: str, step: int, background: bool, storage_options: dict[str, Any] | None) -> None:
        """Collective: every rank writes its DCP shard under `url`, straight there (a local folder or a store)."""
        state = self.rank_state().state_dict()  # model and optimizer shards, LR schedule, this rank's RNG
        if background:
            self.stager = stager_for_next_save(self.stager)
        start_dcp_save(self.saver, url, state, background, storage_options, self.checkpoint_group, self.stager)

    def load_checkpoint(self, url: str, storage_options: dict[str, Any] | None) -> bool:
        restored_rng = load_fsdp_state(url, self.rank_state(), self.world_size, storage_options)
        apply_schedule(self.optimizer, self.scheduler)  # this run's schedule, not the saved run's
        return restored_rng

    def load_resharded_snapshot(self, holders: list[Any], step: int) -> None:
        state = self.rank_state()
        template = state.state_dict()
        parts = ((old_rank, fetch_part(holder, step, old_rank)) for old_rank, holder in enumerate(holders))
        local = resharded_state(template, parts, len(holders), self.rank, self.world_size)
        state.load_state_dict(placed_like(local, template))

    # -- state -------------------------------------------------------------------------------------

    def state_parts(self) -> dict[str, Any]:
        return self.parts

    # -- weights out ---------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.rank == 0 else None

    def weight_source(self) -> WeightSource:
        return FSDPWeightSource(self.model)
