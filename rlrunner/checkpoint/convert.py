"""Offline conversion of an actor checkpoint: the model's weights alone, as a plain state dict or an HF folder.

Both backends' checkpoints are read: DCP shards (FSDP) and Megatron tensor-parallel files (merged through the
HF layout, the vocabulary padding stripped).

Only the `model.*` entries are requested from DCP, so the optimizer's shards are never read into
memory: peak memory is about the size of the weights. No process group is needed. Checkpoints are
read from a local folder or straight from any store's URL (s3://, gs://, ...); the outputs are local.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from rlrunner.checkpoint import layout
from rlrunner.checkpoint.megatron_files import HF_DIR, find_root, read_hf_weights
from rlrunner.checkpoint.safe_dcp import METADATA_FILE, SafeFileSystemReader, SafeLoadPlanner
from rlrunner.storage import Storage, is_url, open_storage

MODEL_PREFIX = "model."


def find_dcp_dir(url: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> str:
    """Accept a DCP folder itself, or a `global_step_N` folder holding one under `actor/`; its URL (or absolute path)."""
    return _find_dcp_dir(open_storage(url, storage_options))


def _find_dcp_dir(storage: Storage) -> str:
    for candidate in (storage.url, storage.join(storage.url, layout.ACTOR_DIR)):
        if storage.exists(storage.join(candidate, METADATA_FILE)):
            return candidate
    raise FileNotFoundError(f"no DCP checkpoint (.metadata) in {storage.url} or {storage.join(storage.url, layout.ACTOR_DIR)}")


def load_model_weights(
    url: str | os.PathLike, dtype: torch.dtype | None = None, storage_options: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) weights with HF key names, read from a DCP folder without its optimizer.

    `url` is a DCP folder or a `global_step_N` folder, a local path or any store's URL.
    """
    return _model_weights(open_storage(url, storage_options), dtype)


def _model_weights(storage: Storage, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    megatron_root = _find_megatron_root(storage)
    if megatron_root is not None:
        return _megatron_weights(storage, megatron_root, dtype)
    folder = _find_dcp_dir(storage)
    reader = SafeFileSystemReader(folder, storage=storage)  # one connection for the metadata and the shards
    weights: dict[str, torch.Tensor] = {}
    for key, item in reader.read_metadata().state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata):
            weights[key] = torch.empty(item.size, dtype=item.properties.dtype)
    if not weights:
        raise ValueError(f"{folder} holds no model weights (no '{MODEL_PREFIX}*' tensors)")
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(weights, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    state = {key[len(MODEL_PREFIX):]: tensor for key, tensor in weights.items()}
    if dtype is not None:
        state = {key: tensor.to(dtype) for key, tensor in state.items()}
    return state


def _find_megatron_root(storage: Storage) -> str | None:
    """The folder holding a Megatron backend's tracker (the URL itself or its `actor/`), or None for a DCP checkpoint."""
    try:
        return find_root(storage, storage.url)
    except FileNotFoundError:
        return None


def _megatron_weights(storage: Storage, root: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The HF weights merged from the tensor-parallel shards of the iteration the tracker names."""
    with _local_folder(storage, storage.join(root, HF_DIR)) as local:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(local)
    state = read_hf_weights(storage, root, config)
    return {key: tensor.to(dtype) for key, tensor in state.items()} if dtype is not None else state


@contextlib.contextmanager
def _local_folder(storage: Storage, url: str) -> Iterator[str]:
    """`url` itself on a local disk; elsewhere a temporary local copy of the files under it (small: config, tokenizer)."""
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
    hf_url = storage.join(storage.url, layout.HF_DIR)
    if not storage.exists(storage.join(hf_url, "config.json")):
        raise FileNotFoundError(f"{checkpoint_url} has no {layout.HF_DIR}/config.json: pass a global_step_N folder")
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
