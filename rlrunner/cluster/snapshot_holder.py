"""A snapshot holder: one process per node keeping actor ranks' in-memory snapshot parts in its host memory.

The driver runs one `SnapshotHolder` as a Ray actor on each node (`rlrunner.runner.snapshots`). Each actor rank streams
its part of a step's snapshot (its parameters, optimizer state, LR schedule and RNG: a skeleton, then the tensors' raw
bytes; `rlrunner.backends.snapshot_stream`) to a holder on another node than the rank's own where the cluster has one,
so that losing the rank's process or node leaves the part alive; the driver's state of that step (data position,
step) goes beside rank 0's part. A part counts as held once its last byte is in.

The parts come over a TCP connection of their own (`address`), not through Ray's object store: the rank sends its
tensors' bytes straight from their memory, and the holder reads them straight into the part's one buffer, so neither
process copies them on the way (through the object store each would: every byte in it stays in the sender's resident
set). The connection must first give the holder's token, which only a Ray call (`address`) hands out. A part is
refused, with the reason, where keeping it would leave the node less than `reserve_bytes` of free memory.

Wire format, per part: a JSON line {"token", "step", "rank", "skeleton_bytes", "scalars_bytes", "total_bytes"}, the
skeleton and the scalars (a JSON list); the holder answers a line (empty: go on; else why not, and it closes the
connection), then reads `total_bytes` of tensor bytes and answers a last line (empty: held). A rank sends its next parts
over the same connection (the holder waits for them), so a snapshot costs it no new connection and the holder no new
thread.

Plain Python without torch or Ray imports: a holder starts in a fraction of a second and holds bytes only.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
from typing import Any, BinaryIO

from rlrunner.cluster.node import available_memory_bytes, node_ip

RECEIVE_TIMEOUT_S = 300.0  # a sender silent this long is given up (its part is not held)


def read_exactly(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise ConnectionError(f"the connection closed after {len(data)} of {size} bytes")
    return data


class SnapshotHolder:
    def __init__(self, reserve_bytes: int):
        self.reserve_bytes = reserve_bytes
        # (step, rank) -> (skeleton, scalars, tensor bytes)
        self.parts: dict[tuple[int, int], tuple[bytes, bytes, bytearray]] = {}
        self.driver_states: dict[int, Any] = {}  # step -> the driver's state of that step
        self._lock = threading.Lock()  # the parts are added by the connections' threads
        self._spares: dict[int, list[bytearray]] = {}  # size -> buffers of dropped parts, for the next parts
        self._listener: socket.socket | None = None
        self._token = secrets.token_hex(16)

    def ping(self) -> int:
        return os.getpid()

    # -- receiving -------------------------------------------------------------------------------

    def address(self) -> tuple[str, int, str]:
        """Where ranks send their parts, and the token they must give: (host, port, token). Starts listening on the
        first call."""
        if self._listener is None:
            listener = socket.create_server(("", 0))
            self._listener = listener
            threading.Thread(target=self._accept, args=(listener,), name="snapshot-holder", daemon=True).start()
        return node_ip(), self._listener.getsockname()[1], self._token

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._receive, args=(connection,), daemon=True).start()

    def _receive(self, connection: socket.socket) -> None:
        """One rank's parts over `connection`, one after another (the rank keeps its connection from one snapshot to
        the next): each kept once every byte is in; nothing is kept from a broken one, and the connection then ends."""
        with connection:
            try:
                stream = connection.makefile("rb")
                while True:
                    connection.settimeout(None)  # the rank's next part comes with its next snapshot
                    line = stream.readline(4096)
                    if not line:
                        return  # the rank closed its connection (or its process ended)
                    connection.settimeout(RECEIVE_TIMEOUT_S)
                    if not self._receive_part(connection, stream, json.loads(line)):
                        return
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return  # the sender died or sent garbage: its part is not held, and it learns so (if alive)

    def _receive_part(self, connection: socket.socket, stream: BinaryIO, header: dict[str, Any]) -> bool:
        """The part whose `header` was read; False where the connection must end (a wrong token, a refusal)."""
        if not secrets.compare_digest(str(header.get("token")), self._token):
            return False  # not a rank of this run: not a byte more is read
        step, rank, total = int(header["step"]), int(header["rank"]), int(header["total_bytes"])
        skeleton = read_exactly(stream, int(header["skeleton_bytes"]))
        scalars = read_exactly(stream, int(header["scalars_bytes"]))
        data = self._reused_buffer(total)
        refused = None if data is not None else self._refusal(total)
        connection.sendall((refused or "").encode() + b"\n")
        if refused:
            return False
        data = data if data is not None else bytearray(total)
        view, filled = memoryview(data), 0
        while filled < total:
            got = stream.readinto(view[filled:])
            if not got:
                raise ConnectionError(f"the connection closed after {filled} of {total} bytes")
            filled += got
        with self._lock:
            self.parts[(step, rank)] = (skeleton, scalars, data)
        connection.sendall(b"\n")
        return True

    def _reused_buffer(self, size: int) -> bytearray | None:
        """A dropped part's buffer of `size` bytes, if one is kept: a rank's part has the same size every step, and
        writing into memory already touched is about twice as fast as into new pages."""
        with self._lock:
            spares = self._spares.get(size)
            return spares.pop() if spares else None

    def _refusal(self, total_bytes: int) -> str | None:
        available = available_memory_bytes()
        if available - total_bytes < self.reserve_bytes:
            return (
                f"a {total_bytes / 2**20:.0f} MiB part would leave {max(available - total_bytes, 0) / 2**30:.1f} GiB "
                f"of host memory free on the holder's node, below the {self.reserve_bytes / 2**30:g} GiB reserve "
                "(runner.snapshot.reserve_memory_gb)"
            )
        return None

    def put_driver_state(self, step: int, driver_state: Any) -> None:
        self.driver_states[step] = driver_state

    # -- what is held ----------------------------------------------------------------------------

    def held(self) -> dict[int, list[int]]:
        """{step: the ranks whose whole parts of that step are held here}."""
        steps: dict[int, list[int]] = {}
        with self._lock:
            keys = list(self.parts)
        for step, rank in keys:
            steps.setdefault(step, []).append(rank)
        return {step: sorted(ranks) for step, ranks in steps.items()}

    def get(self, step: int, rank: int, chunk_bytes: int) -> tuple[bytes, bytes, int]:
        """A held part's skeleton, its scalars, and how many chunks of `chunk_bytes` its tensor bytes are read in
        (`get_chunk`)."""
        skeleton, scalars, data = self.parts[(step, rank)]
        return skeleton, scalars, -(-len(data) // chunk_bytes)

    def get_chunk(self, step: int, rank: int, index: int, chunk_bytes: int) -> bytes:
        data = self.parts[(step, rank)][2]
        return bytes(memoryview(data)[index * chunk_bytes : (index + 1) * chunk_bytes])

    def get_driver_state(self, step: int) -> Any:
        return self.driver_states[step]

    def drop_before(self, step: int) -> None:
        """Drop every part of a step older than `step` (once `step`'s snapshot is complete); their buffers are kept for
        the next step's parts (so a holder keeps two snapshots' memory, as it does while one arrives)."""
        with self._lock:
            self._spares = {}  # buffers no part took since the last drop are freed: at most one snapshot's are kept
            for key in [key for key in self.parts if key[0] < step]:
                data = self.parts.pop(key)[2]
                self._spares.setdefault(len(data), []).append(data)  # for the same rank's next part
        self.driver_states = {s: state for s, state in self.driver_states.items() if s >= step}

    def reset(self, reserve_bytes: int) -> int:
        """Hold nothing, with `reserve_bytes` as the reserve: a holder kept for the driver's next run
        (`SnapshotStore.close`); it goes on listening where it did. Returns `ping()`."""
        with self._lock:
            self.parts, self._spares = {}, {}
        self.driver_states = {}
        self.reserve_bytes = reserve_bytes
        return self.ping()
