"""The Megatron (tensor-parallel) training backend end to end on real Ray: layout, bitwise resume, data x tensor
parallel dispatch, resharding over tensor-parallel sizes, corrupt shards, retention, converters.

The session's Megatron reference run (tests/reference_runs.py: tp=2 x dp=1, 10 steps, saves at 3, 6, 9 and 10) is
what the runs here are compared with, and resumed from; they train 8 steps and save every 3 (RUN), with the same data
as test_checkpoint_e2e.py (6 steps per epoch).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from reference_runs import (
    NUMERICS,
    REFERENCE_STEPS,
    Reference,
    actor_rng_states,
    assert_resumed_bitwise,
    assert_same_weights,
    reference_run,
    start_weights,
)
from spawned_ranks import spawn_ranks

from rlrunner.backends.megatron.files import read_rank_states, read_tracker
from rlrunner.backends.megatron.layout import DecoderDims, expected_megatron_keys
from rlrunner.backends.megatron.megatron_entries import RLRUNNER_SCHEDULER, optimizer_step
from rlrunner.backends.megatron.moment_files import read_moments
from rlrunner.checkpoint.manifest import read_manifest
from rlrunner.checkpoint.status import COMPLETE, scan_checkpoints
from rlrunner.errors import CheckpointError
from rlrunner.runner.supervisor import Supervisor
from rlrunner.tools.convert import load_model_weights

from conftest import LOCAL, Inspect, assert_bit_equal, read_metrics, run_config, run_toolkit, without_time

pytestmark = pytest.mark.slow

RUN = [*NUMERICS, "runner.max_steps=8", "runner.save_interval=3"]  # test_checkpoint_e2e.py's runs

# two query groups, so that tp=2 splits them; megatron backend
MEGATRON = ["model.override_config.num_key_value_heads=2", "actor.training_backend=megatron"]


def megatron_config(out: Path, tp: int, workers: int, *overrides: str):
    return run_config(
        out, *RUN, *MEGATRON, f"actor.tensor_model_parallel_size={tp}", f"actor.num_workers={workers}", *overrides
    )


@pytest.fixture(scope="module")
def reference(ray_session, tmp_path_factory) -> Reference:
    """The session's Megatron reference run: megatron_config(out, 2, 2) of 10 steps (trained in this module's Ray if no
    module before trained it)."""
    return reference_run("megatron", tmp_path_factory)


def resume(tmp_path: Path, resume_dir, tp: int = 2, workers: int = 2, *overrides: str, callbacks=()) -> Path:
    Supervisor(
        megatron_config(tmp_path, tp, workers, f"runner.resume_dir={resume_dir}", *overrides), callbacks=list(callbacks)
    ).run()
    return tmp_path / "test"


def test_checkpoints_are_in_megatrons_layout_and_read_with_weights_only(reference):
    root = reference.experiment / "checkpoints"
    assert REFERENCE_STEPS == 10  # saves every 3 steps, and at the last
    assert sorted(p.name for p in root.iterdir()) == [
        "global_step_10",
        "global_step_3",
        "global_step_6",
        "global_step_9",
    ]
    assert [s.status for s in scan_checkpoints(LOCAL, str(root), checksums=True)] == [COMPLETE] * 4
    actor = reference.checkpoint(6) / "actor"
    assert sorted(p.name for p in actor.iterdir()) == [
        "huggingface",
        "iter_0000006",
        "latest_checkpointed_iteration.txt",
    ]
    assert sorted(p.name for p in (actor / "iter_0000006").iterdir()) == ["mp_rank_00", "mp_rank_01"]
    for rank in ("mp_rank_00", "mp_rank_01"):
        assert sorted(p.name for p in (actor / "iter_0000006" / rank).iterdir()) == [
            "distrib_optim.pt",
            "model_optim_rng.pt",
        ]
    assert read_tracker(LOCAL, str(actor)) == 6
    manifest = read_manifest(LOCAL, str(reference.checkpoint(6)))
    assert manifest["backend"] == "megatron-tp" and manifest["world_size"] == 2
    assert "actor/latest_checkpointed_iteration.txt" in manifest["files"]

    iteration, states = read_rank_states(LOCAL, str(actor))  # torch.load(weights_only=True), Namespace allowed
    assert iteration == 6 and len(states) == 2
    dims = DecoderDims.from_config(json_config(actor / "huggingface" / "config.json"))
    for tp_rank, state in enumerate(states):
        args = state["args"]
        assert (args.tensor_model_parallel_size, args.data_parallel_size, args.padded_vocab_size) == (2, 1, 256)
        assert args.vocab_size == 99 and args.use_distributed_optimizer
        assert set(state["model"]) == set(expected_megatron_keys(dims))  # what megatron-core's strict load expects
        assert state["checkpoint_version"] == 3.0 and state["iteration"] == 6
        assert len(state["rng_state"]) == 1 and {"random_rng_state", "np_rng_state", "torch_rng_state"} <= set(
            state["rng_state"][0]
        )
        # the optimizer and its schedule in Megatron's shapes (megatron-core's own loaders read them:
        # test_megatron_core.py), our LR scheduler's state beside them; 6 steps of 16 samples each
        scheduler = state["opt_param_scheduler"]
        assert scheduler[RLRUNNER_SCHEDULER]["last_epoch"] == 6 and optimizer_step(state["optimizer"]) == 6
        assert (args.global_batch_size, args.consumed_train_samples, scheduler["num_steps"]) == (16, 96, 96)
        assert set(state["rng_state"][0]["rng_tracker_states"]) == {
            "data-parallel-rng",
            "model-parallel-rng",
            "expert-parallel-rng",
        }
        moments = read_moments(LOCAL, str(actor), 6, tp_rank)
        assert moments.step == 6
        weights = {k: v for k, v in state["model"].items() if v is not None}
        assert_bit_equal(dict(moments.tensors("param")), weights)  # the fp32 weights, as megatron-core keeps them
        assert [name for name, _ in moments.layout] == list(weights)  # the model's order: the optimizer's flat order
        assert all(moments.tensor("exp_avg", k).shape == weights[k].shape for k in weights)
        # the padding rows of the vocabulary (99..255: rank 0's rows 99..127, all of rank 1's) are zero and never
        # get a gradient, so their moments stay zero
        padding = slice(max(0, 99 - 128 * tp_rank), 128)
        for table in (weights, moments.tensors("exp_avg"), moments.tensors("exp_avg_sq")):
            assert torch.count_nonzero(table["embedding.word_embeddings.weight"][padding]) == 0
            assert torch.count_nonzero(table["output_layer.weight"][padding]) == 0
    assert torch.count_nonzero(read_moments(LOCAL, str(actor), 6, 0).tensor("exp_avg_sq", "output_layer.weight")) > 0
    # the replicated norms are the same on both ranks
    assert torch.equal(
        states[0]["model"]["decoder.final_layernorm.weight"], states[1]["model"]["decoder.final_layernorm.weight"]
    )


def json_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path.parent))


def test_training_learns_and_the_converter_gives_the_live_policy(reference, tmp_path):
    from transformers import AutoModelForCausalLM

    last = reference.metrics[-1]
    assert last["actor/lr"] == pytest.approx(3e-4) and all(m["actor/skipped_steps"] == 0 for m in reference.metrics)
    # a step learns when its rewards differ within a group (a gradient): the policy moves at the first such step, and
    # ends the run away from the initial one (the tiny model's rewards are too sparse to trend up in 10 steps)
    learning = [m["step"] for m in reference.metrics if m["actor/grad_norm"] > 0]
    assert learning, "no step had a gradient"
    assert differs(reference.weights(learning[0]), reference.weights(learning[0] - 1))
    assert differs(reference.weights(), reference.weights(0))
    out = tmp_path / "hf"
    run_toolkit("convert_megatron_to_hf", "--ckpt_path", str(reference.checkpoint(10)), "--output_path", str(out))
    model = AutoModelForCausalLM.from_pretrained(out)
    assert_same_weights(model.state_dict(), reference.weights(10))  # the HF model's key order
    assert_bit_equal(load_model_weights(reference.checkpoint(10)), reference.weights(10))


def differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Some tensor of the same keys differs."""
    assert a.keys() == b.keys()
    return any(not torch.equal(a[k], b[k]) for k in b)


def test_it_trains_like_the_fsdp_backend(reference, tmp_path):
    """The same model, data and seeds with FSDP (2 data-parallel ranks): the same run up to float reduction order."""
    Supervisor(run_config(tmp_path, *RUN, "model.override_config.num_key_value_heads=2", "runner.max_steps=4")).run()
    fsdp = read_metrics(tmp_path / "test" / "metrics.jsonl")
    assert fsdp[0]["rollout/reward_mean"] == reference.metrics[0]["rollout/reward_mean"]
    for got, want in zip(fsdp, reference.metrics[:4]):
        for key in ("actor/grad_norm", "actor/entropy", "actor/loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)


def test_resume_mid_epoch_is_bitwise_identical_to_the_uninterrupted_run(reference, tmp_path):
    """(The epoch boundary is the data loader's business, tested with FSDP.) Every rank's own RNG state comes back
    too: the reference seeded each rank differently, so a restore of "rank 0's copy everywhere" (or none) would end
    with other states than the reference's."""
    assert not torch.equal(reference.rng(8)[0], reference.rng(8)[1])
    seen = {}
    end = Inspect(on_end=lambda trainer: seen.update(rng=actor_rng_states(trainer)))
    assert_resumed_bitwise(resume(tmp_path, reference.checkpoint(3), callbacks=[end]), reference, 3, 8)
    assert all(torch.equal(a, b) for a, b in zip(seen["rng"], reference.rng(8), strict=True))


def test_a_resume_with_recomputation_ends_bitwise_identical(reference, tmp_path):
    """actor.gradient_checkpointing=true recomputes each layer (its tensor-parallel collectives too) in the backward:
    the same gradients as keeping the activations (the default for the tiny model), so the same run."""
    assert_resumed_bitwise(
        resume(tmp_path, reference.checkpoint(6), 2, 2, "actor.gradient_checkpointing=true"), reference, 6, 8
    )


@pytest.mark.parametrize("tp, workers", [(1, 2), (2, 4)], ids=["tp1_dp2", "tp2_dp2"])  # tp1 x dp1: the next test
def test_a_tp2_checkpoint_loads_at_other_parallel_sizes_exactly(reference, tmp_path, caplog, tp, workers):
    """Resharding through the HF layout: the live weights after the load are the checkpoint's, bit for bit."""
    with caplog.at_level(logging.WARNING):
        # runner.max_steps=6: nothing left to train, the run ends once started
        loaded = start_weights(
            megatron_config(
                tmp_path, tp, workers, f"runner.resume_dir={reference.checkpoint(6)}", "runner.max_steps=6"
            ),
            step=6,
        )
    assert_bit_equal(loaded, load_model_weights(reference.checkpoint(6)))
    if workers != 2:
        assert f"resharding global_step_6 from 2 to {workers} actor ranks" in caplog.text
    if tp != 2:
        assert "from tensor-parallel size 2 to 1 through the HF layout" in caplog.text
    else:
        assert "tensor-parallel size 2 to" not in caplog.text


def test_resharding_tp2_to_tp1_and_back_goes_on_training_like_the_reference(reference, tmp_path):
    # tp=2 -> tp=1: steps 7, 8 from global_step_6 (the update reduces in another order: close, not bitwise)
    one = resume(tmp_path / "tp1", reference.checkpoint(6), 1, 1)
    resumed = read_metrics(one / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [7, 8]
    for key in ("rollout/reward_mean", "rollout/response_length_mean"):
        assert resumed[0][key] == reference.metrics[6][key]  # step 7 generates with the restored weights
    for got, want in zip(resumed, reference.metrics[6:8], strict=True):
        assert got["actor/entropy"] == pytest.approx(want["actor/entropy"], rel=1e-4)
        assert got["actor/loss"] == pytest.approx(want["actor/loss"], abs=1e-4)
    final, want = load_model_weights(one / "checkpoints" / "global_step_8"), reference.weights(8)
    assert final.keys() == want.keys() and all(torch.allclose(final[k], want[k], atol=1e-4) for k in final)
    # and the tp=1 checkpoint back at tp=2: loads exactly
    loaded = start_weights(
        megatron_config(tmp_path / "back", 2, 2, f"runner.resume_dir={one / 'checkpoints' / 'global_step_8'}")
    )
    assert_bit_equal(loaded, final)


def test_data_parallel_with_a_sharded_optimizer_matches_and_resumes_bitwise(reference, tmp_path):
    """dp=2 x tp=2: each data-parallel rank gets half the rows, metrics are counted once per data-parallel rank, the
    optimizer state and the weights are split over the data-parallel ranks (ZeRO-3, the default) and each rank saves
    its own slice of the moments (nothing gathered; the weights are written a layer at a time). Resumed with whole
    weights (ZeRO-2, Megatron-LM's layout) and background saves, the run goes on bit for bit: the same files, the
    same numbers."""
    # synchronous saves: each unit's weights written into model_optim_rng.pt while it is gathered
    Supervisor(
        megatron_config(
            tmp_path / "full", 2, 4, "runner.max_steps=4", "runner.save_interval=2", "runner.async_save=false"
        )
    ).run()
    full = read_metrics(tmp_path / "full" / "test" / "metrics.jsonl")
    assert [m["step"] for m in full] == [1, 2, 3, 4]
    assert full[0]["rollout/reward_mean"] == reference.metrics[0]["rollout/reward_mean"]
    for got, want in zip(full, reference.metrics[:4]):  # the same training as dp=1, up to the reduction order
        assert got["actor/entropy"] == pytest.approx(want["actor/entropy"], rel=1e-4)
        assert got["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-3)
    actor = tmp_path / "full" / "test" / "checkpoints" / "global_step_2" / "actor"
    _, states = read_rank_states(LOCAL, str(actor))
    assert [len(s["rng_state"]) for s in states] == [2, 2] and states[0]["args"].data_parallel_size == 2
    for rank in ("mp_rank_00", "mp_rank_01"):
        assert sorted(p.name for p in (actor / "iter_0000002" / rank).iterdir()) == [
            "distrib_optim.pt",
            "model_optim_rng.pt",
        ]
    moments = read_moments(LOCAL, str(actor), 2, 0)
    assert moments.flat("exp_avg", 0, moments.numel).shape == (moments.numel,)  # both DP ranks' slices in one file
    assert all(moments.tensor("exp_avg", k).shape == t.shape for k, t in states[0]["model"].items() if t is not None)

    Supervisor(
        megatron_config(
            tmp_path / "resumed",
            2,
            4,
            "runner.max_steps=4",
            "runner.save_interval=2",
            f"runner.resume_dir={actor.parent}",
            "actor.megatron.shard_weights=false",
        )
    ).run()
    resumed = read_metrics(tmp_path / "resumed" / "test" / "metrics.jsonl")
    assert without_time(resumed) == without_time(full[2:])
    assert_bit_equal(
        load_model_weights(tmp_path / "resumed" / "test" / "checkpoints" / "global_step_4"),
        load_model_weights(tmp_path / "full" / "test" / "checkpoints" / "global_step_4"),
    )


def test_auto_skips_a_corrupt_shard_and_still_ends_bitwise(reference, tmp_path, caplog):
    copy = tmp_path / "test"
    shutil.copytree(reference.experiment, copy)
    shard = copy / "checkpoints" / "global_step_10" / "actor" / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, another CRC-32
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO, logger="rlrunner.checkpoint"):
        Supervisor(
            megatron_config(tmp_path, 2, 2, "runner.resume_dir=auto", f"runner.max_steps={REFERENCE_STEPS}")
        ).run()
    assert "skipping global_step_10: corrupt (actor/iter_0000010/mp_rank_01/model_optim_rng.pt: checksum" in caplog.text
    assert_bit_equal(
        load_model_weights(copy / "checkpoints" / "global_step_10"), load_model_weights(reference.checkpoint(10))
    )


def test_retention_keeps_the_newest_with_a_kl_reference_and_bfloat16_compute(ray_session, tmp_path):
    # dp 2 x tp 1 with the whole gradients all-reduced once per step (ZeRO-1), the other runs' sharded ones aside
    Supervisor(
        megatron_config(
            tmp_path,
            1,
            2,
            "runner.max_steps=4",
            "runner.save_interval=1",
            "runner.max_ckpt_to_keep=2",
            "algorithm.use_kl_loss=true",
            "actor.param_dtype=bfloat16",
            "actor.megatron.shard_gradients=false",
            "actor.megatron.shard_weights=false",
        )
    ).run()
    root = tmp_path / "test" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["global_step_3", "global_step_4"]
    assert [s.status for s in scan_checkpoints(LOCAL, str(root), checksums=True)] == [COMPLETE] * 2
    metrics = read_metrics(tmp_path / "test" / "metrics.jsonl")
    # the frozen reference is the initial policy: no divergence until the policy has moved (a step's KL is measured
    # before its update: from the step after the first with a gradient), some once it has
    moved = False
    for m in metrics:
        assert m["actor/kl"] > 0 if moved else m["actor/kl"] == pytest.approx(0.0, abs=1e-3), m
        moved = moved or m["actor/grad_norm"] > 0
    assert all(m["actor/skipped_steps"] == 0 for m in metrics)
    weights = load_model_weights(root / "global_step_4")
    assert all(t.dtype == torch.float32 for t in weights.values())  # master weights stay float32


def test_a_checkpoint_of_the_other_backend_is_refused(reference, tmp_path):
    runner = Supervisor(run_config(tmp_path, *RUN, "model.override_config.num_key_value_heads=2"))
    checkpoint = runner.ctx.handler.find_resume(str(reference.checkpoint(3)))
    # refused before any worker is asked to load (no actor group is needed to see it)
    with pytest.raises(CheckpointError, match="was written by the megatron-tp backend, this run uses fsdp2-dcp"):
        runner.ctx.handler.load(checkpoint, runner.ctx.checkpoint_manager(None))


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_a_run_on_s3_saves_and_resumes_from_the_store_bitwise(reference, s3_store, tmp_path, ckpt_format):
    from test_s3_runs import s3_overrides

    from rlrunner.storage import open_storage

    url, options = s3_store
    layout = [f"actor.megatron.ckpt_format={ckpt_format}"]
    remote = s3_overrides(url, options, tmp_path / "cache-a")
    Supervisor(megatron_config(tmp_path, 2, 2, *remote, *layout, "runner.max_steps=4", "runner.save_interval=2")).run()
    storage = open_storage(url, options)
    actor = f"{url}/test/checkpoints/global_step_4/actor"
    assert read_tracker(storage, actor) == 4
    written = "mp_rank_01/distrib_optim.pt" if ckpt_format == "torch" else "__1_0.distcp"
    assert storage.exists(f"{actor}/iter_0000004/{written}")
    # another machine (an empty log cache) resumes from the store and ends where the local run ended
    remote = s3_overrides(url, options, tmp_path / "cache-b")
    Supervisor(megatron_config(tmp_path, 2, 2, *remote, *layout, "runner.resume_dir=auto")).run()
    metrics = [json.loads(line) for line in storage.read_bytes(f"{url}/test/metrics.jsonl").decode().splitlines()]
    assert without_time(metrics) == without_time(reference.metrics[:8])
    assert_bit_equal(
        load_model_weights(f"{url}/test/checkpoints/global_step_8", storage_options=options), reference.weights(8)
    )
    assert not (tmp_path / "test").exists()


def test_megatron_core_loads_a_trained_checkpoint_strictly(reference, tmp_path):
    """megatron-core's GPTModel (CPU, gloo, tp=2) accepts each rank's `model` of a checkpoint the backend wrote, and
    what it loaded is the trained policy."""
    import megatron.core  # noqa: F401  (the test extra installs it: the check must run, never skip)
    from ports import free_port
    from test_megatron_core import megatron_core_worker
    from transformers import AutoModelForCausalLM

    from rlrunner.backends.megatron.to_hf import megatron_to_hf

    actor = tmp_path / "actor"
    shutil.copytree(reference.checkpoint(10) / "actor", actor)
    spawn_ranks(megatron_core_worker, args=(2, free_port(), str(actor)), nprocs=2)  # raises if a rank fails
    results = [torch.load(actor / f"megatron_core_rank{r}.pt", weights_only=True) for r in range(2)]
    config = json_config(actor / "huggingface" / "config.json")
    assert_bit_equal(megatron_to_hf([r["model"] for r in results], config), reference.weights(10))
    policy = AutoModelForCausalLM.from_config(config)
    policy.load_state_dict(reference.weights(10))
    with torch.no_grad():
        expected = policy(torch.tensor([[3, 17, 42, 98, 0, 5, 61]])).logits
    assert torch.allclose(results[0]["logits"][..., :99], expected, atol=1e-5)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_a_llama_model_trains_and_resumes_bitwise(ray_session, tmp_path, ckpt_format) -> None:
    """The embedded model as a Llama (`+model.override_config.model_type=llama`: no QKV bias) trains at tp 2 with the
    hf rollout engine, its checkpoints in either format are a Llama's, and a resume mid-run ends bit-identical."""
    llama = [
        "+model.override_config.model_type=llama",
        "runner.max_steps=4",
        "runner.save_interval=2",
        f"actor.megatron.ckpt_format={ckpt_format}",
    ]
    Supervisor(megatron_config(tmp_path / "full", 2, 2, *llama)).run()
    full = read_metrics(tmp_path / "full" / "test" / "metrics.jsonl")
    assert [m["step"] for m in full] == [1, 2, 3, 4]
    checkpoint = tmp_path / "full" / "test" / "checkpoints" / "global_step_2"
    if ckpt_format == "torch":
        _, states = read_rank_states(LOCAL, str(checkpoint / "actor"))
        assert not states[0]["args"].add_qkv_bias
        assert "decoder.layers.0.self_attention.linear_qkv.bias" not in states[0]["model"]
    weights = load_model_weights(tmp_path / "full" / "test" / "checkpoints" / "global_step_4")
    assert "model.layers.0.self_attn.q_proj.weight" in weights and not any(k.endswith("_proj.bias") for k in weights)
    Supervisor(megatron_config(tmp_path / "resumed", 2, 2, *llama, f"runner.resume_dir={checkpoint}")).run()
    resumed = read_metrics(tmp_path / "resumed" / "test" / "metrics.jsonl")
    assert without_time(resumed) == without_time(full[2:])
    assert_bit_equal(weights, load_model_weights(tmp_path / "resumed" / "test" / "checkpoints" / "global_step_4"))


def test_torch_dist_checkpoints_resume_bitwise_and_convert(reference, tmp_path):
    """`actor.megatron.ckpt_format=torch_dist` changes no number: the run saves megatron-core's distributed format
    under the commit protocol, a resume from it (by a run saving the legacy layout) ends bit-identical to the
    reference, and the converter and `load_model_weights` read the reference's weights from it
    (test_megatron_torch_dist.py: layouts, megatron-core)."""
    from transformers import AutoModelForCausalLM

    dist = ["actor.megatron.ckpt_format=torch_dist"]
    Supervisor(megatron_config(tmp_path / "dist", 2, 2, *dist, "runner.max_steps=3")).run()
    checkpoint = tmp_path / "dist" / "test" / "checkpoints" / "global_step_3"
    files = read_manifest(LOCAL, str(checkpoint))["files"]
    assert {"actor/iter_0000003/common.pt", "actor/iter_0000003/metadata.json", "actor/iter_0000003/.metadata"} <= set(
        files
    )
    assert sorted(k for k in files if k.endswith(".distcp")) == [f"actor/iter_0000003/__{r}_0.distcp" for r in (0, 1)]
    assert_bit_equal(load_model_weights(checkpoint), reference.weights(3))
    out = tmp_path / "hf"
    run_toolkit("convert_megatron_to_hf", "--ckpt_path", str(checkpoint), "--output_path", str(out))
    assert_same_weights(AutoModelForCausalLM.from_pretrained(out).state_dict(), reference.weights(3))
    # a new run started from it (model.path) at tp 1, each tensor read whole
    started = start_weights(megatron_config(tmp_path / "new", 1, 1, f"model.path={checkpoint}", "runner.max_steps=1"))
    assert_same_weights(started, reference.weights(3))
    # resumed by a run that saves the legacy layout: a checkpoint is read in the format it was written in
    assert_resumed_bitwise(resume(tmp_path / "resumed", checkpoint, 2, 2), reference, 3, 8)
