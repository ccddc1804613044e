"""megatron-core's own model, DDP, distributed optimizer and LR scheduler, in spawned CPU ranks over gloo, reading our
Megatron-layout files the way Megatron-LM's `load_checkpoint` does (tests/integration/test_megatron_core.py and
test_megatron_distrib_optim_file.py judge our files with them).

megatron-core's training stack assumes CUDA. On this CPU-only machine three of its calls are redirected, in the
spawned ranks only, for as long as the model, DDP and optimizer are built and loaded (`_cuda_on_cpu`):
- `torch.cuda.current_device()` -> "cpu" (the device DDP's buffers and the optimizer's state are allocated on);
- `torch.tensor(..., device="cuda")` -> on the CPU (`MixedPrecisionOptimizer.__init__`'s scalars);
- `Parameter.type()` -> "torch.cuda.FloatTensor" for a CPU fp32 parameter (`DistributedOptimizer` accepts only CUDA
  type names).
And one bug of its plain-torch (no Apex, no Transformer Engine) path is stepped around: after `load_state_dict` each
parameter's optimizer state holds `step`, which `load_parameter_state_from_dp_zero` then looks for among the file's
tensors (KeyError 'step', distrib_optimizer.py:940); the step is held aside while the file is read, then put back
(the same tensor for every parameter, as megatron-core's `load_state_dict` left it: distrib_optimizer.py:817-824); and
the file is read under `torch.no_grad()`, since with fp32 parameters the main weights it copies into are views of the
model's parameters, which autograd refuses to change in place.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
import torch.nn.functional as F

from rlrunner.backends.megatron import files as mf
from rlrunner.storage import open_storage

MOMENT_KEYS = ("param", "exp_avg", "exp_avg_sq")


def gpt_model(args):
    """megatron-core's GPTModel (local layer spec, CPU) of a checkpoint's `args`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

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
    )
    return config, model


@contextlib.contextmanager
def _cuda_on_cpu():
    """The three redirections listed in the module docstring, undone on exit."""
    real_device, real_tensor, real_type = torch.cuda.current_device, torch.tensor, torch.nn.Parameter.type

    def tensor(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return real_tensor(*args, **kwargs)

    def parameter_type(self, *args, **kwargs):
        name = real_type(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not (args or kwargs) and self.device.type == "cpu" else name

    torch.cuda.current_device, torch.tensor, torch.nn.Parameter.type = (lambda: "cpu"), tensor, parameter_type
    try:
        yield
    finally:
        torch.cuda.current_device, torch.tensor, torch.nn.Parameter.type = real_device, real_tensor, real_type


@contextlib.contextmanager
def step_held_aside(distributed):
    """The `step` bug of the module docstring stepped around: each parameter's optimizer `step` is taken out of its
    state while a parameter state file is read into `distributed` (a DistributedOptimizer), then put back."""
    inner = distributed.optimizer
    params = [param for group in inner.param_groups for param in group["params"] if "step" in inner.state[param]]
    steps = {param: inner.state[param].pop("step") for param in params}
    try:
        yield
    finally:
        for param, step in steps.items():
            inner.state[param]["step"] = step


def start_rank(rank: int, world: int, port: int, args) -> None:
    """Join the gloo group of `world` spawned ranks and set megatron-core's parallel state up for a checkpoint's
    `args` (its tensor-parallel size)."""
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size)


def _training_job(args):
    """megatron-core's model, DDP, distributed optimizer and LR scheduler for a checkpoint's `args` (under
    `_cuda_on_cpu`)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    samples = args.global_batch_size
    config, model = gpt_model(args)
    # the DDP a Megatron-LM run with the checkpoint's flags builds (its buckets decide distrib_optim.pt's layout)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=getattr(args, "overlap_grad_reduce", False),
        bucket_size=getattr(args, "ddp_bucket_size", None),
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        use_distributed_optimizer=True,
        params_dtype=torch.float32,
    )
    optimizer = get_megatron_optimizer(optimizer_config, [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * samples,
        lr_decay_steps=args.lr_decay_iters * samples,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * samples,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
    )
    return model, ddp, optimizer, scheduler


def _held(model, optimizer, scheduler) -> dict:
    """What a megatron-core rank holds: each parameter's piece of the fp32 weights and moments (this rank's shard),
    the Adam step counts, the scheduler's position and the groups' LR."""
    from megatron.core import parallel_state

    (distributed,) = optimizer.chained_optimizers
    names = {param: name for name, param in model.named_parameters()}
    pieces = []  # (name, first element of the parameter this rank holds, {param, exp_avg, exp_avg_sq})
    for buckets in distributed.gbuf_ranges[0].values():
        for bucket in buckets:
            for param, ranges in bucket["param_map"].items():
                held = distributed._get_main_param_and_optimizer_states(param)
                tensors = {key: held[key].detach().clone() for key in MOMENT_KEYS}
                pieces.append((names[param], ranges["param"].start, tensors))
    return {
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pieces": pieces,
        "steps": sorted({float(s["step"]) for s in distributed.optimizer.state.values()}),
        "num_steps": scheduler.num_steps,
        "lrs": [group["lr"] for group in distributed.optimizer.param_groups],
    }


def resume_worker(rank: int, world: int, port: int, folder: str, out: str) -> None:
    """One rank of a megatron-core training job resuming our legacy checkpoint under `folder` (an actor folder) the
    way Megatron-LM's `load_checkpoint` does: the model strictly, the optimizer's state dict, its parameter state file
    (`distrib_optim.pt`, through megatron-core's `load_parameter_state`), the LR scheduler's state, and the RNG of
    `rng_state[0]`. Writes what it then holds (`_held`), the tracker's states and draws of each RNG."""
    import random

    import numpy as np

    storage = open_storage(folder)
    iteration, states = mf.read_rank_states(storage, storage.url)
    start_rank(rank, world, port, states[0]["args"])
    from megatron.core import parallel_state, tensor_parallel

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    state = states[tp_rank]
    with _cuda_on_cpu():
        model, ddp, optimizer, scheduler = _training_job(state["args"])
        ddp.load_state_dict(dict(state["model"]), strict=True)
        optimizer.load_state_dict(state["optimizer"])
        (distributed,) = optimizer.chained_optimizers
        optim_file = os.path.join(folder, mf.iteration_dir(iteration), mf.rank_dir(tp_rank), "distrib_optim.pt")
        with step_held_aside(distributed), torch.no_grad():  # no_grad: the fp32 main weights are views of the params
            distributed.load_parameter_state(optim_file)
        scheduler.load_state_dict(state["opt_param_scheduler"])
    entry = state["rng_state"][0]  # Megatron-LM reads data-parallel rank 0's unless data_parallel_random_init
    random.setstate(entry["random_rng_state"])
    np.random.set_state(entry["np_rng_state"])
    torch.set_rng_state(entry["torch_rng_state"])
    assert entry["rng_tracker_states"], "Megatron-LM exits on an empty tracker state"
    tensor_parallel.get_cuda_rng_tracker().set_states(entry["rng_tracker_states"])
    result = {
        **_held(model, optimizer, scheduler),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
        "draws": [random.random(), float(np.random.rand()), torch.rand(3)],
        "buckets": [len(buffer.buckets) for buffer in ddp.buffers],  # its gradient buffer's buckets
    }
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def dist_load_worker(rank: int, world: int, port: int, folder: str, out: str) -> None:
    """One rank of a megatron-core training job reading our `torch_dist` checkpoint under `folder` (an iteration's
    folder) through `dist_checkpointing.load`: the model's sharded state dict, the optimizer's in the
    `fully_reshardable` layout, and its tensor-parallel rank's `rng_state` object, then loaded into the model (strict)
    and the optimizer as Megatron-LM does. Writes what it then holds (`_held`) and the RNG entries it read."""
    args = mf.load_file(os.path.join(folder, "common.pt"))["args"]
    start_rank(rank, world, port, args)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    tp_rank, tp = parallel_state.get_tensor_model_parallel_rank(), args.tensor_model_parallel_size
    dp_rank = parallel_state.get_data_parallel_rank()
    with _cuda_on_cpu():
        model, ddp, optimizer, scheduler = _training_job(args)
        (distributed,) = optimizer.chained_optimizers
        # the plain-torch optimizer has no state before its first step: megatron-core's own way to make it one, which
        # the load then overwrites (as its fsdp_dtensor load path does)
        distributed._init_optimizer_states_with_dummy_values()
        model_sd = model.sharded_state_dict()
        # the optimizer state's layout as Megatron-LM's load_checkpoint learns it: from the checkpoint's own metadata
        metadata = dist_checkpointing.load_content_metadata(folder)
        assert metadata is not None and metadata["distrib_optim_sharding_type"] == "fully_reshardable", metadata
        optimizer_sd = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)
        rng = ShardedObject("rng_state", None, (1, tp), (0, tp_rank), replica_id=dp_rank)
        loaded = dist_checkpointing.load({"model": model_sd, "optimizer": optimizer_sd, "rng_state": rng}, folder)
        model.load_state_dict(loaded["model"], strict=True)
        # `DistributedOptimizer.load_state_dict` in two halves around the `step` bug (the module docstring): the
        # groups and the step, then the parameter state
        state = dict(loaded["optimizer"])
        param_state = state.pop("param_state")
        assert state.pop("param_state_sharding_type") == "fully_reshardable"
        optimizer.load_state_dict(state)
        with step_held_aside(distributed), torch.no_grad():  # no_grad: the fp32 main weights are views of the params
            distributed.load_parameter_state_from_fully_reshardable(param_state)
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    result = {**_held(model, optimizer, scheduler), "rng_state": loaded["rng_state"], "iteration": loaded["iteration"]}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def held_state(results: list[dict], tp_rank: int, shapes: dict[str, torch.Size]) -> dict[str, dict[str, torch.Tensor]]:
    """{param|exp_avg|exp_avg_sq: {name: flat tensor}} that the megatron-core ranks of tensor-parallel rank `tp_rank`
    held together (NaN where no rank held an element)."""
    held = {
        key: {name: torch.full((shape.numel(),), float("nan")) for name, shape in shapes.items()} for key in MOMENT_KEYS
    }
    for result in (r for r in results if r["tp_rank"] == tp_rank):
        for name, first, tensors in result["pieces"]:
            for key, tensor in tensors.items():
                held[key][name][first : first + tensor.numel()] = tensor
    return held
