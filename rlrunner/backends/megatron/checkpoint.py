"""The Megatron backend's checkpoint manager: the ranks' files, then the tracker the driver writes."""

from __future__ import annotations

import logging
from typing import Any

from rlrunner.backends.checkpoints import ActorCheckpointManager
from rlrunner.backends.megatron.dist_ckpt import is_torch_dist, read_common
from rlrunner.backends.megatron.file_writes import write_tracker
from rlrunner.backends.megatron.files import rank_dirs, read_tracker
from rlrunner.storage import open_storage

logger = logging.getLogger(__name__)


class MegatronCheckpointManager(ActorCheckpointManager):
    """`iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt` and `distrib_optim.pt`, written by data-parallel rank 0 of each
    tensor-parallel rank (the other data-parallel ranks stream it their slices of the moments), or `iter_XXXXXXX/`'s
    distributed format (`dist_ckpt`: every rank its part), straight to the store;
    the driver writes `latest_checkpointed_iteration.txt` once every rank's files are written, so the tracker never
    names a partial iteration (and the manifest, written after it, commits the whole)."""

    def __init__(self, actor_group: Any, backend: str, tensor_parallel_size: int, **options: Any):
        super().__init__(actor_group, backend, **options)
        self.tensor_parallel_size = tensor_parallel_size

    def after_write(self, url: str, step: int) -> dict[str, dict[str, Any]]:
        storage = open_storage(url, self.storage_options)
        return {name: record.as_dict() for name, record in write_tracker(storage, url, step).items()}

    def before_load(self, url: str) -> None:
        storage = open_storage(url, self.storage_options)
        iteration = read_tracker(storage, url)
        if is_torch_dist(storage, url, iteration):
            saved_tp = read_common(url, self.storage_options, iteration)["args"].tensor_model_parallel_size
            if saved_tp != self.tensor_parallel_size:
                logger.warning(
                    "resharding %s (torch_dist) from tensor-parallel size %d to %d: each rank reads the chunks that "
                    "cover its part; per-rank RNG states are not restored",
                    url,
                    saved_tp,
                    self.tensor_parallel_size,
                )
            return
        saved_tp = len(rank_dirs(storage, url, iteration))
        if saved_tp != self.tensor_parallel_size:
            logger.warning(
                "resharding %s from tensor-parallel size %d to %d through the HF layout: model and optimizer moments "
                "are resharded, per-rank RNG states are not restored",
                url,
                saved_tp,
                self.tensor_parallel_size,
            )
