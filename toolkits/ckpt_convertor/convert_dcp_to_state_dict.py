#!/usr/bin/env python
"""Convert an FSDP/DCP actor checkpoint to a plain PyTorch state dict of the model's weights (HF key names).

    python toolkits/ckpt_convertor/convert_dcp_to_state_dict.py --dcp_path DCP_PATH --output_path OUTPUT_PATH

DCP_PATH is the DCP folder (`.../global_step_N/actor`) or the `global_step_N` folder itself, on a
local disk or any store (s3://bucket/..., gs://...), read directly. Credentials come the usual way
(AWS_* variables, ~/.aws, ...) or from --storage_options. The optimizer state is never read: peak
memory is about the size of the weights. OUTPUT_PATH is a local file; load it with
`torch.load(OUTPUT_PATH, weights_only=True)`.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from rlrunner.errors import ConfigError  # noqa: E402
from rlrunner.storage import add_storage_options_argument, is_url  # noqa: E402
from rlrunner.tools.convert import load_model_weights  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dcp_path",
        required=True,
        help="DCP folder (global_step_N/actor) or global_step_N: a local path or a URL (s3://...)",
    )
    parser.add_argument("--output_path", required=True, help="local file to write (torch.save format)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="cast the weights")
    add_storage_options_argument(parser)
    args = parser.parse_args(argv)
    options = args.storage_options
    if is_url(args.output_path):
        parser.error(f"--output_path must be a local file, got {args.output_path}")
    try:
        dtype = getattr(torch, args.dtype) if args.dtype else None
        state = load_model_weights(args.dcp_path, dtype, options)
    except (ConfigError, OSError, ValueError, pickle.UnpicklingError) as exc:
        print(f"convert_dcp_to_state_dict: error: {exc}", file=sys.stderr)
        return 2
    output = Path(args.output_path)
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, output)
    size = sum(t.numel() * t.element_size() for t in state.values())
    print(f"wrote {len(state)} tensors ({size / 1e6:.1f} MB) to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
