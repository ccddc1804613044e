"""The weight sync's plan: what each actor rank sends, in which buckets, and where each byte lands (pure functions).

The unit is a **piece**: rows [start, stop) along one dimension of one tensor in Hugging Face layout, held by one
actor rank (an FSDP2 shard is dim-0 rows of every tensor, a tensor-parallel slice a row or column block: the
backends' weight sources say which). Every rollout worker wants every tensor whole, in its own dtype: the sink's
**layout**.

    layout (from the sink)     [TensorSpec(name, shape, dtype), ...]       the tensors to fill, in HF names
    pieces (from each source)  [Piece(name, shape, dim, start, stop, dtype), ...]   dtype: the layout's (the wire's)
    check_coverage(layout, pieces of every rank)   every tensor tiled exactly once, along one dimension
    plan_buckets(pieces, bucket_bytes)             a rank's pieces packed in order into flat byte buckets; a piece
                                                   larger than what is left of a bucket goes on in the next one

A segment is elements [start, stop) of one piece's block (the block flattened in row-major order) at a byte offset
of its bucket, aligned to its dtype's size so a byte view of the bucket can be cast.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"weight sync cannot send tensors of dtype {dtype}")
    return name


class WeightSyncError(RuntimeError):
    """The weight-sync channels are inconsistent or broken (layout mismatch, protocol out of step, failed peer)."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a rollout worker wants whole, in HF layout and its own dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) along `dim` of tensor `name` (full shape `shape`), sent in `dtype` by one actor rank."""

    name: str
    shape: tuple[int, ...]
    dim: int
    start: int
    stop: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (*self.shape[: self.dim], self.stop - self.start, *self.shape[self.dim + 1 :])

    @property
    def numel(self) -> int:
        return math.prod(self.block_shape)

    @property
    def flat_start(self) -> int | None:
        """Where the block starts among the full tensor's flat elements when it is one contiguous run of them (every
        dimension before `dim` has size 1: dim-0 rows, say), else None."""
        if any(size != 1 for size in self.shape[: self.dim]):
            return None
        return self.start * math.prod(self.shape[self.dim + 1 :])


@dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of piece number `piece` (in its rank's list), flattened, at byte `offset` of a bucket."""

    piece: int
    start: int
    stop: int
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    segments: tuple[Segment, ...]


# -- the messages members exchange at join (through the rendezvous store) ------------------------------


def layout_to_json(layout: Sequence[TensorSpec]) -> bytes:
    return json.dumps([[s.name, list(s.shape), dtype_name(s.dtype)] for s in layout]).encode()


def layout_from_json(data: bytes) -> list[TensorSpec]:
    return [TensorSpec(name, tuple(shape), DTYPES[dtype]) for name, shape, dtype in json.loads(data)]


def pieces_to_json(pieces: Sequence[Piece]) -> bytes:
    return json.dumps([[p.name, list(p.shape), p.dim, p.start, p.stop, dtype_name(p.dtype)] for p in pieces]).encode()


def pieces_from_json(data: bytes) -> list[Piece]:
    return [
        Piece(name, tuple(shape), dim, start, stop, DTYPES[dtype])
        for name, shape, dim, start, stop, dtype in json.loads(data)
    ]


# -- checks and packing ------------------------------------------------------------------------------


def check_coverage(layout: Sequence[TensorSpec], pieces_by_rank: Sequence[Sequence[Piece]]) -> None:
    """Raise WeightSyncError unless the actor ranks' pieces fill every layout tensor exactly once, in its dtype."""
    specs = {spec.name: spec for spec in layout}
    ranges: dict[str, list[tuple[int, int, int, int]]] = {name: [] for name in specs}
    for rank, pieces in enumerate(pieces_by_rank):
        for piece in pieces:
            spec = specs.get(piece.name)
            if spec is None:
                raise WeightSyncError(f"actor rank {rank} sends {piece.name}, which the rollout model does not have")
            if piece.shape != spec.shape or piece.dtype != spec.dtype:
                raise WeightSyncError(
                    f"{piece.name}: actor rank {rank} sends {piece.shape} {piece.dtype}, "
                    f"the rollout model has {spec.shape} {spec.dtype}"
                )
            if not 0 <= piece.dim < max(1, len(spec.shape)):
                raise WeightSyncError(
                    f"{piece.name}: actor rank {rank} splits it along dim {piece.dim} of {spec.shape}"
                )
            ranges[piece.name].append((piece.dim, piece.start, piece.stop, rank))
    for name, parts in ranges.items():
        spec = specs[name]
        dims = {dim for dim, _, _, _ in parts}
        if len(dims) > 1:
            raise WeightSyncError(f"{name}: the actor ranks split it along different dimensions {sorted(dims)}")
        extent = spec.shape[dims.pop()] if dims and spec.shape else 1
        position = 0
        for _, start, stop, _ in sorted(parts):
            if start != position or stop <= start:
                raise WeightSyncError(f"{name}: the actor ranks' pieces {sorted(parts)} do not tile its {extent} rows")
            position = stop
        if position != extent:
            raise WeightSyncError(f"{name}: the actor ranks send {position} of its {extent} rows")


MIN_BUCKET_BYTES = 4 << 20
BUCKETS_PER_SYNC = 32


def channel_bucket_bytes(pieces: Sequence[Piece], cap: int) -> int:
    """The bucket size of one actor rank's channel: what the rank sends over BUCKETS_PER_SYNC (rounded up to 64 bytes),
    at least MIN_BUCKET_BYTES and at most `cap`. The two buffers each end of a channel holds during a sync are then
    about a sixteenth of what the rank sends (itself at most a quarter of its share of the training state: 4 bytes
    per parameter against 16), where a fixed size would outweigh the share of a small model over many ranks; a
    large part still goes in buckets of `cap`. Both ends compute it from the same pieces."""
    total = sum(piece.numel * piece.dtype.itemsize for piece in pieces)
    size = -(-total // BUCKETS_PER_SYNC // 64) * 64
    return min(cap, max(MIN_BUCKET_BYTES, size))


def plan_buckets(pieces: Iterable[Piece], bucket_bytes: int) -> list[Bucket]:
    """Pack pieces, in order, into buckets of at most `bucket_bytes`; a piece that does not fit the rest of a bucket is
    split by elements. Each segment starts at a multiple of its dtype's size (so a byte view can be cast)."""
    buckets: list[Bucket] = []
    segments: list[Segment] = []
    used = 0
    for index, piece in enumerate(pieces):
        size = piece.dtype.itemsize
        if bucket_bytes < size:
            raise ValueError(f"bucket_bytes {bucket_bytes} is smaller than one {piece.dtype} element")
        position, total = 0, piece.numel
        while position < total:
            offset = -(-used // size) * size
            room = (bucket_bytes - offset) // size
            if room <= 0:
                buckets.append(Bucket(used, tuple(segments)))
                segments, used = [], 0
                continue
            count = min(room, total - position)
            segments.append(Segment(index, position, position + count, piece.dtype, offset))
            used = offset + count * size
            position += count
    if segments:
        buckets.append(Bucket(used, tuple(segments)))
    return buckets


@torch.no_grad()
def pack_bucket(bucket: Bucket, blocks: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copy (and cast: round to nearest even, like load_state_dict) each segment of the flat `blocks` (one per piece)
    into the uint8 buffer `out`."""
    for seg in bucket.segments:
        out[seg.offset : seg.offset + seg.nbytes].view(seg.dtype).copy_(blocks[seg.piece][seg.start : seg.stop])


class Assembler:
    """A receiver's side of one sync: unpacks every rank's buckets into whole tensors (the sink's own where it offers
    them) and hands each tensor to the sink once all of its pieces have arrived."""

    def __init__(self, layout: Sequence[TensorSpec], pieces_by_rank: Sequence[Sequence[Piece]], sink) -> None:
        self.specs = {spec.name: spec for spec in layout}
        self.pieces_by_rank = pieces_by_rank
        self.sink = sink
        self.targets: dict[str, torch.Tensor] = {}
        self.remaining: dict[str, int] = {}
        self.staging: dict[
            tuple[int, int], tuple[torch.Tensor, int]
        ] = {}  # (rank, piece) -> (flat block, elements left)

    def _target(self, name: str) -> torch.Tensor:
        target = self.targets.get(name)
        if target is None:
            spec = self.specs[name]
            target = self.sink.target(spec)
            if tuple(target.shape) != spec.shape or target.dtype != spec.dtype or not target.is_contiguous():
                raise WeightSyncError(
                    f"{name}: the sink's tensor is {tuple(target.shape)} {target.dtype}, not {spec.shape} "
                    f"{spec.dtype} and contiguous"
                )
            self.targets[name] = target.detach()
            self.remaining[name] = spec.numel
        return self.targets[name]

    @torch.no_grad()
    def unpack(self, rank: int, bucket: Bucket, buffer: torch.Tensor) -> None:
        """Place each segment of `buffer` (a uint8 bucket from actor rank `rank`)."""
        for seg in bucket.segments:
            piece = self.pieces_by_rank[rank][seg.piece]
            data = buffer[seg.offset : seg.offset + seg.nbytes].view(seg.dtype)
            target = self._target(piece.name)
            flat_start = piece.flat_start
            if flat_start is not None:  # the block is a run of the target's elements: straight in
                target.view(-1)[flat_start + seg.start : flat_start + seg.stop].copy_(data)
            else:  # a column block: gathered whole, then copied into its strided place
                key = (rank, seg.piece)
                block, left = self.staging.get(key) or (
                    torch.empty(piece.numel, dtype=piece.dtype, device=target.device),
                    piece.numel,
                )
                block[seg.start : seg.stop].copy_(data)
                left -= seg.stop - seg.start
                if left:
                    self.staging[key] = (block, left)
                else:
                    self.staging.pop(key, None)
                    target.narrow(piece.dim, piece.start, piece.stop - piece.start).copy_(block.view(piece.block_shape))
            self.remaining[piece.name] -= seg.stop - seg.start
            if not self.remaining[piece.name]:
                self.sink.load(piece.name, self.targets.pop(piece.name))

    def finish(self) -> None:
        """Every tensor must be complete; then the sink may finish loading (e.g. drop caches of the old weights)."""
        started = [name for name, left in self.remaining.items() if left]
        missing = [name for name, spec in self.specs.items() if name not in self.remaining and spec.numel]
        if started or missing:
            raise WeightSyncError(f"the sync ended with tensors incomplete: {(started + missing)[:5]}")
        self.sink.finish()
