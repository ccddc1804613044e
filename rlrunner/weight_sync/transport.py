"""The two ends of the weight sync's wire: an actor rank sends its blocks, every rollout worker receives all of them.

At join (a collective of every actor rank and rollout worker, through the rendezvous store):
  * rollout worker 0 publishes its sink's layout (HF names, shapes, its dtype: the wire's);
  * each actor rank publishes its pieces (what its source holds, in the layout's dtypes);
  * every rollout worker checks that the pieces tile each tensor exactly once, and every channel is built.
At each sync, actor rank r broadcasts a header (magic, sync number, bucket size, number of buckets), then its
pieces packed into buckets of at most `bucket_bytes` (`channel_bucket_bytes`: about a 32nd of what the rank sends,
within [4 MiB, the cap the driver gives]; two buffers: one is packed while the other is sent); the
rollout workers post bucket k of every channel at once (the actor ranks send side by side) and unpack round k-1
meanwhile. After any failure a member closes its channels (its peers' waits on it fail at once, instead of at the
channel's timeout) and must join again.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlrunner.errors import describe
from rlrunner.weight_sync.channels import Channel, channel_backend, device_tag, device_tags, handshake, store_get
from rlrunner.weight_sync.endpoints import Block, WeightSink, WeightSource
from rlrunner.weight_sync.plan import (
    Assembler,
    Bucket,
    Piece,
    WeightSyncError,
    channel_bucket_bytes,
    check_coverage,
    layout_from_json,
    layout_to_json,
    pack_bucket,
    pieces_from_json,
    pieces_to_json,
    plan_buckets,
)

_HEADER_MAGIC = 0x5753  # "WS": a header that does not start with it means the channel is out of step
_HEADER_LEN = 4  # magic, sync sequence number, bucket_bytes, number of buckets


class _Member:
    # Whether plain host buffers stay from one sync to the next (`Channel.release`): refilling kept buffers is faster
    # than faulting in fresh ones (bench_weight_sync, 100M parameters from 2 ranks: 0.20 s with kept buffers on both
    # ends, 0.34 s with none, 0.26 s with the receivers' kept), but an actor rank's memory is its training state's:
    # only the receivers keep theirs.
    keep_host_buffers = False

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

    def _run(self, sync, bucket_bytes: int) -> dict[str, float]:
        """One sync; any failure breaks the channels for good."""
        self._check()
        started = time.perf_counter()
        try:
            with torch.no_grad():  # the blocks are read, never trained through (a DTensor's to_local is then cheap)
                stats = sync(bucket_bytes)
        except BaseException as exc:
            self.broken = describe(exc)
            # Close our end at once, so that the peers still blocked on us fail now instead of at the channel's
            # timeout: a sender waits for its receivers to post their buckets, so a receiver whose wait on a dead
            # rank's channel failed would otherwise hold every other actor rank in its sync (unable to leave its
            # process group). A gloo group's connections close when its last reference goes, and the pending works
            # in the failed sync's frames hold it too: the traceback (which keeps those frames) is dropped.
            self.close()
            exc.__traceback__ = None
            raise
        finally:
            for channel in self.channels:
                channel.release(self.keep_host_buffers)
        self.sequence += 1
        return {**stats, "seconds": time.perf_counter() - started}

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        self.channels = []


class WeightSender(_Member):
    """Actor rank `rank`'s end: the root of channel `rank`, sending what `source` holds."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        num_actor_ranks: int,
        num_rollout_workers: int,
        source: WeightSource,
        device: torch.device,
        timeout_s: float,
        local_host: str | None = None,
    ):
        super().__init__(timeout_s)
        self.rank = rank
        self.source = source
        store.set(f"device/actor/{rank}", device_tag(device))
        self.layout = {
            spec.name: spec
            for spec in layout_from_json(store_get(store, "rollout/layout", "layout from rollout worker 0", timeout_s))
        }
        self.pieces, _, _ = self._pieces()
        store.set(f"pieces/{rank}", pieces_to_json(self.pieces))
        actors, rollouts = device_tags(store, num_actor_ranks, num_rollout_workers, timeout_s)
        backend = channel_backend([actors[rank], *rollouts])
        channel = Channel(
            rank, store, 0, 1 + num_rollout_workers, backend, device, timedelta(seconds=timeout_s), local_host
        )
        self.channels = [channel]
        handshake(channel)

    @property
    def backend(self) -> str:
        return self.channels[0].backend if self.channels else "closed"

    def _pieces(self) -> tuple[list[Piece], list[int], list[Block]]:
        """The source's blocks as pieces in the wire's dtypes, the index of each piece's block, and the blocks."""
        pieces, indices = [], []
        blocks = self.source.blocks()
        for index, block in enumerate(blocks):
            spec = self.layout.get(block.name)
            if spec is None:
                raise WeightSyncError(
                    f"actor rank {self.rank} holds {block.name}, which the rollout model does not have"
                )
            if tuple(block.shape) != spec.shape:
                raise WeightSyncError(f"{block.name}: actor shape {tuple(block.shape)} != rollout shape {spec.shape}")
            piece = Piece(block.name, spec.shape, block.dim, block.start, block.stop, spec.dtype)
            if tuple(block.tensor.shape) != piece.block_shape:
                raise WeightSyncError(
                    f"{block.name}: actor rank {self.rank}'s block is {tuple(block.tensor.shape)}, "
                    f"rows {block.start}:{block.stop} of dim {block.dim} are {piece.block_shape}"
                )
            if piece.numel:
                pieces.append(piece)
                indices.append(index)
        return pieces, indices, blocks

    def send(self, bucket_bytes: int) -> dict[str, float]:
        """Broadcast this rank's blocks as they are now, in buckets; returns stats."""
        return self._run(self._send, bucket_bytes)

    def copy_blocks(self) -> list[torch.Tensor]:
        """This rank's blocks as they are now, copied in the wire's dtypes (one flat tensor per piece): what
        `send_copy` sends, now or later. Made whole before any of it is sent, so a send that fails still leaves it."""
        try:
            with torch.no_grad():
                flat = self._block_values()
                return [flat[k].to(piece.dtype, copy=True) for k, piece in enumerate(self.pieces)]
        finally:
            self.source.end_of_sync()

    def send_copy(self, bucket_bytes: int, copy: list[torch.Tensor]) -> dict[str, float]:
        """Broadcast `copy` (`copy_blocks`') instead of the blocks: the weights an overlapped run's generation in
        flight was started with, after the update has changed the live ones."""
        if [(t.numel(), t.dtype) for t in copy] != [(p.numel, p.dtype) for p in self.pieces]:
            raise WeightSyncError(f"actor rank {self.rank}: the kept copy of the weights does not fit these channels")
        return self._run(lambda size: self._send_values(size, copy), bucket_bytes)

    def _block_values(self) -> _BlockValues:
        pieces, indices, blocks = self._pieces()
        if pieces != self.pieces:
            raise WeightSyncError(f"actor rank {self.rank}: the model's shards changed since the join; join again")
        return _BlockValues(self.source, blocks, indices)

    def _send(self, bucket_bytes: int) -> dict[str, float]:
        try:
            return self._send_values(bucket_bytes, self._block_values())
        finally:
            self.source.end_of_sync()

    def _send_values(self, bucket_bytes: int, flat: Any) -> dict[str, float]:
        """Send piece k's flattened values `flat[k]`, in buckets."""
        pieces = self.pieces
        bucket_bytes = channel_bucket_bytes(pieces, bucket_bytes)
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
            pack_bucket(bucket, flat, buffer)  # overlaps the broadcast of the other buffer
            in_flight[slot] = channel.broadcast(buffer)
        for work in in_flight:
            if work is not None:
                channel.wait(work)
        return {"bytes": float(sum(b.nbytes for b in buckets)), "buckets": float(len(buckets))}


class _BlockValues:
    """Piece k's flattened values, read from the source when first asked for: buckets are packed in piece order, so
    only the piece being packed is held (a source may gather its weights a unit at a time)."""

    def __init__(self, source: WeightSource, blocks: list[Block], indices: list[int]):
        self.source, self.blocks, self.indices = source, blocks, indices
        self.current: tuple[int, torch.Tensor] | None = None

    def __getitem__(self, piece: int) -> torch.Tensor:
        if self.current is None or self.current[0] != piece:
            if self.current is not None and piece < self.current[0]:
                raise WeightSyncError(
                    f"piece {piece} asked for after piece {self.current[0]}: pieces are packed in order"
                )
            self.current = None  # drop the last one before asking for the next
            index = self.indices[piece]
            block = self.blocks[index]
            tensor = self.source.block_tensor(index, block).detach()
            if tuple(tensor.shape) != tuple(block.tensor.shape):
                raise WeightSyncError(
                    f"{block.name}: the source gave {tuple(tensor.shape)} for a block of {tuple(block.tensor.shape)}"
                )
            self.current = (piece, tensor.reshape(-1))
        return self.current[1]


class WeightReceiver(_Member):
    """Rollout worker `index`'s end: channel rank 1 + index of every channel, receiving into `sink`."""

    keep_host_buffers = True

    def __init__(
        self,
        store: dist.Store,
        index: int,
        num_actor_ranks: int,
        num_rollout_workers: int,
        sink: WeightSink,
        device: torch.device,
        timeout_s: float,
        local_host: str | None = None,
    ):
        super().__init__(timeout_s)
        self.index = index
        self.sink = sink
        self.layout = sink.layout()
        store.set(f"device/rollout/{index}", device_tag(device))
        if index == 0:
            store.set("rollout/layout", layout_to_json(self.layout))
        self.pieces = [
            pieces_from_json(store_get(store, f"pieces/{r}", f"pieces from actor rank {r}", timeout_s))
            for r in range(num_actor_ranks)
        ]
        check_coverage(self.layout, self.pieces)  # also: this worker's layout matches worker 0's
        actors, rollouts = device_tags(store, num_actor_ranks, num_rollout_workers, timeout_s)
        timeout = timedelta(seconds=timeout_s)
        for r in range(num_actor_ranks):
            backend = channel_backend([actors[r], *rollouts])
            self.channels.append(
                Channel(r, store, 1 + index, 1 + num_rollout_workers, backend, device, timeout, local_host)
            )
        for channel in self.channels:
            handshake(channel)

    @property
    def backends(self) -> list[str]:
        return [channel.backend for channel in self.channels]

    def receive(self, bucket_bytes: int) -> dict[str, float]:
        """Receive every actor rank's buckets and load the weights into the sink; returns stats."""
        return self._run(self._receive, bucket_bytes)

    def _receive(self, bucket_bytes: int) -> dict[str, float]:
        assembler = Assembler(self.layout, self.pieces, self.sink)
        sizes = [channel_bucket_bytes(pieces, bucket_bytes) for pieces in self.pieces]
        plans = [plan_buckets(pieces, size) for pieces, size in zip(self.pieces, sizes)]
        headers = [channel.new_tensor((_HEADER_LEN,), torch.int64) for channel in self.channels]
        works = [channel.broadcast(header) for channel, header in zip(self.channels, headers)]
        for channel, header, work, size, buckets in zip(self.channels, headers, works, sizes, plans):
            channel.wait(work)
            got = header.tolist()
            expected = [_HEADER_MAGIC, self.sequence, size, len(buckets)]
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
            self._unpack(previous, assembler)
            previous = current
        self._unpack(previous, assembler)
        assembler.finish()
        if self.sink.device.type == "cuda":
            torch.cuda.synchronize()
        return {
            "bytes": float(sum(b.nbytes for buckets in plans for b in buckets)),
            "buckets": float(sum(len(b) for b in plans)),
        }

    @staticmethod
    def _unpack(posted, assembler: Assembler) -> None:
        for channel, bucket, buffer, work in posted:
            channel.wait(work)
            assembler.unpack(channel.index, bucket, buffer)
