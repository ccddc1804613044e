"""Weight transfer from the actor ranks to every rollout worker over collective channels (no Ray needed here).

One channel (a process group of its own, never the actors' default group) per actor rank r:

    channel r = {actor rank r (channel rank 0, the root), rollout worker 0..R-1 (channel ranks 1..R)}

Actor rank r sends only what it holds: the local pieces of its FSDP2 shards (dim-0 row ranges, torch.chunk
semantics), cast to the rollout's dtype, packed into flat byte buckets of at most `bucket_bytes`, one
broadcast per bucket. A dim-0 row range of a contiguous tensor is a contiguous range of its flattened
elements, so every piece is just `(name, flat start, flat stop)` and a piece larger than a bucket is split
across buckets by elements. The rollout workers receive on all A channels at once (the actor ranks send in
parallel) and copy each piece into its place in their full tensors.

Set-up, without any default process group:
  * actor rank 0 hosts a TCPStore (`serve_store`, a free port chosen by the OS); every member connects;
  * rollout worker 0 publishes its tensor layout (names, shapes, dtypes: the wire dtype of each tensor is the
    rollout's own, so the cast is the one `load_state_dict` did); each actor rank publishes its pieces; every
    rollout worker checks that the pieces tile each of its tensors exactly once;
  * channel r is built on `PrefixStore("channel/r/", store)` as a ProcessGroupGloo, or a ProcessGroupNCCL when
    every member is on a GPU and no two members share one (NCCL refuses two ranks on the same device, the
    common colocated case): a channel with a shared GPU uses gloo over pinned host buffers.

Every wait is bounded by the join's `timeout_s`: a dead or stuck peer surfaces as an exception. After any
failure the channels are marked broken and must be joined again (the runner rebuilds its groups anyway).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

_HEADER_MAGIC = 0x5753  # "WS": a header that does not start with it means the channel is out of step
_HEADER_LEN = 4  # magic, sync sequence number, bucket_bytes, number of buckets

DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"weight sync cannot send tensors of dtype {dtype}")
    return name


class WeightSyncError(RuntimeError):
    """The weight-sync channels are inconsistent or broken (layout mismatch, protocol out of step, failed peer)."""


# -- layout and pieces (pure functions) ------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the rollout model: the unit the actors fill."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    aliases: tuple[str, ...] = ()  # later state-dict names of the same tensor (tied weights)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Piece:
    """Flat elements [start, stop) of tensor `name` (full shape `shape`), sent in `dtype` by one actor rank."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Segment:
    """A piece, or part of one, at byte `offset` of a bucket: flat elements [start, stop) of tensor `name`."""

    name: str
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


def tensor_layout(state: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The distinct tensors of a (rollout) state dict (`state_dict(keep_vars=True)`), in its order; a tied tensor is
    listed once, under its first name, with its other names as aliases."""
    first: dict[int, str] = {}
    specs: dict[str, TensorSpec] = {}
    for name, tensor in state.items():
        owner = first.setdefault(id(tensor), name)
        if owner == name:
            specs[name] = TensorSpec(name, tuple(tensor.shape), tensor.dtype)
        else:
            spec = specs[owner]
            specs[owner] = TensorSpec(spec.name, spec.shape, spec.dtype, (*spec.aliases, name))
    return list(specs.values())


def layout_to_json(layout: Sequence[TensorSpec]) -> bytes:
    return json.dumps([[s.name, list(s.shape), dtype_name(s.dtype), list(s.aliases)] for s in layout]).encode()


def layout_from_json(data: bytes) -> list[TensorSpec]:
    return [TensorSpec(name, tuple(shape), DTYPES[dtype], tuple(aliases)) for name, shape, dtype, aliases in json.loads(data)]


def pieces_to_json(pieces: Sequence[Piece]) -> bytes:
    return json.dumps([[p.name, list(p.shape), p.start, p.stop, dtype_name(p.dtype)] for p in pieces]).encode()


def pieces_from_json(data: bytes) -> list[Piece]:
    return [Piece(name, tuple(shape), start, stop, DTYPES[dtype]) for name, shape, start, stop, dtype in json.loads(data)]


def local_piece(name: str, tensor: torch.Tensor, rank: int) -> tuple[int, int, torch.Tensor] | None:
    """(flat start, flat stop, local elements flattened) of what actor `rank` sends of `tensor`, or None.

    A DTensor sharded on dim 0 over a 1-D mesh (FSDP2): this rank's rows, checked against its local shape.
    A replicated DTensor or a plain tensor (a buffer): rank 0 sends all of it.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shape = tuple(tensor.shape)
    numel = tensor.numel()
    if isinstance(tensor, DTensor):
        mesh, placements = tensor.device_mesh, tensor.placements
        local = tensor.to_local()
        if mesh.ndim != 1:
            raise NotImplementedError(f"weight sync: {name} is on a {mesh.ndim}-D device mesh (only 1-D FSDP meshes)")
        placement = placements[0]
        if type(placement) is Shard and placement.dim == 0:
            if not shape:
                raise NotImplementedError(f"weight sync: {name} is a sharded 0-d tensor")
            start_row, stop_row = shard_rows(shape[0], mesh.size(), mesh.get_local_rank())
            expected = (stop_row - start_row, *shape[1:])
            if tuple(local.shape) != expected:
                raise WeightSyncError(
                    f"{name}: local shard {tuple(local.shape)} is not rows {start_row}:{stop_row} of {shape} "
                    "(FSDP's split differs from torch.chunk's)"
                )
            if start_row == stop_row:
                return None
            row = numel // shape[0]
            return start_row * row, stop_row * row, local.reshape(-1)
        if isinstance(placement, Replicate):
            return (0, numel, local.reshape(-1)) if rank == 0 and numel else None
        raise NotImplementedError(f"weight sync: {name} has placement {placement} (only Shard(0) and Replicate)")
    return (0, numel, tensor.reshape(-1)) if rank == 0 and numel else None


def actor_pieces(
    state: Mapping[str, torch.Tensor], layout: Sequence[TensorSpec], rank: int
) -> tuple[list[Piece], dict[str, tuple[int, torch.Tensor]]]:
    """What actor `rank` sends for the rollout `layout`: its pieces (wire dtype = the rollout tensor's dtype) and,
    per name, (flat start of its piece, its local elements flattened) to pack from."""
    names = {name for spec in layout for name in (spec.name, *spec.aliases)}
    missing = sorted(names - set(state))
    if missing:
        raise WeightSyncError(f"the actor model has no tensors named {missing[:5]} that the rollout model has")
    extra = sorted(set(state) - names)
    if extra:
        raise WeightSyncError(f"the rollout model has no tensors named {extra[:5]} that the actor model has")
    pieces, sources = [], {}
    for spec in layout:
        tensor = state[spec.name]
        if tuple(tensor.shape) != spec.shape:
            raise WeightSyncError(f"{spec.name}: actor shape {tuple(tensor.shape)} != rollout shape {spec.shape}")
        part = local_piece(spec.name, tensor, rank)
        if part is None:
            continue
        start, stop, flat = part
        pieces.append(Piece(spec.name, spec.shape, start, stop, spec.dtype))
        sources[spec.name] = (start, flat)
    return pieces, sources


def check_coverage(layout: Sequence[TensorSpec], pieces_by_rank: Sequence[Sequence[Piece]]) -> None:
    """Raise WeightSyncError unless the actor ranks' pieces fill every rollout tensor exactly once, in its dtype."""
    specs = {spec.name: spec for spec in layout}
    ranges: dict[str, list[tuple[int, int, int]]] = {name: [] for name in specs}
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
            ranges[piece.name].append((piece.start, piece.stop, rank))
    for name, parts in ranges.items():
        position = 0
        for start, stop, rank in sorted(parts):
            if start != position or stop <= start:
                raise WeightSyncError(
                    f"{name}: the actor ranks' pieces {sorted(parts)} do not tile its {specs[name].numel} elements"
                )
            position = stop
        if position != specs[name].numel:
            raise WeightSyncError(f"{name}: the actor ranks send {position} of its {specs[name].numel} elements")


def plan_buckets(pieces: Iterable[Piece], bucket_bytes: int) -> list[Bucket]:
    """Pack pieces, in order, into buckets of at most `bucket_bytes`; a piece that does not fit the rest of a bucket is
    split by elements. Each segment starts at a multiple of its dtype's size (so a byte view can be cast)."""
    buckets: list[Bucket] = []
    segments: list[Segment] = []
    used = 0
    for piece in pieces:
        size = piece.dtype.itemsize
        if bucket_bytes < size:
            raise ValueError(f"bucket_bytes {bucket_bytes} is smaller than one {piece.dtype} element")
        position = piece.start
        while position < piece.stop:
            offset = -(-used // size) * size
            room = (bucket_bytes - offset) // size
            if room <= 0:
                buckets.append(Bucket(used, tuple(segments)))
                segments, used = [], 0
                continue
            count = min(room, piece.stop - position)
            segments.append(Segment(piece.name, position, position + count, piece.dtype, offset))
            used = offset + count * size
            position += count
    if segments:
        buckets.append(Bucket(used, tuple(segments)))
    return buckets


@torch.no_grad()
def pack_bucket(bucket: Bucket, sources: Mapping[str, tuple[int, torch.Tensor]], out: torch.Tensor) -> None:
    """Copy (and cast: round to nearest even, like load_state_dict) each segment into the uint8 buffer `out`."""
    for seg in bucket.segments:
        base, flat = sources[seg.name]
        out[seg.offset : seg.offset + seg.nbytes].view(seg.dtype).copy_(flat[seg.start - base : seg.stop - base])


@torch.no_grad()
def unpack_bucket(bucket: Bucket, buffer: torch.Tensor, targets: Mapping[str, torch.Tensor]) -> None:
    """Copy each segment of the uint8 `buffer` into its elements of the flat target tensors."""
    for seg in bucket.segments:
        targets[seg.name][seg.start : seg.stop].copy_(buffer[seg.offset : seg.offset + seg.nbytes].view(seg.dtype))


def flat_targets(state: Mapping[str, torch.Tensor], layout: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """Flat views of the rollout tensors the buckets are unpacked into (they must be contiguous)."""
    targets = {}
    for spec in layout:
        tensor = state[spec.name]
        if not tensor.is_contiguous():
            raise WeightSyncError(f"{spec.name}: the rollout tensor is not contiguous")
        targets[spec.name] = tensor.detach().view(-1)
    return targets


# -- store, devices, channels ----------------------------------------------------------------------


def serve_store(host: str, timeout_s: float = 300.0) -> dist.TCPStore:
    """A TCPStore server on a free port (chosen by the OS, no race) of this node; keep it alive while channels are used.
    Its `.port` is the port to hand to the members; it listens on every interface."""
    return dist.TCPStore(host, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def connect_store(host: str, port: int, timeout_s: float) -> dist.Store:
    store = dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def device_tag(device: torch.device) -> str:
    """'cpu', or 'cuda:<GPU uuid>' (what NCCL looks at to refuse two ranks on one GPU)."""
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


def channel_backend(tags: Sequence[str]) -> str:
    """NCCL when every member is on its own GPU, else gloo (CPU members, or a GPU shared by two members)."""
    if all(tag.startswith("cuda:") for tag in tags) and len(set(tags)) == len(tags) and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def _gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta, local_host: str | None):
    """A gloo group bound to `local_host` (the node's IP as Ray sees it), or to GLOO_SOCKET_IFNAME when set."""
    if local_host is None or os.environ.get("GLOO_SOCKET_IFNAME"):
        return dist.ProcessGroupGloo(store, rank, size, timeout)  # the default device honours GLOO_SOCKET_IFNAME
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    return dist.ProcessGroupGloo(store, rank, size, options)


def _nccl_group(store: dist.Store, rank: int, size: int, timeout: timedelta):
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    return ProcessGroupNCCL(store, rank, size, options)


class Channel:
    """One process group: actor rank `index` (channel rank 0, the root) and the R rollout workers."""

    def __init__(self, index: int, store: dist.Store, rank: int, size: int, backend: str, device: torch.device,
                 timeout: timedelta, local_host: str | None):
        self.index, self.rank, self.size, self.backend, self.timeout = index, rank, size, backend, timeout
        prefixed = dist.PrefixStore(f"channel/{index}/", store)
        if backend == "nccl":
            self.group = _nccl_group(prefixed, rank, size, timeout)
            self.buffer_device, self.pin = device, False
        else:
            self.group = _gloo_group(prefixed, rank, size, timeout, local_host)
            self.buffer_device, self.pin = torch.device("cpu"), device.type == "cuda"
        self.buffers: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor):
        """Post a broadcast from the root (channel rank 0); returns the work to `wait` on."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        options.timeout = self.timeout
        return self.group.broadcast([tensor], options)

    def wait(self, work) -> None:
        """Wait for `work`, at most the channel's timeout (NCCL: the CPU thread blocks too, the watchdog backs it up)."""
        work.wait(self.timeout)

    def new_tensor(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.buffer_device, pin_memory=self.pin)

    def bucket_buffers(self, nbytes: int, count: int) -> list[torch.Tensor]:
        """`count` uint8 buffers of at least `nbytes`. Host buffers are kept between syncs (pinned allocations are
        slow); GPU buffers go back to the caching allocator after each sync (`release`), for generation to use."""
        if len(self.buffers) != count or any(b.numel() < nbytes for b in self.buffers):
            self.buffers = []
            self.buffers = [self.new_tensor((nbytes,), torch.uint8) for _ in range(count)]
        return self.buffers

    def release(self) -> None:
        if self.buffer_device.type != "cpu":
            self.buffers = []

    def close(self) -> None:
        group, self.group, self.buffers = getattr(self, "group", None), None, []
        if group is not None and self.backend == "nccl":
            try:
                group.abort()
            except Exception:  # already torn down
                pass


def _handshake(channel: Channel) -> None:
    """One tiny broadcast at join: the channel works (and NCCL has built its communicator) before join returns."""
    probe = channel.new_tensor((1,), torch.int64)
    probe.fill_(channel.index if channel.rank == 0 else -1)
    channel.wait(channel.broadcast(probe))
    if int(probe.item()) != channel.index:
        raise WeightSyncError(f"channel {channel.index}: handshake carried {int(probe.item())}")


def _get(store: dist.Store, key: str, what: str, timeout_s: float) -> bytes:
    try:
        return store.get(key)
    except Exception as exc:  # a member never published (dead or never joined): the store timed out
        raise WeightSyncError(f"weight sync: no {what} within {timeout_s:g}s ({type(exc).__name__}: {exc})") from exc


def _device_tags(store: dist.Store, num_actor_ranks: int, num_rollout_workers: int, timeout_s: float):
    actors = [_get(store, f"device/actor/{r}", f"device of actor rank {r}", timeout_s).decode() for r in range(num_actor_ranks)]
    rollouts = [
        _get(store, f"device/rollout/{i}", f"device of rollout worker {i}", timeout_s).decode()
        for i in range(num_rollout_workers)
    ]
    return actors, rollouts


class _Member:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.sequence = 0
        self.broken: str | None = None
        self.channels: list[Channel] = []

    def _check(self) -> None:
        if self.broken is not None:
            raise WeightSyncError(f"the weight-sync channels broke in an earlier sync ({self.broken}); join again")
        if not self.channels:
            raise WeightSyncError("the weight-sync channels are closed; join again")

    def _header(self, channel: Channel, bucket_bytes: int, num_buckets: int) -> torch.Tensor:
        header = channel.new_tensor((_HEADER_LEN,), torch.int64)
        header.copy_(torch.tensor([_HEADER_MAGIC, self.sequence, bucket_bytes, num_buckets]))
        return header

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        self.channels = []

    def _fail(self, exc: BaseException) -> None:
        self.broken = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


class ActorSync(_Member):
    """Actor rank `rank`'s end: the root of channel `rank`."""

    def __init__(self, store: dist.Store, rank: int, num_actor_ranks: int, num_rollout_workers: int,
                 state: Mapping[str, torch.Tensor], device: torch.device, timeout_s: float, local_host: str | None = None):
        super().__init__(timeout_s)
        self.rank = rank
        timeout = timedelta(seconds=timeout_s)
        store.set(f"device/actor/{rank}", device_tag(device))
        self.layout = layout_from_json(_get(store, "rollout/layout", "layout from rollout worker 0", timeout_s))
        self.pieces, _ = actor_pieces(state, self.layout, rank)
        store.set(f"pieces/{rank}", pieces_to_json(self.pieces))
        actors, rollouts = _device_tags(store, num_actor_ranks, num_rollout_workers, timeout_s)
        backend = channel_backend([actors[rank], *rollouts])
        channel = Channel(rank, store, 0, 1 + num_rollout_workers, backend, device, timeout, local_host)
        self.channels = [channel]
        _handshake(channel)

    @property
    def backend(self) -> str:
        return self.channels[0].backend if self.channels else "closed"

    def send(self, state: Mapping[str, torch.Tensor], bucket_bytes: int) -> dict[str, float]:
        """Broadcast this rank's pieces of `state` (its current sharded state dict) in buckets; returns stats."""
        self._check()
        started = time.perf_counter()
        try:
            stats = self._send(state, bucket_bytes)
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self.channels[0].release()
        self.sequence += 1
        return {**stats, "seconds": time.perf_counter() - started}

    def _send(self, state: Mapping[str, torch.Tensor], bucket_bytes: int) -> dict[str, float]:
        pieces, sources = actor_pieces(state, self.layout, self.rank)
        if pieces != self.pieces:
            raise WeightSyncError(f"actor rank {self.rank}: the model's shards changed since the join; join again")
        buckets = plan_buckets(pieces, bucket_bytes)
        channel = self.channels[0]
        channel.wait(channel.broadcast(self._header(channel, bucket_bytes, len(buckets))))
        if not buckets:
            return {"bytes": 0.0, "buckets": 0.0}
        buffers = channel.bucket_buffers(max(b.nbytes for b in buckets), min(2, len(buckets)))
        in_flight: list[Any] = [None] * len(buffers)
        for k, bucket in enumerate(buckets):
            slot = k % len(buffers)
            if in_flight[slot] is not None:  # the buffer is still being sent: wait before refilling it
                channel.wait(in_flight[slot])
            buffer = buffers[slot][: bucket.nbytes]
            pack_bucket(bucket, sources, buffer)  # overlaps the broadcast of the other buffer
            in_flight[slot] = channel.broadcast(buffer)
        for work in in_flight:
            if work is not None:
                channel.wait(work)
        return {"bytes": float(sum(b.nbytes for b in buckets)), "buckets": float(len(buckets))}


class RolloutSync(_Member):
    """Rollout worker `index`'s end: channel rank 1 + index of every channel."""

    def __init__(self, store: dist.Store, index: int, num_actor_ranks: int, num_rollout_workers: int,
                 state: Mapping[str, torch.Tensor], device: torch.device, timeout_s: float, local_host: str | None = None):
        super().__init__(timeout_s)
        self.index = index
        timeout = timedelta(seconds=timeout_s)
        self.layout = tensor_layout(state)
        store.set(f"device/rollout/{index}", device_tag(device))
        if index == 0:
            store.set("rollout/layout", layout_to_json(self.layout))
        self.pieces = [
            pieces_from_json(_get(store, f"pieces/{r}", f"pieces from actor rank {r}", timeout_s)) for r in range(num_actor_ranks)
        ]
        check_coverage(self.layout, self.pieces)  # also: this worker's layout matches worker 0's
        actors, rollouts = _device_tags(store, num_actor_ranks, num_rollout_workers, timeout_s)
        for r in range(num_actor_ranks):
            backend = channel_backend([actors[r], *rollouts])
            self.channels.append(Channel(r, store, 1 + index, 1 + num_rollout_workers, backend, device, timeout, local_host))
        for channel in self.channels:
            _handshake(channel)

    @property
    def backends(self) -> list[str]:
        return [channel.backend for channel in self.channels]

    def receive(self, state: Mapping[str, torch.Tensor], bucket_bytes: int) -> dict[str, float]:
        """Receive every actor rank's buckets into the tensors of `state` (this worker's model); returns stats."""
        self._check()
        started = time.perf_counter()
        try:
            stats = self._receive(state, bucket_bytes)
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            for channel in self.channels:
                channel.release()
        self.sequence += 1
        return {**stats, "seconds": time.perf_counter() - started}

    def _receive(self, state: Mapping[str, torch.Tensor], bucket_bytes: int) -> dict[str, float]:
        targets = flat_targets(state, self.layout)
        plans = [plan_buckets(pieces, bucket_bytes) for pieces in self.pieces]
        headers = [channel.new_tensor((_HEADER_LEN,), torch.int64) for channel in self.channels]
        works = [channel.broadcast(header) for channel, header in zip(self.channels, headers)]
        for channel, header, work, buckets in zip(self.channels, headers, works, plans):
            channel.wait(work)
            got = header.tolist()
            expected = [_HEADER_MAGIC, self.sequence, bucket_bytes, len(buckets)]
            if got != expected:
                raise WeightSyncError(
                    f"channel {channel.index}: actor sent header {got} (magic, sync, bucket_bytes, buckets), "
                    f"rollout worker {self.index} expected {expected}"
                )
        buffers = [
            channel.bucket_buffers(max(b.nbytes for b in buckets), min(2, len(buckets))) if buckets else []
            for channel, buckets in zip(self.channels, plans)
        ]
        # Round k posts bucket k of every channel (the actor ranks send side by side), then unpacks round k-1.
        previous: list[tuple[Channel, Bucket, torch.Tensor, Any]] = []
        for k in range(max((len(b) for b in plans), default=0)):
            current = []
            for channel, buckets, bufs in zip(self.channels, plans, buffers):
                if k < len(buckets):
                    buffer = bufs[k % len(bufs)][: buckets[k].nbytes]
                    current.append((channel, buckets[k], buffer, channel.broadcast(buffer)))
            self._finish(previous, targets)
            previous = current
        self._finish(previous, targets)
        if any(t.is_cuda for t in targets.values()):
            torch.cuda.synchronize()
        return {"bytes": float(sum(b.nbytes for buckets in plans for b in buckets)),
                "buckets": float(sum(len(b) for b in plans))}

    @staticmethod
    def _finish(posted, targets) -> None:
        for channel, bucket, buffer, work in posted:
            channel.wait(work)
            unpack_bucket(bucket, buffer, targets)
