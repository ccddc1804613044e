"""The training backends by name (`actor.training_backend`): a new backend is one package and one line here."""

from __future__ import annotations

import functools
from typing import Any, Callable

from rlrunner.backends.base import TrainingBackend
from rlrunner.backends.fsdp import FSDPBackend
from rlrunner.backends.megatron import MegatronBackend
from rlrunner.errors import ConfigError
from rlrunner.models.hf_tensors import HFTensors
from rlrunner.storage import Storage, open_storage

BACKENDS: dict[str, TrainingBackend] = {backend.name: backend for backend in (FSDPBackend(), MegatronBackend())}


def get_backend(name: str) -> TrainingBackend:
    """The backend called `name`, or a ConfigError naming the choices."""
    backend = BACKENDS.get(name)
    if backend is None:
        raise ConfigError(f"actor.training_backend must be one of {', '.join(BACKENDS)}, got '{name}'")
    return backend


def find_checkpoint(storage: Storage, url: str) -> tuple[TrainingBackend, str] | None:
    """(the backend that wrote it, the folder of its actor files) for a checkpoint at `url`, or None."""
    for backend in BACKENDS.values():
        root = backend.find_checkpoint(storage, url)
        if root is not None:
            return backend, root
    return None


def checkpoint_weights_reader(storage: Storage, url: str) -> Callable[[Any], HFTensors] | None:
    """For `model.path` (any backend starts from any backend's checkpoint): a picklable function from the HF config to
    the checkpoint's HF tensors (`TrainingBackend.hf_tensors`: read in slices), or None when `url` is not a
    checkpoint."""
    found = find_checkpoint(storage, url)
    if found is None:
        return None
    backend, root = found
    return functools.partial(backend.hf_tensors, storage, root)


def check_model_path(path: str) -> None:
    """ConfigError (one line) unless `model.path` is a usable HF folder, or any backend's checkpoint with its
    `huggingface/` config and tokenizer (any backend starts from any backend's checkpoint)."""
    from rlrunner.models.loading import check_model_folder  # transformers: only when a model path is checked

    storage = open_storage(str(path))
    check_model_folder(path, checkpoint=find_checkpoint(storage, storage.url) is not None)
