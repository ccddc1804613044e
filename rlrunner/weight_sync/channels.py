"""The weight sync's channels: a rendezvous store, and one process group per actor rank with every rollout worker.

    channel r = {actor rank r (channel rank 0, the root), rollout worker 0..R-1 (channel ranks 1..R)}

Set-up needs no default process group: actor rank 0 hosts a TCPStore (`serve_store`, a free port chosen by the
OS) and every member connects. Channel r is built on `PrefixStore("channel/r/", store)` as a ProcessGroupGloo, or
a ProcessGroupNCCL when every member is on a GPU and no two members share one (NCCL refuses two ranks on the same
device, the common colocated case): a channel with a shared GPU uses gloo over pinned host buffers. Every wait
is bounded by the channel's timeout: a dead or stuck peer surfaces as an exception.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from rlrunner.weight_sync.plan import WeightSyncError


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

    def __init__(
        self,
        index: int,
        store: dist.Store,
        rank: int,
        size: int,
        backend: str,
        device: torch.device,
        timeout: timedelta,
        local_host: str | None,
    ):
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
        """Wait for `work`, at most the channel's timeout (NCCL: the CPU thread blocks too, the watchdog backs it
        up)."""
        work.wait(self.timeout)

    def new_tensor(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.buffer_device, pin_memory=self.pin)

    def bucket_buffers(self, nbytes: int, count: int) -> list[torch.Tensor]:
        """`count` uint8 buffers of at least `nbytes`, kept until `release`."""
        if len(self.buffers) != count or any(b.numel() < nbytes for b in self.buffers):
            self.buffers = []
            self.buffers = [self.new_tensor((nbytes,), torch.uint8) for _ in range(count)]
        return self.buffers

    def release(self, keep_host: bool) -> None:
        """After a sync: pinned host buffers are kept (pinned allocations are slow), and plain host ones when
        `keep_host`; GPU buffers go back to the caching allocator, for generation to use, and plain host buffers
        otherwise to the operating system (an actor rank's two 64 MiB buckets, kept, were its largest allocation
        outside its training state when its share is small)."""
        if not (self.pin or (keep_host and self.buffer_device.type == "cpu")):
            self.buffers = []

    def close(self) -> None:
        group, self.group, self.buffers = getattr(self, "group", None), None, []
        if group is not None and self.backend == "nccl":
            try:
                group.abort()
            except Exception:  # already torn down
                pass


def handshake(channel: Channel) -> None:
    """One tiny broadcast at join: the channel works (and NCCL has built its communicator) before join returns."""
    probe = channel.new_tensor((1,), torch.int64)
    probe.fill_(channel.index if channel.rank == 0 else -1)
    channel.wait(channel.broadcast(probe))
    if int(probe.item()) != channel.index:
        raise WeightSyncError(f"channel {channel.index}: handshake carried {int(probe.item())}")


def store_get(store: dist.Store, key: str, what: str, timeout_s: float) -> bytes:
    try:
        return store.get(key)
    except Exception as exc:  # a member never published (dead or never joined): the store timed out
        raise WeightSyncError(f"weight sync: no {what} within {timeout_s:g}s ({type(exc).__name__}: {exc})") from exc


def device_tags(store: dist.Store, num_actor_ranks: int, num_rollout_workers: int, timeout_s: float):
    actors = [
        store_get(store, f"device/actor/{r}", f"device of actor rank {r}", timeout_s).decode()
        for r in range(num_actor_ranks)
    ]
    rollouts = [
        store_get(store, f"device/rollout/{i}", f"device of rollout worker {i}", timeout_s).decode()
        for i in range(num_rollout_workers)
    ]
    return actors, rollouts
