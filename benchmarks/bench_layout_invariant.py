#!/usr/bin/env python
"""What the FSDP backend's layout-invariant update (`actor.layout_invariant=true`) costs against the stock update, in
time and memory, at data-parallel sizes 1 and 2 (and 4 with `--sizes 1 2 4`); and whether each gives the same weights,
bit for bit, at every size.

For each mode (stock, invariant) and each size, real gloo ranks of the real FSDP actor worker
(`rlrunner.backends.fsdp.worker.FSDPActorWorker`, as tests/integration/test_layout_invariance.py runs them, without
Ray) are started with `torch.multiprocessing` (fork-server context, the backend preloaded), one torch thread each,
the process group made by `worker.init_process_group("127.0.0.1", port, 60)`. Every run starts from the same initial
weights and takes the same `--warmup` + `--steps` updates, each on one mini-batch of `--rows` rows built by
`build_actor_batch` the way the default job's driver builds them: the default job's prompts (its synthetic dataset and
tokenizer, groups of `algorithm.group_size` samples of one prompt), short random responses of 1..rollout.max_new_tokens
tokens (an EOS ending those under the limit), random rollout log-probs and 0/1 rewards turned into the job's advantages.
The driver's `shard_actor_batch` gives each rank its rows and micro-batches under `--micro-batch-size` and
`--micro-batch-tokens` (default: the job's actor.micro_batch_size / micro_batch_tokens); the invariant mode splits the
mini-batch into the same logical micro-batches at every size (`invariant_min_count` = the largest of `--sizes`, as a
run configured at that size does), so at the smaller sizes a rank runs more, smaller passes than the stock update.

The model is the default job's (configs/grpo.yaml: the embedded tiny Qwen2) or, with `--model tiny`, the tests' tinier
one (hidden 32, intermediate 64, 2 layers, 2 heads, 1 KV head).

Run from the repository root:

    .venv/bin/python benchmarks/bench_layout_invariant.py                     # dp 1 and 2, default job's model
    .venv/bin/python benchmarks/bench_layout_invariant.py --sizes 1 2 4       # and dp 4 (logical micro-batches: 4)
    .venv/bin/python benchmarks/bench_layout_invariant.py --model tiny --rows 64 --steps 5 --warmup 1

The table's columns:

  mode                            stock (actor.layout_invariant=false) or invariant (true)
  dp                              data-parallel size (FSDP ranks)
  update s (median)               `worker.update(shard)` wall time per step: the slowest rank's (the ranks start each
                                  step together, after a barrier), median over the `--steps` steps after `--warmup`
  ratio to stock                  that median / the stock update's at the same dp, measured in the same run
  peak RSS growth MiB             each rank's peak RSS (getrusage ru_maxrss) after all the steps minus after setup,
                                  the largest over the ranks: what the updates add on top of the model and optimizer
                                  (the invariant mode's tree buffers included)
  weights identical across sizes  rank 0's `worker.full_state_dict()` after the last step, every tensor's bits (floats
                                  viewed as integers) against the same mode's at the smallest dp: "reference" there,
                                  then "yes" or "no" (how many tensors differ, the largest absolute difference)

The invariant mode should give "yes" at every size and the stock one "no". On a machine with fewer cores than ranks
(or other load) the larger sizes' times include the ranks sharing cores.
"""

from __future__ import annotations

import argparse
import gc
import resource
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, beside this script
from benchlib.common import command_line, machine, make_workdir  # noqa: E402

MODES = ("stock", "invariant")
TINY_MODEL = [  # the tests' tiny model (tests/conftest.py TINY_MODEL)
    "+model.override_config.hidden_size=32",
    "+model.override_config.intermediate_size=64",
    "+model.override_config.num_hidden_layers=2",
    "+model.override_config.num_attention_heads=2",
    "+model.override_config.num_key_value_heads=1",
]
PRELOAD = ["torch", "transformers", "rlrunner.backends.fsdp.worker"]  # what the fork server imports once


@dataclass
class Run:
    """One mode at one size: each rank's update times per step, peak-RSS growth, and rank 0's final weights."""

    mode: str
    dp: int
    times: list[list[float]]  # [rank][step]
    rss_growth_kib: list[int]  # per rank
    weights: dict[str, Any]
    passes: int  # forward/backward passes per rank per step

    def median_s(self, warmup: int) -> float:
        per_step = [max(rank[step] for rank in self.times) for step in range(warmup, len(self.times[0]))]
        return statistics.median(per_step)


# -- the config and the batches (driver) --------------------------------------------------------------------------


def overrides(args: argparse.Namespace) -> list[str]:
    return [*(TINY_MODEL if args.model == "tiny" else []), *args.override]


def worker_kwargs(cfg: Any, invariant: bool, rows: int, total_steps: int) -> dict[str, Any]:
    """The actor worker's keyword arguments for `cfg`, as the runner's placement gives them (plain dicts)."""
    from omegaconf import OmegaConf

    from rlrunner.utils.seeding import derive_seed

    plain = lambda node: OmegaConf.to_container(node, resolve=True)  # noqa: E731
    return {
        "model_cfg": plain(cfg.model),
        "actor_cfg": {**plain(cfg.actor), "layout_invariant": invariant},
        "algorithm_cfg": plain(cfg.algorithm),
        "init_seed": derive_seed(cfg.runner.seed, "model_init"),
        "total_optimizer_steps": total_steps,
        "samples_per_optimizer_step": rows,
        "threads": 1,
    }


def build_batches(cfg: Any, rows: int, count: int, seed: int) -> list[dict[str, Any]]:
    """`count` actor batches of `rows` rows: the default job's prompts in groups of `algorithm.group_size`, short
    random responses, random log-probs and rewards, the job's advantages."""
    import torch

    from rlrunner.algorithms.registry import get_adv_estimator
    from rlrunner.data.datasets import build_dataset
    from rlrunner.models.loading import build_tokenizer
    from rlrunner.runner.batching import build_actor_batch

    tokenizer = build_tokenizer(cfg.model)
    dataset = build_dataset(cfg.data, tokenizer, cfg.runner.seed)
    group, max_new = cfg.algorithm.group_size, cfg.rollout.max_new_tokens
    vocab, eos, pad = len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id
    estimator = get_adv_estimator(cfg.algorithm.adv_estimator)
    prompts_per_batch = rows // group
    batches = []
    for step in range(count):
        gen = torch.Generator().manual_seed(seed * 1000 + step)
        samples = []
        for p in range(prompts_per_batch):
            prompt = dataset[(step * prompts_per_batch + p) % len(dataset)]["prompt_ids"]
            for _ in range(group):
                length = int(torch.randint(1, max_new + 1, (1,), generator=gen))
                response = torch.randint(3, vocab, (length,), generator=gen).tolist()
                if length < max_new:
                    response[-1] = eos  # stopped early
                logprobs = (-torch.rand(length, generator=gen)).tolist()
                samples.append({"prompt_ids": prompt, "response_ids": response, "logprobs": logprobs})
        rewards = torch.randint(0, 2, (rows,), generator=gen).float()
        lengths = torch.tensor([len(s["response_ids"]) for s in samples])
        advantages = estimator(rewards, group, lengths, cfg.algorithm.norm_adv_by_std)
        batches.append(build_actor_batch(samples, advantages, pad))
    return batches


def model_description(cfg: Any) -> str:
    from rlrunner.models.loading import build_hf_config, build_tokenizer

    config = build_hf_config(cfg.model, build_tokenizer(cfg.model))
    keys = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"]
    return ", ".join(f"{key}={getattr(config, key)}" for key in keys) + f", vocab_size={config.vocab_size}"


# -- the ranks ------------------------------------------------------------------------------------------------------


def peak_rss_kib() -> int:
    gc.collect()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _rank(rank: int, world: int, port: int, kwargs: dict, plan: dict, folder: str) -> None:
    import torch
    import torch.distributed as dist

    from rlrunner.backends.fsdp.worker import FSDPActorWorker
    from rlrunner.runner.batching import shard_actor_batch

    torch.set_num_threads(1)
    batches = torch.load(plan["batches"], weights_only=True)
    shards = [
        shard_actor_batch(
            batch, world, 1, plan["micro_batch_size"], plan["micro_batch_tokens"], plan["invariant_min_count"]
        )[rank]
        for batch in batches
    ]
    worker = FSDPActorWorker(rank, world, **kwargs)
    worker.init_process_group("127.0.0.1", port, 60)
    worker.setup()
    dist.barrier()
    rss_setup = peak_rss_kib()
    times = []
    for shard in shards:
        dist.barrier()  # every rank starts the step together: the slowest rank's time is the step's
        started = time.perf_counter()
        worker.update(shard)
        times.append(time.perf_counter() - started)
    rss_end = peak_rss_kib()
    weights = worker.full_state_dict()
    result = {
        "times": times,
        "rss_growth_kib": rss_end - rss_setup,
        "weights": weights,
        "passes": len(shards[0]["micro_batches"]),
    }
    torch.save(result, Path(folder) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_mode(mode: str, dp: int, kwargs: dict, plan: dict, work: Path) -> Run:
    import multiprocessing

    import torch
    import torch.multiprocessing

    folder = work / f"{mode}-dp{dp}"
    folder.mkdir()
    multiprocessing.set_forkserver_preload(PRELOAD)
    started = time.perf_counter()
    torch.multiprocessing.start_processes(
        _rank, args=(dp, free_port(), kwargs, plan, str(folder)), nprocs=dp, join=True, start_method="forkserver"
    )
    ranks = [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(dp)]
    print(f"{mode} dp={dp}: done in {time.perf_counter() - started:.1f}s (start-up included)", flush=True)
    return Run(
        mode,
        dp,
        [r["times"] for r in ranks],
        [r["rss_growth_kib"] for r in ranks],
        ranks[0]["weights"],
        ranks[0]["passes"],
    )


# -- the comparison and the table --------------------------------------------------------------------------------


def bits(tensor):
    """The raw bits, so that equality is bit for bit (signed zeros, NaN payloads included)."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.contiguous().view(ints[tensor.element_size()]) if tensor.is_floating_point() else tensor


def compare(got: dict, expected: dict) -> tuple[bool, str]:
    """(bit-identical, in words) of two state dicts."""
    import torch

    if list(got) != list(expected):
        return False, "no (different tensor names)"
    differ, largest = 0, 0.0
    for name, want in expected.items():
        have = got[name]
        if have.dtype != want.dtype or have.shape != want.shape:
            differ += 1
            continue
        if not torch.equal(bits(have), bits(want)):
            differ += 1
            if have.is_floating_point():
                largest = max(largest, float((have.double() - want.double()).abs().max()))
    if differ == 0:
        return True, "yes"
    return False, f"no ({differ} of {len(expected)} tensors differ, max abs diff {largest:.2e})"


def table(runs: dict[tuple[str, int], Run], sizes: list[int], warmup: int) -> tuple[str, dict[str, bool]]:
    lines = [
        "| mode | dp | update s (median) | ratio to stock (same dp) | peak RSS growth MiB | weights identical across "
        "sizes |",
        "|---|---:|---:|---:|---:|---|",
    ]
    identical = {}
    for mode in MODES:
        reference = runs[(mode, sizes[0])]
        identical[mode] = True
        for dp in sizes:
            run = runs[(mode, dp)]
            median, stock = run.median_s(warmup), runs[("stock", dp)].median_s(warmup)
            if dp == sizes[0]:
                same = "reference"
            else:
                equal, same = compare(run.weights, reference.weights)
                identical[mode] &= equal
            growth = max(run.rss_growth_kib) / 1024
            lines.append(f"| {mode} | {dp} | {median:.4f} | {median / stock:.2f} | {growth:.1f} | {same} |")
    return "\n".join(lines), identical


# -- main -----------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="data-parallel sizes (powers of two)")
    parser.add_argument("--model", choices=("default", "tiny"), default="default", help="the default job's or tiny")
    parser.add_argument("--rows", type=int, default=None, help="rows per step (default: data.batch_size x group_size)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per run (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per run, excluded from the medians")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="default: the job's actor.micro_batch_size")
    parser.add_argument(
        "--micro-batch-tokens", type=int, default=None, help="default: the job's actor.micro_batch_tokens"
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the synthetic responses and rewards")
    parser.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE", help="an extra config override (repeatable)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="folder for the ranks' files (a fresh subfolder)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be positive and --warmup at least 0")
    if any(size < 1 or size & (size - 1) for size in args.sizes):
        parser.error(f"--sizes must be powers of two, got {args.sizes}")
    args.sizes = sorted(set(args.sizes))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import shutil

    import torch

    from rlrunner.backends.fsdp.invariant_grads import supports_layout_invariance
    from rlrunner.config import load_config

    if not supports_layout_invariance():
        print(f"bench_layout_invariant: torch {torch.__version__} has no layout-invariant FSDP2", file=sys.stderr)
        return 2
    started = time.perf_counter()
    cfg = load_config(overrides(args))
    group = cfg.algorithm.group_size
    rows = args.rows if args.rows is not None else cfg.data.batch_size * group
    largest = max(args.sizes)
    if rows % group or rows % largest:
        print(f"bench_layout_invariant: --rows {rows} must divide into groups of {group} and {largest} ranks")
        return 2
    micro_rows = args.micro_batch_size if args.micro_batch_size is not None else cfg.actor.micro_batch_size
    micro_tokens = args.micro_batch_tokens if args.micro_batch_tokens is not None else cfg.actor.micro_batch_tokens
    total = args.warmup + args.steps

    print(f"command: {command_line()}")
    print(f"machine: {machine()}")
    print(
        f"model: Qwen2 {model_description(cfg)}; {rows} rows ({rows // group} prompts x {group}), "
        f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}, one mini-batch; micro-batches: at most "
        f"{micro_rows or 'any'} rows and {micro_tokens or 'any'} tokens; invariant_min_count={largest}",
        flush=True,
    )
    work = make_workdir(args.dir, "bench_layout_invariant_")
    try:
        torch.save(build_batches(cfg, rows, total, args.seed), work / "batches.pt")
        runs = {}
        for dp in args.sizes:
            for mode in MODES:
                invariant = mode == "invariant"
                plan = {
                    "micro_batch_size": micro_rows,
                    "micro_batch_tokens": micro_tokens,
                    "invariant_min_count": largest if invariant else None,
                    "batches": str(work / "batches.pt"),
                }
                runs[(mode, dp)] = run_mode(mode, dp, worker_kwargs(cfg, invariant, rows, total), plan, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    text, identical = table(runs, args.sizes, args.warmup)
    print()
    print(text)
    print()
    passes = ", ".join(f"{mode} dp={dp}: {runs[(mode, dp)].passes}" for dp in args.sizes for mode in MODES)
    print(f"forward/backward passes per rank per step: {passes}")
    sizes = ", ".join(map(str, args.sizes))
    verdict = "; ".join(
        f"{mode} {'bit-identical' if identical[mode] else 'NOT bit-identical'} across dp {sizes}" for mode in MODES
    )
    ratios = ", ".join(
        f"dp={dp} {runs[('invariant', dp)].median_s(args.warmup) / runs[('stock', dp)].median_s(args.warmup):.2f}x"
        for dp in args.sizes
    )
    print(
        f"summary: invariant / stock update time {ratios} (medians of {args.steps} steps after {args.warmup}); "
        f"weights: {verdict}."
    )
    print(f"total time: {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
