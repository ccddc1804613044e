#!/usr/bin/env python
"""Convert a `global_step_N` checkpoint to a Hugging Face model folder (config, model.safetensors, tokenizer).

    python toolkits/ckpt_convertor/convert_dcp_to_hf.py --ckpt_path .../global_step_N --output_path OUT_DIR

The config and tokenizer come from the checkpoint's `actor/huggingface/`; the weights from its DCP
shards (the optimizer is never read). `AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from rlrunner.checkpoint.convert import export_hf  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt_path", required=True, help="a global_step_N folder")
    parser.add_argument("--output_path", required=True, help="folder to write the HF model into")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="cast the weights")
    args = parser.parse_args(argv)
    try:
        out = export_hf(args.ckpt_path, args.output_path, getattr(torch, args.dtype) if args.dtype else None)
    except (FileNotFoundError, ValueError) as exc:
        print(f"convert_dcp_to_hf: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a Hugging Face model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
