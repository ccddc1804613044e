"""An actor rank's part of an in-memory snapshot, streamed to its holder straight off the live tensors.

    stream = SnapshotStream(step, rank, holder_address, local_tensors(rank_state().state_dict()))  # starts a thread
    ... the weight sync runs meanwhile: it only reads the same tensors ...
    reason = stream.wait()  # None once the holder has the whole part; else why it has none

The part is a skeleton (the state with every tensor replaced by a meta tensor of its dtype and shape: `torch.save`
bytes, read back with `weights_only=True`) and the tensors' raw bytes, in order, sent over a TCP connection to the
holder (`SnapshotHolder.address`; the wire format is in `rlrunner.cluster.snapshot_holder`). A large host tensor's
bytes are sent from its own memory; small and device tensors' through one host buffer of at most `CHUNK_BYTES`. So
the rank holds no copy of its state beside it (the serialized part a snapshot used to be, or chunks in Ray's object
store: every byte put there stays in the putting process's resident set).

The tensors must not change until `wait` returns: the driver waits for the stream within the step it snapshots, before
any later update (`rlrunner.runner.snapshots`). A part is read back from its holder in chunks (`fetch_part`).
"""

from __future__ import annotations

import io
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Iterable, Iterator

import numpy
import ray
import torch

from rlrunner.errors import describe
from rlrunner.utils.tensors import PLAIN_TYPES, map_tensors, tensor_bytes

CHUNK_BYTES = 32 * 2**20  # small or device tensors' bytes go through a host buffer this big; parts are read back so
DIRECT_BYTES = 2**20  # a host tensor this big is sent from its own memory
CONNECT_TIMEOUT_S = 10.0  # a holder that does not accept by then is lost: the wait for the part must not hang on it
# The streams' threads, kept from one snapshot to the next: starting a thread waits until the CPU runs it, 2 ms of an
# actor rank's step on the default job's busy cores, where a kept thread is handed the stream and the rank goes on.
_STREAM_THREADS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="snapshot-stream")


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bytes as a flat uint8 tensor (a view when it is contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def split_state(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """`state`'s skeleton (`torch.save` bytes, every tensor a meta tensor of its dtype and shape) and its tensors in the
    order `join_state` fills them back."""
    tensors: list[torch.Tensor] = []

    def placeholder(tensor: torch.Tensor) -> torch.Tensor:
        tensors.append(tensor)
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")

    buffer = io.BytesIO()
    torch.save(map_tensors(state, placeholder), buffer)
    return buffer.getvalue(), tensors


def _structure(state: Any, tensors: list[torch.Tensor], out: list[Any]) -> bool:
    """Append `state`'s tensors (in `split_state`'s order) to `tensors` and what its skeleton is made of (containers,
    keys, plain values, tensors' dtypes and shapes) to `out`. False where a value is of a type that could change in
    place without the structure showing it (its skeleton is then never reused)."""
    if isinstance(state, torch.Tensor):
        tensors.append(state)
        out.append((state.dtype, state.shape))
        return True
    if isinstance(state, dict):
        out.append((dict, len(state)))
        reusable = True
        for key, value in state.items():
            out.append((type(key), key))
            reusable = _structure(value, tensors, out) and reusable
        return reusable and all(type(key) in PLAIN_TYPES for key in state)
    if isinstance(state, (list, tuple)):
        out.append((type(state), len(state)))
        if all(type(value) in PLAIN_TYPES for value in state):  # plain values only (Python's RNG state: 625 ints)
            out.append(tuple((type(value), value) for value in state))
            return True
        reusable = True
        for value in state:
            reusable = _structure(value, tensors, out) and reusable
        return reusable
    out.append((type(state), state))
    return type(state) in PLAIN_TYPES


class SkeletonCache:
    """The last skeleton a rank sent, reused for a state of the same structure: a rank's part has the same keys, plain
    values, dtypes and shapes step after step (its tensors' values change in place), and writing the skeleton
    (`torch.save`) was most of the time a part took to split."""

    def __init__(self) -> None:
        self._last: tuple[list[Any], bytes] | None = None
        self._lock = threading.Lock()

    def split(self, state: Any) -> tuple[bytes, list[torch.Tensor]]:
        """`split_state(state)`, the skeleton written only when the structure differs from the last one's."""
        tensors: list[torch.Tensor] = []
        structure: list[Any] = []
        reusable = _structure(state, tensors, structure)
        with self._lock:
            if reusable and self._last is not None and self._last[0] == structure:
                return self._last[1], tensors
        skeleton, tensors = split_state(state)
        with self._lock:
            self._last = (structure, skeleton) if reusable else None
        return skeleton, tensors


def _small(tensor: torch.Tensor) -> bool:
    return tensor_bytes(tensor) < DIRECT_BYTES


def byte_views(tensors: list[torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """The tensors' bytes, in order, as views to send: a host tensor of at least `DIRECT_BYTES` from its own memory
    (copied only if not contiguous); smaller ones, and device tensors, copied through one reused host buffer of
    `chunk_bytes` (so that a model's many small tensors go out in few sends). A view is valid until the next is asked
    for."""
    buffer: torch.Tensor | None = None
    filled = 0
    for tensor in tensors:
        raw = _raw(tensor)
        if raw.device.type == "cpu" and not _small(raw):
            if filled:
                yield memoryview(buffer[:filled].numpy())
                filled = 0
            yield memoryview(raw.numpy())
            continue
        if buffer is None:
            staged = tensor_bytes([t for t in tensors if t.device.type != "cpu" or _small(t)])
            buffer = torch.empty(min(chunk_bytes, staged), dtype=torch.uint8, pin_memory=raw.device.type == "cuda")
            chunk_bytes = buffer.numel()
        start = 0
        while start < raw.numel():
            n = min(raw.numel() - start, chunk_bytes - filled)
            buffer[filled : filled + n].copy_(raw[start : start + n])
            filled, start = filled + n, start + n
            if filled == chunk_bytes:
                yield memoryview(buffer.numpy())
                filled = 0
    if filled:
        yield memoryview(buffer[:filled].numpy())


def join_state(skeleton: bytes, chunks: Iterable[bytes]) -> Any:
    """The state `split_state` took apart, its tensors (new ones, on the host) filled from the chunks' bytes."""
    chunk_iter = iter(chunks)
    pending = memoryview(b"")

    def filled(meta: torch.Tensor) -> torch.Tensor:
        nonlocal pending
        tensor = torch.empty(meta.shape, dtype=meta.dtype)
        target = _raw(tensor).numpy()  # a view of the new tensor's bytes
        start = 0
        while start < target.size:
            if not len(pending):
                pending = memoryview(next(chunk_iter))
            n = min(target.size - start, len(pending))
            target[start : start + n] = numpy.frombuffer(pending[:n], dtype=numpy.uint8)
            pending, start = pending[n:], start + n
        return tensor

    state = map_tensors(torch.load(io.BytesIO(skeleton), weights_only=True), filled)
    if len(pending) or next(chunk_iter, None) is not None:
        raise ValueError("a snapshot part has more bytes than its tensors")
    return state


class SnapshotStream:
    """One rank's part of `step` sent to the holder at `address` ((host, port, token): `SnapshotHolder.address`) from
    a thread of the streams' own."""

    def __init__(
        self,
        step: int,
        rank: int,
        address: tuple[str, int, str],
        state: Any,
        timeout_s: float = 300.0,
        skeletons: SkeletonCache | None = None,
    ):
        self.step, self.rank, self.address, self.timeout_s = step, rank, address, timeout_s
        self._skeletons = skeletons if skeletons is not None else SkeletonCache()
        self.reason: str | None = None
        self._state = state  # read on the thread: the caller built it, nothing else refers to the structure
        self._given_up = threading.Event()
        self._connection: socket.socket | None = None
        self._sent = _STREAM_THREADS.submit(self._run)

    def _run(self) -> None:
        try:
            skeleton, tensors = self._skeletons.split(self._state)
            total = tensor_bytes(tensors)
            header = {"token": self.address[2], "step": self.step, "rank": self.rank}
            header.update(skeleton_bytes=len(skeleton), total_bytes=total)
            request = json.dumps(header).encode() + b"\n" + skeleton
            kept = _KEPT_CONNECTIONS.take(self.address)
            if kept is not None:
                try:
                    self._send(kept, request, tensors)
                    return
                except Exception:
                    if self._given_up.is_set():
                        raise
                    # The holder ended the connection since the last part (it closes a connection it refused a
                    # part on, or its run's reset): it keeps nothing half-sent, so the part goes again on a new one.
            self._send(_HolderConnection(self.address[:2], self.timeout_s), request, tensors)
        except Exception as exc:  # the holder was lost: this step's snapshot is incomplete, the run goes on
            self.reason = f"actor rank {self.rank}'s part was lost on the way ({describe(exc)})"
        finally:
            self._state = None  # the live tensors are no longer referenced from here

    def _send(self, holder: _HolderConnection, request: bytes, tensors: list[torch.Tensor]) -> None:
        """The part over `holder`'s connection, kept for the next part once held; closed on any failure."""
        self._connection = holder.socket
        try:
            holder.socket.sendall(request)
            self.reason = _answer(holder.answers)
            if self.reason is None:
                for view in byte_views(tensors):
                    if self._given_up.is_set():
                        raise ConnectionAbortedError("given up")
                    holder.socket.sendall(view)
                self.reason = _answer(holder.answers)
        except BaseException:
            holder.close()
            raise
        if self.reason is None:
            _KEPT_CONNECTIONS.put(self.address, holder)
        else:
            holder.close()  # a refusal ends the connection on the holder's side too

    def wait(self, timeout_s: float | None = None) -> str | None:
        """None once the holder keeps the whole part; else why it keeps none. A part still on its way after
        `timeout_s` is given up before this returns (its connection cut, so that the holder keeps none of it): the
        caller may then change the tensors."""
        try:
            self._sent.result(timeout_s)
        except FutureTimeout:
            self._given_up.set()
            connection = self._connection
            if connection is not None:
                try:
                    connection.shutdown(socket.SHUT_RDWR)  # a send blocked on a stuck holder fails at once
                except OSError:
                    pass
            self._sent.result()
            return f"actor rank {self.rank}'s part was still on its way after {timeout_s:g} s"
        return self.reason


class _HolderConnection:
    """A rank's TCP connection to a holder, with the reader of the holder's answer lines."""

    def __init__(self, host_port: tuple[str, int], timeout_s: float):
        self.socket = socket.create_connection(host_port, timeout=CONNECT_TIMEOUT_S)
        self.socket.settimeout(timeout_s)
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the header waits for no ACK
        self.answers = self.socket.makefile("rb")

    def close(self) -> None:
        self.answers.close()
        self.socket.close()


class _KeptConnections:
    """The connection to the holder of the last part sent, kept for the next one: a snapshot then costs a rank no new
    connection and its holder no new thread (both wait on the busy cores, every step). A rank sends its parts to one
    holder at a time, so one is kept (one to another holder is closed). A stream takes it out while using it."""

    def __init__(self) -> None:
        self._kept: tuple[tuple[str, int, str], _HolderConnection] | None = None
        self._lock = threading.Lock()

    def take(self, address: tuple[str, int, str]) -> _HolderConnection | None:
        with self._lock:
            if self._kept is None or self._kept[0] != tuple(address):
                return None
            connection, self._kept = self._kept[1], None
        return connection

    def put(self, address: tuple[str, int, str], connection: _HolderConnection) -> None:
        with self._lock:
            old, self._kept = self._kept, (tuple(address), connection)
        if old is not None:
            old[1].close()


_KEPT_CONNECTIONS = _KeptConnections()


def _answer(answers: Any) -> str | None:
    """The holder's answer line: None for go on (or held), else its reason."""
    line = answers.readline()
    if not line.endswith(b"\n"):
        raise ConnectionError("the holder closed the connection")
    return line.decode().strip() or None


def fetch_part(holder: Any, step: int, rank: int) -> Any:
    """`rank`'s part of `step` read back from `holder` (a `SnapshotHolder` actor), a chunk at a time."""
    skeleton, num_chunks = ray.get(holder.get.remote(step, rank, CHUNK_BYTES))
    chunks = (ray.get(holder.get_chunk.remote(step, rank, i, CHUNK_BYTES)) for i in range(num_chunks))
    return join_state(skeleton, chunks)
