"""Building the policy model and its tokenizer from `model.*` config: a local HF folder or the tiny default."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from rlrunner.checkpoint.layout import ACTOR_HF_DIR, HF_DIR
from rlrunner.errors import ConfigError, describe
from rlrunner.models.hf_tensors import HFTensors, SafetensorsFolder, SeededInit, StateDict, tied_aliases
from rlrunner.models.tokenizer import build_char_tokenizer
from rlrunner.utils.heap import SMALL_MODEL_MMAP_THRESHOLD_BYTES, release_freed_memory

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


def hf_folder(path: str) -> Path:
    """Where the HF config and tokenizer of `model.path` are: the folder itself, or the `huggingface/` folder a training
    checkpoint keeps beside its weights (`<root>/huggingface`, or `actor/huggingface` of a global_step_N folder)."""
    folder = Path(path).expanduser()
    for candidate in (folder, folder / HF_DIR, folder / ACTOR_HF_DIR):
        if (candidate / "config.json").is_file():
            return candidate
    return folder


def check_model_folder(path: str, checkpoint: bool = False) -> None:
    """Raise ConfigError unless `path` is a local HF causal-LM folder with config, weights and tokenizer, or (with
    `checkpoint`: a training backend recognised its files) a training checkpoint or a converter's output with its
    `huggingface/` config and tokenizer."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ConfigError(f"model.path does not exist: {path}")
    if not folder.is_dir():
        raise ConfigError(f"model.path is not a directory: {path}")
    if checkpoint:
        folder = hf_folder(path)
        if not (folder / "config.json").is_file():
            raise ConfigError(
                f"model.path is a training checkpoint without {HF_DIR}/config.json (its HF config): {path}"
            )
    elif not (folder / "config.json").is_file():
        raise ConfigError(f"model.path is not a Hugging Face model folder (no config.json): {path}")
    if not checkpoint and not any(any(folder.glob(pattern)) for pattern in _WEIGHT_PATTERNS):
        raise ConfigError(f"model.path has no weights (*.safetensors or pytorch_model*.bin): {path}")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ConfigError(f"model.path has no tokenizer (tokenizer.json, tokenizer.model or vocab.json): {path}")
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(folder))
    except Exception as exc:  # transformers raises several types for unreadable configs
        raise ConfigError(f"model.path has an unreadable config.json ({describe(exc)}): {path}") from None
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
    from transformers import AutoConfig

    overrides = dict(model_cfg.get("override_config") or {})
    if model_cfg["path"] is None:
        settings = json.loads(TINY_CONFIG_PATH.read_text())
        settings.update(
            vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
        )
        settings.update(overrides)
        # the embedded model is a Qwen2; `+model.override_config.model_type=llama` makes it a Llama of the same shape
        config = AutoConfig.for_model(settings.pop("model_type", "qwen2"), **settings)
    else:
        config = AutoConfig.from_pretrained(str(hf_folder(model_cfg["path"])), **overrides)
    return config


def build_model(
    model_cfg: Mapping[str, Any],
    tokenizer,
    seed: int,
    dtype: str | None = None,
    read_weights: Callable[[Any], HFTensors] | None = None,
) -> torch.nn.Module:
    """The whole causal LM on CPU: the weights `read_weights(config)` reads (model.path is a training checkpoint),
    or pretrained weights from the `model.path` HF folder, or the random init seeded by `seed`.

    Every rank that calls this with the same arguments gets bit-identical weights. What a process that needs the
    whole model calls (a rollout worker, a converter); a training rank builds only its part (`initial_tensors`)."""
    from transformers import AutoModelForCausalLM

    config = build_hf_config(model_cfg, tokenizer)
    torch_type = torch_dtype(dtype or model_cfg["dtype"])
    attn = model_cfg["attn_implementation"]
    if read_weights is not None or model_cfg["path"] is None:
        model = meta_model(config, attn, torch_type)
        materialize(model, initial_tensors(model_cfg, config, seed, model, read_weights), config)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(Path(model_cfg["path"]).expanduser()), config=config, attn_implementation=attn, dtype=torch_type
        )
    model.config.use_cache = False
    return model


# A model whose float32 weights are at most this big is small: its whole state is less than a rank's fixed overhead
# (about 0.5 GiB), so what scales memory at real sizes need not be paid for it (rlrunner.backends.fsdp.worker's
# `resolve_unit`, `fit_heap_to`, `recomputes_activations`). 16M parameters; the default job's model has 0.3M.
SMALL_MODEL_BYTES = 64 * 2**20


def float32_bytes(model: torch.nn.Module) -> int:
    """The bytes of `model`'s parameters in float32 (a meta model's too)."""
    return sum(p.numel() for p in model.parameters()) * 4


def recomputes_activations(setting: bool | None, model_bytes: int) -> bool:
    """`actor.gradient_checkpointing` for a policy of `model_bytes` float32 bytes: the setting, or when it is null
    (auto) on unless the model is small. Recomputation trades a second forward for activation memory, which is worth
    it where activations are large; a small model's are not (about 80 bytes per token, layer and hidden unit in
    float32: 24 MB for the default job's micro-batch, at most a few GiB at the default token budget), and the default
    job would pay a sixth of its update for them. Either way the numbers are the same bit for bit."""
    return bool(setting) if setting is not None else model_bytes > SMALL_MODEL_BYTES


def fit_heap_to(model_bytes: int) -> None:
    """An actor rank's setup, with its policy's float32 bytes: a small model's rank leaves freed blocks under 4 MiB in
    glibc's heaps, where its activations are reused without page faults (rlrunner.utils.heap); larger ones keep the
    worker's 1 MiB."""
    if model_bytes <= SMALL_MODEL_BYTES:
        release_freed_memory(SMALL_MODEL_MMAP_THRESHOLD_BYTES)


def meta_model(config: Any, attn_implementation: str, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM of `config` on the meta device: its structure, names and shapes, and no storage."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    model.config.use_cache = False
    return model


def initial_tensors(
    model_cfg: Mapping[str, Any],
    config: Any,
    seed: int,
    model: torch.nn.Module,
    read_weights: Callable[[Any], HFTensors] | None = None,
) -> HFTensors:
    """Where the run's initial weights are read from, slice by slice: a training checkpoint's weights (what
    `read_weights` returns: its backend's `hf_tensors`), the `model.path` folder (safetensors slices, or
    memory-mapped `.bin` files), or the random init of `model` (a meta-device model is enough) seeded by `seed`."""
    if read_weights is not None:
        return read_weights(config)
    if model_cfg["path"] is None:
        return SeededInit(model, config, seed)
    folder = Path(model_cfg["path"]).expanduser()
    if any(folder.glob("*.safetensors")):
        return SafetensorsFolder(folder, config)
    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("pytorch_model*.bin")):
        state.update(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
    return StateDict(state, aliases=tied_aliases(config))


@torch.no_grad()
def materialize(model: torch.nn.Module, tensors: HFTensors, config: Any) -> None:
    """Give the meta-device `model` CPU storage and its weights from `tensors`, one parameter at a time."""
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives each module its own tensor: a tied output layer would come untied
    for name, param in model.named_parameters():
        param.copy_(tensors.read(name))
    restore_buffers(model, config, torch.device("cpu"))


def restore_buffers(model: torch.nn.Module, config: Any, device: torch.device) -> None:
    """Recompute the buffers `to_empty` left uninitialised: the rotary tables (a model's only buffers here), from a
    rotary module built again from `config`; NotImplementedError for any other buffer."""
    rotary = {name for name, module in model.named_modules() if type(module).__name__.endswith("RotaryEmbedding")}
    for name, module in model.named_modules():
        if name in rotary:
            fresh = type(module)(config=config)
            for key, buffer in module.named_buffers(recurse=False):
                module._buffers[key] = fresh.get_buffer(key).to(device=device, dtype=buffer.dtype)
        elif any(True for _ in module.named_buffers(recurse=False)):
            raise NotImplementedError(f"{name or 'the model'} has buffers a meta-device build cannot restore")


def random_model(config: Any, seed: int, attn_implementation: str, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM of `config` with the random init seeded by `seed` (`SeededInit`: the same weights a training
    rank builds its part of; no RNG is used)."""
    model = meta_model(config, attn_implementation, dtype)
    materialize(model, SeededInit(model, config, seed), config)
    return model


def warm_up_model_code(model_cfg: Mapping[str, Any]) -> None:
    """Pay the first-call costs of building and training the run's model (the lazy import of its architecture's code,
    the first use of its kernels) in a throwaway: a one-layer random model of the same architecture runs one forward
    and backward. What a warm spare does before it is needed; the caller's RNG is left as it was."""
    tokenizer = build_tokenizer(model_cfg)
    settings = build_hf_config(model_cfg, tokenizer).to_dict()
    settings.update(num_hidden_layers=1, layer_types=None)  # one layer is enough to run every code path once
    config = type(build_hf_config(model_cfg, tokenizer))(**settings)
    model = random_model(config, 0, model_cfg["attn_implementation"], torch.float32)
    input_ids = torch.zeros((1, 2), dtype=torch.long)
    model(input_ids=input_ids, use_cache=False).logits.float().mean().backward()
