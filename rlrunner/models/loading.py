"""Building the policy model and its tokenizer from `model.*` config: a local HF folder or the tiny default."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from rlrunner.errors import ConfigError
from rlrunner.models.tokenizer import build_char_tokenizer

TINY_CONFIG_PATH = Path(__file__).with_name("tiny_qwen2.json")
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # the vocabulary itself, not only its config


@dataclass(frozen=True)
class TokenIds:
    """The special token ids the runner needs: padding, and the ids that end a response."""

    pad: int
    eos: tuple[int, ...]


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def megatron_root(path: str) -> Path | None:
    """The folder holding a Megatron checkpoint's latest_checkpointed_iteration.txt (`path` itself, or its `actor/` for a
    global_step_N folder), or None when `path` is not a Megatron checkpoint."""
    from rlrunner.checkpoint.megatron_files import find_root
    from rlrunner.storage import open_storage

    folder = str(Path(path).expanduser())
    try:
        return Path(find_root(open_storage(folder), folder))
    except FileNotFoundError:
        return None


def hf_folder(path: str) -> Path:
    """Where the HF config and tokenizer of `model.path` are: the folder itself, or a Megatron checkpoint's `huggingface/`."""
    from rlrunner.checkpoint.megatron_files import HF_DIR

    root = megatron_root(path)
    return root / HF_DIR if root is not None else Path(path).expanduser()


def check_model_path(path: str) -> None:
    """Raise ConfigError unless `path` is a local HF causal-LM folder with config, weights and tokenizer, or a Megatron
    checkpoint (toolkits/ckpt_convertor/convert_hf_to_megatron.py's output, or a megatron backend's global_step_N)
    with its `huggingface/` config and tokenizer."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ConfigError(f"model.path does not exist: {path}")
    if not folder.is_dir():
        raise ConfigError(f"model.path is not a directory: {path}")
    megatron = megatron_root(path) is not None
    if megatron:
        folder = hf_folder(path)
        if not (folder / "config.json").is_file():
            raise ConfigError(f"model.path is a Megatron checkpoint without {folder.name}/config.json (its HF config): {path}")
    elif not (folder / "config.json").is_file():
        raise ConfigError(f"model.path is not a Hugging Face model folder (no config.json): {path}")
    if not megatron and not any(any(folder.glob(pattern)) for pattern in _WEIGHT_PATTERNS):
        raise ConfigError(f"model.path has no weights (*.safetensors or pytorch_model*.bin): {path}")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ConfigError(f"model.path has no tokenizer (tokenizer.json, tokenizer.model or vocab.json): {path}")
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(folder))
    except Exception as exc:  # transformers raises several types for unreadable configs
        raise ConfigError(f"model.path has an unreadable config.json ({type(exc).__name__}: {str(exc).splitlines()[0]}): {path}") from None
    if not getattr(config, "architectures", None) or not any("CausalLM" in a for a in config.architectures):
        raise ConfigError(f"model.path is not a causal language model (architectures={config.architectures}): {path}")


def build_tokenizer(model_cfg: Mapping[str, Any]):
    """The run's tokenizer: the model folder's, or the embedded character tokenizer."""
    if model_cfg["path"] is None:
        return build_char_tokenizer()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_folder(model_cfg["path"])))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def token_ids(model_cfg: Mapping[str, Any], tokenizer) -> TokenIds:
    """Pad id and stop ids: the tokenizer's eos plus any listed in the folder's generation_config.json."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if model_cfg["path"] is not None:
        generation_config = hf_folder(model_cfg["path"]) / "generation_config.json"
        if generation_config.is_file():
            listed = json.loads(generation_config.read_text()).get("eos_token_id")
            eos += listed if isinstance(listed, list) else [listed] if listed is not None else []
    if not eos:
        raise ConfigError("the tokenizer has no eos token: responses could never end")
    return TokenIds(pad=int(tokenizer.pad_token_id), eos=tuple(sorted(set(int(i) for i in eos))))


def build_hf_config(model_cfg: Mapping[str, Any], tokenizer):
    """The HF config of the policy, with `model.override_config` applied."""
    from transformers import AutoConfig, Qwen2Config

    overrides = dict(model_cfg.get("override_config") or {})
    if model_cfg["path"] is None:
        settings = json.loads(TINY_CONFIG_PATH.read_text())
        settings.update(
            vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
        )
        settings.update(overrides)
        config = Qwen2Config(**settings)
    else:
        config = AutoConfig.from_pretrained(str(hf_folder(model_cfg["path"])), **overrides)
    return config


def build_model(model_cfg: Mapping[str, Any], tokenizer, seed: int, dtype: str | None = None) -> torch.nn.Module:
    """The causal LM on CPU: pretrained weights from `model.path`, or a random init seeded by `seed`.

    Every rank that calls this with the same arguments gets bit-identical weights.
    """
    from transformers import AutoModelForCausalLM

    config = build_hf_config(model_cfg, tokenizer)
    torch_type = torch_dtype(dtype or model_cfg["dtype"])
    attn = model_cfg["attn_implementation"]
    root = megatron_root(model_cfg["path"]) if model_cfg["path"] is not None else None
    if model_cfg["path"] is None:
        with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch_type)
    elif root is not None:
        model = _from_megatron(root, config, attn, torch_type)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(Path(model_cfg["path"]).expanduser()), config=config, attn_implementation=attn, dtype=torch_type
        )
    model.config.use_cache = False
    return model


def _from_megatron(root: Path, config, attn: str, dtype: torch.dtype) -> torch.nn.Module:
    """The HF model with the weights merged from a Megatron checkpoint's tensor-parallel shards (any split)."""
    from transformers import AutoModelForCausalLM

    from rlrunner.checkpoint.megatron_files import read_hf_weights
    from rlrunner.storage import open_storage

    state = read_hf_weights(open_storage(str(root)), str(root), config, mmap=True)
    with torch.random.fork_rng(devices=[]):  # the init is overwritten; it must not move the caller's RNG
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model
