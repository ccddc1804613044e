"""Offline conversion of a DCP actor checkpoint: the model's weights alone, as a plain state dict or an HF folder.

Only the `model.*` entries are requested from DCP, so the optimizer's shards are never read into
memory: peak memory is about the size of the weights. No process group is needed.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from rlrunner.checkpoint import layout
from rlrunner.checkpoint.safe_dcp import METADATA_FILE, SafeFileSystemReader, SafeLoadPlanner, read_metadata

MODEL_PREFIX = "model."


def find_dcp_dir(path: str | Path) -> Path:
    """Accept a DCP folder itself, or a `global_step_N` folder holding one under `actor/`."""
    folder = Path(path).expanduser().resolve()
    for candidate in (folder, folder / layout.ACTOR_DIR):
        if (candidate / METADATA_FILE).is_file():
            return candidate
    raise FileNotFoundError(f"no DCP checkpoint (.metadata) in {path} or {Path(path) / layout.ACTOR_DIR}")


def load_model_weights(dcp_path: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) weights with HF key names, read from a DCP folder without its optimizer."""
    folder = find_dcp_dir(dcp_path)
    metadata = read_metadata(folder)
    weights: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata):
            weights[key] = torch.empty(item.size, dtype=item.properties.dtype)
    if not weights:
        raise ValueError(f"{folder} holds no model weights (no '{MODEL_PREFIX}*' tensors)")
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(weights, storage_reader=SafeFileSystemReader(str(folder)), planner=SafeLoadPlanner(), no_dist=True)
    state = {key[len(MODEL_PREFIX):]: tensor for key, tensor in weights.items()}
    if dtype is not None:
        state = {key: tensor.to(dtype) for key, tensor in state.items()}
    return state


def export_hf(checkpoint: str | Path, output: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write an HF folder (config, model.safetensors, tokenizer) that `AutoModelForCausalLM.from_pretrained` loads."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = Path(checkpoint).expanduser().resolve()
    hf_dir = folder / layout.HF_DIR
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no {layout.HF_DIR}/config.json: pass a global_step_N folder")
    config = AutoConfig.from_pretrained(hf_dir)
    state = load_model_weights(folder, dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    out = Path(output)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out)
    return out
