#!/usr/bin/env python
"""Convert an FSDP/DCP actor checkpoint to a plain PyTorch state dict of the model's weights (HF key names).

    python toolkits/ckpt_convertor/convert_dcp_to_state_dict.py --dcp_path DCP_PATH --output_path OUTPUT_PATH

DCP_PATH is the DCP folder (`.../global_step_N/actor`) or the `global_step_N` folder itself. The
optimizer state is never read: peak memory is about the size of the weights. Load the result
with `torch.load(OUTPUT_PATH, weights_only=True)`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from rlrunner.checkpoint.convert import load_model_weights  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dcp_path", required=True, help="DCP folder (global_step_N/actor) or global_step_N")
    parser.add_argument("--output_path", required=True, help="file to write (torch.save format)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="cast the weights")
    args = parser.parse_args(argv)
    try:
        state = load_model_weights(args.dcp_path, getattr(torch, args.dtype) if args.dtype else None)
    except (FileNotFoundError, ValueError) as exc:
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
