"""megatron-core's own code (CPU, gloo, spawned tensor-parallel ranks) reads our Megatron-layout files: its GPTModel
loads our per-rank files strictly and computes what the HF model does; and, from a training checkpoint of our run,
its DDP and DistributedOptimizer with its LR scheduler load everything Megatron-LM's `load_checkpoint` loads, through
megatron-core's own loaders, and hold what our run held: the weights, both Adam moments, the step, the LR schedule, the
RNG (megatron-core comes with the `test` extra: the checks run, never skip).

megatron-core runs in spawned ranks (tests/megatron_core_loader.py, which lists the CUDA calls it redirects there).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from ports import free_port
from spawned_ranks import spawn_ranks

from rlrunner.backends.megatron import file_writes as mfw
from rlrunner.backends.megatron import files as mf
from rlrunner.backends.megatron.layout import padded_vocab_size
from rlrunner.backends.megatron.to_hf import megatron_to_hf
from rlrunner.storage import open_storage

from conftest import assert_bit_equal
from megatron_core_loader import gpt_model, held_state, resume_worker, start_rank


def megatron_core_worker(rank: int, world: int, port: int, folder: str) -> None:
    """One tensor-parallel rank: megatron-core's GPTModel (local spec, CPU, gloo) built from our file's `args`,
    strictly loaded from its `model`, then run forward; writes what it loaded and its logits."""
    storage = open_storage(folder)
    _, states = mf.read_rank_states(storage, storage.url)
    start_rank(rank, world, port, states[rank]["args"])
    _, model = gpt_model(states[rank]["args"])
    model.eval()
    model.load_state_dict(dict(states[rank]["model"]), strict=True)
    # megatron-core assumes CUDA in two places of its forward: the rotary table's device and the dropout RNG fork
    torch.cuda.current_device = lambda: "cpu"
    import megatron.core.tensor_parallel.random as megatron_random

    megatron_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    ids = torch.tensor([[3, 17, 42, 98, 0, 5, 61]])
    mask = torch.triu(torch.ones(1, 1, 7, 7, dtype=torch.bool), diagonal=1)  # True = masked out
    with torch.no_grad():
        logits = model(ids, torch.arange(7)[None], mask)
    torch.save({"model": model.state_dict(), "logits": logits}, os.path.join(folder, f"megatron_core_rank{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("tp, shape", [(1, "tied"), (2, "gqa"), (2, "llama_tied")])
def test_megatron_core_gpt_model_loads_our_rank_files_strictly(tmp_path, megatron_models, tp, shape) -> None:
    import megatron.core  # noqa: F401  (the test extra installs it: the check must run, never skip)

    model = megatron_models[shape]
    storage = open_storage(str(tmp_path))
    mfw.write_model_checkpoint(storage, storage.url, model.state_dict(), model.config, tp=tp)
    spawn_ranks(megatron_core_worker, args=(tp, free_port(), str(tmp_path)), nprocs=tp)  # raises if a rank fails
    results = [torch.load(tmp_path / f"megatron_core_rank{r}.pt", weights_only=True) for r in range(tp)]
    # what megatron-core loaded, merged back through our converter, is the HF model bit for bit
    loaded = megatron_to_hf([r["model"] for r in results], model.config)
    expected = {
        k: v for k, v in model.state_dict().items() if not (model.config.tie_word_embeddings and k == "lm_head.weight")
    }
    assert_bit_equal(dict(sorted(loaded.items())), dict(sorted(expected.items())))  # q, k and v come out together
    # and megatron-core's own forward over the shards gives HF's logits (the padding columns cut off)
    logits = results[0]["logits"]
    assert logits.shape == (1, 7, padded_vocab_size(99, tp))
    with torch.no_grad():
        reference = model(torch.tensor([[3, 17, 42, 98, 0, 5, 61]])).logits
    assert torch.allclose(logits[..., :99], reference, atol=1e-5)


def test_megatron_core_resumes_our_training_checkpoint_holding_what_our_run_held(tmp_path, tmp_path_factory) -> None:
    import random

    import numpy as np
    from reference_runs import reference_run

    from rlrunner.backends.megatron.megatron_entries import rng_from_entry, tracker_states
    from rlrunner.backends.megatron.moment_files import read_moments
    from rlrunner.utils.rng import restore_rng

    reference = reference_run("megatron", tmp_path_factory)  # tp 2 x dp 1, saved at steps 3, 6, 9 and 10
    actor = str(reference.checkpoint(6) / "actor")
    storage = open_storage(actor)
    _, states = mf.read_rank_states(storage, actor)
    args = states[0]["args"]
    tp = args.tensor_model_parallel_size
    world = tp * args.data_parallel_size
    spawn_ranks(resume_worker, args=(world, free_port(), actor, str(tmp_path)), nprocs=world)
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(world)]

    for tp_rank in range(tp):
        moments = read_moments(storage, actor, 6, tp_rank)
        weights = {k: v for k, v in states[tp_rank]["model"].items() if v is not None}
        expected = {"param": weights, **{key: dict(moments.tensors(key)) for key in ("exp_avg", "exp_avg_sq")}}
        held = held_state(results, tp_rank, {name: t.shape for name, t in weights.items()})
        for key in expected:  # every element of every parameter, as our run held it (moments: as our reader reads)
            assert_bit_equal(held[key], {name: t.reshape(-1) for name, t in expected[key].items()})
        assert moments.step == 6
    for result in results:
        assert result["steps"] == [6.0]  # the Adam step count
        assert result["num_steps"] == 6 * args.global_batch_size  # the scheduler, counted in samples as Megatron counts
        assert result["lrs"] == [args.lr, args.lr]  # the reference's schedule is constant
        assert_bit_equal(result["tracker"], tracker_states(args.seed, result["tp_rank"]))
        # the CPU generators Megatron-LM restores are those of our run's data-parallel rank 0 after step 6
        restore_rng(rng_from_entry(states[result["tp_rank"]]["rng_state"][0]))
        assert torch.equal(torch.get_rng_state(), reference.rng(6)[result["tp_rank"]])
        draws = [random.random(), float(np.random.rand()), torch.rand(3)]
        assert draws[:2] == result["draws"][:2] and torch.equal(draws[2], result["draws"][2])
