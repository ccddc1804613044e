"""Offline conversion of an actor checkpoint: the model's weights alone, as a plain state dict or an HF folder.

Every backend's checkpoints are read, by the backend that wrote them (`TrainingBackend.read_hf_weights`): DCP
shards (FSDP: only the `model.*` entries are requested, so the optimizer's shards are never read) and Megatron
tensor-parallel files (merged through the HF layout, the vocabulary padding stripped). Peak memory is about the
size of the weights; no process group is needed. Checkpoints are read from a local folder or straight from any
store's URL (s3://, gs://, ...); the outputs are local.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

from rlrunner.backends.registry import BACKENDS, find_checkpoint
from rlrunner.checkpoint import layout
from rlrunner.storage import Storage, is_url, open_storage


def load_model_weights(
    url: str | os.PathLike, dtype: torch.dtype | None = None, storage_options: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) weights with HF key names, without the optimizer's state.

    `url` is a `global_step_N` folder, its `actor/` folder (or a converter's output), a local path or any store's URL.
    """
    return _model_weights(open_storage(url, storage_options), dtype)


def _model_weights(storage: Storage, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    found = find_checkpoint(storage, storage.url)
    if found is None:
        raise FileNotFoundError(
            f"no checkpoint of any backend ({', '.join(BACKENDS)}) in {storage.url} or its {layout.ACTOR_DIR}/ folder"
        )
    backend, root = found
    hf_url = storage.join(root, layout.HF_DIR)
    config = None
    if storage.exists(storage.join(hf_url, "config.json")):
        from transformers import AutoConfig

        with _local_folder(storage, hf_url) as local:
            config = AutoConfig.from_pretrained(local)
    state = backend.read_hf_weights(storage, root, config)
    return {key: tensor.to(dtype) for key, tensor in state.items()} if dtype is not None else state


@contextlib.contextmanager
def _local_folder(storage: Storage, url: str) -> Iterator[str]:
    """`url` itself on a local disk; elsewhere a temporary local copy of the files under it (small: config,
    tokenizer)."""
    if storage.is_local:
        yield url
        return
    with tempfile.TemporaryDirectory(prefix="rlrunner-hf-") as local:
        for name in storage.walk(url):
            target = os.path.join(local, *name.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            storage.get_file(storage.join(url, name), target)
        yield local


def export_hf(
    checkpoint_url: str | os.PathLike,
    output: str | os.PathLike,
    dtype: torch.dtype | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Path:
    """Write an HF folder (config, model.safetensors, tokenizer) that `AutoModelForCausalLM.from_pretrained` loads.

    `checkpoint_url` is a `global_step_N` folder, local or on any store; `output` is a local folder.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if is_url(os.fspath(output)):
        raise ValueError(f"the output must be a local folder, got {output} (upload the exported folder afterwards)")
    storage = open_storage(checkpoint_url, storage_options)
    hf_url = storage.join(storage.url, layout.ACTOR_HF_DIR)
    if not storage.exists(storage.join(hf_url, "config.json")):
        raise FileNotFoundError(
            f"{checkpoint_url} has no {layout.ACTOR_HF_DIR}/config.json: pass a global_step_N folder"
        )
    out = Path(output)
    with _local_folder(storage, hf_url) as hf_dir:
        config = AutoConfig.from_pretrained(hf_dir)
        state = _model_weights(storage, dtype)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(state, strict=True, assign=True)
        if config.tie_word_embeddings:
            model.tie_weights()
        model.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out)
    return out
