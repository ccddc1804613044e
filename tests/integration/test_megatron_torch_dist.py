"""megatron-core's distributed checkpoint format (`actor.megatron.ckpt_format=torch_dist`), saved by real
`MegatronActorWorker`s over real gloo groups (spawned processes, no Ray): every rank writes its own part (the
data-parallel ranks distinct parts of the weights and moments), synchronously or in the background; a load at the
saved layout and at other tensor-parallel and data-parallel sizes gets the weights and moments bit for bit; and
megatron-core's own `dist_checkpointing.load` reads the model and the `fully_reshardable` optimizer state from it
(tests/megatron_core_loader.py) and holds the same values."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from ports import free_port
from spawned_ranks import spawn_ranks

from rlrunner.backends.megatron.dist_ckpt import COMMON_FILE, FORMAT_FILE
from rlrunner.backends.megatron.file_writes import write_tracker
from rlrunner.backends.megatron.files import iteration_dir, load_file
from rlrunner.storage import open_storage

from conftest import assert_bit_equal, run_config
from megatron_core_loader import dist_load_worker, held_state
from megatron_models import spawn_workers, worker_kwargs

STEP = 4
DIST = "actor.megatron.ckpt_format=torch_dist"


def _full_state(worker) -> dict:
    """This tensor-parallel rank's whole state: the weights (its shard, megatron-core names) and both moments per
    parameter (gathered over data-parallel ranks: a collective)."""
    from rlrunner.backends.megatron.weight_units import UnitCursor

    cursor = UnitCursor(worker.optimizer.units, worker.optimizer.space)
    weights = {
        k: cursor.tensor(k).detach().clone() for k in worker.model.state_dict() if not k.endswith("_extra_state")
    }
    cursor.finish()
    state = worker.optimizer.full_state()
    return {"weights": weights, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"], "step": state["step"]}


def _save(worker, folders: dict[str, str], out: str) -> None:
    """Give the moments known values and a step, save to each folder ({"sync"|"background": url}), and write what this
    rank held (its tensor-parallel rank's whole state, from data-parallel rank 0) under `out`."""
    from rlrunner.backends.megatron.worker import replicated_names

    opt = worker.optimizer
    start, stop = opt._own_range()
    generator = torch.Generator().manual_seed(100)
    replicated = replicated_names(worker.model)
    for key in ("exp_avg", "exp_avg_sq"):
        # what a run holds: the same moments on every tensor-parallel rank for the replicated norms, others per rank
        flat = torch.randn(opt.space.numel, generator=generator)
        for index, name in enumerate(opt.names):
            piece = flat[opt.space.offsets[index] : opt.space.offsets[index + 1]]
            if name not in replicated:
                piece += 10.0 * worker.tp_rank
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):  # the vocabulary's padding rows
                rows = piece.view(opt.params[index].shape)
                rows[max(0, 99 - rows.shape[0] * worker.tp_rank) :] = 0.0
        opt.moments[key][: stop - start].copy_(flat[start:stop])
    opt._set_chunk_state(STEP)
    for mode, url in folders.items():
        background = mode == "background"
        worker.start_checkpoint(url, STEP, background, None)
        if background:  # training's collectives go on in this thread while the save's run in the saver's
            for _ in range(30):
                dist.all_reduce(torch.ones(4096), group=worker.dp_group)
                dist.all_reduce(torch.ones(4096), group=worker.tp_group)
        files = worker.finish_checkpoint()["files"]
        assert all(name.startswith(iteration_dir(STEP) + "/") for name in files), files
        dist.barrier()
        if worker.rank == 0:
            write_tracker(open_storage(url), url, STEP)
        dist.barrier()
    state = _full_state(worker)
    if worker.dp_rank == 0:
        torch.save(state, os.path.join(out, f"held_tp{worker.tp_rank}.pt"))


def _load(worker, folders: list[str], out: str) -> None:
    """Each folder loaded at this layout holds what the saving run held (its weights and moments, resharded), bit for
    bit; written under `out` for the test process to compare."""
    results = []
    for url in folders:
        for key in ("exp_avg", "exp_avg_sq"):
            worker.optimizer.moments[key].zero_()
        worker.load_checkpoint(url, None)
        results.append(_full_state(worker))
    if worker.dp_rank == 0:
        torch.save(results, os.path.join(out, f"loaded_tp{worker.tp_rank}_of{worker.tp}.pt"))


def test_torch_dist_is_saved_by_every_rank_and_loads_at_other_layouts_bit_for_bit(tmp_path) -> None:
    from rlrunner.backends.megatron.layout import hf_to_megatron
    from rlrunner.backends.megatron.to_hf import megatron_to_hf

    folders = {mode: str(tmp_path / mode) for mode in ("sync", "background")}
    out = tmp_path / "out"
    out.mkdir()
    spawn_workers(4, worker_kwargs(tmp_path, 2, 4, DIST), _save, folders, str(out))  # dp 2 x tp 2, sharded weights
    for url in folders.values():
        folder = Path(url) / iteration_dir(STEP)
        assert json.loads((folder / FORMAT_FILE).read_text())["sharded_backend"] == "torch_dist"
        assert sorted(p.name for p in folder.iterdir() if p.suffix == ".distcp") == [
            f"__{r}_0.distcp" for r in range(4)
        ]
        common = load_file(str(folder / COMMON_FILE))  # weights_only
        assert common["iteration"] == STEP and common["args"].ckpt_format == "torch_dist"
        assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
        assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    held = [torch.load(out / f"held_tp{r}.pt", weights_only=True) for r in range(2)]
    _megatron_core_holds_it(folders["background"], held, tmp_path / "megatron_core")
    config = _hf_config(tmp_path)

    def at_tp1(shards: list[dict]) -> dict:  # tp 2 shards merged through the HF layout, split for tp 1
        merged = hf_to_megatron(megatron_to_hf(shards, config), config, 1)[0]
        return {k: v for k, v in sorted(merged.items()) if v is not None}

    # at tp 1 x dp 1, tp 2 x dp 1 (whole weights) and tp 1 x dp 3
    for tp, world, extra in (
        (1, 1, ()),
        (2, 2, ("actor.megatron.shard_weights=false",)),
        (1, 3, ("data.batch_size=3",)),
    ):
        spawn_workers(world, worker_kwargs(tmp_path, tp, world, DIST, *extra), _load, list(folders.values()), str(out))
        loaded = [torch.load(out / f"loaded_tp{r}_of{tp}.pt", weights_only=True) for r in range(tp)]
        for index in range(len(folders)):
            for key in ("weights", "exp_avg", "exp_avg_sq"):
                if tp == 2:
                    for r in range(2):
                        assert_bit_equal(loaded[r][index][key], held[r][key])
                else:
                    got = dict(sorted(loaded[0][index][key].items()))
                    assert_bit_equal(got, at_tp1([held[r][key] for r in range(2)]))
            assert all(rank[index]["step"] == STEP for rank in loaded)


def _megatron_core_holds_it(url: str, held: list[dict], out: Path) -> None:
    """megatron-core at the saved layout (dp 2 x tp 2) reads the checkpoint with `dist_checkpointing.load` and holds
    the saving run's weights and moments, element for element, its step, and each tensor-parallel rank's RNG states."""
    out.mkdir()
    folder = Path(url) / iteration_dir(STEP)
    spawn_ranks(dist_load_worker, args=(4, free_port(), str(folder), str(out)), nprocs=4)
    results = [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(4)]
    for tp_rank in range(2):
        weights = held[tp_rank]["weights"]
        got = held_state(results, tp_rank, {name: tensor.shape for name, tensor in weights.items()})
        expected = {"param": weights, "exp_avg": held[tp_rank]["exp_avg"], "exp_avg_sq": held[tp_rank]["exp_avg_sq"]}
        for key, tensors in expected.items():
            assert_bit_equal(got[key], {name: tensor.reshape(-1) for name, tensor in tensors.items()})
    for result in results:
        assert result["steps"] == [float(STEP)] and result["iteration"] == STEP
        assert len(result["rng_state"]) == 2 and set(result["rng_state"][0]) >= {
            "torch_rng_state",
            "rng_tracker_states",
        }


def _hf_config(tmp_path: Path):
    from omegaconf import OmegaConf

    from rlrunner.models.loading import build_hf_config, build_tokenizer

    model_cfg = OmegaConf.to_container(run_config(tmp_path, "model.override_config.num_key_value_heads=2").model)
    return build_hf_config(model_cfg, build_tokenizer(model_cfg))
