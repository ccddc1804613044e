"""Megatron-LM's legacy per-rank checkpoint files: their names, what each holds, and reading them through Storage.

    <root>/                                   a local folder or any store's URL (s3://...)
      iter_0000050/
        mp_rank_00/model_optim_rng.pt         one file per tensor-parallel rank (no pipeline part in the name)
        mp_rank_00/distrib_optim.pt           its Adam moments (rlrunner.backends.megatron.moment_files)
        mp_rank_01/model_optim_rng.pt
        mp_rank_01/distrib_optim.pt
      latest_checkpointed_iteration.txt       "50", written last
      huggingface/                            the HF config and tokenizer (what the converters need)

Each `model_optim_rng.pt` holds what Megatron-LM's own `--ckpt-format torch` checkpoints hold
(`generate_state_dict` in megatron/training/checkpointing.py): `args` (an argparse.Namespace with the
model's dimensions, the padded vocabulary and the parallel sizes), `checkpoint_version` (3.0),
`iteration`, `model` (megatron-core key names, see rlrunner.backends.megatron.layout), `optimizer` and
`opt_param_scheduler` (left out for a model-only checkpoint) and `rng_state`.

`rng_state` has Megatron's shape: a list with one dict per data-parallel rank, each with
`random_rng_state`, `np_rng_state`, `torch_rng_state`, `cuda_rng_state` and `rng_tracker_states`
(rlrunner.backends.megatron.megatron_entries, which also shapes `optimizer` and `opt_param_scheduler` as
Megatron reads them). The one difference: numpy's MT19937 key is held as an int64 tensor instead of
a numpy array, so that loading needs no numpy classes (`np.random.set_state`, which Megatron calls,
accepts it as it is).

Files are read with `torch.load(weights_only=True)` allowing exactly `argparse.Namespace` besides
what weights_only always allows (tensors, containers, numbers, strings, torch dtypes); a file holding
any other class is refused (`check_loadable` finds such a value before a save). Writing the files is
rlrunner.backends.megatron.file_writes.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import tempfile
from typing import Any, Iterator, Mapping, Sequence

import torch

from rlrunner.backends.megatron.layout import (
    DEFAULT_VOCAB_DIVISIBLE_BY,
    DecoderDims,
    check_splittable,
    padded_vocab_size,
)
from rlrunner.backends.megatron.to_hf import MegatronShards, megatron_to_hf
from rlrunner.checkpoint.layout import ACTOR_DIR
from rlrunner.storage import Storage

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
ALLOWED_GLOBALS: tuple[type, ...] = (argparse.Namespace,)  # all a model_optim_rng.pt needs beyond weights_only's own

_RANK_DIR = re.compile(r"^mp_rank_(\d{2,})$")
_PLAIN = (str, int, float, bool, type(None), torch.dtype, torch.device, torch.Size)


def iteration_dir(iteration: int) -> str:
    """`iter_0000050`: Megatron's folder name for an iteration."""
    if iteration < 0:
        raise ValueError(f"an iteration is a non-negative integer, got {iteration}")
    return f"iter_{iteration:07d}"


def rank_dir(tp_rank: int) -> str:
    """`mp_rank_01`: Megatron's folder for a tensor-parallel rank when there is no pipeline parallelism."""
    return f"mp_rank_{tp_rank:02d}"


def rank_file(iteration: int, tp_rank: int) -> str:
    """`iter_0000050/mp_rank_01/model_optim_rng.pt`, relative to the checkpoint root."""
    return f"{iteration_dir(iteration)}/{rank_dir(tp_rank)}/{MODEL_FILE}"


def _rope_parameters(config: Any) -> Mapping[str, Any]:
    get = config.get if isinstance(config, Mapping) else (lambda key, default=None: getattr(config, key, default))
    parameters = get("rope_parameters") or get("rope_scaling") or {}
    return parameters if isinstance(parameters, Mapping) else {}


def _rope_type(config: Any) -> str:
    parameters = _rope_parameters(config)
    return str(parameters.get("rope_type") or parameters.get("type") or "default")


def _rope_theta(config: Any) -> int | float:
    get = config.get if isinstance(config, Mapping) else (lambda key, default=None: getattr(config, key, default))
    theta = float(_rope_parameters(config).get("rope_theta") or get("rope_theta") or 10000)
    return int(theta) if theta.is_integer() else theta  # Megatron's --rotary-base is an int


def megatron_args(
    config: Any,
    tp: int,
    dp: int = 1,
    divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
    dtype: torch.dtype | None = None,
    **extra: Any,
) -> argparse.Namespace:
    """The `args` of a checkpoint of this HF Qwen2 or Llama config split `tp` ways, named as Megatron-LM's arguments
    (what its `load_args_from_checkpoint` and `check_checkpoint_args` read); `extra` adds or overrides fields."""
    dims = DecoderDims.from_config(config)
    check_splittable(dims, tp)
    get = config.get if isinstance(config, Mapping) else (lambda key, default=None: getattr(config, key, default))
    dtype = dtype or torch.float32
    args = argparse.Namespace(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        ffn_hidden_size=dims.intermediate_size,
        num_attention_heads=dims.num_heads,
        group_query_attention=dims.num_kv_heads != dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        kv_channels=dims.head_dim,
        max_position_embeddings=int(get("max_position_embeddings") or 0),
        position_embedding_type="rope",
        add_position_embedding=False,
        use_rotary_position_embeddings=True,
        rotary_base=_rope_theta(config),
        rotary_percent=1.0,
        rotary_interleaved=False,
        # Llama 3.1's frequency scaling (Megatron-LM's --use-rope-scaling, --rope-scaling-factor)
        use_rope_scaling=_rope_type(config) == "llama3",
        rope_scaling_factor=float(_rope_parameters(config).get("factor") or 8.0),
        normalization="RMSNorm",
        norm_epsilon=float(get("rms_norm_eps") or 1e-6),
        apply_layernorm_1p=False,
        swiglu=True,
        squared_relu=False,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        untie_embeddings_and_output_weights=not dims.tie_word_embeddings,
        attention_dropout=float(get("attention_dropout") or 0.0),
        hidden_dropout=0.0,
        vocab_size=dims.vocab_size,
        padded_vocab_size=padded_vocab_size(dims.vocab_size, tp, divisible_by),
        make_vocab_size_divisible_by=divisible_by,
        tokenizer_type="HuggingFaceTokenizer",
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        data_parallel_size=dp,
        world_size=tp * dp,
        ckpt_format="torch",
        use_dist_ckpt=False,
        data_parallel_random_init=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
    )
    for key, value in extra.items():
        setattr(args, key, value)
    return args


# -- what a file holds -------------------------------------------------------------------------------


def check_loadable(obj: Any, where: str = "checkpoint") -> None:
    """TypeError naming the first value under `obj` that the weights_only reader with ALLOWED_GLOBALS would refuse,
    so that a save fails at once instead of the resume that reads it."""
    if isinstance(obj, torch.Tensor) or isinstance(obj, _PLAIN):
        return
    if isinstance(obj, argparse.Namespace):
        obj = vars(obj)
    if isinstance(obj, (dict, collections.OrderedDict)):
        for key, value in obj.items():
            plain_tuple = type(key) is tuple and all(isinstance(part, _PLAIN) for part in key)  # (dtype, dtype)
            if not isinstance(key, _PLAIN) and not plain_tuple:
                raise TypeError(f"{where}: a key of type {type(key).__name__} cannot be loaded with weights_only")
            check_loadable(value, f"{where}[{key!r}]")
        return
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        for index, value in enumerate(obj):
            check_loadable(value, f"{where}[{index}]")
        return
    raise TypeError(
        f"{where} holds a {type(obj).__module__}.{type(obj).__qualname__}, which weights_only loading refuses"
    )


def rank_state(
    iteration: int,
    model: Mapping[str, Any],
    args: argparse.Namespace,
    optimizer: Any = None,
    opt_param_scheduler: Any = None,
    rng_state: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The dict a `model_optim_rng.pt` holds, in Megatron's key names (optimizer parts left out when None)."""
    state: dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": int(iteration)}
    state["model"] = dict(model)
    # what Megatron-LM's own torch-format saves hold besides: no step to rerun, and the FLOPs it counts for its
    # throughput log (not counted here)
    state["rerun_state_machine"] = None
    state["num_floating_point_operations_so_far"] = 0
    if optimizer is not None:
        state["optimizer"] = optimizer
    if opt_param_scheduler is not None:
        state["opt_param_scheduler"] = opt_param_scheduler
    if rng_state is not None:
        state["rng_state"] = list(rng_state)
    return state


# -- reading -----------------------------------------------------------------------------------------


def load_file(source: Any, mmap: bool = False) -> dict[str, Any]:
    """torch.load(weights_only=True) of a path or binary stream, with exactly ALLOWED_GLOBALS added.

    An UnpicklingError (naming the class) for a file that holds anything else. Only the classes the process has not
    allowed itself are added for the call: the context removes what it added on exit, and megatron-core, imported,
    allows `argparse.Namespace` for good (its own loads would fail after ours)."""
    allowed = set(torch.serialization.get_safe_globals())
    with torch.serialization.safe_globals([cls for cls in ALLOWED_GLOBALS if cls not in allowed]):
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)


@contextlib.contextmanager
def _local_copy(storage: Storage, url: str) -> Iterator[str]:
    """A local path for `url`: itself on a local disk, else a downloaded temporary file (removed afterwards)."""
    if storage.is_local:
        from rlrunner.storage.local import local_path

        yield local_path(url)
        return
    handle, path = tempfile.mkstemp(prefix="rlrunner-megatron-", suffix=".pt")
    os.close(handle)
    try:
        storage.get_file(url, path)
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a memory map made from it stays valid


def read_torch_file(storage: Storage, url: str, mmap: bool) -> Any:
    """`load_file` of `url`: memory-mapped from a local path (a remote file downloaded first) with `mmap`, else read.

    A file torch.load cannot open (truncated, not a torch.save zip) is a ValueError naming it, in one line."""
    try:
        if mmap:
            with _local_copy(storage, url) as path:
                return load_file(path, mmap=True)
        with storage.open_read(url) as handle:
            return load_file(handle)
    except (RuntimeError, EOFError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{url} cannot be read (truncated or corrupt?): {reason}") from exc


def read_rank_file(storage: Storage, url: str, mmap: bool = False) -> dict[str, Any]:
    """One `model_optim_rng.pt` (a full URL), checked to be a Megatron checkpoint of version 3.0.

    With `mmap` the tensors are memory-mapped from a local file (a remote file is downloaded to a temporary
    file first), so they take page cache rather than process memory."""
    state = read_torch_file(storage, url, mmap)
    if not isinstance(state, dict) or "model" not in state or "args" not in state:
        raise ValueError(f"{url} is not a Megatron checkpoint file (no 'model' and 'args')")
    version = state.get("checkpoint_version")
    if version != CHECKPOINT_VERSION:
        raise ValueError(f"{url} has checkpoint_version {version!r}; this reader knows {CHECKPOINT_VERSION}")
    return state


def read_tracker(storage: Storage, root: str) -> int:
    """The iteration named by `root`/latest_checkpointed_iteration.txt."""
    url = storage.join(root, TRACKER_FILE)
    text = storage.read_bytes(url).decode("utf-8", "replace").strip()
    if not text.isdigit():
        raise ValueError(f"{url} holds {text[:40]!r}, not an iteration number")
    return int(text)


def rank_dirs(storage: Storage, root: str, iteration: int) -> list[str]:
    """The `mp_rank_XX` folder names of an iteration, checked to be 00..tp-1 with nothing else (no pipeline parts)."""
    folder = storage.join(root, iteration_dir(iteration))
    names = storage.list(folder, dirs_only=True)
    if not names:
        raise FileNotFoundError(f"no {iteration_dir(iteration)}/mp_rank_* folders under {root}")
    ranks = []
    for name in names:
        match = _RANK_DIR.match(name)
        if match is None:
            raise ValueError(
                f"{folder}/{name} is not an mp_rank_XX folder (pipeline parallel checkpoints are not read)"
            )
        ranks.append(int(match.group(1)))
    if sorted(ranks) != list(range(len(ranks))):
        raise ValueError(f"{folder} has tensor-parallel ranks {sorted(ranks)}, not 0..{len(ranks) - 1}")
    return [rank_dir(rank) for rank in range(len(ranks))]


def read_rank_states(
    storage: Storage, root: str, iteration: int | None = None, mmap: bool = False
) -> tuple[int, list[dict[str, Any]]]:
    """(iteration, every tensor-parallel rank's file content in rank order) of the iteration the tracker names
    (or `iteration`), checked against each file's own `iteration` and `args.tensor_model_parallel_size`."""
    if iteration is None:
        iteration = read_tracker(storage, root)
    tp = len(rank_dirs(storage, root, iteration))
    return iteration, [read_rank(storage, root, iteration, tp_rank, tp, mmap) for tp_rank in range(tp)]


def read_rank(storage: Storage, root: str, iteration: int, tp_rank: int, tp: int, mmap: bool = False) -> dict[str, Any]:
    """Tensor-parallel rank `tp_rank`'s file of `iteration` (of `tp` mp_rank folders), checked against its own
    `iteration` and `args.tensor_model_parallel_size`."""
    url = storage.join(root, rank_file(iteration, tp_rank))
    if not storage.exists(url):
        raise FileNotFoundError(f"{url} is missing")
    state = read_rank_file(storage, url, mmap=mmap)
    saved_tp = getattr(state["args"], "tensor_model_parallel_size", None)
    if saved_tp != tp:
        raise ValueError(f"{url} was saved with tensor_model_parallel_size={saved_tp} but {tp} mp_rank folders exist")
    if state.get("iteration") != iteration:
        raise ValueError(f"{url} holds iteration {state.get('iteration')}, its folder says {iteration}")
    return state


def read_hf_weights(storage: Storage, root: str, config: Any, mmap: bool = False) -> dict[str, torch.Tensor]:
    """The full HF state dict merged from every tensor-parallel rank of the iteration the tracker under `root` names."""
    _, states = read_rank_states(storage, root, mmap=mmap)
    return megatron_to_hf([state["model"] for state in states], config)


def read_hf_tensors(storage: Storage, root: str, config: Any) -> MegatronShards:
    """The HF tensors of the iteration the tracker under `root` names, read in slices from every tensor-parallel
    rank's memory-mapped file: a rank starting from this checkpoint reads only its own part."""
    _, states = read_rank_states(storage, root, mmap=True)
    return MegatronShards([state["model"] for state in states], config)


def find_root(storage: Storage, url: str) -> str:
    """The folder holding latest_checkpointed_iteration.txt: `url` itself, or its `actor/` (a global_step_N folder)."""
    for candidate in (url, storage.join(url, ACTOR_DIR)):
        if storage.exists(storage.join(candidate, TRACKER_FILE)):
            return candidate
    raise FileNotFoundError(f"no {TRACKER_FILE} in {url} or {storage.join(url, ACTOR_DIR)}")
