"""The Megatron backend: the policy split Megatron-LM's way with tensor parallelism (tensor-parallel groups inside
data-parallel replicas), AdamW sharded over the data-parallel ranks, and checkpoints in Megatron-LM's legacy layout
(`iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt`, `distrib_optim.pt`, `latest_checkpointed_iteration.txt`) or
megatron-core's distributed format (`actor.megatron.ckpt_format=torch_dist`: `iter_XXXXXXX/` holding DCP files,
`common.pt` and `metadata.json`)."""

from __future__ import annotations

from typing import Any, Mapping

from rlrunner.backends.base import RankMap, TrainingBackend
from rlrunner.errors import ConfigError
from rlrunner.storage import Storage

CKPT_FORMATS = ("torch", "torch_dist")  # actor.megatron.ckpt_format


class MegatronBackend(TrainingBackend):
    name = "megatron"
    checkpoint_format = "megatron-tp"

    @property
    def worker_class(self) -> type:
        from rlrunner.backends.megatron.worker import MegatronActorWorker

        return MegatronActorWorker

    def check_config(self, cfg: Any) -> None:
        if cfg.actor.reduce_dtype != "float32":
            raise ConfigError(
                "actor.reduce_dtype must be float32 with actor.training_backend=megatron (gradients are reduced in "
                f"float32), got '{cfg.actor.reduce_dtype}'"
            )
        options = cfg.actor.megatron
        if options.ckpt_format not in CKPT_FORMATS:
            raise ConfigError(
                f"actor.megatron.ckpt_format must be one of {', '.join(CKPT_FORMATS)}, got '{options.ckpt_format}'"
            )
        if options.ddp_bucket_size is not None and options.ddp_bucket_size < 1:
            raise ConfigError(
                f"actor.megatron.ddp_bucket_size must be a positive number of elements or null, "
                f"got {options.ddp_bucket_size}"
            )
        if options.shard_weights and not options.shard_gradients:
            raise ConfigError(
                "actor.megatron.shard_weights=true needs actor.megatron.shard_gradients=true (whole "
                "gradients would outweigh sharded weights); set actor.megatron.shard_weights=false for "
                "Megatron-LM's own layout"
            )

    def check_model(self, hf_config: Any, actor_cfg: Mapping[str, Any]) -> None:
        from rlrunner.backends.megatron.layout import DecoderDims, check_splittable

        tp = actor_cfg["tensor_model_parallel_size"]
        try:
            check_splittable(DecoderDims.from_config(hf_config), tp)
        except ValueError as exc:
            raise ConfigError(
                f"actor.training_backend=megatron with actor.tensor_model_parallel_size={tp}: {exc}"
            ) from None

    def checkpoint_manager(
        self,
        actor_group: Any,
        rank_map: RankMap,
        timeout_s: float | None,
        background: bool,
        storage_options: Mapping[str, Any] | None,
    ) -> Any:
        from rlrunner.backends.megatron.checkpoint import MegatronCheckpointManager

        return MegatronCheckpointManager(
            actor_group,
            self.checkpoint_format,
            rank_map.tp,
            timeout_s=timeout_s,
            background=background,
            storage_options=storage_options,
        )

    def find_checkpoint(self, storage: Storage, url: str) -> str | None:
        from rlrunner.backends.megatron.files import find_root

        try:
            return find_root(storage, url)
        except FileNotFoundError:
            return None

    def read_hf_weights(self, storage: Storage, root: str, config: Any) -> dict[str, Any]:
        from rlrunner.backends.megatron.files import read_hf_weights
        from rlrunner.backends.megatron.to_hf import megatron_to_hf

        shard = _dist_model_shard(storage, root, config)
        if shard is not None:
            return megatron_to_hf([shard], config)
        return read_hf_weights(storage, root, config, mmap=True)  # tensors backed by the file: less resident memory

    def hf_tensors(self, storage: Storage, root: str, config: Any) -> Any:
        from rlrunner.backends.megatron.files import read_hf_tensors
        from rlrunner.backends.megatron.to_hf import MegatronShards

        shard = _dist_model_shard(storage, root, config)
        if shard is not None:
            return MegatronShards([shard], config)
        return read_hf_tensors(storage, root, config)


def _dist_model_shard(storage: Storage, root: str, config: Any) -> dict[str, Any] | None:
    """The whole model (a tp 1 dict) when the iteration the tracker under `root` names is in the `torch_dist` format;
    None for the legacy per-rank files."""
    from rlrunner.backends.megatron.dist_ckpt import is_torch_dist, read_model_shard
    from rlrunner.backends.megatron.files import read_tracker

    iteration = read_tracker(storage, root)
    return read_model_shard(storage, root, iteration, config) if is_torch_dist(storage, root, iteration) else None
