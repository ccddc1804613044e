"""Tiny Qwen2 and Llama models the Megatron-layout tests share (unit and integration): shapes that split 1, 2 and 4
ways."""

from __future__ import annotations

from pathlib import Path

import torch
from ports import free_port
from spawned_ranks import spawn_ranks

from rlrunner.models.loading import build_model
from rlrunner.models.tokenizer import build_char_tokenizer

from conftest import TINY_MODEL_CFG, actor_worker_kwargs, run_config

# Grouped-query attention with an untied output layer, and plain multi-head attention with tied embeddings.
# The vocabulary is the character tokenizer's 99 tokens.
GQA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}
TIED = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "tie_word_embeddings": True,
}
# Llama 3.x shapes (no QKV bias): untied with Llama 3.1's frequency scaling (a short original context, so that it
# changes the table here), and tied as Llama 3.2's small models are
LLAMA = {
    **GQA,
    "model_type": "llama",
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}
LLAMA_TIED = {**GQA, "model_type": "llama", "tie_word_embeddings": True}
SHAPES = {"gqa": GQA, "tied": TIED, "llama": LLAMA, "llama_tied": LLAMA_TIED}


def model_cfg(overrides: dict) -> dict:
    return {**TINY_MODEL_CFG, "override_config": overrides}


def build_test_model(overrides: dict, seed: int = 0):
    """A tiny Qwen2 model whose biases and norm weights are random too (HF initializes them to 0 and 1, which would
    hide a misplaced bias or norm); and its tokenizer."""
    tokenizer = build_char_tokenizer()
    model = build_model(model_cfg(overrides), tokenizer, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    return model.eval(), tokenizer


def save_hf_folder(folder: Path, overrides: dict) -> tuple[Path, torch.nn.Module]:
    """An HF model folder (config, weights, tokenizer) of a test model, and the model."""
    model, tokenizer = build_test_model(overrides, seed=5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model


# -- MegatronActorWorker ranks in spawned processes (real gloo groups, no Ray) --------------------------------------


def worker_kwargs(tmp_path: Path, tp: int, world: int, *overrides: str) -> dict:
    """The keyword arguments of a MegatronActorWorker of `world` ranks at tensor-parallel size `tp` (two query groups,
    so that tp 2 splits them)."""
    cfg = run_config(
        tmp_path,
        "actor.training_backend=megatron",
        "model.override_config.num_key_value_heads=2",
        f"actor.tensor_model_parallel_size={tp}",
        f"actor.num_workers={world}",
        *overrides,
    )
    return actor_worker_kwargs(cfg)


def _run_worker(rank: int, world: int, port: int, kwargs: dict, job) -> None:
    import os
    import warnings
    from datetime import timedelta

    import torch.distributed as dist

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from rlrunner.backends.megatron.worker import MegatronActorWorker

        worker = MegatronActorWorker(rank, world, **kwargs)
        worker.dist_timeout = timedelta(seconds=60)
        worker.setup()
        job[0](worker, *job[1:])
    finally:
        dist.destroy_process_group()


def spawn_workers(world: int, kwargs: dict, *job) -> None:
    """`job[0](worker, *job[1:])` on each of `world` MegatronActorWorker ranks, set up, in processes of their own;
    raises with a rank's traceback if one fails."""

    spawn_ranks(_run_worker, args=(world, free_port(), kwargs, job), nprocs=world)
