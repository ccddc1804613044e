#!/usr/bin/env python
"""Merge a Megatron-LM tensor-parallel checkpoint into a Hugging Face folder (config, model.safetensors, tokenizer).

    python toolkits/ckpt_convertor/convert_megatron_to_hf.py --ckpt_path CKPT --output_path OUT_DIR

CKPT is the folder holding latest_checkpointed_iteration.txt, or a `global_step_N` folder whose
`actor/` holds it, on a local disk or any store (s3://...). The iteration the tracker names is read
(its `mp_rank_XX/model_optim_rng.pt` files, with torch.load(weights_only=True), or, in megatron-core's
`torch_dist` format, its DCP files, each tensor read whole); the HF config and
tokenizer come from the `huggingface/` folder beside it. The vocabulary padding is stripped.
OUT_DIR is a local folder: `AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads it.

Peak memory is about the size of the weights: the shards are memory-mapped (downloaded to a temporary
file first when remote), and each HF tensor is merged, written into model.safetensors and dropped in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from rlrunner.backends.megatron.dist_ckpt import is_torch_dist, read_model_shard  # noqa: E402
from rlrunner.backends.megatron.files import find_root, read_rank_states, read_tracker  # noqa: E402
from rlrunner.backends.megatron.to_hf import iter_megatron_to_hf  # noqa: E402
from rlrunner.checkpoint.layout import HF_DIR  # noqa: E402
from rlrunner.errors import ConfigError  # noqa: E402
from rlrunner.storage import FileRecord, Storage, add_storage_options_argument, is_url, open_storage  # noqa: E402

WEIGHTS_FILE = "model.safetensors"
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(
    storage: Storage,
    url: str,
    layout: Sequence[tuple[str, torch.Tensor]],
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> FileRecord:
    """Stream tensors into a safetensors file (format "pt"), one at a time.

    `layout` gives the names, dtypes and shapes in file order (meta tensors will do); `tensors` yields the real
    ones in that order (default: `layout` itself). safetensors' own save_file would copy every tensor to bytes
    first: here only the tensor being written is held."""
    if sys.byteorder != "little":
        raise OSError("safetensors files are little-endian; this machine is not")
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in layout:
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name} has dtype {tensor.dtype}, which this writer does not store")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    stream = iter(layout if tensors is None else tensors)
    with storage.open_write(url) as writer:  # on any error below, no file appears
        writer.write(struct.pack("<Q", len(encoded)))
        writer.write(encoded)
        for name, planned in layout:
            got, tensor = next(stream, (None, None))
            if got != name or tensor.dtype != planned.dtype or tensor.shape != planned.shape:
                raise ValueError(f"expected {name} {planned.dtype} {tuple(planned.shape)} next, got {got}")
            flat = tensor.detach().contiguous().reshape(-1)
            if flat.numel():
                writer.write(flat.view(torch.uint8).numpy())  # a view of the tensor's bytes, no copy
            del tensor, flat
        if next(stream, None) is not None:
            raise ValueError("more tensors than the layout lists")
    return writer.record()


def _copy_hf_dir(storage: Storage, hf_url: str, target: Path) -> list[str]:
    """Copy the files of the checkpoint's huggingface/ folder (config, tokenizer) into the local `target`."""
    names = list(storage.walk(hf_url))
    for name in names:
        path = target.joinpath(*name.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        storage.get_file(storage.join(hf_url, name), str(path))
    return names


def convert(ckpt_path: str, output: str, storage_options: dict | None = None) -> Path:
    """Write the HF folder of the Megatron checkpoint at `ckpt_path` into the local folder `output`."""
    from transformers import AutoConfig

    if is_url(os.fspath(output)):
        raise ValueError(f"the output must be a local folder, got {output} (upload the exported folder afterwards)")
    storage = open_storage(ckpt_path, storage_options)
    root = find_root(storage, storage.url)
    hf_url = storage.join(root, HF_DIR)
    if not storage.exists(storage.join(hf_url, "config.json")):
        raise FileNotFoundError(f"{root} has no {HF_DIR}/config.json: the HF config must sit beside the shards")
    out = Path(output).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(
            f"{out} exists and is not an empty folder (stale weight files would mix with the new ones)"
        )
    # The config is read from a scratch copy, and only copied to `out` once the shards have merged.
    with tempfile.TemporaryDirectory(prefix="rlrunner-hf-config-") as scratch:
        _copy_hf_dir(storage, hf_url, Path(scratch))
        config = AutoConfig.from_pretrained(scratch)
        iteration = read_tracker(storage, root)
        if is_torch_dist(storage, root, iteration):  # megatron-core's distributed format: the model read whole
            shards = [read_model_shard(storage, root, iteration, config)]
        else:
            _, states = read_rank_states(storage, root, mmap=True)
            shards = [state.pop("model") for state in states]
            del states  # the optimizer and RNG are never needed here
        # The file's layout from a dry run on meta tensors (checks the shards too), then the real tensors one by one.
        layout = list(iter_megatron_to_hf([_meta(shard) for shard in shards], config))
        out.mkdir(parents=True, exist_ok=True)
        shutil.copytree(scratch, out, dirs_exist_ok=True)
    write_safetensors(
        open_storage(str(out)), str(out / WEIGHTS_FILE), layout, iter_megatron_to_hf(shards, config, consume=True)
    )
    return out


def _meta(shard: dict) -> dict:
    return {key: value.to("meta") if isinstance(value, torch.Tensor) else value for key, value in shard.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ckpt_path",
        required=True,
        help="folder with latest_checkpointed_iteration.txt, or global_step_N: a local path or a URL",
    )
    parser.add_argument("--output_path", required=True, help="local folder to write the HF model into")
    add_storage_options_argument(parser)
    args = parser.parse_args(argv)
    options = args.storage_options
    try:
        out = convert(args.ckpt_path, args.output_path, options)
    except (ConfigError, OSError, ValueError, pickle.UnpicklingError) as exc:
        print(f"convert_megatron_to_hf: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a Hugging Face model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
