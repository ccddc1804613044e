"""Megatron-LM's own `load_checkpoint` (megatron/training/checkpointing.py) resumes checkpoints of our Megatron backend:
a check run by hand, with a Megatron-LM checkout (its training package is not published on PyPI: CI cannot install it,
and the suite's tests judge our files with megatron-core's loaders instead, tests/megatron_core_loader.py):

    git clone --branch core_v0.16.1 https://github.com/NVIDIA/Megatron-LM /tmp/Megatron-LM   # the megatron-core we pin
    python tests/megatron_lm_resume.py /tmp/Megatron-LM

A real run of our Megatron backend (tp 2, 3 steps, embedded Ray) is saved in each format (`torch`: Megatron-LM's
legacy per-rank files with `distrib_optim.pt`; `torch_dist`: megatron-core's distributed checkpoint). Each is then
loaded by Megatron-LM's `load_checkpoint`, unchanged, into megatron-core's DDP model, DistributedOptimizer and LR
scheduler built in spawned CPU ranks over gloo, with the arguments Megatron-LM's own parser gives for the run's
command line (`--use-distributed-optimizer --ckpt-format ...`): at the saved tensor-parallel size, and for `torch_dist`
at tp 1 too (Megatron-LM reads the legacy format only at its saved size). What it then holds (every element of the
fp32 weights and both Adam moments, the step, the scheduler, the RNG) is compared, bit for bit, with what
megatron-core's own loaders hold from the same files at tp 2 (which the suite compares with what our run held), and at
tp 1 with that merged through our converter. Exits 0 when every check holds; prints each check.

What runs on the CPU beyond Megatron-LM's code: the CUDA redirections of tests/megatron_core_loader.py, the `step`
hold-aside around megatron-core's plain-torch `load_parameter_state_from_dp_zero` (its bug, described there), and
`torch.cuda.set_rng_state` skipped (a CPU run has no CUDA generator; the CUDA tracker states are still set).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEP = 3
PACKAGES = ("training", "legacy", "rl", "post_training")  # what `megatron.training` imports beside megatron.core


def megatron_lm_path(checkout: Path, into: Path) -> Path:
    """A folder to put on sys.path whose `megatron/` holds links to the checkout's packages other than `core`: the
    namespace package `megatron` then joins them to the installed megatron-core (the version the suite pins)."""
    if not (checkout / "megatron" / "training" / "__init__.py").exists():
        raise SystemExit(f"{checkout} is not a Megatron-LM checkout (no megatron/training)")
    folder = into / "megatron_lm" / "megatron"
    folder.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        source, link = checkout / "megatron" / name, folder / name
        if source.exists() and not link.is_symlink():
            link.symlink_to(source)
    return folder.parent


def train_and_save(out: Path, ckpt_format: str) -> Path:
    """Our Megatron backend trains 3 steps at tp 2 (dp 1) and saves in `ckpt_format`: the checkpoint's actor folder."""
    from reference_runs import MEGATRON, NUMERICS

    from rlrunner.runner.supervisor import Supervisor

    from conftest import run_config

    cfg = run_config(
        out,
        *NUMERICS,
        *MEGATRON,
        f"runner.max_steps={STEP}",
        f"runner.save_interval={STEP}",
        f"actor.megatron.ckpt_format={ckpt_format}",
    )
    Supervisor(cfg).run()
    return out / "test" / "checkpoints" / f"global_step_{STEP}" / "actor"


def megatron_lm_args(saved, tp: int, load: str, ckpt_format: str):
    """The arguments Megatron-LM's parser gives the command line of a run resuming `saved` (a checkpoint's `args`) at
    tensor-parallel size `tp`, with what `validate_args` derives for the run's size set as it sets it."""
    from megatron.training.arguments import parse_args

    from rlrunner.backends.megatron.layout import padded_vocab_size

    world = torch.distributed.get_world_size()
    argv = [
        "pretrain_gpt.py",
        f"--num-layers={saved.num_layers}",
        f"--hidden-size={saved.hidden_size}",
        f"--ffn-hidden-size={saved.ffn_hidden_size}",
        f"--num-attention-heads={saved.num_attention_heads}",
        f"--kv-channels={saved.kv_channels}",
        f"--seq-length={saved.max_position_embeddings}",
        f"--max-position-embeddings={saved.max_position_embeddings}",
        f"--normalization={saved.normalization}",
        f"--norm-epsilon={saved.norm_epsilon}",
        f"--position-embedding-type={saved.position_embedding_type}",
        f"--rotary-base={saved.rotary_base}",
        "--micro-batch-size=1",
        f"--global-batch-size={saved.global_batch_size}",
        f"--lr={saved.lr}",
        f"--seed={saved.seed}",
        f"--tensor-model-parallel-size={tp}",
        "--use-distributed-optimizer",
        f"--ckpt-format={ckpt_format}",
        f"--load={load}",
    ]
    flags = {
        "swiglu": "--swiglu",
        "group_query_attention": "--group-query-attention",
        "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
        "add_qkv_bias": "--add-qkv-bias",
    }
    argv += [flag for name, flag in flags.items() if getattr(saved, name)]
    argv += [] if saved.add_bias_linear else ["--disable-bias-linear"]
    argv += [] if saved.add_position_embedding else ["--no-position-embedding"]
    if saved.group_query_attention:
        argv.append(f"--num-query-groups={saved.num_query_groups}")
    sys.argv = argv
    args = parse_args()
    args.world_size = world
    args.data_parallel_size = world // tp
    args.rank = torch.distributed.get_rank()
    args.use_dist_ckpt = ckpt_format != "torch"  # as validate_args sets them
    args.padded_vocab_size = padded_vocab_size(saved.vocab_size, tp)
    return args


def load_worker(rank: int, tp: int, port: int, folder: str, ckpt_format: str, out: str, path: str):
    """One of `tp` ranks of a megatron-core training job at tensor-parallel size `tp` (dp 1) resuming our checkpoint
    under `folder` (an actor folder) with Megatron-LM's `load_checkpoint`; writes what it then holds."""
    import random
    import types

    import numpy as np

    sys.path.insert(0, path)
    from rlrunner.backends.megatron import files as mf
    from rlrunner.storage import open_storage

    from megatron_core_loader import _cuda_on_cpu, _held, _training_job, step_held_aside

    storage = open_storage(folder)
    _, states = mf.read_rank_states(storage, storage.url) if ckpt_format == "torch" else (None, None)
    saved = (
        states[0]["args"] if states else mf.load_file(os.path.join(folder, mf.iteration_dir(STEP), "common.pt"))["args"]
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=tp)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.training import checkpointing, global_vars

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    args = megatron_lm_args(saved, tp, folder, ckpt_format)
    global_vars.set_args(args)
    init_num_microbatches_calculator(  # as Megatron-LM's set_global_variables does
        args.rank, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size, args.data_parallel_size
    )
    run_args = types.SimpleNamespace(
        **{**vars(saved), "tensor_model_parallel_size": tp, "padded_vocab_size": args.padded_vocab_size}
    )

    def without_step(load):  # megatron-core's plain-torch `step` bug (tests/megatron_core_loader.py), both formats
        def wrapped(self, *args, **kwargs):
            with step_held_aside(self):
                return load(self, *args, **kwargs)

        return wrapped

    for name in ("load_parameter_state_from_dp_zero", "load_parameter_state_from_fully_reshardable"):
        setattr(DistributedOptimizer, name, without_step(getattr(DistributedOptimizer, name)))
    # no CUDA generator on a CPU: its state in the template of the RNG object to load is a CPU generator's, and
    # setting it is skipped
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": None
    with _cuda_on_cpu():
        model, ddp, optimizer, scheduler = _training_job(run_args)
        if ckpt_format == "torch_dist":  # its load asks the optimizer for its state dict, which a plain-torch Adam
            # has only after a step: megatron-core's own way to give it one, as tests/megatron_core_loader.py does
            optimizer.chained_optimizers[0]._init_optimizer_states_with_dummy_values()
        with torch.no_grad():  # the fp32 main weights are views of the model's parameters
            iteration, _ = checkpointing.load_checkpoint([ddp], optimizer, scheduler)
    result = {
        **_held(model, optimizer, scheduler),
        "shapes": {name: param.shape for name, param in model.named_parameters()},
        "iteration": iteration,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
        "draws": [random.random(), float(np.random.rand()), torch.rand(3)],
    }
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("megatron_lm", type=Path, help="a Megatron-LM checkout (core_v0.16.1 for the pinned core)")
    parser.add_argument("--work", type=Path, help="a folder for the runs (kept; its runs reused when there)")
    options = parser.parse_args()
    checkout = options.megatron_lm.resolve()
    import ray
    from ports import free_port
    from spawned_ranks import spawn_ranks

    work = options.work or Path(tempfile.mkdtemp(prefix="megatron-lm-resume-"))
    path = str(megatron_lm_path(checkout, work))
    saved = Path("test") / "checkpoints" / f"global_step_{STEP}" / "actor"
    actors = {fmt: work / fmt / saved for fmt in ("torch", "torch_dist")}
    if not all(actor.exists() for actor in actors.values()):
        ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING")
        try:
            actors = {fmt: train_and_save(work / fmt, fmt) for fmt in actors}
        finally:
            ray.shutdown()
    results = {}
    for fmt, actor in actors.items():
        for tp in (2, 1) if fmt == "torch_dist" else (2,):
            out = work / f"loaded_{fmt}_tp{tp}"
            out.mkdir(exist_ok=True)
            spawn_ranks(load_worker, args=(tp, free_port(), str(actor), fmt, str(out), path), nprocs=tp)
            results[fmt, tp] = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(tp)]
            print(
                f"Megatron-LM's load_checkpoint read the {fmt} checkpoint at tp {tp}: iteration "
                f"{results[fmt, tp][0]['iteration']}"
            )
    return compare(results, actors, work)


def megatron_core_loads(fmt: str, actor: Path, out: Path) -> list[dict]:
    """What megatron-core's own loaders (tests/megatron_core_loader.py) hold from the checkpoint at its saved size."""
    from ports import free_port
    from spawned_ranks import spawn_ranks

    from rlrunner.backends.megatron.files import iteration_dir

    from megatron_core_loader import dist_load_worker, resume_worker

    out.mkdir(exist_ok=True)
    if fmt == "torch":
        spawn_ranks(resume_worker, args=(2, free_port(), str(actor), str(out)), nprocs=2)
    else:
        spawn_ranks(dist_load_worker, args=(2, free_port(), str(actor / iteration_dir(STEP)), str(out)), nprocs=2)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def held_tensors(results: list[dict], tp_rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """{param|exp_avg|exp_avg_sq: {name: tensor}} of tensor-parallel rank `tp_rank`, in the parameters' shapes."""
    from megatron_core_loader import held_state

    shapes = results[0]["shapes"]
    flat = held_state(results, tp_rank, shapes)
    return {key: {name: t.view(shapes[name]) for name, t in tensors.items()} for key, tensors in flat.items()}


def compare(results: dict, actors: dict[str, Path], work: Path) -> int:
    """Each Megatron-LM load against megatron-core's loaders' (tp 2) or their state merged to tp 1; prints each check
    and returns the exit status."""
    from rlrunner.backends.megatron.layout import hf_to_megatron
    from rlrunner.backends.megatron.to_hf import megatron_to_hf
    from rlrunner.models.loading import build_hf_config, build_tokenizer

    from conftest import run_config

    failures = 0

    def check(ok: bool, what: str) -> None:
        nonlocal failures
        failures += not ok
        print(("ok      " if ok else "FAILED  ") + what)

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    from omegaconf import OmegaConf

    model_cfg = OmegaConf.to_container(run_config(work, "model.override_config.num_key_value_heads=2").model)
    config = build_hf_config(model_cfg, build_tokenizer(model_cfg))
    for fmt, actor in actors.items():
        reference = megatron_core_loads(fmt, actor, work / f"megatron_core_{fmt}")
        for tp_rank in range(2):
            reference[tp_rank]["shapes"] = results[fmt, 2][0]["shapes"]
        expected = [held_tensors(reference, r) for r in range(2)]
        for (loaded_fmt, tp), loaded in results.items():
            if loaded_fmt != fmt:
                continue
            where = f"{fmt} at tp {tp}"
            for rank in loaded:
                check(rank["iteration"] == STEP, f"{where}: iteration {rank['iteration']}")
                check(rank["steps"] == reference[0]["steps"], f"{where}: Adam step {rank['steps']}")
                check(rank["num_steps"] == reference[0]["num_steps"], f"{where}: scheduler at {rank['num_steps']}")
                check(rank["lrs"] == reference[0]["lrs"], f"{where}: learning rates {rank['lrs']}")
            for key in ("param", "exp_avg", "exp_avg_sq"):
                if tp == 2:
                    got = [held_tensors(loaded, r)[key] for r in range(2)]
                    ok = all(same(got[r], expected[r][key]) for r in range(2))
                else:  # megatron-core's tp 2 state merged to tp 1 through the HF layout
                    merged = hf_to_megatron(megatron_to_hf([e[key] for e in expected], config), config, 1)[0]
                    want = {k: v for k, v in merged.items() if v is not None and k in loaded[0]["shapes"]}
                    ok = same(held_tensors(loaded, 0)[key], want)
                check(ok, f"{where}: every element of {key}, bit for bit")
            if tp == 2 and fmt == "torch":
                for r in range(2):
                    same_rng = same(loaded[r]["tracker"], reference[r]["tracker"]) and all(
                        torch.equal(torch.as_tensor(a), torch.as_tensor(b))
                        for a, b in zip(loaded[r]["draws"], reference[r]["draws"])
                    )
                    check(same_rng, f"{where}: rank {r}'s RNG (tracker states and the next draws)")
            if tp == 2 and fmt == "torch_dist":
                for r in range(2):
                    trackers = reference[r]["rng_state"][0]["rng_tracker_states"]
                    check(same(loaded[r]["tracker"], trackers), f"{where}: rank {r}'s RNG tracker states")
    print("every check holds" if not failures else f"{failures} checks FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
