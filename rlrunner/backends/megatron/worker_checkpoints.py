"""A Megatron actor rank's checkpoints: what it writes (Megatron-LM's legacy files, or its part of megatron-core's
`torch_dist` format) and how it loads either at this run's layout, whatever the saved one.

A mixin of `MegatronActorWorker` (rlrunner/backends/megatron/worker.py), which holds what these methods read: the
model, `optimizer` (`DistributedAdamW`), `scheduler`, the parallel groups and ranks, `hf_config`, `actor_cfg`,
`ckpt_format`, `saver` (`BackgroundSave`) and the run's step counts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlrunner.backends.megatron.buffer_geometry import bucket_size, megatron_param_names
from rlrunner.backends.megatron.dist_ckpt import (
    is_torch_dist,
    load_torch_dist,
    owned_pieces,
    read_common,
    save_torch_dist,
    slice_rectangles,
    whole_rectangles,
)
from rlrunner.backends.megatron.dist_layout import CONTENT_METADATA, extra_state_keys, rng_state_key, sharded_params
from rlrunner.backends.megatron.distrib_optim import MOMENTS
from rlrunner.backends.megatron.files import megatron_args, rank_file, rank_state, read_tracker
from rlrunner.backends.megatron.layout import (
    EXTRA_STATE,
    DecoderDims,
    expected_megatron_keys,
)
from rlrunner.backends.megatron.megatron_entries import (
    optimizer_entry,
    optimizer_step,
    our_scheduler,
    rng_entry,
    rng_from_entry,
    scheduler_entry,
)
from rlrunner.backends.megatron.moment_files import coalesced_offsets_of
from rlrunner.backends.megatron.moment_save import MomentSave
from rlrunner.backends.megatron.rank_state import MegatronRankState, load_rank
from rlrunner.backends.megatron.weight_units import UnitCursor
from rlrunner.backends.optim import apply_schedule
from rlrunner.storage import open_storage
from rlrunner.utils.rng import capture_rng, restore_rng


class MegatronCheckpoints:
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
        options = self.actor_cfg["megatron"]
        buckets = bucket_size(self.data_parallel_size, options["overlap_grad_reduce"], options["ddp_bucket_size"])
        offsets, numel = coalesced_offsets_of(layout, megatron_param_names(dims), self.data_parallel_size, buckets)
        moments = MomentSave(step, self.tp, self.tp_rank, layout, offsets, numel, own, self.save_group)
        # sharded weights are walked a unit at a time by every DP rank (`UnitCursor`); a synchronous save writes each
        # unit while it is gathered (a stand-in now, the values when they are due), a background one copies it now
        streamed = self.optimizer.shard_weights and not background
        cursor = UnitCursor(self.optimizer.units, self.optimizer.space)
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
            model = {**weights, **{k: None for k in _extra_state_keys(self.hf_config)}}
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
            optimizer["param_state_sharding_type"] = CONTENT_METADATA["distrib_optim_sharding_type"]
            common = rank_state(step, {}, args, optimizer, scheduler)
            del common["model"]  # the sharded keys hold it
            common["content_metadata"] = dict(CONTENT_METADATA)
        group = self.dist_group
        self.saver.run(
            lambda: save_torch_dist(url, storage_options, step, pieces, own, objects, common, group), background
        )

    def _training_entries(self, step: int, **extra_args: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """(`args`, `optimizer`, `opt_param_scheduler`) of a `model_optim_rng.pt`, as Megatron-LM reads them."""
        optim, options = self.actor_cfg["optim"], self.actor_cfg["megatron"]
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
            # the flags a resuming Megatron-LM run takes, which laid distrib_optim.pt's buckets out
            overlap_grad_reduce=bool(options["overlap_grad_reduce"]),
            ddp_bucket_size=options["ddp_bucket_size"],
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


def _extra_state_keys(hf_config: Any) -> list[str]:
    """megatron-core's `_extra_state` entries of the layers (None in its legacy checkpoints): our model has no such
    state, the files carry the keys so that megatron-core's strict load accepts them."""
    return [key for key in expected_megatron_keys(DecoderDims.from_config(hf_config)) if key.endswith(EXTRA_STATE)]
