#!/usr/bin/env python
"""Peak memory of a Megatron checkpoint load that reshards over tensor-parallel sizes, against the rank's state.

For each model size (`--sizes`, the shapes of bench_memory.py) it writes a training checkpoint in the Megatron
backend's layout at the saved tensor-parallel size (the weights of the seeded init, Adam moments derived from them,
written by `MegatronRankState` as a run writes them), then loads tensor-parallel rank 0 of each new size
(`--cases saved:new`) in a fresh process, two ways:

  streamed  `rank_state.load_rank`: the files memory-mapped, each of the new rank's tensors assembled from the slices
            of the saved ones it covers (`MegatronShards`), copied into the rank's tensors one at a time
  whole     the previous load, the baseline: every saved rank's files read whole, merged into whole HF state dicts
            (weights and both moments), split again for the new size, then copied

Each child first allocates what the rank holds anyway (its fp32 weights and both moments: 12 bytes per parameter
of its shard, at data-parallel size 1), then loads; `load peak` is its peak resident set (VmHWM) less its resident
set once those are allocated, and is printed against that state. File pages mapped by the streamed load count in
the resident set while mapped (page cache the kernel can take back; the whole load's memory is anonymous): a saved
rank's files stay mapped until the tensors read from them are copied, so its peak is about the largest such file
set (the moment files, two thirds of the state, for a load that needs all of them).

Run from the repository root (about 3 minutes on 2 cores, 24 GiB):

    .venv/bin/python benchmarks/bench_reshard_load.py
    .venv/bin/python benchmarks/bench_reshard_load.py --sizes 358m --cases 2:1
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib and bench_memory, beside this script
from bench_memory import SIZES  # noqa: E402

from benchlib.common import command_line, make_workdir  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
MODES = ("streamed", "whole")


def hf_config(size: str):
    from rlrunner.models.loading import build_hf_config
    from rlrunner.models.tokenizer import build_char_tokenizer

    model_cfg = {"path": None, "override_config": SIZES[size], "attn_implementation": "eager", "dtype": "float32"}
    return build_hf_config(model_cfg, build_char_tokenizer())


def write_checkpoint(folder: Path, size: str, tp: int) -> int:
    """A training checkpoint of `size` at tensor-parallel size `tp` under `folder` (its actor folder); the
    parameter count."""
    import torch

    from rlrunner.backends.megatron.file_writes import write_tracker
    from rlrunner.backends.megatron.files import megatron_args, rank_file, rank_state
    from rlrunner.backends.megatron.layout import iter_hf_to_megatron_rank
    from rlrunner.backends.megatron.megatron_entries import rng_entry
    from rlrunner.backends.megatron.moment_files import moment_file, moment_slice_state
    from rlrunner.backends.megatron.rank_state import MegatronRankState
    from rlrunner.models.hf_tensors import SeededInit
    from rlrunner.models.loading import meta_model
    from rlrunner.storage import open_storage
    from rlrunner.utils.rng import capture_rng

    config = hf_config(size)
    init = SeededInit(meta_model(config, "eager", torch.float32), config, seed=1)
    params = 0
    for rank in range(tp):
        model = {k: v for k, v in iter_hf_to_megatron_rank(init, config, tp, rank) if v is not None}
        params += sum(v.numel() for v in model.values())
        layout = [(k, tuple(v.shape)) for k, v in model.items()]
        flat = torch.cat([v.reshape(-1) for v in model.values()])
        args = megatron_args(config, tp, 1, iteration=7, use_distributed_optimizer=True)
        state = MegatronRankState(
            {
                rank_file(7, rank): rank_state(
                    7,
                    model,
                    args,
                    {"lr": 1e-5, "distributed_optimizer": True},
                    {"last_epoch": 7},
                    [rng_entry(capture_rng(), 1, rank)],
                ),
                # data-parallel size 1: one slice file holds the whole flat moments
                moment_file(7, rank, 0): moment_slice_state(
                    7, tp, 1, 0, 7, layout, 0, flat.numel(), flat * 0.1, flat * flat
                ),
            }
        )
        state.write(str(folder), None)
        del model, state, flat
    write_tracker(open_storage(str(folder)), str(folder), 7)
    return params


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(mode: str, folder: str, size: str, tp: int) -> dict[str, float]:
    """In a fresh process: allocate tensor-parallel rank 0's state at size `tp`, load it `mode`'s way, report."""
    import torch

    from rlrunner.backends.megatron.files import rank_dirs, read_rank, read_tracker
    from rlrunner.backends.megatron.layout import DEFAULT_VOCAB_DIVISIBLE_BY, hf_to_megatron_rank
    from rlrunner.backends.megatron.moment_files import read_moments
    from rlrunner.backends.megatron.rank_state import _tensors, load_rank
    from rlrunner.backends.megatron.to_hf import megatron_to_hf
    from rlrunner.storage import open_storage

    config = hf_config(size)
    shapes = _rank_shapes(config, tp)
    # ones, not zeros: pages of zeros would only become resident when the load writes them
    own = {part: {k: torch.ones(shape) for k, shape in shapes.items()} for part in ("model", "exp_avg", "exp_avg_sq")}
    state_bytes = sum(t.numel() * 4 for tensors in own.values() for t in tensors.values())
    before = _status_bytes("VmRSS")
    started = time.perf_counter()
    if mode == "streamed":
        loaded = load_rank(folder, None, config, tp, 0, 1, 0, DEFAULT_VOCAB_DIVISIBLE_BY)
        parts = {"model": loaded.model, "exp_avg": loaded.exp_avg, "exp_avg_sq": loaded.exp_avg_sq}
    else:
        storage = open_storage(folder)
        iteration = read_tracker(storage, folder)
        saved_tp = len(rank_dirs(storage, folder, iteration))
        states = [read_rank(storage, folder, iteration, r, saved_tp) for r in range(saved_tp)]
        moments = [read_moments(storage, folder, iteration, r, mmap=False) for r in range(saved_tp)]
        parts = {
            "model": hf_to_megatron_rank(megatron_to_hf([_tensors(s["model"]) for s in states], config), config, tp, 0)
        }
        for key in ("exp_avg", "exp_avg_sq"):
            parts[key] = hf_to_megatron_rank(
                megatron_to_hf([dict(m.tensors(key)) for m in moments], config), config, tp, 0
            )
        parts = {part: pairs.items() for part, pairs in parts.items()}
    for part, pairs in parts.items():
        for key, tensor in pairs:
            if tensor is not None:
                own[part][key].copy_(tensor)
    seconds = time.perf_counter() - started
    checksum = float(sum(t.double().sum() for tensors in own.values() for t in tensors.values()))
    return {
        "state_bytes": state_bytes,
        "load_peak_bytes": _status_bytes("VmHWM") - before,
        "seconds": seconds,
        "checksum": checksum,
    }


def _rank_shapes(config, tp: int) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of tensor-parallel rank 0's dict at size `tp`."""
    from rlrunner.backends.megatron.layout import DecoderDims, padded_vocab_size, rank_shapes

    dims = DecoderDims.from_config(config)
    shapes = rank_shapes(dims, tp)
    vocab = (padded_vocab_size(dims.vocab_size, tp) // tp, dims.hidden_size)
    shapes["embedding.word_embeddings.weight"] = vocab
    if not dims.tie_word_embeddings:
        shapes["output_layer.weight"] = vocab
    return shapes


def run_child(mode: str, folder: Path, size: str, tp: int) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", mode, "--folder", str(folder), "--sizes", size, "--tp", str(tp)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} load of {folder} at tp {tp} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="120m,358m", help=f"comma-separated sizes of {sorted(SIZES)}")
    parser.add_argument("--cases", default="2:1,1:2", help="saved:new tensor-parallel sizes, comma-separated")
    parser.add_argument("--workdir", default=None, help="where checkpoints go (default: a temp folder, deleted)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.folder, args.sizes, args.tp)))
        return 0

    cases = [tuple(int(x) for x in case.split(":")) for case in args.cases.split(",") if case]
    work = make_workdir(Path(args.workdir) if args.workdir else None, "bench-reshard-")
    print(f"# {command_line()}\n")
    print(
        "| size | params | saved tp -> tp | rank 0's state (GiB) | streamed peak (GiB) | / state | whole peak (GiB) "
        "| / state | streamed / whole | streamed s | whole s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for size in [s for s in args.sizes.split(",") if s]:
            written: dict[int, tuple[Path, int]] = {}
            for saved, tp in cases:
                if saved not in written:
                    folder = work / f"{size}-tp{saved}"
                    written[saved] = folder, write_checkpoint(folder, size, saved)
                folder, params = written[saved]
                results = {mode: run_child(mode, folder, size, tp) for mode in MODES}
                if results["streamed"]["checksum"] != results["whole"]["checksum"]:
                    raise RuntimeError(f"{size} {saved}->{tp}: the two loads differ")
                state = results["streamed"]["state_bytes"]
                s, w = results["streamed"]["load_peak_bytes"], results["whole"]["load_peak_bytes"]
                print(
                    f"| {size} | {params / 1e6:.0f}M | {saved} -> {tp} | {state / 2**30:.2f} | {s / 2**30:.2f} | "
                    f"{s / state:.2f} | {w / 2**30:.2f} | {w / state:.2f} | {s / w:.2f} | "
                    f"{results['streamed']['seconds']:.1f} | {results['whole']['seconds']:.1f} |",
                    flush=True,
                )
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
