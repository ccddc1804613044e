#!/usr/bin/env python
"""Convert a `global_step_N` checkpoint to a Hugging Face model folder (config, model.safetensors, tokenizer).

    python toolkits/ckpt_convertor/convert_dcp_to_hf.py --ckpt_path .../global_step_N --output_path OUT_DIR

The checkpoint is a local folder or on any store (s3://bucket/..., gs://...), read directly;
credentials come the usual way (AWS_* variables, ~/.aws, ...) or from --storage_options. The config
and tokenizer come from the checkpoint's `actor/huggingface/`; the weights from its DCP shards (the
optimizer is never read). OUT_DIR is a local folder: `AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads it.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from rlrunner.errors import ConfigError  # noqa: E402
from rlrunner.storage import add_storage_options_argument  # noqa: E402
from rlrunner.tools.convert import export_hf  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt_path", required=True, help="a global_step_N folder: a local path or a URL (s3://...)")
    parser.add_argument("--output_path", required=True, help="local folder to write the HF model into")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="cast the weights")
    add_storage_options_argument(parser)
    args = parser.parse_args(argv)
    options = args.storage_options
    try:
        dtype = getattr(torch, args.dtype) if args.dtype else None
        out = export_hf(args.ckpt_path, args.output_path, dtype, options)
    except (ConfigError, OSError, ValueError, pickle.UnpicklingError) as exc:
        print(f"convert_dcp_to_hf: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a Hugging Face model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
