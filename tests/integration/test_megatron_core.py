"""megatron-core's own GPTModel (CPU, gloo, spawned tensor-parallel ranks) loads our per-rank files strictly, and
computes what the HF model does (megatron-core comes with the `test` extra: the check runs, never skips)."""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

from rlrunner.backends.megatron import file_writes as mfw
from rlrunner.backends.megatron import files as mf
from rlrunner.backends.megatron.layout import padded_vocab_size
from rlrunner.backends.megatron.to_hf import megatron_to_hf
from rlrunner.storage import open_storage

from conftest import assert_bit_equal
from megatron_models import free_port


def megatron_core_worker(rank: int, world: int, port: int, folder: str) -> None:
    """One tensor-parallel rank: megatron-core's GPTModel (local spec, CPU, gloo) built from our file's `args`,
    strictly loaded from its `model`, then run forward; writes what it loaded and its logits."""
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    storage = open_storage(folder)
    _, states = mf.read_rank_states(storage, storage.url)
    args = states[rank]["args"]
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        params_dtype=args.params_dtype,
        use_cpu_initialization=True,
        perform_initialization=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=args.normalization),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        parallel_output=False,
    ).eval()
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


@pytest.mark.parametrize("tp, shape", [(1, "tied"), (2, "gqa")])
def test_megatron_core_gpt_model_loads_our_rank_files_strictly(tmp_path, megatron_models, tp, shape) -> None:
    import megatron.core  # noqa: F401  (the test extra installs it: the check must run, never skip)
    import torch.multiprocessing as mp

    model = megatron_models[shape]
    storage = open_storage(str(tmp_path))
    mfw.write_model_checkpoint(storage, storage.url, model.state_dict(), model.config, tp=tp)
    mp.spawn(megatron_core_worker, args=(tp, free_port(), str(tmp_path)), nprocs=tp)  # raises if a rank fails
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
