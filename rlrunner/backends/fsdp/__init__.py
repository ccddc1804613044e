"""The FSDP backend: the policy sharded with PyTorch FSDP2 over every actor rank (data parallel), AdamW, and
checkpoints in torch.distributed.checkpoint's format (one `.distcp` file per rank and a `.metadata`)."""

from __future__ import annotations

from typing import Any, Mapping

from rlrunner.backends.base import RankMap, TrainingBackend
from rlrunner.errors import ConfigError
from rlrunner.storage import Storage

# HF attention implementations that take a boolean 4D mask, as packed rows need (rlrunner/backends/prompt_packing.py);
# eager attention adds a mask as floats
PACKING_ATTENTION = ("sdpa",)


class FSDPBackend(TrainingBackend):
    name = "fsdp"
    checkpoint_format = "fsdp2-dcp"

    @property
    def worker_class(self) -> type:
        from rlrunner.backends.fsdp.worker import FSDPActorWorker

        return FSDPActorWorker

    layout_invariant = True
    reshards_snapshots = True

    def check_config(self, cfg: Any) -> None:
        tp = cfg.actor.tensor_model_parallel_size
        if tp > 1:
            raise ConfigError(
                f"actor.tensor_model_parallel_size={tp} needs actor.training_backend=megatron "
                "(fsdp shards, it does not split layers)"
            )
        if not cfg.actor.megatron.shard_gradients:
            raise ConfigError(
                "actor.megatron.shard_gradients=false needs actor.training_backend=megatron (fsdp always "
                "reduce-scatters its gradients to the ranks' shards)"
            )
        if not cfg.actor.megatron.shard_weights:
            raise ConfigError(
                "actor.megatron.shard_weights=false needs actor.training_backend=megatron (fsdp always shards "
                "its weights and all-gathers them a unit at a time)"
            )
        if cfg.actor.pack_shared_prompts and cfg.model.attn_implementation not in PACKING_ATTENTION:
            raise ConfigError(
                "actor.pack_shared_prompts=true needs model.attn_implementation in "
                f"{', '.join(PACKING_ATTENTION)} (a boolean 4D mask), got '{cfg.model.attn_implementation}'"
            )

    def checkpoint_manager(
        self,
        actor_group: Any,
        rank_map: RankMap,
        timeout_s: float | None,
        background: bool,
        storage_options: Mapping[str, Any] | None,
    ) -> Any:
        from rlrunner.backends.checkpoints import ActorCheckpointManager

        return ActorCheckpointManager(actor_group, self.checkpoint_format, timeout_s, background, storage_options)

    def find_checkpoint(self, storage: Storage, url: str) -> str | None:
        from rlrunner.backends.fsdp.weights import find_dcp_dir

        return find_dcp_dir(storage, url)

    def read_hf_weights(self, storage: Storage, root: str, config: Any) -> dict[str, Any]:
        from rlrunner.backends.fsdp.weights import read_dcp_weights

        return read_dcp_weights(storage, root)
