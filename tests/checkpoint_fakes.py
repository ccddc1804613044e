"""A small file-writing CheckpointManager and an experiment folder on local disk or S3 (moto): what the checkpoint
handler tests use to exercise the commit protocol without Ray (test_checkpoint_handler.py, test_checkpoint_retention.py,
test_checkpoint_units.py)."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from rlrunner.checkpoint.handler import CheckpointHandler
from rlrunner.checkpoint.status import COMPLETE, scan_checkpoints
from rlrunner.storage import Storage, open_storage

FINGERPRINT = {"model.config.hidden_size": 32, "actor.optim.lr": 0.001, "actor.optim.betas": [0.9, 0.99]}


class FileBackend:
    """A second CheckpointManager implementation: one torch file per rank. Shows the handler is backend-agnostic."""

    backend = "test-files"

    def __init__(self, world_size: int = 2, payload_bytes: int = 4096, storage: Storage | None = None):
        self.world_size = world_size
        self.payload_bytes = payload_bytes
        self.storage = storage
        self.loaded: list[dict] = []

    def start_save(self, url: str, step: int) -> None:
        storage = self.storage or open_storage(url)
        self.written = {}
        for rank in range(self.world_size):
            name = f"rank_{rank}.pt"
            buffer = io.BytesIO()
            torch.save(
                {"step": step, "rank": rank, "weights": torch.full((self.payload_bytes // 4,), float(step))}, buffer
            )
            with storage.open_write(storage.join(url, name)) as out:
                out.write(buffer.getvalue())
            self.written[name] = out.record().as_dict()

    def finish_save(self, wait: bool) -> dict[str, dict]:
        return self.written

    def load(self, url: str) -> None:
        storage = self.storage or open_storage(url)
        self.loaded = [
            torch.load(io.BytesIO(storage.read_bytes(storage.join(url, f"rank_{r}.pt"))), weights_only=True)
            for r in range(self.world_size)
        ]


class Store:
    """An experiment folder on one storage, with the file surgery the tests do (truncate, delete, a leftover)."""

    def __init__(self, storage: Storage, experiment: str):
        self.storage, self.experiment = storage, experiment

    def handler(
        self, interval: int = 2, keep: int | None = None, fingerprint=None, name: str | None = None
    ) -> CheckpointHandler:
        experiment = self.storage.join(self.experiment, name) if name else self.experiment
        return CheckpointHandler(self.storage, experiment, interval, keep, fingerprint or FINGERPRINT)

    def backend(self, **kwargs) -> FileBackend:
        return FileBackend(storage=self.storage, **kwargs)

    def url(self, handler: CheckpointHandler, *parts: str) -> str:
        return self.storage.join(handler.root, *parts)

    def read(self, url: str) -> bytes:
        return self.storage.read_bytes(url)

    def write(self, url: str, data: bytes) -> None:
        self.storage.write_bytes(url, data)

    def delete(self, url: str) -> None:
        self.storage.delete(url)

    def partial_folder(self, url: str) -> None:
        """A folder a killed save left: some bytes, no manifest (an empty folder does not exist on an object store)."""
        self.write(self.storage.join(url, "actor", "__0_0.distcp"), b"partial")


def make_handler(experiment: Path, interval: int = 2, keep: int | None = None, fingerprint=None) -> CheckpointHandler:
    """A handler on a local experiment folder (the local-only tests)."""
    storage = open_storage(str(experiment))
    return CheckpointHandler(storage, storage.url, interval, keep, fingerprint or FINGERPRINT)


def save_steps(handler: CheckpointHandler, steps, backend=None) -> None:
    backend = backend or FileBackend(storage=handler.storage)
    for step in steps:
        handler.save(step, backend, {"runner": {"global_step": step}})


def steps_of(handler: CheckpointHandler, checksums: bool = False, complete_only: bool = False) -> list[int]:
    return [
        s.step
        for s in scan_checkpoints(handler.storage, handler.root, checksums)
        if s.status == COMPLETE or not complete_only
    ]


class BackgroundBackend(FileBackend):
    """Writes nothing until told to: a save whose files are still being written in the background."""

    def __init__(self, storage=None):
        super().__init__(storage=storage)
        self.done = False

    def start_save(self, url, step):
        self.args = (url, step)

    def finish_save(self, wait):
        if not (self.done or wait):
            return None
        super().start_save(*self.args)
        return self.written
