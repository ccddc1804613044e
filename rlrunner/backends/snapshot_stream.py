"""An actor rank's part of an in-memory snapshot, streamed to its holder straight off the live tensors.

    stream = SnapshotStream(step, rank, holder_address, local_tensors(rank_state().state_dict()))  # starts a thread
    ... the weight sync runs meanwhile: it only reads the same tensors ...
    reason = stream.wait()  # None once the holder has the whole part; else why it has none

The part is a skeleton (the state with every tensor replaced by a meta tensor of its dtype and shape: `torch.save`
bytes, read back with `weights_only=True`), its scalars (every int, float, bool, str and None in it, in order: a JSON
list that replaces the skeleton's own when the part is read back) and the tensors' raw bytes, in order, sent over a TCP
connection to the holder (`SnapshotHolder.address`; the wire format is in `rlrunner.cluster.snapshot_holder`). A large
host tensor's bytes are sent from its own memory; small and device tensors' through one host buffer of at most
`CHUNK_BYTES`. So the rank holds no copy of its state beside it (the serialized part a snapshot used to be, or chunks in
Ray's object store: every byte put there stays in the putting process's resident set).

The tensors must not change until `wait` returns: the driver waits for the stream within the step it snapshots, before
any later update (`rlrunner.runner.snapshots`). A part is read back from its holder in chunks (`fetch_part`).
"""

from __future__ import annotations

import functools
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


@functools.cache
def _numpy_has(dtype: torch.dtype) -> bool:
    """Whether numpy has `dtype` (bfloat16 and the float8s it has not)."""
    try:
        torch.empty(0, dtype=dtype).numpy()
    except TypeError:
        return False
    return True


def _host_bytes(tensor: torch.Tensor) -> numpy.ndarray:
    """A host tensor's bytes as a flat uint8 array (a view when it is contiguous). Read through numpy where it has the
    dtype (`Tensor.numpy()`, then numpy's views and copies): a torch call costs several microseconds, and `_raw` and a
    copy through torch took 8 ms of the default job's step per rank for its ~110 small tensors."""
    array = tensor.numpy() if _numpy_has(tensor.dtype) and not tensor.requires_grad else _raw(tensor).numpy()
    return numpy.ascontiguousarray(array).reshape(-1).view(numpy.uint8)


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


# Values sent apart from the skeleton, as JSON (which gives each back exactly, of the same type): an LR schedule's step
# count changes every step, and the skeleton would otherwise be written again for it.
SCALAR_TYPES = frozenset({int, float, bool, str, type(None)})


def _structure(state: Any, tensors: list[torch.Tensor], scalars: list[Any], out: list[Any]) -> bool:
    """Append `state`'s tensors (in `split_state`'s order) to `tensors`, its scalars (`SCALAR_TYPES`, in the order
    `join_state` puts them back) to `scalars`, and what its skeleton is made of (containers, keys, the scalars' types,
    other plain values, tensors' dtypes and shapes) to `out`. False where a value is of a type that could change in
    place without the structure showing it (its skeleton is then never reused)."""
    if isinstance(state, torch.Tensor):
        tensors.append(state)
        out.append((state.dtype, state.shape))
        return True
    if type(state) in SCALAR_TYPES:
        scalars.append(state)
        out.append(type(state))
        return True
    if isinstance(state, dict):
        out.append((dict, len(state)))
        reusable = True
        for key, value in state.items():
            out.append((type(key), key))
            reusable = _structure(value, tensors, scalars, out) and reusable
        return reusable and all(type(key) in PLAIN_TYPES for key in state)
    if isinstance(state, (list, tuple)):
        out.append((type(state), len(state)))
        reusable = True
        for value in state:
            reusable = _structure(value, tensors, scalars, out) and reusable
        return reusable
    out.append((type(state), state))
    return type(state) in PLAIN_TYPES


def _with_scalars(state: Any, scalars: Iterator[Any], fill: Any) -> Any:
    """`state` (a skeleton read back) with its scalars replaced, in `_structure`'s order, by the next of `scalars`, and
    each tensor by `fill(tensor)`."""
    if isinstance(state, torch.Tensor):
        return fill(state)
    if type(state) in SCALAR_TYPES:
        return next(scalars)
    if isinstance(state, dict):
        return {key: _with_scalars(value, scalars, fill) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_with_scalars(value, scalars, fill) for value in state)
    return state


class SkeletonCache:
    """The last skeleton a rank sent, reused for a state of the same structure: a rank's part has the same keys,
    dtypes and shapes step after step (its tensors' values change in place, its scalars go apart), and writing the
    skeleton (`torch.save`, a cost per tensor) took 8 ms of each of the default job's steps on each rank."""

    def __init__(self) -> None:
        self._last: tuple[list[Any], bytes] | None = None
        self._lock = threading.Lock()

    def split(self, state: Any) -> tuple[bytes, list[Any], list[torch.Tensor]]:
        """`split_state(state)` and the state's scalars: the skeleton written only when the structure differs from the
        last one's."""
        tensors: list[torch.Tensor] = []
        scalars: list[Any] = []
        structure: list[Any] = []
        reusable = _structure(state, tensors, scalars, structure)
        with self._lock:
            if reusable and self._last is not None and self._last[0] == structure:
                return self._last[1], scalars, tensors
        skeleton, tensors = split_state(state)
        with self._lock:
            self._last = (structure, skeleton) if reusable else None
        return skeleton, scalars, tensors


def _small(tensor: torch.Tensor) -> bool:
    return tensor_bytes(tensor) < DIRECT_BYTES


def byte_views(tensors: list[torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """The tensors' bytes, in order, as views to send: a host tensor of at least `DIRECT_BYTES` from its own memory
    (copied only if not contiguous); smaller ones, and device tensors, copied through one reused host buffer of
    `chunk_bytes` (so that a model's many small tensors go out in few sends). A view is valid until the next is asked
    for."""
    buffer: torch.Tensor | None = None
    host_buffer: numpy.ndarray | None = None  # the buffer's bytes, seen by numpy
    filled = 0
    for tensor in tensors:
        on_host = tensor.device.type == "cpu"
        raw = _host_bytes(tensor) if on_host else _raw(tensor)
        size = raw.size if on_host else raw.numel()
        if on_host and size >= DIRECT_BYTES:
            if filled:
                yield memoryview(host_buffer[:filled])
                filled = 0
            yield memoryview(raw)
            continue
        if buffer is None:
            staged = tensor_bytes([t for t in tensors if t.device.type != "cpu" or _small(t)])
            buffer = torch.empty(min(chunk_bytes, staged), dtype=torch.uint8, pin_memory=not on_host)
            host_buffer, chunk_bytes = buffer.numpy(), buffer.numel()
        start = 0
        while start < size:
            n = min(size - start, chunk_bytes - filled)
            if on_host:
                host_buffer[filled : filled + n] = raw[start : start + n]
            else:
                buffer[filled : filled + n].copy_(raw[start : start + n])
            filled, start = filled + n, start + n
            if filled == chunk_bytes:
                yield memoryview(host_buffer)
                filled = 0
    if filled:
        yield memoryview(host_buffer[:filled])


def join_state(skeleton: bytes, chunks: Iterable[bytes], scalars: list[Any] | None = None) -> Any:
    """The state `split_state` took apart, its tensors (new ones, on the host) filled from the chunks' bytes, and its
    scalars, where given (`SkeletonCache.split`'s), in place of the skeleton's."""
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

    loaded = torch.load(io.BytesIO(skeleton), weights_only=True)
    if scalars is None:
        state = map_tensors(loaded, filled)
    else:
        scalar_iter = iter(scalars)
        state = _with_scalars(loaded, scalar_iter, filled)
        if next(scalar_iter, _END) is not _END:
            raise ValueError("a snapshot part has more scalars than its skeleton")
    if len(pending) or next(chunk_iter, None) is not None:
        raise ValueError("a snapshot part has more bytes than its tensors")
    return state


_END = object()


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
            skeleton, scalars, tensors = self._skeletons.split(self._state)
            values = json.dumps(scalars).encode()
            total = tensor_bytes(tensors)
            header = {"token": self.address[2], "step": self.step, "rank": self.rank}
            header.update(skeleton_bytes=len(skeleton), scalars_bytes=len(values), total_bytes=total)
            request = json.dumps(header).encode() + b"\n" + skeleton + values
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
    skeleton, scalars, num_chunks = ray.get(holder.get.remote(step, rank, CHUNK_BYTES))
    chunks = (ray.get(holder.get_chunk.remote(step, rank, i, CHUNK_BYTES)) for i in range(num_chunks))
    return join_state(skeleton, chunks, json.loads(scalars))
