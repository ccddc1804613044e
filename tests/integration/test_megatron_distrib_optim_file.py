"""The Megatron backend's `mp_rank_XX/distrib_optim.pt`, one per tensor-parallel rank at every data-parallel size,
saved by real `MegatronActorWorker`s over real gloo groups (spawned processes, no Ray), in megatron-core's
coalesced-bucket layout: data-parallel rank 0 writes it while the other ranks stream their slices of the weights and
moments into it (`moment_save`), and it alone records it. A
synchronous save with sharded weights (the units walked while model_optim_rng.pt is written, then the transfers) and a
background one (the transfers in the saver's thread while the training thread runs collectives) give the same files,
megatron-core's own loader at the saved layout holds the weights and moments bit for bit, and a load at another
data-parallel size gets the moments bit for bit; so does an older checkpoint's per data-parallel rank slice files
(format 2)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from ports import free_port
from spawned_ranks import spawn_ranks

from rlrunner.backends.megatron import moment_save
from rlrunner.backends.megatron.file_writes import write_state_file, write_tracker
from rlrunner.backends.megatron.files import load_file, rank_file, read_rank_states
from rlrunner.backends.megatron.moment_files import (
    COALESCED_FORMAT,
    MOMENTS,
    moment_file,
    moment_slice_state,
    optimizer_file,
    read_moments,
)
from rlrunner.storage import open_storage

from conftest import assert_bit_equal
from megatron_core_loader import held_state, resume_worker
from megatron_models import spawn_workers, worker_kwargs

STEP = 4
CHUNK = 777  # elements: a slice of the tiny model's moments is many chunks
BUCKETS = ["actor.megatron.overlap_grad_reduce=true", "actor.megatron.ddp_bucket_size=2000"]


def _expected(tp_rank: int, numel: int) -> dict[str, torch.Tensor]:
    """The flat moments of tensor-parallel rank `tp_rank` the saving run holds (random, distinct per moment and
    rank)."""
    return {
        key: torch.randn(numel, generator=torch.Generator().manual_seed(100 * tp_rank + index))
        for index, key in enumerate(MOMENTS)
    }


def _save(worker, folders: dict[str, str]) -> None:
    """Give the moments known values, then save them to each folder ({"sync"|"background": url})."""
    moment_save.CHUNK_ELEMENTS = CHUNK
    opt = worker.optimizer
    start, stop = opt._own_range()
    for key, flat in _expected(worker.tp_rank, opt.space.numel).items():
        opt.moments[key][: stop - start].copy_(flat[start:stop])
    opt._set_chunk_state(STEP)
    for mode, url in folders.items():
        background = mode == "background"
        worker.start_checkpoint(url, STEP, background, None)
        if background:  # training's collectives go on in this thread while the moments travel in the saver's
            for _ in range(30):
                dist.all_reduce(torch.ones(4096), group=worker.dp_group)
                dist.all_reduce(torch.ones(4096), group=worker.tp_group)
        files = worker.finish_checkpoint()["files"]
        names = {rank_file(STEP, worker.tp_rank), optimizer_file(STEP, worker.tp_rank)}
        assert set(files) == (names if worker.dp_rank == 0 else set()), (mode, worker.rank, files)  # recorded once
        dist.barrier()
        if worker.rank == 0:
            write_tracker(open_storage(url), url, STEP)
        dist.barrier()


def _load(worker, folders: list[str]) -> None:
    """Each folder's moments, loaded at this data-parallel size, are the saved ones bit for bit."""
    opt = worker.optimizer
    expected = {
        key: dict(zip(opt.names, opt.space.views(flat)))
        for key, flat in _expected(worker.tp_rank, opt.space.numel).items()
    }
    for url in folders:
        opt.moments["exp_avg"].zero_()
        opt.moments["exp_avg_sq"].zero_()
        worker.load_checkpoint(url, None)
        state = opt.full_state()
        assert state["step"] == STEP, url
        for key in MOMENTS:
            assert_bit_equal(state[key], expected[key])


def _check_layout(root: Path, tp: int, dp: int) -> None:
    storage = open_storage(str(root))
    for tp_rank in range(tp):
        folder = root / "iter_0000004" / f"mp_rank_{tp_rank:02d}"
        assert sorted(p.name for p in folder.iterdir()) == ["distrib_optim.pt", "model_optim_rng.pt"]
        state = load_file(str(folder / "distrib_optim.pt"))  # torch.load(weights_only=True)
        assert (state["format"], state["buckets_coalesced"], state["data_parallel_size"]) == (
            COALESCED_FORMAT,
            True,
            dp,
        )
        assert state["step"] == STEP and state["tensor_model_parallel_size"] == tp
        moments = read_moments(storage, str(root), STEP, tp_rank)
        assert_bit_equal(
            {key: moments.flat(key, 0, moments.numel) for key in MOMENTS}, _expected(tp_rank, moments.numel)
        )
        model = load_file(str(folder / "model_optim_rng.pt"))
        assert model["args"].data_parallel_size == dp
        weights = {name: tensor for name, tensor in model["model"].items() if tensor is not None}
        assert_bit_equal(dict(sorted(moments.tensors("param").items())), dict(sorted(weights.items())))


def _megatron_core_holds_it(folder: str, out: Path) -> None:
    """megatron-core at the saved layout (2 data-parallel ranks here) loads the file through its own loader
    (`load_parameter_state`: data-parallel rank 0 reads it, scatters each rank its shard) and holds our weights and
    moments, element for element, and the step."""
    out.mkdir()
    storage = open_storage(folder)
    _, states = read_rank_states(storage, folder)
    world = states[0]["args"].data_parallel_size
    spawn_ranks(resume_worker, args=(world, free_port(), folder, str(out)), nprocs=world)
    results = [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(world)]
    assert all(result["steps"] == [float(STEP)] for result in results)
    assert len(results[0]["buckets"]) == 1 and results[0]["buckets"][0] > 2, results[0]["buckets"]  # BUCKETS: several
    weights = {name: tensor for name, tensor in states[0]["model"].items() if tensor is not None}
    held = held_state(results, 0, {name: tensor.shape for name, tensor in weights.items()})
    moments = read_moments(storage, folder, STEP, 0)
    expected = {"param": weights, **{key: dict(moments.tensors(key)) for key in MOMENTS}}
    for key, tensors in expected.items():
        assert_bit_equal(held[key], {name: tensor.reshape(-1) for name, tensor in tensors.items()})


def _as_slice_files(source: Path, target: Path, tp: int, dp: int) -> None:
    """An older checkpoint of the same state: each distrib_optim.pt as the per data-parallel rank slice files
    (format 2) that `dp` ranks wrote before."""
    shutil.copytree(source, target)
    storage = open_storage(str(target))
    for tp_rank in range(tp):
        moments = read_moments(storage, str(target), STEP, tp_rank, mmap=False)
        (target / optimizer_file(STEP, tp_rank)).unlink()
        numel = moments.numel
        size = -(-numel // dp)
        for d in range(dp):
            lo, hi = min(d * size, numel), min((d + 1) * size, numel)
            piece = moment_slice_state(
                STEP,
                tp,
                dp,
                d,
                STEP,
                moments.layout,
                lo,
                hi,
                moments.flat("exp_avg", lo, hi).clone(),
                moments.flat("exp_avg_sq", lo, hi).clone(),
            )
            write_state_file(storage, str(target), moment_file(STEP, tp_rank, d), piece)


def test_dp2_tp1_saves_one_distrib_optim_file_and_loads_at_dp1_and_dp3(tmp_path) -> None:
    """Saved for a Megatron-LM run with --overlap-grad-reduce and buckets of 2000 elements: the tiny model's buffer in
    several buckets, each with its end padding left out (megatron-core checks their sum and reads each bucket's)."""
    folders = {mode: str(tmp_path / mode) for mode in ("sync", "background")}
    spawn_workers(2, worker_kwargs(tmp_path, 1, 2, *BUCKETS), _save, folders)  # sharded weights (the default at dp 2)
    for url in folders.values():
        _check_layout(Path(url), 1, 2)
    _megatron_core_holds_it(folders["background"], tmp_path / "megatron_core")
    _as_slice_files(tmp_path / "sync", tmp_path / "old", 1, 2)
    loads = [*folders.values(), str(tmp_path / "old")]
    spawn_workers(1, worker_kwargs(tmp_path, 1, 1), _load, loads)
    spawn_workers(3, worker_kwargs(tmp_path, 1, 3, "data.batch_size=3"), _load, loads)  # rows that split 3 ways


def test_dp2_tp2_saves_one_distrib_optim_file_per_tensor_parallel_rank_and_loads_at_dp1(tmp_path) -> None:
    folders = {mode: str(tmp_path / mode) for mode in ("sync", "background")}
    spawn_workers(4, worker_kwargs(tmp_path, 2, 4, "actor.megatron.shard_weights=false"), _save, folders)
    for url in folders.values():
        _check_layout(Path(url), 2, 2)
    spawn_workers(2, worker_kwargs(tmp_path, 2, 2), _load, list(folders.values()))
