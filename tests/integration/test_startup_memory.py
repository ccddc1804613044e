"""A training rank's start-up never materialises the whole model: each rank's resident memory grows by about its own
part of the weights while it builds the policy, not by the whole model (real Ray actors, real gloo groups; the
peak resident set of the actor's process is read from /proc, reset just before `setup`)."""

from __future__ import annotations

import sys

import pytest

# 135M parameters (540 MB of float32 weights): large against the process's own allocations during set-up
BIG = (
    "+model.override_config={hidden_size:1024,num_hidden_layers:12,intermediate_size:2816,"
    "num_attention_heads:16,num_key_value_heads:4}"
)


def _rss_bytes(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measured_setup(worker) -> dict:
    """Runs inside the actor: the growth of its peak resident set over the set-up, and what it then holds of its own:
    its weights, and the storage of everything its parameters, gradients and optimizer moments are (FSDP's local
    shards; Megatron's gradient buffer and moments, allocated up front), each storage once."""
    import gc

    # A first build, not measured: what only the first one costs (lazy imports of the model code, which vary with
    # the installed packages, and one-time set-up) is not the model. Then it is dropped, and the second is measured.
    worker.setup()
    for name in ("model", "ref_model", "optimizer", "scheduler"):
        setattr(worker, name, None)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset VmHWM to the current resident set
    before = _rss_bytes("VmRSS")
    worker.setup()
    grown = _rss_bytes("VmHWM") - before
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    params = [local(p) for p in worker.model.parameters()]
    grads = [local(p.grad) for p in worker.model.parameters() if p.grad is not None]
    moments = list(getattr(worker.optimizer, "moments", {}).values())  # DistributedAdamW allocates them up front
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in params + grads + moments}
    return {"grown": grown, "own_weights": sum(p.numel() * 4 for p in params), "held": sum(storages.values())}


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_each_rank_builds_only_its_part_of_the_model(ray_session, tmp_path, backend):
    import torch
    from ray import cloudpickle
    from transformers import AutoModelForCausalLM

    from rlrunner.backends.registry import get_backend
    from rlrunner.cluster.worker_group import WorkerGroup
    from rlrunner.models.loading import build_hf_config, build_tokenizer

    from conftest import actor_worker_kwargs, run_config

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import this module by name
    overrides = [BIG, "actor.num_workers=2", f"actor.training_backend={backend}"]
    if backend == "megatron":
        overrides.append("actor.tensor_model_parallel_size=2")
    cfg = run_config(tmp_path, *overrides)
    kwargs = actor_worker_kwargs(cfg)
    config = build_hf_config(kwargs["model_cfg"], build_tokenizer(kwargs["model_cfg"]))
    with torch.device("meta"):
        whole = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_config(config).parameters())
    assert whole > 300e6

    worker_class = get_backend(backend).worker_class
    group = WorkerGroup(
        "actor", worker_class, 2, worker_kwargs=kwargs, cpus_per_worker=0.5, distributed=True, call_timeout_s=300
    )
    try:
        measured = group.get([w.__ray_call__.remote(_measured_setup) for w in group.workers])
    finally:
        group.shutdown()
    for rank, m in enumerate(measured):
        # each rank holds half the weights; the set-up may add a few generated blocks, never the whole model (the
        # build that made the whole model first grew by more than `whole` on top of what it kept; measured at this
        # commit: FSDP grew less than it holds, Megatron 25 MB more, in CI's venv and in one with a newer transformers)
        assert abs(m["own_weights"] - whole / 2) < 0.05 * whole, (rank, m, whole)
        # at most its share of the training state (16 bytes per parameter over 2 ranks: twice the fp32 weights)
        assert m["held"] < 2.05 * whole, (rank, m, whole)
        assert m["grown"] < m["held"] + 0.2 * whole, (rank, m, whole)
