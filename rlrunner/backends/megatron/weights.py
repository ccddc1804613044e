"""The Megatron backend's weights out in a weight sync: each tensor-parallel rank sends its own slices, in HF layout.

Nothing is gathered: a column-parallel weight gives dim-0 blocks of the HF tensors (q, k, v per query group, gate
and up), a row-parallel one dim-1 blocks (o_proj, down_proj), a vocabulary-parallel one its rows below the
vocabulary size; the replicated norms come from tensor-parallel rank 0. Only data-parallel rank 0's group sends.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from rlrunner.backends.megatron.layout import DecoderDims
from rlrunner.backends.megatron.to_hf import HFBlock, rank_blocks
from rlrunner.backends.megatron.weight_units import UnitCursor
from rlrunner.weight_sync.endpoints import Block, WeightSource


def hf_blocks(
    shard: Mapping[str, torch.Tensor], config: Any, tp: int, rank: int
) -> list[tuple[str, tuple[int, ...], int, int, int, torch.Tensor]]:
    """What tensor-parallel rank `rank`'s megatron-core dict holds of each HF tensor, without gathering anything:
    (HF key, full HF shape, dim, start, stop, block) with the block = rows [start, stop) of the HF tensor along
    `dim` (`to_hf.rank_blocks`). Assembling every rank's blocks gives `megatron_to_hf` of the shards, exactly."""
    rows = shard["embedding.word_embeddings.weight"].shape[0]
    return [
        (block.name, block.shape, block.dim, block.start, block.stop, block.take(shard[block.key]))
        for block in rank_blocks(DecoderDims.from_config(config), tp, rank, rows)
    ]


class MegatronWeightSource(WeightSource):
    """Data-parallel rank 0's tensor-parallel ranks each send their own slices, in HF layout; the other data-parallel
    replicas hold the same weights and send nothing.

    With sharded weights (ZeRO-3) the blocks hold only their shapes; each block's values are taken from its unit,
    gathered as the sync reaches it (`UnitCursor`), and the other data-parallel ranks walk the units along with it
    (`end_of_sync`), so no rank holds more than a unit of the weights beyond its slice."""

    def __init__(self, worker: Any):  # a MegatronActorWorker
        self.worker = worker
        self.cursor: UnitCursor | None = None
        self.rank_blocks: list[HFBlock] | None = None  # what `block_tensor` takes each block's values by

    def blocks(self) -> list[Block]:
        worker = self.worker
        if worker.dp_rank != 0:
            return []
        sharded = worker.optimizer.shard_weights  # then stand-ins of the parameters' shapes: the values come later
        shard = {
            k: torch.empty(v.shape, dtype=v.dtype, device="meta") if sharded else v.detach()
            for k, v in worker.model.state_dict().items()
        }
        return [Block(*block) for block in hf_blocks(shard, worker.hf_config, worker.tp, worker.tp_rank)]

    def block_tensor(self, index: int, block: Block) -> torch.Tensor:
        worker = self.worker
        if not worker.optimizer.shard_weights:
            return block.tensor
        if self.rank_blocks is None:
            rows = worker.model.embedding.word_embeddings.weight.shape[0]
            self.rank_blocks = rank_blocks(DecoderDims.from_config(worker.hf_config), worker.tp, worker.tp_rank, rows)
        if self.cursor is None:  # the first block of this sync
            self.cursor = UnitCursor(worker.optimizer.units, worker.optimizer.space)
        hf_block = self.rank_blocks[index]
        return hf_block.take(self.cursor.tensor(hf_block.key).detach())

    def end_of_sync(self) -> None:
        cursor, self.cursor = self.cursor or UnitCursor(self.worker.optimizer.units, self.worker.optimizer.space), None
        cursor.finish()
