"""megatron-core's distributed checkpoint format (`actor.megatron.ckpt_format=torch_dist`), written and read with
torch.distributed.checkpoint (DCP), every rank its own part.

    <actor folder>/iter_0000050/
        .metadata, __<rank>_0.distcp   DCP: the sharded keys (`dist_layout`): the model, and megatron-core's
                                       `fully_reshardable` optimizer state (`optimizer.state.{param,exp_avg,
                                       exp_avg_sq}.<model key>`), the layers' `_extra_state` and `rng_state` objects
        common.pt                      what is not sharded: args, iteration, the optimizer's parameter groups, the LR
                                       schedule (written by rank 0, read with weights_only)
        metadata.json                  {"sharded_backend": "torch_dist", ...}: megatron-core's format marker
    <actor folder>/latest_checkpointed_iteration.txt   written by the driver once every rank's part is written

Fully parallel: a rank writes the parts of its tensor-parallel rank's weights and moments that it owns as a
data-parallel rank (its flat slice, cut into rectangles of the global tensors: `dist_layout.flat_range_chunks`), so
the data-parallel ranks write distinct parts and no byte is written twice (what the tensor-parallel ranks all hold,
the norms, they write in identical chunks, which DCP writes once). A load asks DCP for the rectangles it needs at its
own layout (the whole tensor-parallel shard of each weight, its own flat slice of the moments) and DCP reads them from
whichever saved chunks cover them: any tensor-parallel and data-parallel size loads any other.
"""

from __future__ import annotations

import io
import json
import math
import warnings
from typing import Any, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from rlrunner.backends.dcp_files import SafeFileSystemReader, checksumming_writer
from rlrunner.backends.megatron.dist_layout import Chunk, ShardedParam, optimizer_key, rank_shapes, sharded_params
from rlrunner.backends.megatron.file_writes import write_state_file
from rlrunner.backends.megatron.files import iteration_dir, read_torch_file
from rlrunner.backends.megatron.flat_space import flat_offsets
from rlrunner.storage import open_storage

COMMON_FILE = "common.pt"
FORMAT_FILE = "metadata.json"
FORMAT = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
PARAM_STATES = ("param", "exp_avg", "exp_avg_sq")  # the optimizer's state per parameter, megatron-core's names


def is_torch_dist(storage: Any, root: str, iteration: int) -> bool:
    """Whether the iteration under `root` was saved in the distributed format (its marker file)."""
    return storage.exists(storage.join(root, iteration_dir(iteration), FORMAT_FILE))


def owned_pieces(
    params: Mapping[str, ShardedParam], layout: list[tuple[str, tuple[int, ...]]], start: int, stop: int
) -> list[tuple[ShardedParam, Chunk, int]]:
    """(parameter, global rectangle, its first element in the flat range [start, stop)) of every piece of the flat
    space (`layout`'s parameters end to end) in [start, stop)."""
    offsets = flat_offsets(math.prod(shape) for _, shape in layout)
    pieces = []
    for index, (name, _) in enumerate(layout):
        lo, hi = max(start, offsets[index]), min(stop, offsets[index + 1])
        if lo < hi:
            for chunk in params[name].flat_range_chunks(lo - offsets[index], hi - offsets[index]):
                pieces.append((params[name], chunk, lo - start + chunk.flat_start))
    return pieces


Rectangles = dict[tuple[str, tuple[int, ...]], torch.Tensor]  # {(sharded key, global offsets): the tensor to fill}


def whole_rectangles(params: Mapping[str, ShardedParam], tensors: Mapping[str, torch.Tensor]) -> Rectangles:
    """The rectangles of each parameter's whole tensor-parallel shard, to be read into `tensors` (by our name)."""
    wanted: Rectangles = {}
    for name, param in params.items():
        flat = tensors[name].view(-1)
        for chunk in param.flat_range_chunks(0, flat.numel()):
            wanted[(param.key, chunk.offsets)] = flat[chunk.flat_start : chunk.flat_start + chunk.numel].view(
                chunk.sizes
            )
    return wanted


def slice_rectangles(pieces: list[tuple[ShardedParam, Chunk, int]], flats: Mapping[str, torch.Tensor]) -> Rectangles:
    """The rectangles of the optimizer's state (`flats`: {exp_avg|...: this rank's flat slice}) over `pieces`."""
    wanted: Rectangles = {}
    for param, chunk, first in pieces:
        for state, flat in flats.items():
            wanted[(optimizer_key(state, param.key), chunk.offsets)] = flat[first : first + chunk.numel].view(
                chunk.sizes
            )
    return wanted


class _PiecesSavePlanner(DefaultSavePlanner):
    """DCP's default planner (replicated chunks written once, the metadata merged), given the write items directly:
    tensor rectangles and byte objects, instead of a state dict."""

    def __init__(self, tensors: dict[tuple[str, tuple[int, ...]], tuple[torch.Tensor, tuple[int, ...]]], blobs: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.tensors, self.blobs = tensors, blobs

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, offsets), (tensor, global_shape) in self.tensors.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape)
            data = TensorWriteData(
                chunk=chunk, properties=TensorProperties(dtype=tensor.dtype), size=torch.Size(global_shape)
            )
            items.append(
                WriteItem(index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD, tensor_data=data)
            )
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.blobs]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        key = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save([self.blobs[key]], buffer)  # megatron-core's ShardedObject: a list of its objects
            return buffer
        return self.tensors[(key, tuple(write_item.index.offset))][0].detach().to("cpu").contiguous()


def save_torch_dist(
    url: str,
    storage_options: Mapping[str, Any] | None,
    iteration: int,
    pieces: list[tuple[ShardedParam, Chunk, int]],
    own: Mapping[str, torch.Tensor],
    objects: Mapping[str, Any],
    common: Mapping[str, Any] | None,
    process_group: Any,
) -> dict[str, Any]:
    """Collective over `process_group` (every actor rank): write this rank's `pieces` of its own flat slices `own`
    ({param|exp_avg|exp_avg_sq: 1-D}: the weights under the model's keys and as `optimizer.state.param`, the moments
    under theirs), the byte `objects` it writes, and, from the rank that passes it, `common` with the format marker.
    {path under `url`: size and CRC-32} of the files this rank wrote."""
    tensors: dict[tuple[str, tuple[int, ...]], tuple[torch.Tensor, tuple[int, ...]]] = {}
    for param, chunk, first in pieces:
        for state in PARAM_STATES:
            data = own[state][first : first + chunk.numel].view(chunk.sizes)
            tensors[(optimizer_key(state, param.key), chunk.offsets)] = (data, param.global_shape)
        tensors[(param.key, chunk.offsets)] = (
            own["param"][first : first + chunk.numel].view(chunk.sizes),
            param.global_shape,
        )
    folder = iteration_dir(iteration)
    storage = open_storage(url, storage_options)
    target = storage.join(url, folder)
    writer = checksumming_writer(target, storage_options)
    dcp.save({}, storage_writer=writer, planner=_PiecesSavePlanner(tensors, dict(objects)), process_group=process_group)
    records: dict[str, Any] = {f"{folder}/{name}": record for name, record in writer.fs.records.items()}
    if common is not None:
        records.update(write_state_file(storage, url, f"{folder}/{COMMON_FILE}", common))
        marker = f"{folder}/{FORMAT_FILE}"
        records[marker] = storage.write_bytes(storage.join(url, marker), json.dumps(FORMAT).encode())
    return records


class _RectanglesLoadPlanner(LoadPlanner):
    """Reads the given global rectangles into the given tensors (DCP cuts each from the saved chunks it overlaps),
    and the given byte objects (weights_only)."""

    def __init__(self, wanted: dict[tuple[str, tuple[int, ...]], torch.Tensor], objects: list[str]):
        self.wanted, self.objects, self.loaded_objects = wanted, objects, {}

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        items = []
        for (key, offsets), tensor in self.wanted.items():
            if key not in saved:
                raise ValueError(f"the distributed checkpoint has no tensor {key!r}")
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape)
            for item in create_read_items_for_chunk_list(key, saved[key], [chunk]):
                items.append(item)
        for key in self.objects:
            if key not in saved:
                raise ValueError(f"the distributed checkpoint has no object {key!r}")
            items.append(
                ReadItem(
                    type=LoadItemType.BYTE_IO,
                    dest_index=MetadataIndex(key),
                    dest_offsets=torch.Size((0,)),
                    storage_index=MetadataIndex(key),
                    storage_offsets=torch.Size((0,)),
                    lengths=torch.Size((0,)),
                )
            )
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.loaded_objects[read_item.dest_index.fqn] = torch.load(value, weights_only=True)[0]

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        tensor = self.wanted[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for axis, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            tensor = tensor.narrow(axis, offset, length)
        return tensor

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        pass


def read_common(url: str, storage_options: Mapping[str, Any] | None, iteration: int) -> dict[str, Any]:
    """The `common.pt` of `iteration` (weights_only, argparse.Namespace allowed)."""
    storage = open_storage(url, storage_options)
    state = read_torch_file(storage, storage.join(url, iteration_dir(iteration), COMMON_FILE), mmap=False)
    if not isinstance(state, dict) or "args" not in state:
        raise ValueError(f"{storage.join(url, iteration_dir(iteration), COMMON_FILE)} is not a Megatron common.pt")
    return state


def load_torch_dist(
    url: str,
    storage_options: Mapping[str, Any] | None,
    iteration: int,
    wanted: dict[tuple[str, tuple[int, ...]], torch.Tensor],
    objects: list[str],
    process_group: Any,
) -> dict[str, Any]:
    """Collective over `process_group`: read each wanted rectangle ({(key, global offsets): tensor to fill}) and the
    named byte `objects` (returned by key) from the distributed checkpoint of `iteration` under `url`."""
    storage = open_storage(url, storage_options)
    reader = SafeFileSystemReader(storage.join(url, iteration_dir(iteration)), storage_options)
    planner = _RectanglesLoadPlanner(wanted, objects)
    dcp.load({}, storage_reader=reader, planner=planner, process_group=process_group)
    return planner.loaded_objects


def read_model_shard(storage: Any, root: str, iteration: int, config: Any) -> dict[str, torch.Tensor]:
    """The model of a `torch_dist` checkpoint as one tensor-parallel rank's dict (tp 1, megatron-core names), each
    tensor read whole (no process group needed): what the converters, `load_model_weights` and `model.path` read."""
    from rlrunner.backends.megatron.layout import DecoderDims

    dims = DecoderDims.from_config(config)
    shapes = dict(rank_shapes(dims, 1))
    params = sharded_params(list(shapes.items()), dims, 1, 0)
    tensors = {name: torch.zeros(shape) for name, shape in shapes.items()}
    reader = SafeFileSystemReader(storage.join(root, iteration_dir(iteration)), storage=storage)
    planner = _RectanglesLoadPlanner(whole_rectangles(params, tensors), [])
    with warnings.catch_warnings():  # DCP's note that it loads in a single process: what this reader means to do
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({}, storage_reader=reader, planner=planner, no_dist=True)
    return tensors
