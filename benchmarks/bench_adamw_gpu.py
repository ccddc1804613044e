#!/usr/bin/env python
"""GPU memory and time of the FSDP actor's optimizer step: torch AdamW's foreach implementation (its default on
CUDA) against its fused one, on one GPU, in one run.

The FSDP backend steps a rank's shard with `torch.optim.AdamW` (`rlrunner.backends.optim.build_optimizer`). On CUDA
torch picks the foreach implementation unless told otherwise, whose temporaries (the square root of exp_avg_sq, the
update) are the size of the rank's whole shard; the fused kernel works element by element. The CPU measurements of
`bench_memory.py` cannot show this (on the CPU torch's default is the per-tensor loop), hence this benchmark.

For each size (`--sizes`, Qwen2.5 shapes with Qwen2's 151936-token vocabulary) and each implementation, in a
process of its own, the model is built as the FSDP actor builds it (`meta_model`, `shard_model` with its
per-decoder-layer units, then storage on the GPU; the weights are seeded normals, the same for both
implementations), and `--steps` training steps run on random token ids (`--batch` x `--seq`, compute in
`--param-dtype`, a mean log-sum-exp loss), each with the gradient clipped as the actor clips it. Printed per
implementation:

  state GiB                  parameters, gradients and AdamW's two moments in float32: 16 bytes per parameter (the
                             share of a one-rank actor)
  step's temporaries         the most GPU memory allocated during `optimizer.step()` less what was allocated just
                             before it, over the steps after the first
  first step                 the same for the first step, which also allocates the moments (8 bytes per parameter)
  forward+backward peak      the most GPU memory allocated from a step's forward to its clipped gradient, after the
                             first step (the moments are there)
  step ms                    the median time of `optimizer.step()` over the steps after the first

and fused / foreach for each, plus the largest difference between the two runs' weights after the last step (the
two implementations round differently; neither is the reference of the other).

Run on a machine with one CUDA GPU, from the repository root (it needs torch and transformers, not Ray):

    python benchmarks/bench_adamw_gpu.py                      # 1.5b and 3b, 3 steps
    python benchmarks/bench_adamw_gpu.py --sizes 0.5b --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for rlrunner
from rlrunner.backends.fsdp.worker import shard_model  # noqa: E402
from rlrunner.backends.optim import adamw_implementation  # noqa: E402
from rlrunner.backends.rank_parts import local_shard  # noqa: E402
from rlrunner.models.loading import meta_model  # noqa: E402

GiB = 2**30
SIZES = {  # Qwen2 shapes: hidden, layers, MLP, heads, KV heads (Qwen2.5's 0.5B, 1.5B, 3B)
    "0.5b": (896, 24, 4864, 14, 2),
    "1.5b": (1536, 28, 8960, 12, 2),
    "3b": (2048, 36, 11008, 16, 2),
}


def qwen2_config(size: str):
    from transformers import Qwen2Config

    hidden, layers, mlp, heads, kv = SIZES[size]
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=mlp,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=size == "0.5b",
    )


def run(size: str, implementation: str, args: argparse.Namespace) -> dict:
    """One (size, implementation) run, in this process (a fresh one: see `main`)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    config = qwen2_config(size)
    model = meta_model(config, "sdpa", torch.float32)
    shard_model(model, args.param_dtype, "float32")
    model.to_empty(device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            local_shard(param).normal_(0.0, 0.02, generator=generator)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-5, betas=(0.9, 0.999), weight_decay=0.01, **{implementation: True}
    )
    ids_generator = torch.Generator(device="cuda").manual_seed(1)
    step_peaks, step_times, train_peaks = [], [], []
    for _ in range(args.steps):
        torch.cuda.reset_peak_memory_stats()
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda", generator=ids_generator)
        loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
        loss.backward()
        del loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        torch.cuda.synchronize()
        train_peaks.append(torch.cuda.max_memory_allocated())
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        optimizer.step()
        torch.cuda.synchronize()
        step_times.append(time.perf_counter() - start)
        step_peaks.append(torch.cuda.max_memory_allocated() - before)
        optimizer.zero_grad(set_to_none=True)
    digest = torch.cat([local_shard(p).reshape(-1)[::997].float() for p in model.parameters()]).cpu()
    dist.destroy_process_group()
    # the first step also allocates the moments (8 bytes per parameter): the temporaries are the later steps'
    return {
        "params": params,
        "first_step": step_peaks[0],
        "step": max(step_peaks[1:] or step_peaks),
        "train": max(train_peaks[1:] or train_peaks),
        "ms": 1000 * statistics.median(step_times[1:] or step_times),
        "digest": digest.tolist(),
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1.5b,3b", help=f"comma-separated sizes of {sorted(SIZES)}")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--param-dtype", default="bfloat16", help="FSDP's compute dtype (actor.param_dtype)")
    parser.add_argument("--one", nargs=2, metavar=("SIZE", "IMPLEMENTATION"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_adamw_gpu.py needs a CUDA GPU")
    if args.one:
        print(json.dumps(run(*args.one, args)))
        return
    print(
        f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}; build_optimizer on CUDA: "
        f"{adamw_implementation(torch.device('cuda'))}; batch {args.batch} x {args.seq}, {args.param_dtype}, "
        f"{args.steps} steps, each run in a process of its own"
    )
    print(
        "| size | params | state GiB | AdamW | step's temporaries GiB | first step GiB | forward+backward peak GiB "
        "| step ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for size in [s for s in args.sizes.split(",") if s]:
        results = {}
        for impl in ("foreach", "fused"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    size,
                    impl,
                    "--steps",
                    str(args.steps),
                    "--batch",
                    str(args.batch),
                    "--seq",
                    str(args.seq),
                    "--param-dtype",
                    args.param_dtype,
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            results[impl] = json.loads(out.strip().splitlines()[-1])
        state = 16 * results["foreach"]["params"] / GiB
        for impl, r in results.items():
            print(
                f"| {size} | {r['params'] / 1e9:.2f}B | {state:.1f} | {impl} | {r['step'] / GiB:.2f} "
                f"| {r['first_step'] / GiB:.2f} | {r['train'] / GiB:.2f} | {r['ms']:.1f} |"
            )
        a, b = results["foreach"], results["fused"]
        print(
            f"| {size} | | | fused / foreach | {b['step'] / max(a['step'], 1):.3f} | "
            f"{b['first_step'] / a['first_step']:.3f} "
            f"| {b['train'] / a['train']:.3f} | {b['ms'] / a['ms']:.3f} |"
        )
        diff = (torch.tensor(a["digest"]) - torch.tensor(b["digest"])).abs().max().item()
        print(
            f"#   {size}: largest difference between the two runs' weights (every 997th element) after "
            f"{args.steps} steps: {diff:.3g}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
