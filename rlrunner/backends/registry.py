"""The training backends by name (`actor.training_backend`): a new backend is one package and one line here.

Each entry is "module:class" (`rlrunner/utils/registry.py`), the `TrainingBackend` subclass, imported and made once
when first asked for; a backend's class imports its heavy parts (worker, model, files) only inside the methods that
need them.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

from rlrunner.backends.base import TrainingBackend
from rlrunner.storage import Storage, open_storage
from rlrunner.utils.registry import load_entry

if TYPE_CHECKING:  # a type only: checking a config imports no torch
    from rlrunner.models.hf_tensors import HFTensors

BACKENDS: dict[str, str] = {
    "fsdp": "rlrunner.backends.fsdp:FSDPBackend",
    "megatron": "rlrunner.backends.megatron:MegatronBackend",
}


@functools.cache
def get_backend(name: str) -> TrainingBackend:
    """The backend called `name` (one instance per process), or a ConfigError naming `actor.training_backend`'s
    choices."""
    return load_entry(BACKENDS, name, "actor.training_backend")()


def find_checkpoint(storage: Storage, url: str) -> tuple[TrainingBackend, str] | None:
    """(the backend that wrote it, the folder of its actor files) for a checkpoint at `url`, or None."""
    for backend in map(get_backend, BACKENDS):
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
