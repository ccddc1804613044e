#!/usr/bin/env python
"""Split a Hugging Face Qwen2 or Llama folder into Megatron-LM tensor-parallel shards (model only, iteration 0).

    python toolkits/ckpt_convertor/convert_hf_to_megatron.py --hf_path HF_DIR --output_path OUT \\
        --tensor_model_parallel_size K

OUT (a local folder or any store's URL, s3://...) receives

    iter_0000000/mp_rank_00/model_optim_rng.pt ... mp_rank_<K-1>/model_optim_rng.pt
    latest_checkpointed_iteration.txt          (0; written after the shards)
    huggingface/                               the HF config, tokenizer and generation config (no weights)

so that convert_megatron_to_hf.py needs nothing else. The vocabulary is padded as Megatron pads it
(to a multiple of --make_vocab_size_divisible_by x K). Peak memory: the HF weights plus one rank's shard.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from rlrunner.backends.megatron.file_writes import write_model_checkpoint  # noqa: E402
from rlrunner.backends.megatron.files import TRACKER_FILE  # noqa: E402
from rlrunner.backends.megatron.layout import DEFAULT_VOCAB_DIVISIBLE_BY, DecoderDims, check_splittable  # noqa: E402
from rlrunner.checkpoint.layout import HF_DIR  # noqa: E402
from rlrunner.errors import ConfigError  # noqa: E402
from rlrunner.models.loading import check_model_folder  # noqa: E402
from rlrunner.storage import Storage, add_storage_options_argument, open_storage  # noqa: E402

# Files of an HF folder that are weights (or their indexes), not copied beside the shards.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder's weight files: *.safetensors, else pytorch_model*.bin (weights_only)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        for path in files:
            with safe_open(str(path), framework="pt") as reader:
                for key in reader.keys():
                    state[key] = reader.get_tensor(key)
        return state
    for path in sorted(folder.glob("pytorch_model*.bin")):
        state.update(torch.load(path, map_location="cpu", weights_only=True))
    if not state:
        raise ConfigError(f"{folder} has no weights (*.safetensors or pytorch_model*.bin)")
    return state


def copy_hf_files(folder: Path, storage: Storage, target: str) -> list[str]:
    """Copy the folder's top-level files other than weights (config, tokenizer, generation config) to `target`."""
    copied = []
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.name.startswith(".") and not path.name.endswith(WEIGHT_SUFFIXES):
            storage.put_file(str(path), storage.join(target, path.name))
            copied.append(path.name)
    return copied


def convert(
    hf_path: str,
    output: str,
    tp: int,
    divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
    storage_options: dict | None = None,
) -> dict:
    """Write the Megatron shards of `hf_path` under `output`; {relative file: size and CRC-32}."""
    from transformers import AutoConfig

    check_model_folder(hf_path)
    folder = Path(hf_path).expanduser()
    config = AutoConfig.from_pretrained(str(folder))
    check_splittable(DecoderDims.from_config(config), tp)  # before reading any weights
    storage = open_storage(output, storage_options)
    if storage.exists(storage.join(storage.url, TRACKER_FILE)):
        raise ConfigError(f"{storage.url} already holds a Megatron checkpoint ({TRACKER_FILE}): choose an empty folder")
    state = read_hf_weights(folder)
    # The HF files go first: the tracker, written last by write_model_checkpoint, marks the whole folder complete.
    copy_hf_files(folder, storage, storage.join(storage.url, HF_DIR))
    records = write_model_checkpoint(storage, storage.url, state, config, tp, iteration=0, divisible_by=divisible_by)
    return {name: record.as_dict() for name, record in records.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--hf_path", required=True, help="a local Hugging Face Qwen2 folder (config, weights, tokenizer)"
    )
    parser.add_argument("--output_path", required=True, help="folder to write: a local path or a URL (s3://...)")
    parser.add_argument("--tensor_model_parallel_size", type=int, required=True, help="number of tensor-parallel ranks")
    parser.add_argument(
        "--make_vocab_size_divisible_by",
        type=int,
        default=DEFAULT_VOCAB_DIVISIBLE_BY,
        help="pad the vocabulary to a multiple of this times the tensor-parallel size (Megatron's)",
    )
    add_storage_options_argument(parser)
    args = parser.parse_args(argv)
    options = args.storage_options
    try:
        records = convert(
            args.hf_path, args.output_path, args.tensor_model_parallel_size, args.make_vocab_size_divisible_by, options
        )
    except (ConfigError, OSError, ValueError, pickle.UnpicklingError) as exc:
        print(f"convert_hf_to_megatron: error: {exc}", file=sys.stderr)
        return 2
    size = sum(record["size"] for record in records.values())
    print(f"wrote {len(records) - 1} tensor-parallel shard(s), {size / 2**20:.1f} MiB, to {args.output_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
