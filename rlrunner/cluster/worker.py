"""The base of every worker class a WorkerGroup runs: its rank, its thread budget, torch.distributed set-up."""

from __future__ import annotations

import gc
import os
import socket
from datetime import timedelta

from rlrunner.cluster.node import node_id, node_ip
from rlrunner.cluster.shared_storage import answer_probe_at
from rlrunner.utils.heap import release_freed_memory

_FRESH_RNG: object = None  # torch's CPU generator as this process started: what a reused worker starts from again


class Worker:
    """Plain Python class (no Ray imports), so a worker can also be built and tested in-process."""

    def __init__(self, rank: int, world_size: int, threads: int = 1, use_gpu: bool = False):
        import torch

        global _FRESH_RNG
        if _FRESH_RNG is None:
            _FRESH_RNG = torch.get_rng_state()
        release_freed_memory()  # a worker's peak memory is its state, not blocks freed long ago
        self.rank = rank
        self.world_size = world_size
        # A fixed thread count keeps float reductions in the same order run after run.
        torch.set_num_threads(threads)
        self.device = torch.device("cuda" if use_gpu and torch.cuda.is_available() else "cpu")

    def adopt(self, rank: int, world_size: int) -> None:
        """A warm spare (built with no rank) becomes rank `rank` of a group of `world_size`, before anything else."""
        self.rank = rank
        self.world_size = world_size

    def warm_up(self) -> dict:
        """A warm spare's preparation, before it is needed (first-call costs its rank would otherwise pay at once);
        nothing by default. Returns `ping()`: the spare is up once this returns."""
        return self.ping()

    def close(self) -> None:
        """Free what this worker holds before its process is killed or kept for another run (called by
        `WorkerGroup.shutdown` and `release` on a graceful end; never after a failure, when it may not answer). Nothing
        by default."""

    def release(self) -> None:
        """A finished run's worker kept for the next run of the same driver (`WorkerGroup.finish`): free everything it
        holds (`close`, the process group, every attribute), keeping only the process and its imports."""
        self.close()
        self.leave_process_group()
        self.__dict__.clear()
        self.rank, self.world_size = -1, 0  # what `ping` tells while parked
        gc.collect()
        release_freed_memory()

    def reinit(self, rank: int, world_size: int, **kwargs) -> dict:
        """A released worker built again for a new run, as a new process would be (the same constructor, torch's
        generator back at its start state); returns `ping()`."""
        import torch

        self.__dict__.clear()
        torch.set_rng_state(_FRESH_RNG)
        type(self).__init__(self, rank=rank, world_size=world_size, **kwargs)
        return self.ping()

    def ping(self) -> dict:
        """Where this worker runs: used for placement checks and logs."""
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node_ip": node_ip(),
            "node_id": node_id(),
        }

    def probe_storage(self, storage_url: str, storage_options: dict, url: str, token: str) -> str | None:
        """Read the driver's probe under `url` and leave this worker's own (see `check_shared_folder`)."""
        return answer_probe_at(storage_url, storage_options, url, token, node_ip())

    def free_address(self) -> tuple[str, int]:
        """An address and free port on this worker's node for the process-group rendezvous."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return node_ip(), sock.getsockname()[1]

    def init_process_group(self, host: str, port: int, timeout_s: float) -> None:
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.dist_timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )

    def leave_process_group(self) -> None:
        """A survivor of a lost peer: drop the process group (and every group made from it), so that the group can be
        formed again with the peer's replacement (`init_process_group` once more)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
