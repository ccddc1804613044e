"""The FSDP backend's weights out: what a rank sends in a weight sync, and the offline reader of its checkpoints.

`FSDPWeightSource`: each rank sends the dim-0 rows FSDP2 gave it of every tensor (torch.chunk's split; the last
ranks may hold fewer rows, or none); replicated tensors and plain buffers are sent by rank 0.

`read_dcp_weights`: the model's full weights from a DCP folder, without its optimizer (only the `model.*` entries
are requested, so peak memory is about one copy of the weights). No process group is needed.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from rlrunner.backends.dcp_files import METADATA_FILE, SafeFileSystemReader, SafeLoadPlanner
from rlrunner.checkpoint.layout import ACTOR_DIR
from rlrunner.storage import Storage
from rlrunner.weight_sync.endpoints import Block, WeightSource
from rlrunner.weight_sync.plan import WeightSyncError

MODEL_PREFIX = "model."


def shard_rows(dim0: int, num_shards: int, index: int) -> tuple[int, int]:
    """Rows [start, stop) of dim 0 held by shard `index` of `num_shards`: FSDP2's torch.chunk split.

    torch.chunk makes chunks of ceil(dim0 / num_shards) rows, the last one shorter, and fewer chunks than
    shards when dim0 is small (FSDP2 gives the missing shards empty tensors): 4 rows over 3 ranks is 2, 2, 0.
    """
    if num_shards <= 0 or not 0 <= index < num_shards:
        raise ValueError(f"shard {index} of {num_shards}")
    size = -(-dim0 // num_shards) if dim0 else 0
    start = min(index * size, dim0)
    return start, min(start + size, dim0)


class FSDPWeightSource(WeightSource):
    """The local shards of an FSDP2 model (any module whose parameters are 1-D-mesh DTensors), by state-dict name."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def blocks(self) -> list[Block]:
        blocks, seen = [], set()
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:  # a tied weight: sent once, under its first name
                continue
            seen.add(id(tensor))
            block = local_block(name, tensor)  # detached there: a DTensor's own detach is a dispatch, 50 us
            if block is not None:
                blocks.append(block)
        return blocks


def local_block(name: str, tensor: torch.Tensor) -> Block | None:
    """What this rank holds of `tensor`: its dim-0 rows of a Shard(0) DTensor (checked against torch.chunk's split),
    all of a replicated DTensor or a plain tensor on rank 0 (None elsewhere, and None for no rows), detached."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shape = tuple(tensor.shape)
    if not isinstance(tensor, DTensor):
        tensor = tensor.detach()
        first = not dist.is_initialized() or dist.get_rank() == 0
        return (
            Block(name, shape, 0, 0, shape[0] if shape else 1, tensor.reshape(shape or (1,)))
            if first and tensor.numel()
            else None
        )
    mesh, placement = tensor.device_mesh, tensor.placements[0]
    local = tensor.to_local().detach()
    if mesh.ndim != 1:
        raise NotImplementedError(f"weight sync: {name} is on a {mesh.ndim}-D device mesh (only 1-D FSDP meshes)")
    if type(placement) is Shard and placement.dim == 0:
        if not shape:
            raise NotImplementedError(f"weight sync: {name} is a sharded 0-d tensor")
        start, stop = shard_rows(shape[0], mesh.size(), mesh.get_local_rank())
        if tuple(local.shape) != (stop - start, *shape[1:]):
            raise WeightSyncError(
                f"{name}: local shard {tuple(local.shape)} is not rows {start}:{stop} of {shape} (FSDP's split differs "
                "from torch.chunk's)"
            )
        return Block(name, shape, 0, start, stop, local) if stop > start else None
    if isinstance(placement, Replicate):
        first = mesh.get_local_rank() == 0
        return (
            Block(name, shape, 0, 0, shape[0] if shape else 1, local.reshape(shape or (1,)))
            if first and local.numel()
            else None
        )
    raise NotImplementedError(f"weight sync: {name} has placement {placement} (only Shard(0) and Replicate)")


# -- the offline reader ------------------------------------------------------------------------------


def find_dcp_dir(storage: Storage, url: str) -> str | None:
    """The DCP folder at `url` (the folder itself, or the `actor/` of a global_step_N folder), or None."""
    for candidate in (url, storage.join(url, ACTOR_DIR)):
        if storage.exists(storage.join(candidate, METADATA_FILE)):
            return candidate
    return None


def read_dcp_weights(storage: Storage, folder: str) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) weights with HF key names from the DCP folder `folder`."""
    reader = SafeFileSystemReader(folder, storage=storage)  # one connection for the metadata and the shards
    weights: dict[str, torch.Tensor] = {}
    for key, item in reader.read_metadata().state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata):
            weights[key] = torch.empty(item.size, dtype=item.properties.dtype)
    if not weights:
        raise ValueError(f"{folder} holds no model weights (no '{MODEL_PREFIX}*' tensors)")
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(weights, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return {key[len(MODEL_PREFIX) :]: tensor for key, tensor in weights.items()}
