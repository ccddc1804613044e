#!/usr/bin/env python
"""Rollout engines side by side: the `vllm` engine against the `hf` engine on the same model, batch and weights, in
one run on a local Ray (each engine in a rollout worker of its own, as a run hosts it).

For each model shape (`--shapes`: `tiny` is the default job's model, `100m` a Qwen2 shape of about 100M parameters
with 64-wide heads) and each dtype (`--dtypes`), one rollout worker per engine is started and timed:

  start         from asking Ray for the worker to the worker being ready (imports, model or engine built)
  update        `RolloutWorker.load_weights` of the same float32 HF-layout weights: the engine's weight sink (the
                `hf` engine copies into its own tensors; `vllm` hands them to vLLM's loader and resets its prefix
                cache); against "copy", a plain in-memory copy of the same bytes into preallocated tensors of the
                engine's dtype in the same worker (the floor of any update)
  generate      `--prompts` prompts x `--samples` samples, at most `--tokens` new tokens each, one call, after one
                warm-up call; tokens/s = the tokens generated (an eos may end a sample early) / seconds

Every timed figure is the median of `--repeats`. "vllm / hf" is the ratio of tokens/s measured in the same run.

    python benchmarks/bench_rollout.py                       # tiny and 100m, float32 and bfloat16
    python benchmarks/bench_rollout.py --shapes tiny --dtypes float32 --repeats 1     # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, beside this script
from benchlib.common import command_line, cpu_model, make_workdir, memory_gib, start_local_ray, stop_ray, timed  # noqa: E402

SHAPES = {
    "tiny": [],  # the default job's model (rlrunner/models/tiny_qwen2.json)
    "100m": [
        "+model.override_config.hidden_size=768",
        "+model.override_config.intermediate_size=3072",
        "+model.override_config.num_hidden_layers=12",
        "+model.override_config.num_attention_heads=12",
        "+model.override_config.num_key_value_heads=12",
    ],
}


def update_and_copy(worker, weights, dtype: str) -> tuple[float, float]:
    """Runs in a rollout worker, on weights already in its memory: seconds of `load_weights` (the engine's sink), and
    seconds of a plain copy of the same tensors into preallocated tensors of `dtype` (the floor of any update)."""
    import time

    import torch

    started = time.perf_counter()
    worker.load_weights(weights)
    update_s = time.perf_counter() - started
    targets = {name: torch.empty(t.shape, dtype=getattr(torch, dtype)) for name, t in weights.items()}
    started = time.perf_counter()
    for name, tensor in weights.items():
        targets[name].copy_(tensor)
    return update_s, time.perf_counter() - started


def measure(engine: str, cfg, weights, records: list[dict], args) -> dict:
    import ray
    from omegaconf import OmegaConf

    from rlrunner.cluster.worker_group import WorkerGroup
    from rlrunner.rewards.scorer import RewardSettings
    from rlrunner.rollout.worker import RolloutWorker

    plain = lambda node: OmegaConf.to_container(node, resolve=True)  # noqa: E731
    kwargs = {
        "model_cfg": plain(cfg.model),
        "rollout_cfg": {**plain(cfg.rollout), "engine": engine},
        "group_size": args.samples,
        "reward": RewardSettings.builtin("arithmetic"),
        "seed": 1,
        "max_prompt_length": 64,
        "threads": args.threads,
    }
    started = time.perf_counter()
    group = WorkerGroup(
        f"rollout-{engine}", RolloutWorker, 1, worker_kwargs=kwargs, cpus_per_worker=1.0, call_timeout_s=1800
    )
    start_s = time.perf_counter() - started
    try:
        weights_ref = ray.put(weights)
        updates, copies, generations = [], [], []
        for _ in range(args.repeats):
            update_s, copy_s = group.get(
                group.workers[0].__ray_call__.remote(update_and_copy, weights_ref, cfg.model.dtype)
            )
            updates.append(update_s)
            copies.append(copy_s)
        group.call_rank(0, "generate", 1, [records])  # warm-up
        for _ in range(args.repeats):
            seconds, samples = timed(lambda: group.call_rank(0, "generate", 1, [records]))
            generations.append((seconds, sum(len(s["response_ids"]) for s in samples)))
    finally:
        group.shutdown()
    seconds = statistics.median(s for s, _ in generations)
    tokens = generations[0][1]
    return {
        "start_s": start_s,
        "update_s": statistics.median(updates),
        "copy_s": statistics.median(copies),
        "generate_s": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each rollout worker")
    args = parser.parse_args()

    from rlrunner.config import load_config
    from rlrunner.models.loading import build_model, build_tokenizer

    workdir = make_workdir(None, "bench-rollout-")
    started = time.perf_counter()
    start_local_ray(num_cpus=2)
    rows = []
    try:
        for shape in args.shapes:
            for dtype in args.dtypes:
                cfg = load_config(
                    [
                        f"runner.output_dir={workdir}",
                        f"model.dtype={dtype}",
                        f"rollout.max_new_tokens={args.tokens}",
                        "rollout.temperature=1.0",
                        "rollout.vllm.kv_cache_gb=1",
                        *SHAPES[shape],
                    ]
                )
                tokenizer = build_tokenizer(cfg.model)
                model = build_model(cfg.model, tokenizer, seed=1, dtype="float32")
                params = sum(p.numel() for p in model.parameters())
                weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
                if model.config.tie_word_embeddings:
                    weights.pop("lm_head.weight", None)
                del model
                records = [
                    {
                        "index": i,
                        "prompt_ids": tokenizer.encode(f"{i % 5}+{(3 * i) % 5}="),
                        "answer": "0",
                        "data_source": "arithmetic",
                        "extra_info": {},
                    }
                    for i in range(args.prompts)
                ]
                results = {engine: measure(engine, cfg, weights, records, args) for engine in ("hf", "vllm")}
                rows.append((shape, params, dtype, results))
    finally:
        stop_ray()

    print(f"\n{command_line()}")
    print(
        f"machine: {cpu_model()}, {memory_gib():.0f} GiB; {args.prompts} prompts x {args.samples} samples x "
        f"{args.tokens} tokens; median of {args.repeats}"
    )
    print("\n| shape | params | dtype | engine | start s | update s | copy s | update / copy | tokens/s | vllm / hf |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape, params, dtype, results in rows:
        ratio = results["vllm"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
        for engine, r in results.items():
            print(
                f"| {shape} | {params / 1e6:.1f}M | {dtype} | {engine} | {r['start_s']:.1f} | {r['update_s']:.3f} | "
                f"{r['copy_s']:.3f} | {r['update_s'] / r['copy_s']:.1f} | {r['tokens_per_s']:.0f} | "
                f"{ratio:.2f} |"
                if engine == "vllm"
                else f"| {shape} | {params / 1e6:.1f}M | {dtype} | {engine} | {r['start_s']:.1f} | "
                f"{r['update_s']:.3f} | "
                f"{r['copy_s']:.3f} | {r['update_s'] / r['copy_s']:.1f} | {r['tokens_per_s']:.0f} | |"
            )
    print(f"\ntotal time: {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
