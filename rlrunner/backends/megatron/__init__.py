"""The Megatron backend: the policy split Megatron-LM's way with tensor parallelism (tensor-parallel groups inside
data-parallel replicas), AdamW sharded over the data-parallel ranks, and checkpoints in Megatron-LM's legacy layout
(`iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt`, `distrib_optim.pt`, `latest_checkpointed_iteration.txt`)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from rlrunner.backends.base import RankMap, TrainingBackend
from rlrunner.backends.megatron.checkpoint import MegatronCheckpointManager
from rlrunner.backends.megatron.files import find_root, read_hf_weights
from rlrunner.backends.megatron.layout import Qwen2Dims, check_splittable
from rlrunner.backends.megatron.worker import MegatronActorWorker
from rlrunner.errors import ConfigError
from rlrunner.storage import Storage


class MegatronBackend(TrainingBackend):
    name = "megatron"
    checkpoint_format = "megatron-tp"

    @property
    def worker_class(self) -> type:
        return MegatronActorWorker

    def check_config(self, cfg: Any) -> None:
        if cfg.actor.reduce_dtype != "float32":
            raise ConfigError(
                "actor.reduce_dtype must be float32 with actor.training_backend=megatron (gradients are reduced in "
                f"float32), got '{cfg.actor.reduce_dtype}'"
            )

    def check_model(self, hf_config: Any, actor_cfg: Mapping[str, Any]) -> None:
        tp = actor_cfg["tensor_model_parallel_size"]
        try:
            check_splittable(Qwen2Dims.from_config(hf_config), tp)
        except ValueError as exc:
            raise ConfigError(f"actor.training_backend=megatron with actor.tensor_model_parallel_size={tp}: {exc}") from None

    def checkpoint_manager(self, actor_group: Any, rank_map: RankMap, timeout_s: float | None, background: bool,
                           storage_options: Mapping[str, Any] | None) -> MegatronCheckpointManager:
        return MegatronCheckpointManager(actor_group, self.checkpoint_format, rank_map.tp, timeout_s=timeout_s,
                                         background=background, storage_options=storage_options)

    def find_checkpoint(self, storage: Storage, url: str) -> str | None:
        try:
            return find_root(storage, url)
        except FileNotFoundError:
            return None

    def read_hf_weights(self, storage: Storage, root: str, config: Any) -> dict[str, torch.Tensor]:
        return read_hf_weights(storage, root, config, mmap=True)  # tensors backed by the file: less resident memory
