"""The Adam moments (and fp32 weights) of the Megatron backend's checkpoints: one `distrib_optim.pt` per
tensor-parallel rank, in megatron-core's own coalesced-bucket layout, written with no gather.

    <actor folder>/iter_0000050/mp_rank_01/model_optim_rng.pt    TP rank 1's weights, optimizer settings, RNG
    <actor folder>/iter_0000050/mp_rank_01/distrib_optim.pt      TP rank 1's parameter state, whole

The distributed optimizer (`DistributedAdamW`, ZeRO-2) keeps each tensor-parallel rank's moments as one flat
vector (its parameters flattened and concatenated in order), split into equal slices over the data-parallel ranks.
Data-parallel rank 0 writes the file, and the other data-parallel ranks send it their slices a piece at a time as
it writes them (`moment_save`): no rank holds more than its own slice and a chunk. The file (format
`rlrunner.distrib_optim/4`) is what megatron-core's `DistributedOptimizer.get_parameter_state_dp_zero` returns and
`load_parameter_state_from_dp_zero` reads:

    buckets_coalesced: True
    0: {(torch.float32, torch.float32): {param, exp_avg, exp_avg_sq: 1-D float32, numel_unpadded: int}}

the flat tensors laid out as megatron-core's gradient buffer lays the parameters out for this model and the run's
data-parallel size (`buffer_geometry`: reverse order, each parameter 64-aligned, zeros between), and, which
megatron-core does not read:

    format, iteration, tensor_model_parallel_size, data_parallel_size, step
    params      [[megatron-core name, shape, offset in the flat tensors], ...], in our flat order

`SavedMoments` reads one saved tensor-parallel rank's moments back (memory-mapped: only what is looked up is read
from disk): a range of our flat vector (what a data-parallel rank of the same tensor-parallel layout loads, at any
data-parallel size: its own slice), or a parameter's whole moment shaped like the parameter (what a load that
reshards over tensor-parallel sizes slices, one tensor at a time).

Older checkpoints are still read:
- format `rlrunner.distrib_optim/3`: `distrib_optim.pt` with the flat moments in our order, no padding
  (`FlatMoments`);
- format `rlrunner.distrib_optim/2`: one file per data-parallel rank, `distrib_optim_dp_DDD.pt` (`moment_file`),
  holding that rank's slice (`moment_slice_state`: also the data-parallel size and rank, and the slice's `start`
  and `stop`); each file is opened when a range it holds is first read (`SlicedMoments`);
- format `rlrunner.distrib_optim/1`: `distrib_optim.pt` with one whole tensor per parameter (`WholeMoments`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence

import torch

from rlrunner.backends.megatron.buffer_geometry import coalesced_offsets
from rlrunner.backends.megatron.distrib_optim import MOMENTS
from rlrunner.backends.megatron.files import iteration_dir, rank_dir, read_torch_file
from rlrunner.backends.megatron.flat_space import flat_offsets
from rlrunner.backends.megatron.remote_records import open_remote_file
from rlrunner.storage import Storage

COALESCED_FORMAT = "rlrunner.distrib_optim/4"  # megatron-core's coalesced buckets: what a save writes
FLAT_FORMAT = "rlrunner.distrib_optim/3"  # our flat order (read only)
SLICE_FORMAT = "rlrunner.distrib_optim/2"  # per data-parallel rank files (read only)
LEGACY_FORMAT = "rlrunner.distrib_optim/1"  # per parameter tensors (read only)
OPTIMIZER_FILE = "distrib_optim.pt"

Layout = list[tuple[str, tuple[int, ...]]]  # (parameter name, shape), in the flat order
BUFFER_KEY = (torch.float32, torch.float32)  # megatron-core's buffer of fp32 parameters with fp32 gradients
PARAM_STATE = ("param", *MOMENTS)  # what the coalesced file holds of each parameter, in its order


def optimizer_file(iteration: int, tp_rank: int) -> str:
    """`iter_0000050/mp_rank_01/distrib_optim.pt`, relative to the checkpoint root: tensor-parallel rank 1's moments."""
    return f"{iteration_dir(iteration)}/{rank_dir(tp_rank)}/{OPTIMIZER_FILE}"


def flat_moments_state(
    iteration: int,
    tp: int,
    step: int,
    layout: Layout,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
) -> dict[str, Any]:
    """What a `distrib_optim.pt` of format 3 held (older checkpoints: saves write format 4, `coalesced_state`); as
    `moment_slice_state`, kept to write such files in tests of the readers."""
    numel = sum(math.prod(shape) for _, shape in layout)
    for name, tensor in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if tuple(tensor.shape) != (numel,) or tensor.dtype != torch.float32:
            raise ValueError(f"{name} is {tensor.dtype} {tuple(tensor.shape)}, not float32 ({numel},)")
    return {
        "format": FLAT_FORMAT,
        "iteration": int(iteration),
        "tensor_model_parallel_size": int(tp),
        "step": int(step),
        "params": [[name, list(shape)] for name, shape in layout],
        "exp_avg": exp_avg,
        "exp_avg_sq": exp_avg_sq,
    }


def coalesced_offsets_of(
    layout: Layout, megatron_names: Sequence[str], dp: int, bucket_size: int | None = None
) -> tuple[list[int], int]:
    """(the offset of each parameter of `layout`, our flat order, in the coalesced file's tensors; their length),
    megatron-core's geometry for its parameters `megatron_names` (its order) at data-parallel size `dp`, in buckets of
    `bucket_size` (None: one)."""
    shapes = dict(layout)
    if sorted(shapes) != sorted(megatron_names):
        extra = sorted(set(shapes) ^ set(megatron_names))
        raise ValueError(f"the optimizer's parameters are not megatron-core's for this model: {extra[:3]} differ")
    offsets, numel = coalesced_offsets([math.prod(shapes[name]) for name in megatron_names], dp, bucket_size)
    where = dict(zip(megatron_names, offsets))
    return [where[name] for name, _ in layout], numel


def coalesced_state(
    iteration: int,
    tp: int,
    dp: int,
    step: int,
    layout: Layout,
    offsets: Sequence[int],
    tensors: Mapping[str, torch.Tensor],
) -> dict[str, Any]:
    """What a `distrib_optim.pt` of format 4 holds (see the module docstring): `tensors` are PARAM_STATE's flat
    tensors, of the length `coalesced_offsets_of` gave; they may be stand-ins whose values are written as they arrive
    (`moment_save`)."""
    numel = next(iter(tensors.values())).numel() if tensors else 0
    for key in PARAM_STATE:
        tensor = tensors[key]
        if tuple(tensor.shape) != (numel,) or tensor.dtype != torch.float32:
            raise ValueError(f"{key} is {tensor.dtype} {tuple(tensor.shape)}, not float32 ({numel},)")
    return {
        "buckets_coalesced": True,
        0: {BUFFER_KEY: {**{key: tensors[key] for key in PARAM_STATE}, "numel_unpadded": int(numel)}},
        "format": COALESCED_FORMAT,
        "iteration": int(iteration),
        "tensor_model_parallel_size": int(tp),
        "data_parallel_size": int(dp),
        "step": int(step),
        "params": [[name, list(shape), int(offset)] for (name, shape), offset in zip(layout, offsets)],
    }


def moment_file(iteration: int, tp_rank: int, dp_rank: int) -> str:
    """`iter_0000050/mp_rank_01/distrib_optim_dp_000.pt`: data-parallel rank 0's slice file of format 2 (read only)."""
    if dp_rank < 0:
        raise ValueError(f"a data-parallel rank is a non-negative integer, got {dp_rank}")
    return f"{iteration_dir(iteration)}/{rank_dir(tp_rank)}/distrib_optim_dp_{dp_rank:03d}.pt"


def moment_slice_state(
    iteration: int,
    tp: int,
    dp: int,
    dp_rank: int,
    step: int,
    layout: Layout,
    start: int,
    stop: int,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
) -> dict[str, Any]:
    """What data-parallel rank `dp_rank`'s file of format 2 held (older checkpoints; see the module docstring)."""
    for name, tensor in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if tuple(tensor.shape) != (stop - start,):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} for elements {start}:{stop}")
    return {
        "format": SLICE_FORMAT,
        "iteration": int(iteration),
        "tensor_model_parallel_size": int(tp),
        "data_parallel_size": int(dp),
        "data_parallel_rank": int(dp_rank),
        "step": int(step),
        "params": [[name, list(shape)] for name, shape in layout],
        "start": int(start),
        "stop": int(stop),
        "exp_avg": exp_avg,
        "exp_avg_sq": exp_avg_sq,
    }


class SavedMoments:
    """Both Adam moments of one saved tensor-parallel rank, read from its files (see the module docstring)."""

    def __init__(self, step: int, layout: Layout):
        self.step = step
        self.layout = layout
        self.offsets = flat_offsets(math.prod(shape) for _, shape in layout)
        self.index = {name: index for index, (name, _) in enumerate(layout)}

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    def flat(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of moment `key`'s flat vector (a view of the file where one file holds them all)."""
        raise NotImplementedError

    def tensor(self, key: str, name: str) -> torch.Tensor:
        """Moment `key` of parameter `name`, shaped like the parameter."""
        index = self.index[name]
        return self.flat(key, self.offsets[index], self.offsets[index + 1]).view(self.layout[index][1])

    def tensors(self, key: str) -> Mapping[str, torch.Tensor]:
        """Moment `key` by parameter name, each tensor read when it is looked up."""
        return _LazyTensors(self, key)


class _LazyTensors(Mapping):
    """A parameter's moment read on lookup; the last one is kept, since a resharding reader looks one tensor up several
    times in a row (q, k and v are read one query group at a time)."""

    def __init__(self, moments: SavedMoments, key: str):
        self.moments, self.key = moments, key
        self.last: tuple[str, torch.Tensor] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.last is None or self.last[0] != name:
            self.last = (name, self.moments.tensor(self.key, name))
        return self.last[1]

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self.moments.layout)

    def __len__(self) -> int:
        return len(self.moments.layout)


class SlicedMoments(SavedMoments):
    """The data-parallel slice files of one tensor-parallel rank (format 2). File d holds elements
    [d * S, min((d + 1) * S, numel)) with S = ceil(numel / data-parallel size), as `DistributedAdamW.own_slice` writes
    them; a file is opened (and checked) the first time a range it holds is read, so a rank that loads its own slice
    reads (or, from an object store, downloads) only the one or two files that hold it. `first` is the file of
    data-parallel rank `first_rank`, opened already: any file tells the layout, the step and the sizes."""

    def __init__(
        self, first: Mapping[str, Any], open_slice: Callable[[int], Mapping[str, Any]], where: str, first_rank: int = 0
    ):
        layout = [(str(name), tuple(int(d) for d in shape)) for name, shape in first["params"]]
        super().__init__(int(first["step"]), layout)
        self.dp = int(first["data_parallel_size"])
        self.slice_size = -(-self.numel // self.dp)
        self.first, self.first_rank, self.open_slice, self.where = first, first_rank, open_slice, where
        self.opened: dict[int, Mapping[str, Any]] = {}
        self._slice(first_rank)

    def bounds(self, dp_rank: int) -> tuple[int, int]:
        """The elements [start, stop) data-parallel rank `dp_rank`'s file holds."""
        return min(dp_rank * self.slice_size, self.numel), min((dp_rank + 1) * self.slice_size, self.numel)

    def _slice(self, dp_rank: int) -> Mapping[str, Any]:
        if dp_rank not in self.opened:
            piece = self.first if dp_rank == self.first_rank else self.open_slice(dp_rank)
            label = f"{self.where} data-parallel rank {dp_rank}"
            if piece.get("data_parallel_rank") != dp_rank or piece.get("data_parallel_size") != self.dp:
                raise ValueError(
                    f"{label}: the file says rank {piece.get('data_parallel_rank')} of "
                    f"{piece.get('data_parallel_size')}, not {dp_rank} of {self.dp}"
                )
            if int(piece["step"]) != self.step or [list(p) for p in piece["params"]] != [
                list(p) for p in self.first["params"]
            ]:
                raise ValueError(f"{label}: its step or parameters differ from data-parallel rank {self.first_rank}'s")
            start, stop = self.bounds(dp_rank)
            if (piece["start"], piece["stop"]) != (start, stop):
                raise ValueError(f"{label} holds elements {piece['start']}:{piece['stop']}, expected {start}:{stop}")
            for key in MOMENTS:
                if tuple(piece[key].shape) != (stop - start,):
                    raise ValueError(f"{label}: {key} has shape {tuple(piece[key].shape)} for elements {start}:{stop}")
            self.opened[dp_rank] = piece
        return self.opened[dp_rank]

    def flat(self, key: str, start: int, stop: int) -> torch.Tensor:
        if not 0 <= start <= stop <= self.numel:
            raise ValueError(f"{self.where}: elements {start}:{stop} are outside the {self.numel} saved")
        pieces = []
        if start < stop:
            for dp_rank in range(start // self.slice_size, (stop - 1) // self.slice_size + 1):
                lo, hi = self.bounds(dp_rank)
                piece = self._slice(dp_rank)[key]
                pieces.append(piece[max(start, lo) - lo : min(stop, hi) - lo])
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.float32)


class FlatMoments(SavedMoments):
    """One `distrib_optim.pt` of format 3: both moments' flat vectors whole, a range of them a view of the (mapped)
    file; or, for a file on an object store, read from it by a ranged read (`read`: `remote_records`)."""

    def __init__(
        self, state: Mapping[str, Any], where: str, read: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None
    ):
        layout = [(str(name), tuple(int(d) for d in shape)) for name, shape in state["params"]]
        super().__init__(int(state["step"]), layout)
        for key in MOMENTS:
            tensor = state[key]
            if (
                not isinstance(tensor, torch.Tensor)
                or tuple(tensor.shape) != (self.numel,)
                or tensor.dtype != torch.float32
            ):
                found = (
                    f"{tensor.dtype} {tuple(tensor.shape)}"
                    if isinstance(tensor, torch.Tensor)
                    else type(tensor).__name__
                )
                raise ValueError(f"{where}: {key} is {found}, not the float32 ({self.numel},) of its parameters")
        self.state, self.where, self.read = state, where, read

    def flat(self, key: str, start: int, stop: int) -> torch.Tensor:
        if not 0 <= start <= stop <= self.numel:
            raise ValueError(f"{self.where}: elements {start}:{stop} are outside the {self.numel} saved")
        return self.state[key][start:stop] if self.read is None else self.read(self.state[key], start, stop)


class CoalescedMoments(SavedMoments):
    """One `distrib_optim.pt` of format 4: megatron-core's coalesced tensors, each parameter at its offset there; a
    range of our flat vector is cut from them parameter by parameter (by ranged reads, `read`, for a file on an object
    store)."""

    def __init__(
        self, state: Mapping[str, Any], where: str, read: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None
    ):
        layout = [(str(name), tuple(int(d) for d in shape)) for name, shape, _ in state["params"]]
        super().__init__(int(state["step"]), layout)
        self.file_offsets = [int(offset) for *_, offset in state["params"]]
        buffer = state[0][BUFFER_KEY]
        numel = int(buffer["numel_unpadded"])
        for key in PARAM_STATE:
            tensor = buffer[key]
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != (numel,):
                raise ValueError(f"{where}: {key} is not a tensor of its numel_unpadded {numel} elements")
        ends = [offset + math.prod(shape) for (_, shape), offset in zip(layout, self.file_offsets)]
        if any(offset < 0 for offset in self.file_offsets) or max(ends, default=0) > numel:
            raise ValueError(f"{where}: a parameter's offset lies outside the {numel} elements saved")
        self.buffer, self.where = buffer, where
        self.read = read or (lambda tensor, start, stop: tensor[start:stop])

    def flat(self, key: str, start: int, stop: int) -> torch.Tensor:
        if not 0 <= start <= stop <= self.numel:
            raise ValueError(f"{self.where}: elements {start}:{stop} are outside the {self.numel} saved")
        pieces = []
        for index, offset in enumerate(self.file_offsets):
            lo, hi = self.offsets[index], self.offsets[index + 1]
            first, last = max(start, lo), min(stop, hi)
            if first < last:
                pieces.append(self.read(self.buffer[key], offset + first - lo, offset + last - lo))
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.float32)


class WholeMoments(SavedMoments):
    """One `distrib_optim.pt` of the earlier layout (format 1): every parameter's moment whole."""

    def __init__(self, state: Mapping[str, Any]):
        layout = [(name, tuple(tensor.shape)) for name, tensor in state["exp_avg"].items()]
        super().__init__(int(state["step"]), layout)
        self.state = state

    def tensor(self, key: str, name: str) -> torch.Tensor:
        return self.state[key][name]

    def tensors(self, key: str) -> Mapping[str, torch.Tensor]:
        return self.state[key]

    def flat(self, key: str, start: int, stop: int) -> torch.Tensor:
        pieces = []
        for index, (name, _) in enumerate(self.layout):
            lo, hi = self.offsets[index], self.offsets[index + 1]
            first, last = max(start, lo), min(stop, hi)
            if first < last:
                pieces.append(self.state[key][name].reshape(-1)[first - lo : last - lo])
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.float32)


def _checked(state: Any, url: str, *formats: str) -> dict[str, Any]:
    if not isinstance(state, dict) or state.get("format") not in formats:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{url} is not a distributed-optimizer file of format {' or '.join(formats)} (found {found!r})"
        )
    return state


def read_moments(
    storage: Storage, root: str, iteration: int, tp_rank: int, mmap: bool = True, dp_rank: int = 0
) -> SavedMoments:
    """Tensor-parallel rank `tp_rank`'s moments of `iteration` under `root` (memory-mapped with `mmap`: only what is
    looked up is read; from an object store, a `distrib_optim.pt` of format 3 is read by ranged reads of what is looked
    up): its `distrib_optim.pt` (format 3, or 1 in older checkpoints), or the data-parallel slice files of format 2,
    opened as they are needed. Of those, the file of `dp_rank` is opened first, where there is one (the
    caller passes its own rank when the data-parallel size is unchanged, so that file holds its whole slice and no
    other is read)."""
    whole = storage.join(root, optimizer_file(iteration, tp_rank))
    if storage.exists(whole):
        if mmap and not storage.is_local:  # on a store: its structure now, the elements looked up when they are
            state, read = open_remote_file(storage, whole)
            if isinstance(state, dict) and state.get("format") == COALESCED_FORMAT:
                return CoalescedMoments(state, whole, read)
            if isinstance(state, dict) and state.get("format") == FLAT_FORMAT:
                return FlatMoments(state, whole, read)
        state = _checked(read_torch_file(storage, whole, mmap), whole, COALESCED_FORMAT, FLAT_FORMAT, LEGACY_FORMAT)
        if state["format"] == COALESCED_FORMAT:
            return CoalescedMoments(state, whole)
        return FlatMoments(state, whole) if state["format"] == FLAT_FORMAT else WholeMoments(state)
    first_rank = dp_rank
    first = storage.join(root, moment_file(iteration, tp_rank, dp_rank))
    if dp_rank != 0 and not storage.exists(first):
        first_rank, first = 0, storage.join(root, moment_file(iteration, tp_rank, 0))
    if not storage.exists(first):
        raise FileNotFoundError(f"{whole} is missing (the optimizer moments of tensor-parallel rank {tp_rank})")
    state = _checked(read_torch_file(storage, first, mmap), first, SLICE_FORMAT)

    def open_slice(dp_rank: int) -> dict[str, Any]:
        url = storage.join(root, moment_file(iteration, tp_rank, dp_rank))
        if not storage.exists(url):
            raise FileNotFoundError(f"{url} is missing (saved at data-parallel size {state['data_parallel_size']})")
        return _checked(read_torch_file(storage, url, mmap), url, SLICE_FORMAT)

    return SlicedMoments(state, open_slice, storage.join(root, iteration_dir(iteration), rank_dir(tp_rank)), first_rank)
